"""Evaluation of a pretrained run's checkpoints (docs/method.md section 7).

`python -m otclr_jax.main ... --config.mode=eval` (which also draws the
figures) or `python -m otclr_jax.evaluate --config=configs/X.py --workdir=DIR
[--step=S]` restores the network's params and BatchNorm statistics of a
checkpoint of the run in DIR (partial restoration: the optimiser's and the
method's extra state are not read) and, for every dataset in
`config.eval.datasets`:

1. Extracts frozen 512-d encoder features `h` (BatchNorm in inference mode, no
   augmentation) of the train split and of the complete test split, with the
   images resized to `config.image_size`, the pretraining resolution. Features
   are cached in `DIR/eval/features/step<S>/<dataset key>_<split>.npz` (the
   untrained encoder's in `DIR/eval/features/init/`) and reused by later calls
   only if they were made by the same weights (`variables_fingerprint`, a
   sha256 of params and batch_stats), model settings, dataset and image size;
   otherwise (or if the file is unreadable) they are recomputed, with one
   logged line saying why. A checkpoint with non-finite variables, or
   non-finite features, is refused (`NonFiniteError`) before anything is
   written.
2. Linear probe: multinomial logistic regression on the standardised features
   (mean and standard deviation of the rows it is fitted on), full-batch
   L-BFGS (`optax.lbfgs`, zoom line search) for at most
   `config.eval.probe_steps` iterations. The L2 strength is chosen from
   `L2_GRID` by top-1 accuracy on a stratified 10% of the TRAIN split held out
   with a fixed seed (ties: lower held-out cross-entropy); the probe is then
   refitted on the whole train split.
   The test split is read only for the final top-1 / top-5.
3. Weighted kNN top-1 on l2-normalised features (InstDisc / solo-learn): the
   `KNN_K` most cosine-similar train features vote with weight
   `exp(sim / KNN_TEMPERATURE)`.
4. The same probe and kNN on the untrained encoder (initialised from the run's
   seed exactly as pretraining initialises it, BatchNorm statistics at their
   initial values): the floor row `random_init`.
5. K-means cluster metrics (`metrics.cluster_metrics`, K = number of classes)
   of the l2-normalised test embeddings, on at most `MAX_CLUSTER_POINTS` test
   points drawn with a fixed seed. The embedding is `config.eval.embedding`:
   'z' (default, the paper's: projection-head output of the cached h, see
   `project`) or 'h' (backbone features); recorded in `protocol.embedding`.
6. With `config.eval.recompute_bn`, the BatchNorm statistics are re-estimated
   on at most `MAX_BN_IMAGES` clean (un-augmented) train images of the
   pretraining dataset (`recompute_batch_stats`) and the probe and kNN are
   repeated with them: the row `linear_clean_bn`, beside `linear` (the
   statistics stored in the checkpoint, learnt on augmented views).

Then, on `config.eval.views_dataset` (default: the first eval dataset), view
quality: for `config.eval.num_view_images` test images x (fixed seed) two
SimCLR strong augmentations xs1, xs2 are drawn with a fixed key and turned into
both generators' positive pairs, the SimCLR pair (xs1, xs2) and the OTCLR pair
(ot_views(x, xs1), ot_views(x, xs2)) with the run's OT settings
(`views.make_views`). Both pairs, and the clean anchors x, are embedded by the
SAME restored network (l2-normalised z or h, as for the clusters), so the
two rows differ only in how the
views were generated: this isolates view quality from representation quality.
The key is a module constant, so runs of different methods see identical
augmentations.

Outputs in `DIR/eval/`: `results.json` and `results_step<S>.json` (the format
of docs/method.md section 11, with a `protocol` entry recording the
settings above), `tables.md` and `tables.tex` (`otclr_jax.tables`); the probe
table is printed to stdout. Also, for the figures (`otclr_jax.figures`):
`probe_step<S>_<dataset key>.npz`, the final probe of each dataset (`Probe`,
read back with `load_probe`), `config.json`, the run's config. results.json
also names the run: `method`, `view_generator` ('augment' or 'ot') and
`title`, its row name ('MoCo + OT views', 'OTCLR'). `main.py` then draws
`figures/` (t-SNE of the views and the training curves,
`figures.report_single`; a failure there is logged, never raised); this
module does not import the figures.

Config fields (`config.eval.<name>`, defaults in configs/default.py):
batch_size (images per feature-extraction batch), probe_steps (maximum L-BFGS
iterations), num_view_images (500, the paper's), views_dataset ('' = first
eval dataset), embedding ('z' or 'h'), recompute_bn (add the clean-BN row),
figures (draw the t-SNE and training-curve figures).

The checkpoint directory is opened read-only, so a run that is still training
can be evaluated without disturbing its saves.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import sys
import time
from typing import Any, NamedTuple

from absl import app
from absl import flags
from absl import logging
import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np
import optax
import optax.tree_utils as otu

from otclr_jax import checkpoint
from otclr_jax import fileio
from otclr_jax import input_pipeline
from otclr_jax import metrics
from otclr_jax import models
from otclr_jax import experiment
from otclr_jax import rundir
from otclr_jax import tables
from otclr_jax import views as views_lib

# L2 strengths lambda of the probe, loss = mean CE + lambda / 2 ||W||^2 on
# standardised features (bias not penalised).
L2_GRID = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
HOLDOUT_FRACTION = 0.1
HOLDOUT_SEED = 0
# Stop L-BFGS once the gradient norm is this small (an optimum for practical
# purposes; without an L2 penalty on separable data it never is).
PROBE_TOLERANCE = 1e-5
KNN_K = 200
KNN_TEMPERATURE = 0.07
# Bound on the [rows, N_train] similarity slab of one kNN chunk.
KNN_MAX_SLAB = 2**26
MAX_CLUSTER_POINTS = 10_000
CLUSTER_SEED = 0
VIEWS_SEED = 0
# Which embedding the cluster metrics, view metrics and t-SNE use
# (`config.eval.embedding`): the paper's z, or the backbone's h.
EMBEDDINGS = {'z': 'z, l2-normalised projection-head output',
              'h': 'h, l2-normalised backbone features'}
# `config.eval.recompute_bn`: at most this many clean train images (a fixed
# seed picks them) estimate the BatchNorm statistics.
MAX_BN_IMAGES = 50_000
BN_SEED = 0

DEFAULT_PROBE_STEPS = 500

_SPLITS = ('train', 'test')
_LOG_EVERY_SECONDS = 30.0


# ----------------------------------------------------------------------------
# Small helpers.


def check_dataset_name(name: Any) -> str:
  """Returns `name` if `input_pipeline.load_split` knows it, else raises."""
  if isinstance(name, str) and (
      name == 'digits' or name in input_pipeline.TFDS_SPLITS or
      (name.startswith(input_pipeline.FOLDER_PREFIX)
       and len(name) > len(input_pipeline.FOLDER_PREFIX))):
    return name
  raise ValueError(
      f'unknown evaluation dataset {name!r} in config.eval.datasets; expected '
      f'one of {input_pipeline.known_datasets()}.')


def dataset_key(name: str) -> str:
  """A file-name-safe key for a dataset name.

  Registered names are their own key; `folder:/a/b` becomes
  `folder-b-<first 16 hex digits of sha256 of the absolute path>`, so two trees
  with the same base name do not share a cache file.
  """
  name = check_dataset_name(name)
  if not name.startswith(input_pipeline.FOLDER_PREFIX):
    return name
  root = os.path.abspath(os.path.expanduser(
      name[len(input_pipeline.FOLDER_PREFIX):]))
  base = re.sub(r'[^A-Za-z0-9_.-]', '_', os.path.basename(root)) or 'root'
  return f'folder-{base}-{hashlib.sha256(root.encode()).hexdigest()[:16]}'


def _finite_or_none(value: float) -> float | None:
  # NaN / inf are not JSON; an undefined metric is written as null.
  value = float(value)
  return value if math.isfinite(value) else None


def _json_safe(tree: Any) -> Any:
  """Python scalars, non-finite floats as None (e.g. from a diverged run)."""
  if isinstance(tree, dict):
    return {k: _json_safe(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_json_safe(v) for v in tree]
  if isinstance(tree, (bool, str)) or tree is None:
    return tree
  if isinstance(tree, (int, np.integer)):
    return int(tree)
  return _finite_or_none(tree)


_CLUSTER_KEYS = ('silhouette', 'compactness', 'centroid_margin',
                 'inter_intra_ratio')


def _safe_cluster_metrics(z: np.ndarray, num_classes: int) -> dict[str, Any]:
  """metrics.cluster_metrics, or None values where they are undefined.

  A collapsed encoder (all embeddings nearly equal) gives a degenerate
  K-means clustering; that is a result to report, not a reason to lose the
  whole evaluation.
  """
  if len(z) <= num_classes:
    logging.warning('Cluster metrics need more than K = %d points, got %d.',
                    num_classes, len(z))
    return dict.fromkeys(_CLUSTER_KEYS)
  try:
    result = metrics.cluster_metrics(z, num_classes, CLUSTER_SEED)
  except ValueError as e:
    logging.warning('Cluster metrics undefined: %s', e)
    return dict.fromkeys(_CLUSTER_KEYS)
  return {k: _finite_or_none(result[k]) for k in _CLUSTER_KEYS}


def _hardware() -> str:
  devices = jax.devices()
  return (f'{len(devices)} x {devices[0].device_kind} '
          f'({devices[0].platform}, {jax.process_count()} process(es))')


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  """Pads [n, ...] to [rows, ...] by repeating the last row (a valid input)."""
  if len(x) == rows:
    return x
  return np.concatenate([x, np.repeat(x[-1:], rows - len(x), axis=0)])


# ----------------------------------------------------------------------------
# Feature extraction.


class Encoder:
  """The frozen encoder: features of uint8 images, BatchNorm in inference mode.

  Call it as `encoder(variables, images)` with the network variables
  {'params', 'batch_stats'} and uint8 images [B, S, S, 3], B divisible by
  `num_devices`; it returns float32 features [B, 512] as a host array. The
  batch is split over the devices of `mesh` (default: all local devices).
  """

  def __init__(self, model, mesh=None):
    mesh = (experiment.make_mesh(jax.local_devices()) if mesh is None
            else mesh)
    self.num_devices = mesh.size
    self._data = NamedSharding(mesh, P('data'))
    self._replicated = NamedSharding(mesh, P())

    @jax.jit
    def apply(variables, images):
      # Every method's network returns (h, z, ...): h is the encoder's.
      return model.apply(variables, images.astype(jnp.float32) / 255.0,
                         train=False)[0]

    self._apply = apply

  def __call__(self, variables: Any, images: np.ndarray) -> np.ndarray:
    variables = jax.device_put(variables, self._replicated)
    return np.asarray(jax.device_get(
        self._apply(variables, jax.device_put(images, self._data))))


def extract_features(encoder: Encoder, variables: Any, images: np.ndarray,
                     batch_size: int, what: str = 'features') -> np.ndarray:
  """Encoder features of every image, in order.

  Every batch, the last one padded, has the same shape, so the encoder is
  compiled once.

  Args:
    encoder: the frozen encoder.
    variables: network variables.
    images: uint8 [N, S, S, 3].
    batch_size: images per call; rounded up to a multiple of the devices.
    what: name used in the progress log.

  Returns:
    float32 [N, 512].
  """
  num = len(images)
  if num == 0:
    raise ValueError(f'{what}: no images.')
  devices = encoder.num_devices
  batch_size = -(-min(batch_size, num) // devices) * devices
  parts = []
  start = last_log = time.perf_counter()
  done = 0
  for batch in input_pipeline.eval_batches(images, batch_size):
    parts.append(encoder(variables, _pad_rows(batch, batch_size))[:len(batch)])
    done += len(batch)
    now = time.perf_counter()
    if now - last_log > _LOG_EVERY_SECONDS or done == num:
      last_log = now
      logging.info('%s: %d/%d images (%.0f img/s)', what, done, num,
                   done / max(now - start, 1e-9))
  return np.concatenate(parts).astype(np.float32)


def _cache_path(workdir: str, tag: str, name: str, split: str) -> str:
  return os.path.join(workdir, 'eval', 'features', tag,
                      f'{dataset_key(name)}_{split}.npz')


def variables_fingerprint(variables: Any) -> str:
  """sha256 (hex) of network variables: every leaf's path, dtype, shape, bytes.

  Binds a feature cache to the exact weights that produced it, so retraining
  a workdir to the same step (another seed or method) cannot reuse it.
  """
  digest = hashlib.sha256()
  leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(variables))[0]
  for path, leaf in leaves:
    leaf = np.ascontiguousarray(np.asarray(leaf))
    digest.update(f'{jax.tree_util.keystr(path)}:{leaf.dtype}:{leaf.shape};'
                  .encode())
    digest.update(leaf.tobytes())
  return digest.hexdigest()


def _cache_settings(config: ml_collections.ConfigDict, name: str) -> str:
  """The settings a feature cache depends on besides the weights (JSON).

  Not `data_dir`: where the same dataset is stored does not change it.
  """
  return json.dumps({'dataset': name, 'image_size': int(config.image_size),
                     'model': config.model.to_dict()}, sort_keys=True)


def _load_cached(path: str, name: str, image_size: int,
                 weights: str | None = None, settings: str | None = None):
  """A feature cache file's (features, labels, num_classes), or None.

  None (with one logged line saying why) when the file is absent, unreadable
  (a torn or corrupted write), or was made for another dataset, image size,
  set of weights (`weights`, see `variables_fingerprint`) or model settings;
  the caller then recomputes it. None for `weights`/`settings` skips that
  check (readers that only want what `evaluate` last wrote).
  """
  if not os.path.exists(path):
    return None
  try:
    with np.load(path, allow_pickle=False) as f:
      stored = {k: f[k] for k in f.files}
    features, labels = stored['features'], stored['labels']
    num_classes = int(stored['num_classes'])
    made_for = (str(stored['dataset']), int(stored['image_size']))
  # A torn or corrupted .npz raises zipfile.BadZipFile, OSError, EOFError,
  # KeyError or ValueError depending on where it is damaged; the cache is
  # derived data, so any failure to read it means: rebuild it.
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('Feature cache %s is unreadable (%s: %s); recomputing it.',
                    path, type(e).__name__, e)
    return None
  if made_for != (name, image_size):
    logging.warning('Recomputing feature cache %s: made for %s at %d px, not '
                    '%s at %d px.', path, *made_for, name, image_size)
    return None
  for field, wanted, what in (('weights', weights, 'other weights'),
                              ('settings', settings, 'other model settings')):
    if wanted is None:
      continue
    have = str(stored[field]) if field in stored else None
    if have != wanted:
      logging.warning(
          'Recomputing feature cache %s: it was made by %s (%s %s, now %s).',
          path, what, field, 'unrecorded' if have is None else have[:80],
          wanted[:80])
      return None
  if features.ndim != 2 or len(features) != len(labels):
    logging.warning('Feature cache %s holds features %s and labels %s; '
                    'recomputing it.', path, features.shape, labels.shape)
    return None
  return features, labels, num_classes


class NonFiniteError(ValueError):
  """A checkpoint or its features hold NaN or inf: no result can be trusted."""


def check_finite_variables(variables: Any, workdir: str, step: int) -> None:
  """Raises NonFiniteError naming the non-finite leaves of a checkpoint."""
  bad = []
  leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(variables))[0]
  for path, leaf in leaves:
    leaf = np.asarray(leaf)
    if np.issubdtype(leaf.dtype, np.inexact) and not np.isfinite(leaf).all():
      bad.append(jax.tree_util.keystr(path))
  if bad:
    raise NonFiniteError(
        f'{workdir}: checkpoint step {step} holds non-finite values in '
        f'{len(bad)} variable(s) ({", ".join(bad[:5])}'
        f'{", ..." if len(bad) > 5 else ""}); the run diverged before this '
        'checkpoint. Evaluate an earlier step (--step) or retrain with a '
        'smaller learning rate; nothing was written.')


def check_finite_features(features: np.ndarray, workdir: str, tag: str,
                          name: str, split: str) -> None:
  """Raises NonFiniteError if features of `tag` on name/split are not finite."""
  bad = int(np.size(features) - np.isfinite(features).sum())
  if bad:
    raise NonFiniteError(
        f'{workdir}: the {tag} encoder gives {bad} non-finite feature values '
        f'on {name}/{split} (of {np.size(features)}); probe and kNN numbers '
        'would be meaningless, so nothing was written. The checkpoint is '
        'numerically broken (e.g. a diverged run): evaluate an earlier step '
        'or retrain with a smaller learning rate.')


def load_features(workdir: str, step: int, name: str, split: str,
                  image_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Cached encoder features of checkpoint `step`, as `evaluate` stored them.

  Returns:
    (features float32 [N, 512], labels int32 [N]).

  Raises:
    FileNotFoundError: no cache for this step, dataset, split and image size;
      the message says how to make it.
  """
  path = _cache_path(workdir, f'step{int(step)}', name, split)
  cached = _load_cached(path, name, image_size)
  if cached is None:
    raise FileNotFoundError(
        f'No cached {name}/{split} features of step {step} at {image_size} px '
        f'({path}); run the evaluation first: `python -m otclr_jax.evaluate '
        f'--config=configs/<config>.py --workdir={workdir}`.')
  return cached[0], cached[1]


def _save_cached(path: str, name: str, image_size: int, features: np.ndarray,
                 labels: np.ndarray, num_classes: int, *, weights: str,
                 settings: str) -> None:
  fileio.atomic_write(path, lambda f: np.savez(
      f, features=features, labels=labels, num_classes=num_classes,
      image_size=image_size, dataset=name, weights=weights,
      settings=settings))


def dataset_features(config: ml_collections.ConfigDict, workdir: str,
                     name: str, encoder: Encoder, variables: dict[str, Any]):
  """Features of the train and test splits of one dataset for each encoder.

  Args:
    config: the run's config (image_size, data_dir, eval.batch_size).
    workdir: the run's directory (feature cache under eval/features/).
    name: dataset name.
    encoder: the frozen encoder.
    variables: {cache tag: network variables}, e.g. {'step100': ...,
      'init': ...}.

  Returns:
    `{tag: {split: (features float32 [N, 512], labels int32 [N])}}` and the
    number of classes.
  """
  out = {tag: {} for tag in variables}
  num_classes = None
  settings = _cache_settings(config, name)
  weights = {tag: variables_fingerprint(v) for tag, v in variables.items()}
  for split in _SPLITS:
    data = None
    for tag, tag_variables in variables.items():
      path = _cache_path(workdir, tag, name, split)
      cached = _load_cached(path, name, config.image_size, weights[tag],
                            settings)
      if cached is None:
        if data is None:
          data = input_pipeline.load_split(name, split, config.image_size,
                                           config.data_dir or None)
        feats = extract_features(encoder, tag_variables, data.images,
                                 config.eval.batch_size,
                                 what=f'{tag} features {name}/{split}')
        check_finite_features(feats, workdir, tag, name, split)
        cached = (feats, data.labels.astype(np.int32), data.num_classes)
        _save_cached(path, name, config.image_size, *cached,
                     weights=weights[tag], settings=settings)
      else:
        check_finite_features(cached[0], workdir, tag, name, split)
        logging.info('Using cached features %s', path)
      out[tag][split] = cached[:2]
      num_classes = cached[2]
  return out, num_classes


# ----------------------------------------------------------------------------
# Linear probe.


def stratified_holdout(labels: np.ndarray, fraction: float = HOLDOUT_FRACTION,
                       seed: int = HOLDOUT_SEED) -> np.ndarray:
  """Marks a stratified random `fraction` of the examples as held out.

  In each class of c examples, round(fraction * c) of them, at least 1 and at
  most c - 1 (none for a single example), chosen by one
  `np.random.default_rng(seed)` visiting the classes in increasing order.

  Args:
    labels: int [N].
    fraction: share held out, in (0, 1).
    seed: fixed seed; the same labels always give the same split.

  Returns:
    bool [N], True for held-out examples.
  """
  if not 0.0 < fraction < 1.0:
    raise ValueError(f'fraction must lie in (0, 1), got {fraction}.')
  labels = np.asarray(labels)
  rng = np.random.default_rng(seed)
  held = np.zeros(len(labels), bool)
  for label in np.unique(labels):
    members = np.flatnonzero(labels == label)
    count = len(members)
    n_held = 0 if count < 2 else min(max(round(fraction * count), 1),
                                     count - 1)
    held[rng.permutation(members)[:n_held]] = True
  return held


def _moments(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Float64 column mean and standard deviation [D] of x [N, D]."""
  mean = x.mean(axis=0, dtype=np.float64)
  std = x.std(axis=0, dtype=np.float64)
  # A constant feature (e.g. a dead ReLU channel) is centred, not scaled.
  return mean, np.where(std > 0, std, 1.0)


def _standardiser(x: np.ndarray):
  mean, std = _moments(x)
  return lambda y: ((y - mean) / std).astype(np.float32)


def _matmul(a, b):
  # Full float32 products: TF32 noise would perturb the line search and the
  # kNN ranking differently on different accelerators.
  return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=('num_classes', 'max_steps'))
def _fit_probe(x, y, weights, l2, *, num_classes, max_steps):
  """Weighted softmax regression by L-BFGS; returns ({'w', 'b'}, steps)."""
  params = {'w': jnp.zeros((x.shape[1], num_classes), jnp.float32),
            'b': jnp.zeros((num_classes,), jnp.float32)}
  total = jnp.sum(weights)

  def loss(p):
    logits = _matmul(x, p['w']) + p['b']
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(weights * ce) / total + 0.5 * l2 * jnp.sum(p['w']**2)

  opt = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(loss)

  def step(carry):
    p, state = carry
    value, grad = value_and_grad(p, state=state)
    updates, state = opt.update(grad, state, p, value=value, grad=grad,
                                value_fn=loss)
    return optax.apply_updates(p, updates), state

  def keep_going(carry):
    _, state = carry
    count = otu.tree_get(state, 'count')
    grad_norm = otu.tree_norm(otu.tree_get(state, 'grad'))
    return (count == 0) | ((count < max_steps) & (grad_norm >= PROBE_TOLERANCE))

  params, state = jax.lax.while_loop(keep_going, step,
                                     (params, opt.init(params)))
  return params, otu.tree_get(state, 'count')


@jax.jit
def _logits(params, x):
  return _matmul(x, params['w']) + params['b']


@jax.jit
def _scores(params, x, y):
  """Top-1 hits, top-5 hits and cross-entropy per example."""
  logits = _logits(params, x)
  label_logit = jnp.take_along_axis(logits, y[:, None], axis=1)
  # Rank = number of classes scoring strictly higher than the label; with
  # fewer than 5 classes every rank is < 5, so top-5 is 100%.
  rank = jnp.sum(logits > label_logit, axis=1)
  top1 = jnp.argmax(logits, axis=1) == y
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  return top1, rank < 5, ce


class Probe(NamedTuple):
  """A fitted linear probe: `logits = ((h - mean) / std) @ w + b`.

  Attributes:
    w: float32 [D, C].
    b: float32 [C].
    mean: float64 [D], the train features' mean.
    std: float64 [D], their standard deviation (1 for constant features).
    weight_decay: the L2 strength it was fitted with.
  """
  w: np.ndarray
  b: np.ndarray
  mean: np.ndarray
  std: np.ndarray
  weight_decay: float

  def logits(self, features: np.ndarray) -> np.ndarray:
    """Class scores float32 [N, C] of encoder features [N, D].

    The same float32 computation as the probe's evaluation, so predictions
    reproduce the reported accuracies exactly.
    """
    features = np.asarray(features, np.float32)
    if features.ndim != 2 or features.shape[1] != len(self.mean):
      raise ValueError(f'features must be [N, {len(self.mean)}], got '
                       f'{features.shape}.')
    x = ((features - self.mean) / self.std).astype(np.float32)
    return np.asarray(_logits({'w': jnp.asarray(self.w),
                               'b': jnp.asarray(self.b)}, jnp.asarray(x)))


def probe_path(workdir: str, step: int, name: str) -> str:
  """`<workdir>/eval/probe_step<step>_<dataset key>.npz`."""
  return os.path.join(workdir, 'eval',
                      f'probe_step{int(step)}_{dataset_key(name)}.npz')


def save_probe(path: str, probe: Probe, *, dataset: str, step: int,
               top1: float, weights: str = '') -> None:
  """Writes a probe, with the dataset, step and test top-1 it belongs to.

  `weights` is the encoder's `variables_fingerprint`, recording which
  checkpoint the probe was fitted on.
  """
  fileio.atomic_write(path, lambda f: np.savez(
      f, w=probe.w, b=probe.b, mean=probe.mean, std=probe.std,
      weight_decay=probe.weight_decay, dataset=dataset, step=int(step),
      top1=float(top1), weights=weights))


def load_probe(path: str) -> Probe:
  """Reads a probe written by `save_probe` (i.e. by `evaluate`).

  Raises:
    FileNotFoundError: no probe at `path`; the message says how to make it.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(
        f'No linear probe {path}; run the evaluation first: `python -m '
        'otclr_jax.evaluate --config=configs/<config>.py --workdir=<run dir>` '
        '(it saves the probe of every dataset it evaluates).')
  with np.load(path, allow_pickle=False) as f:
    return Probe(w=f['w'], b=f['b'], mean=f['mean'], std=f['std'],
                 weight_decay=float(f['weight_decay']))


def linear_probe(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray,
                 test_y: np.ndarray, num_classes: int, *,
                 l2_grid=L2_GRID, max_steps: int = DEFAULT_PROBE_STEPS,
                 holdout_fraction: float = HOLDOUT_FRACTION,
                 holdout_seed: int = HOLDOUT_SEED,
                 return_probe: bool = False):
  """Linear probe with the L2 strength chosen on held-out training data.

  For each lambda in `l2_grid`, a probe is fitted on 90% of the train split
  (standardised with that part's statistics) and scored on the held-out,
  stratified 10%; the best lambda (top-1, then lower cross-entropy, then the
  first in the grid) is refitted on the whole train split, standardised with
  the train statistics, and scored on the test split. `test_x` and `test_y`
  are not touched before that last step.

  Args:
    train_x: float [N, D] features.
    train_y: int [N] labels in [0, num_classes).
    test_x: float [M, D].
    test_y: int [M].
    num_classes: C >= 2.
    l2_grid: candidate lambdas >= 0.
    max_steps: maximum L-BFGS iterations per fit.
    holdout_fraction: share of each class held out for the selection.
    holdout_seed: seed of the held-out split.
    return_probe: also return the final probe.

  Returns:
    {'top1', 'top5' (percent on the test split), 'weight_decay' (the chosen
    lambda), 'val_top1' (its held-out top-1, percent), 'num_train',
    'num_test'}; with `return_probe`, the pair (that dict, `Probe`).
  """
  train_x = np.asarray(train_x, np.float32)
  test_x = np.asarray(test_x, np.float32)
  train_y = np.asarray(train_y, np.int32)
  test_y = np.asarray(test_y, np.int32)
  if (train_x.ndim != 2 or test_x.ndim != 2
      or train_x.shape[1] != test_x.shape[1]):
    raise ValueError(f'features must be [N, D] and [M, D], got {train_x.shape} '
                     f'and {test_x.shape}.')
  if len(train_y) != len(train_x) or len(test_y) != len(test_x):
    raise ValueError('each feature row needs one label.')
  if num_classes < 2:
    raise ValueError(f'num_classes must be >= 2, got {num_classes}.')
  for labels, split in ((train_y, 'train'), (test_y, 'test')):
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
      raise ValueError(f'{split} labels must lie in [0, {num_classes}); '
                       'unlabelled examples (-1) cannot be probed.')
  if not l2_grid or min(l2_grid) < 0:
    raise ValueError(f'l2_grid must be non-empty and >= 0, got {l2_grid}.')
  fit = functools.partial(_fit_probe, num_classes=num_classes,
                          max_steps=max_steps)

  held = stratified_holdout(train_y, holdout_fraction, holdout_seed)
  scale = _standardiser(train_x[~held])
  x = jnp.asarray(scale(train_x))
  y = jnp.asarray(train_y)
  weights = jnp.asarray(~held, jnp.float32)
  candidates = []
  for l2 in l2_grid:
    params, steps = fit(x, y, weights, jnp.float32(l2))
    top1, _, ce = jax.device_get(_scores(params, x, y))
    val_top1, val_ce = float(np.mean(top1[held])), float(np.mean(ce[held]))
    logging.info('probe lambda=%g: held-out top-1 %.2f%%, CE %.4f (%d '
                 'L-BFGS steps)', l2, 100 * val_top1, val_ce, int(steps))
    # A diverged fit (non-finite loss) ranks below every finite one.
    candidates.append((-val_top1, val_ce if math.isfinite(val_ce) else math.inf,
                       len(candidates), float(l2)))
  neg_val_top1, _, _, best = min(candidates)

  mean, std = _moments(train_x)
  scale = lambda v: ((v - mean) / std).astype(np.float32)
  params, _ = fit(jnp.asarray(scale(train_x)), y,
                  jnp.ones(len(train_y), jnp.float32), jnp.float32(best))
  top1, top5, _ = jax.device_get(
      _scores(params, jnp.asarray(scale(test_x)), jnp.asarray(test_y)))
  row = {'top1': 100.0 * float(np.mean(top1)),
         'top5': 100.0 * float(np.mean(top5)),
         'weight_decay': best, 'val_top1': -100.0 * neg_val_top1,
         'num_train': int(len(train_y)), 'num_test': int(len(test_y))}
  if not return_probe:
    return row
  w, b = jax.device_get((params['w'], params['b']))
  return row, Probe(w=np.asarray(w), b=np.asarray(b), mean=mean, std=std,
                    weight_decay=float(best))


# ----------------------------------------------------------------------------
# kNN.


def _l2_normalise(x):
  x = np.asarray(x, np.float32)
  return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


@functools.partial(jax.jit, static_argnames=('k', 'num_classes'))
def _knn_predict(train_z, train_y, test_chunks, temperature, *, k,
                 num_classes):
  def chunk(rows):
    sim, idx = jax.lax.top_k(_matmul(rows, train_z.T), k)
    weights = jnp.exp(sim / temperature)
    votes = jax.vmap(lambda l, w: jnp.zeros(num_classes).at[l].add(w))(
        train_y[idx], weights)
    return jnp.argmax(votes, axis=1)
  return jax.lax.map(chunk, test_chunks)


def knn_top1(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray,
             test_y: np.ndarray, num_classes: int, *, k: int = KNN_K,
             temperature: float = KNN_TEMPERATURE) -> float:
  """Weighted kNN accuracy (InstDisc, Wu et al. 2018; solo-learn's default).

  Features are l2-normalised; each test row takes its k most cosine-similar
  train rows (all of them when fewer than k), which vote for their labels
  with weight exp(similarity / temperature); the prediction is the class with
  the largest total (ties: smallest class index). Test rows are processed in
  chunks so that only a [chunk, N_train] similarity slab exists at a time.

  Args:
    train_x: float [N, D].
    train_y: int [N] in [0, num_classes).
    test_x: float [M, D].
    test_y: int [M].
    num_classes: C.
    k: neighbours.
    temperature: > 0.

  Returns:
    Top-1 accuracy on the test rows, percent.
  """
  if k < 1 or temperature <= 0:
    raise ValueError(f'need k >= 1 and temperature > 0, got {k}, '
                     f'{temperature}.')
  train_z, test_z = _l2_normalise(train_x), _l2_normalise(test_x)
  num_test = len(test_z)
  if num_test == 0 or len(train_z) == 0:
    raise ValueError('kNN needs at least one train and one test row.')
  rows = int(max(1, min(256, KNN_MAX_SLAB // len(train_z), num_test)))
  num_chunks = -(-num_test // rows)
  chunks = _pad_rows(test_z, num_chunks * rows).reshape(num_chunks, rows, -1)
  pred = _knn_predict(jnp.asarray(train_z), jnp.asarray(train_y, jnp.int32),
                      jnp.asarray(chunks), jnp.float32(temperature),
                      k=min(k, len(train_z)), num_classes=num_classes)
  pred = np.asarray(pred).reshape(-1)[:num_test]
  return 100.0 * float(np.mean(pred == np.asarray(test_y)))


# ----------------------------------------------------------------------------
# Clusters and views.


def feature_cluster_metrics(test_x: np.ndarray, num_classes: int,
                         max_points: int = MAX_CLUSTER_POINTS,
                         seed: int = CLUSTER_SEED) -> dict[str, Any]:
  """`metrics.cluster_metrics` of l2-normalised features, K = num_classes.

  `test_x` is whichever embedding `config.eval.embedding` names (h, or z from
  `project`); rows are l2-normalised here. More than `max_points` rows are
  subsampled without replacement by `np.random.default_rng(seed)`
  (silhouette needs all pairwise distances).

  Returns:
    The four metrics (None where undefined) and 'num_points'.
  """
  z = _l2_normalise(test_x)
  if len(z) > max_points:
    keep = np.sort(np.random.default_rng(seed).choice(len(z), max_points,
                                                      replace=False))
    logging.info('Cluster metrics on %d of %d test points (seed %d).',
                 max_points, len(z), seed)
    z = z[keep]
  out = _safe_cluster_metrics(z, num_classes)
  out['num_points'] = int(len(z))
  return out


def embedding_of(config: ml_collections.ConfigDict) -> str:
  """`config.eval.embedding` ('z' when a saved config predates the field)."""
  embedding = config.eval.get('embedding', 'z')
  if embedding not in EMBEDDINGS:
    raise ValueError(f'config.eval.embedding must be one of '
                     f'{tuple(EMBEDDINGS)}, got {embedding!r}.')
  return embedding


def project(model, variables: dict[str, Any], features: np.ndarray,
            batch_size: int = 4096) -> np.ndarray:
  """Embeddings z (not normalised) of backbone features h, by the run's head.

  Applies the run's head alone (BatchNorm in inference mode) to cached h, so
  z needs no second pass over the images: g(f(x)) = g(h). The head is the
  ``'head'`` submodule every method's network has (SimCLR, MoCo and BYOL: the
  projection head; DINO: the bottleneck of its head).

  Args:
    model: the run's network (`experiment.create_model`).
    variables: its {'params', 'batch_stats'}.
    features: float32 [N, 512] backbone features h.
    batch_size: rows per call.

  Returns:
    float32 [N, D], D the embedding width of the method's network.
  """
  if isinstance(model, models.DINONet):
    head = models.DINOHead(hidden_dim=model.hidden_dim,
                           bottleneck_dim=model.bottleneck_dim,
                           num_prototypes=model.num_prototypes,
                           dtype=model.dtype)
    head_vars = {'params': variables['params']['head']}
    apply = jax.jit(lambda v, h: head.apply(v, h)[0])
  else:
    head = models.ProjectionHead(hidden_dim=model.proj_hidden_dim,
                                 out_dim=model.proj_dim, dtype=model.dtype)
    head_vars = {'params': variables['params']['head'],
                 'batch_stats': variables['batch_stats']['head']}
    apply = jax.jit(lambda v, h: head.apply(v, h, train=False))
  return np.concatenate([
      np.asarray(apply(head_vars, jnp.asarray(features[i:i + batch_size])))
      for i in range(0, len(features), batch_size)]).astype(np.float32)


def recompute_batch_stats(model, variables: dict[str, Any],
                          images: np.ndarray,
                          batch_size: int) -> dict[str, Any]:
  """BatchNorm statistics re-estimated on clean images (precise BN).

  Every batch goes through the network in training mode (each BatchNorm
  normalises with that batch's statistics, as in pretraining) while the
  input of every BatchNorm layer is intercepted and reduced to its per-channel
  mean mu_b and biased variance var_b. These are pooled over the batches with
  weights equal to the batch sizes n_b:
  mean = sum_b n_b mu_b / N and var = sum_b n_b (var_b + mu_b^2) / N - mean^2.
  For the first BatchNorm (whose input does not depend on other BatchNorm
  layers), and for every layer when one batch holds all images, this is
  exactly the mean and variance of that layer's input over all images. The
  parameters are not changed. Batches are not padded (padding would weight
  repeated images), so the last, shorter batch compiles once more.

  Args:
    model: the run's network.
    variables: {'params', 'batch_stats'}; the stored batch_stats only give
      the structure (and are used by nothing in training mode).
    images: uint8 [N, S, S, 3] clean images (no augmentation).
    batch_size: images per call.

  Returns:
    A batch_stats tree with the structure of `variables['batch_stats']`,
    leaves float32 [C].

  Raises:
    ValueError: no images, or a BatchNorm layer that the forward pass did
      not reach (its statistics could not be re-estimated).
  """
  if len(images) == 0:
    raise ValueError('recompute_batch_stats: no images.')

  @jax.jit
  def moments(variables, batch):
    found = {}

    def record(next_fun, args, kwargs, context):
      if (isinstance(context.module, nn.BatchNorm)
          and context.method_name == '__call__'):
        x = jnp.asarray(args[0], jnp.float32)
        axes = tuple(range(x.ndim - 1))  # every axis but the channels
        mean = jnp.mean(x, axes)
        found['/'.join(context.module.path)] = (
            mean, jnp.mean(jnp.square(x - mean), axes))
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
      model.apply(variables, batch.astype(jnp.float32) / 255.0, train=True,
                  mutable=['batch_stats'])
    return found

  sums: dict[str, list[np.ndarray]] = {}
  for batch in input_pipeline.eval_batches(images, batch_size):
    n = float(len(batch))
    for path, (mean, var) in jax.device_get(
        moments(variables, jnp.asarray(batch))).items():
      # Host float64: var = E[x^2] - mean^2 cancels badly in float32.
      mean = np.asarray(mean, np.float64)
      first = n * mean
      second = n * (np.asarray(var, np.float64) + mean**2)
      if path in sums:
        sums[path][0] += first
        sums[path][1] += second
      else:
        sums[path] = [first, second]

  total = float(len(images))

  def rebuild(tree, prefix):
    if set(tree.keys()) == {'mean', 'var'}:
      path = '/'.join(prefix)
      if path not in sums:
        raise ValueError(f'BatchNorm {path} was not reached by the forward '
                         'pass; its statistics cannot be re-estimated.')
      mean = sums[path][0] / total
      var = np.maximum(sums[path][1] / total - mean**2, 0.0)
      return {'mean': mean.astype(np.float32), 'var': var.astype(np.float32)}
    return {k: rebuild(tree[k], prefix + (k,)) for k in tree.keys()}

  return rebuild(variables['batch_stats'], ())


class ViewEmbeddings(NamedTuple):
  """Encoder embeddings of test images and of both generators' views.

  Attributes:
    indices: int [n], the rows of the test split that were used (sorted).
    anchors: float32 [n, D], the l2-normalised embedding of the clean images
      (D = proj_dim for z, 512 for h).
    simclr: (z1, z2), each [n, D], of the SimCLR pair (xs1, xs2).
    otclr: (z1, z2), each [n, D], of the OTCLR pair.
    pixel_l2: the paper's pixel L2 of the OT views: mean over the 2n views of
      the plain L2 norm of (OT view - its strong endpoint), flattened.
    pixel_rms: the same differences as per-image RMS (`metrics.pixel_rms`).
    embedding: 'z' or 'h', which embedding the arrays hold (`EMBEDDINGS`).
  """
  indices: np.ndarray
  anchors: np.ndarray
  simclr: tuple[np.ndarray, np.ndarray]
  otclr: tuple[np.ndarray, np.ndarray]
  pixel_l2: float
  pixel_rms: float = math.nan
  embedding: str = 'z'


def view_embeddings(config: ml_collections.ConfigDict, model,
                    variables: dict[str, Any], images: np.ndarray, *,
                    num_images: int, batch_size: int,
                    seed: int = VIEWS_SEED) -> ViewEmbeddings:
  """Both generators' positive pairs of test images, embedded by one encoder.

  `num_images` test images (chosen by `np.random.default_rng(seed)`) get two
  strong augmentations each from `jax.random.key(seed)`; the SimCLR pair is
  (xs1, xs2), the OTCLR pair (ot_views(x, xs1), ot_views(x, xs2)) with the
  run's `config.ot` settings and alpha (learnt alpha if any). The network
  `variables` embeds both pairs and the clean images: l2-normalised z (the
  paper's choice) or h, as `config.eval.embedding` says.

  Args:
    config: the run's config.
    model: the run's network.
    variables: its restored {'params', 'batch_stats'} (and 'alpha_logit' for
      a learnt alpha), `experiment.restore_variables`.
    images: uint8 [N, S, S, 3] test images.
    num_images: n, at most N.
    batch_size: images per device call.
    seed: selection and augmentation seed.

  Returns:
    The embeddings.
  """
  n = min(num_images, len(images))
  chosen = np.sort(np.random.default_rng(seed).choice(len(images), n,
                                                      replace=False))
  images = images[chosen]
  both = config.copy_and_resolve_references()
  # 'ot' views: make_views then returns the OT and the strong pairs.
  both.views = 'ot'
  if both.method == views_lib.OTCLR_ALIAS:
    both.method = 'simclr'
  alpha = experiment.alpha_of(config, variables)
  variables = {'params': variables['params'],
               'batch_stats': variables['batch_stats']}
  embedding = embedding_of(config)

  @jax.jit
  def batch_views(variables, batch, key):
    x = batch.astype(jnp.float32) / 255.0
    o1, o2, s1, s2 = views_lib.make_views(both, x, key, alpha)
    h, z = model.apply(variables, jnp.concatenate([x, s1, s2, o1, o2]),
                       train=False)[:2]
    e = z if embedding == 'z' else h
    e = e / jnp.maximum(jnp.linalg.norm(e, axis=1, keepdims=True), 1e-12)
    return jnp.split(e, 5), (o1, o2, s1, s2)

  batch_size = min(batch_size, n)
  key = jax.random.key(seed)
  parts, l2_sum, rms_sum = [], 0.0, 0.0
  for index, batch in enumerate(input_pipeline.eval_batches(images,
                                                            batch_size)):
    real = len(batch)
    zs, (o1, o2, s1, s2) = batch_views(variables,
                                       _pad_rows(batch, batch_size),
                                       jax.random.fold_in(key, index))
    parts.append([np.asarray(z)[:real] for z in zs])
    # The paper's (1 / 2n) sum_i sum_k: both views of every image.
    l2_sum += real * 0.5 * float(metrics.pixel_l2(o1[:real], s1[:real]) +
                                 metrics.pixel_l2(o2[:real], s2[:real]))
    rms_sum += real * 0.5 * float(metrics.pixel_rms(o1[:real], s1[:real]) +
                                  metrics.pixel_rms(o2[:real], s2[:real]))
  za, zs1, zs2, zo1, zo2 = (np.concatenate(p) for p in zip(*parts))
  return ViewEmbeddings(indices=chosen, anchors=za, simclr=(zs1, zs2),
                        otclr=(zo1, zo2), pixel_l2=l2_sum / n,
                        pixel_rms=rms_sum / n, embedding=embedding)


def summarise_views(views: ViewEmbeddings,
                    num_classes: int) -> dict[str, Any]:
  """The view-quality metrics of `view_embeddings` (see `view_metrics`)."""
  out = {}
  # The SimCLR views are their strong endpoints: pixel L2 exactly 0.
  for generator, (z1, z2), pix, rms in (
      ('simclr', views.simclr, 0.0, 0.0),
      ('otclr', views.otclr, views.pixel_l2, views.pixel_rms)):
    row = {'view_distance': float(metrics.view_distance(z1, z2)),
           'view_cosine': float(metrics.view_cosine(z1, z2)),
           'anchor_distance': float(metrics.anchor_distance(z1, z2,
                                                            views.anchors)),
           'pixel_l2': float(pix), 'pixel_rms': float(rms)}
    row.update(_safe_cluster_metrics(np.concatenate([z1, z2]), num_classes))
    out[generator] = row
  return out


def view_metrics(config: ml_collections.ConfigDict, model,
                 variables: dict[str, Any], images: np.ndarray, num_classes: int, *, num_images: int,
                 batch_size: int, seed: int = VIEWS_SEED) -> dict[str, Any]:
  """View-quality metrics of the SimCLR and OTCLR generators, one encoder.

  The views and embeddings are those of `view_embeddings` (same arguments).

  Args:
    config: the run's config.
    model: the run's network.
    variables: as for `view_embeddings`.
    images: uint8 [N, S, S, 3] test images.
    num_classes: K for the cluster metrics of the view embeddings.
    num_images: n, at most N.
    batch_size: images per device call.
    seed: selection and augmentation seed.

  Returns:
    {'simclr': {...}, 'otclr': {...}}, each with view_distance, view_cosine,
    anchor_distance, pixel_l2, pixel_rms and the four cluster metrics of the
    2n view embeddings [z1; z2] (K-means with K = num_classes), all in the
    embedding `config.eval.embedding` names.
  """
  return summarise_views(
      view_embeddings(config, model, variables, images, num_images=num_images,
                      batch_size=batch_size, seed=seed), num_classes)


# ----------------------------------------------------------------------------
# Entry point.


def restore(config: ml_collections.ConfigDict, workdir: str,
            step: int | None = None):
  """The run's network, restored variables and step.

  With `step` None, the newest checkpoint that restores; newer ones that do
  not (truncated, incomplete) are skipped with a warning naming each.

  Returns:
    `(model, variables, step)`: `variables` the network's {'params',
    'batch_stats'} (and 'alpha_logit' for a learnt alpha) of the checkpoint,
    read by partial restoration (`experiment.restore_variables`).

  Raises:
    FileNotFoundError: `workdir` holds no checkpoint.
    ValueError: no checkpoint for `step`.
  """
  model, variables, step, _ = _restore(config, workdir, step)
  return model, variables, step


def _restore(config: ml_collections.ConfigDict, workdir: str,
             step: int | None):
  """The run's model, restored variables, step and checkpoint path."""
  directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
  how = ('pretrain first, e.g. `python -m otclr_jax.main '
         '--config=configs/<config>.py --workdir=' + workdir + '`')
  if not os.path.isdir(directory):
    raise FileNotFoundError(f'No checkpoints in {workdir} ({directory} does '
                            f'not exist); {how}.')
  ckpt = checkpoint.Checkpointer(workdir, read_only=True)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(f'No complete checkpoint in {directory}; {how}.')
    if step is not None and step not in steps:
      raise ValueError(f'No checkpoint for step {step} in {directory}; '
                       f'available steps: {sorted(steps)}.')
  finally:
    ckpt.close()
  if step is not None:
    variables = experiment.restore_variables(config, workdir, step)
  else:
    # The newest checkpoint that restores: a truncated or incomplete newer
    # one (a crash mid-write) is skipped with a warning naming it and why.
    # Read-only, so nothing is moved and a training run there is undisturbed.
    failures = []
    for candidate in sorted(steps, reverse=True):
      try:
        variables = experiment.restore_variables(config, workdir, candidate)
      except Exception as e:  # pylint: disable=broad-except
        failures.append(f'step {candidate}: {checkpoint.describe_error(e)}')
        logging.warning('Skipping checkpoint %s: %s',
                        os.path.join(directory, str(candidate)),
                        checkpoint.describe_error(e))
        continue
      step = candidate
      break
    else:
      raise RuntimeError(f'No checkpoint in {directory} restores '
                         f'({"; ".join(failures)}).')
  return (experiment.create_model(config), variables, int(step),
          os.path.join(directory, str(step)))


class Evaluation(NamedTuple):
  """What `evaluate_run` computed: the results and what the figures draw.

  Attributes:
    results: the results dict written to `workdir/eval/results.json`.
    views: the view embeddings of the view-quality metrics.
    test: the test split they were drawn from.
  """
  results: dict[str, Any]
  views: ViewEmbeddings
  test: input_pipeline.Split


def evaluate(config: ml_collections.ConfigDict, workdir: str,
             step: int | None = None) -> dict[str, Any]:
  """`evaluate_run(...).results`: evaluates a checkpoint, draws no figure."""
  return evaluate_run(config, workdir, step).results


def evaluate_run(config: ml_collections.ConfigDict, workdir: str,
                 step: int | None = None) -> Evaluation:
  """Evaluates a checkpoint of the run in `workdir` (see the module docstring).

  Figures are not drawn here (evaluation does not import them): `main.py`
  draws them from the returned `Evaluation` when `config.eval.figures`.

  Args:
    config: the run's config; `config.eval.datasets` lists the probe datasets.
    workdir: the run's directory, holding checkpoints/.
    step: checkpoint step; None for the newest that restores.

  Returns:
    An `Evaluation`; its results are also written to
    `workdir/eval/results.json`.

  Raises:
    FileNotFoundError: `workdir` holds no checkpoint.
    ValueError: an unknown dataset, a missing step, or a bad config.
  """
  experiment.validate_config(config)
  datasets = tuple(config.eval.datasets)
  if not datasets:
    raise ValueError('config.eval.datasets is empty; name at least one '
                     'dataset, e.g. --config.eval.datasets=cifar10,')
  if len(set(datasets)) != len(datasets):
    raise ValueError(f'config.eval.datasets repeats a name: {datasets}.')
  for name in datasets:
    check_dataset_name(name)
  views_dataset = config.eval.views_dataset or datasets[0]
  check_dataset_name(views_dataset)
  batch_size = int(config.eval.batch_size)
  probe_steps = int(config.eval.probe_steps)
  num_view_images = int(config.eval.num_view_images)
  if min(batch_size, probe_steps, num_view_images) < 1:
    raise ValueError('config.eval.batch_size, probe_steps and num_view_images '
                     'must be >= 1.')
  embedding = embedding_of(config)
  recompute_bn = bool(config.eval.get('recompute_bn', False))

  start = time.perf_counter()
  model, restored, step, ckpt_path = _restore(config, workdir, step)
  logging.info('Evaluating %s (step %d) on %s', ckpt_path, step,
               ', '.join(datasets))
  trained_vars = {'params': restored['params'],
                  'batch_stats': restored['batch_stats']}
  # A diverged run can leave NaN/inf weights or BatchNorm statistics; their
  # features give chance-level numbers that look like results.
  check_finite_variables(trained_vars, workdir, step)
  trained_weights = variables_fingerprint(trained_vars)
  init_vars = {'params': initial.params['net'],
               'batch_stats': initial.batch_stats}
  variables = {f'step{step}': trained_vars, 'init': init_vars}
  sections = [(f'step{step}', 'linear'), ('init', 'random_init')]
  bn_images = 0
  if recompute_bn:
    clean = input_pipeline.load_split(config.dataset, 'train',
                                      config.image_size,
                                      config.data_dir or None).images
    if len(clean) > MAX_BN_IMAGES:
      clean = clean[np.sort(np.random.default_rng(BN_SEED).choice(
          len(clean), MAX_BN_IMAGES, replace=False))]
    bn_images = len(clean)
    logging.info('Recomputing BatchNorm statistics on %d clean %s train '
                 'images.', bn_images, config.dataset)
    variables[f'step{step}_cleanbn'] = {
        'params': trained_vars['params'],
        'batch_stats': recompute_batch_stats(model, trained_vars, clean,
                                             batch_size)}
    sections.append((f'step{step}_cleanbn', 'linear_clean_bn'))
  encoder = Encoder(model)

  results: dict[str, Any] = {
      'step': step, 'checkpoint': ckpt_path, 'method': config.method,
      'view_generator': views_lib.resolve(config)[1],
      'title': experiment.title_of(config),
      'seed': int(config.seed), 'batch_size': int(config.batch_size),
      'pretrain_dataset': config.dataset, 'image_size': int(config.image_size),
      'hardware': _hardware(), 'linear': {}, 'random_init': {},
      'clusters': {}, 'views': {},
  }
  if recompute_bn:
    results['linear_clean_bn'] = {}
  for name in datasets:
    feats, num_classes = dataset_features(config, workdir, name, encoder,
                                          variables)
    for tag, section in sections:
      (tr_x, tr_y), (te_x, te_y) = feats[tag]['train'], feats[tag]['test']
      t0 = time.perf_counter()
      row, probe = linear_probe(tr_x, tr_y, te_x, te_y, num_classes,
                                max_steps=probe_steps, return_probe=True)
      if section == 'linear':
        save_probe(probe_path(workdir, step, name), probe, dataset=name,
                   step=step, top1=row['top1'], weights=trained_weights)
      row['knn_top1'] = knn_top1(tr_x, tr_y, te_x, te_y, num_classes)
      results[section][name] = row
      logging.info('%s %s: probe top-1 %.2f%% top-5 %.2f%% (lambda %g), kNN '
                   'top-1 %.2f%% [%.1f s]', section, name, row['top1'],
                   row['top5'], row['weight_decay'], row['knn_top1'],
                   time.perf_counter() - t0)
    test_h = feats[f'step{step}']['test'][0]
    results['clusters'][name] = feature_cluster_metrics(
        project(model, trained_vars, test_h) if embedding == 'z' else test_h,
        num_classes)

  test = input_pipeline.load_split(views_dataset, 'test', config.image_size,
                                   config.data_dir or None)
  num_view_images = min(num_view_images, len(test.images))
  views = view_embeddings(config, model, restored, test.images,
                          num_images=num_view_images, batch_size=batch_size)
  results['views'] = summarise_views(views, test.num_classes)
  results['protocol'] = {
      'probe': 'softmax regression on standardised features, full-batch '
               'L-BFGS (optax.lbfgs)',
      'probe_max_steps': probe_steps, 'l2_grid': list(L2_GRID),
      'holdout_fraction': HOLDOUT_FRACTION, 'holdout_seed': HOLDOUT_SEED,
      'knn_k': KNN_K, 'knn_temperature': KNN_TEMPERATURE,
      'cluster_seed': CLUSTER_SEED, 'views_dataset': views_dataset,
      'views_num_images': num_view_images, 'views_seed': VIEWS_SEED,
      'embedding': embedding, 'embedding_desc': EMBEDDINGS[embedding],
      'recompute_bn': recompute_bn, 'bn_images': bn_images,
      'alpha': experiment.alpha_of(config, restored),
      'seconds': time.perf_counter() - start,
  }
  results = _json_safe(results)
  write_results(results, workdir)
  # The figure commands rebuild the encoder and find the data from this.
  fileio.write_text(os.path.join(workdir, 'eval', 'config.json'),
                    config.to_json(indent=2) + '\n')
  print(tables.linear_table([results], metrics=('top1', 'top5', 'knn_top1')))
  logging.info('Evaluation of step %d done in %.1f s; results in %s', step,
               time.perf_counter() - start, os.path.join(workdir, 'eval'))
  return Evaluation(results, views, test)


def write_results(results: dict[str, Any], workdir: str) -> None:
  """Writes results.json, results_step<S>.json, tables.md and tables.tex."""
  out_dir = os.path.join(workdir, 'eval')
  os.makedirs(out_dir, exist_ok=True)
  text = json.dumps(results, indent=2, sort_keys=True, allow_nan=False) + '\n'
  for name in ('results.json', f'results_step{results["step"]}.json'):
    path = os.path.join(out_dir, name)
    fileio.write_text(path, text)
  for fmt, ext in (('markdown', 'md'), ('latex', 'tex')):
    report = tables.render_report([results], fmt=fmt)
    fileio.write_text(os.path.join(out_dir, f'tables.{ext}'), report)


# ----------------------------------------------------------------------------
# Command line.


def _main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  checkpoint.quiet_logs()
  logging.info('JAX devices: %s', jax.devices())
  workdir = flags.FLAGS.workdir
  # The lock `main --config.mode=eval` takes: one writer of eval/ at a time.
  # No lock file in a directory that is not there: evaluate says it is
  # missing instead of leaving an empty one behind.
  try:
    with (rundir.lock(workdir, rundir.EVAL_LOCK_FILE)
          if os.path.isdir(workdir) else contextlib.nullcontext()):
      evaluate(flags.FLAGS.config, workdir, flags.FLAGS.step)
    logging.info('Figures: `python -m otclr_jax.figures report --workdir=%s` '
                 '(`python -m otclr_jax.main --config.mode=eval` evaluates '
                 'and draws them).', workdir)
  except rundir.WorkdirLockedError as e:
    logging.error('%s', e)
    sys.exit(rundir.EXIT_LOCKED)


def run() -> None:
  """`python -m otclr_jax.evaluate --config=... --workdir=DIR [--step=S]`."""
  # Defined here, not at import, so that main.py (which defines its own
  # --config and --workdir) can import this module.
  config_flags.DEFINE_config_file(
      'config', None, "The run's training configuration file.",
      lock_config=True)
  flags.DEFINE_string('workdir', None, "The run's directory (holding "
                      'checkpoints/).')
  flags.DEFINE_integer('step', None, 'Checkpoint step to evaluate; default '
                       'the latest.')
  flags.mark_flags_as_required(['config', 'workdir'])
  app.run(_main)


if __name__ == '__main__':
  run()
