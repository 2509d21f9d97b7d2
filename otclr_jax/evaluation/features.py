"""Frozen encoder features: extraction, a cache bound to the weights, checks."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import time
from typing import Any, Callable

from absl import logging
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import ml_collections
import numpy as np

from otclr_jax import cli
from otclr_jax import data
from otclr_jax import experiment
from otclr_jax import fileio
from otclr_jax import rundir


_SPLITS = ('train', 'test')
_LOG_EVERY_SECONDS = 10.0


def check_dataset_name(name: Any) -> str:
  """Returns `name` if `data.load_split` knows it, else raises."""
  if isinstance(name, str) and (
      name == 'digits' or name in data.TFDS_SPLITS or
      (name.startswith(data.FOLDER_PREFIX)
       and len(name) > len(data.FOLDER_PREFIX))):
    return name
  raise ValueError(
      f'unknown evaluation dataset {name!r} in config.eval.datasets; expected '
      f'one of {data.known_datasets()}.')


def dataset_key(name: str) -> str:
  """A file-name-safe key: `folder:/a/b` -> `folder-b-<sha256(path)[:16]>`."""
  name = check_dataset_name(name)
  if not name.startswith(data.FOLDER_PREFIX):
    return name
  root = os.path.abspath(os.path.expanduser(
      name[len(data.FOLDER_PREFIX):]))
  base = re.sub(r'[^A-Za-z0-9_.-]', '_', os.path.basename(root)) or 'root'
  return f'folder-{base}-{hashlib.sha256(root.encode()).hexdigest()[:16]}'


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  """Pads [n, ...] to [rows, ...] by repeating the last row (a valid input)."""
  if len(x) == rows:
    return x
  return np.concatenate([x, np.repeat(x[-1:], rows - len(x), axis=0)])


def l2_normalise(x: np.ndarray) -> np.ndarray:
  """Rows of float [N, D] scaled to unit norm, float32 (zero rows stay zero)."""
  x = np.asarray(x, np.float32)
  return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


@functools.lru_cache(maxsize=8)
def _compiled_apply(model) -> Callable[..., tuple[jax.Array, jax.Array]]:
  """The jitted encoder of `model`, shared by all callers in the process."""

  @jax.jit
  def apply(variables, images):
    return model.apply(variables, images, train=False)[:2]

  return apply


@jax.jit
def to_unit(images: jax.Array) -> jax.Array:
  """uint8 images [B, S, S, 3] as float32 in [0, 1], bit-equal to training's."""
  return images.astype(jnp.float32) / 255.0


class Encoder:
  """The frozen network in inference mode, batches split over local devices.

  `encoder(variables, images)`: uint8 [B, S, S, 3], B divisible by
  `num_devices`, to host float32 features [B, 512].
  """

  def __init__(self, model):
    mesh = experiment.make_mesh(jax.local_devices())
    self.num_devices = mesh.size
    self._data = NamedSharding(mesh, P('data'))
    self._replicated = NamedSharding(mesh, P())
    self._apply = _compiled_apply(model)

  def place(self, variables: Any) -> Any:
    """`variables` replicated on this encoder's devices (placed once)."""
    # Multi-process arrays: this process's copy, on its own devices.
    variables = jax.tree_util.tree_map(
        lambda x: np.asarray(x) if isinstance(x, jax.Array)
        and not x.is_fully_addressable else x, variables)
    return jax.device_put(variables, self._replicated)

  def embed(self, variables: Any, images: Any) -> tuple[jax.Array, jax.Array]:
    """Device (h [B, 512], z [B, proj_dim]) of float32 [B, S, S, 3], [0, 1]."""
    return self._apply(self.place(variables),
                       jax.device_put(images, self._data))

  def __call__(self, variables: Any, images: np.ndarray) -> np.ndarray:
    return np.asarray(jax.device_get(self.embed(variables,
                                                to_unit(images))[0]))


def extract_features(encoder: Encoder, variables: Any, images: np.ndarray,
                     batch_size: int, what: str = 'features', *,
                     log_progress: bool = True) -> np.ndarray:
  """Encoder features of every image, in order (padded: one compilation).

  Args:
    encoder: the frozen encoder.
    variables: network variables.
    images: uint8 [N, S, S, 3].
    batch_size: images per call; rounded up to a multiple of the devices.
    what: name used in the progress log.
    log_progress: log images/s as it goes.

  Returns:
    float32 [N, 512].
  """
  num = len(images)
  if num == 0:
    raise ValueError(f'{what}: no images.')
  devices = encoder.num_devices
  batch_size = -(-batch_size // devices) * devices
  variables = encoder.place(variables)
  parts = []
  start = last_log = time.perf_counter()
  done = 0
  for batch in data.eval_batches(images, batch_size):
    parts.append(encoder(variables, pad_rows(batch, batch_size))[:len(batch)])
    done += len(batch)
    now = time.perf_counter()
    if log_progress and (now - last_log > _LOG_EVERY_SECONDS or done == num):
      last_log = now
      rate = done / max(now - start, 1e-9)
      logging.info('%s: %d/%d images (%.0f img/s, ETA %.0f s)', what, done,
                   num, rate, (num - done) / rate)
  return np.concatenate(parts).astype(np.float32)


def _cache_path(workdir: str, tag: str, name: str, split: str) -> str:
  return os.path.join(workdir,
                      rundir.features_file(tag, dataset_key(name), split))


def check_labels(num_classes: int, **labels_by_split: np.ndarray) -> None:
  """Raises ValueError unless each split's int labels lie in [0, C)."""
  for split, labels in labels_by_split.items():
    labels = np.asarray(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
      raise ValueError(f'{split} labels must lie in [0, {num_classes}); '
                       'unlabelled examples (-1) cannot be scored.')


def variables_fingerprint(variables: Any) -> str:
  """sha256 (hex) of every leaf's path, dtype, shape and bytes."""
  digest = hashlib.sha256()
  leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(variables))[0]
  for path, leaf in leaves:
    leaf = np.ascontiguousarray(np.asarray(leaf))
    digest.update(f'{jax.tree_util.keystr(path)}:{leaf.dtype}:{leaf.shape};'
                  .encode())
    digest.update(leaf.tobytes())
  return digest.hexdigest()


def cache_settings(config: ml_collections.ConfigDict, name: str,
                    devices: int) -> str:
  """JSON of a cache's inputs besides the weights (sources, not data_dir).

  The batch, the `devices` extracting it and the compute dtype too: they
  change the features, and one command gives the same bits with or without
  a cache.
  """
  sources = {split: data.describe_source(name, split) for split in _SPLITS}
  return json.dumps({'dataset': name, 'image_size': int(config.image_size),
                     'model': config.model.to_dict(), 'sources': sources,
                     'dtype': config.dtype,
                     'batch_size': int(config.eval.batch_size),
                     'devices': devices}, sort_keys=True)


def _load_cached(path: str, name: str, image_size: int | None,
                 weights: str | None = None, settings: str | None = None):
  """A cache file's (features, labels, num_classes), or None (logged) if stale.

  `image_size` / `weights` / `settings` None skip their check.
  """
  if not os.path.exists(path):
    return None
  try:
    with np.load(path, allow_pickle=False) as f:
      stored = {k: f[k] for k in f.files}
    features, labels = stored['features'], stored['labels']
    num_classes = int(stored['num_classes'])
    made_for = (str(stored['dataset']), int(stored['image_size']))
  # Derived data: any read failure of a damaged .npz means rebuild.
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('Feature cache %s is unreadable (%s: %s); recomputing it.',
                    path, type(e).__name__, e)
    return None
  if image_size is None:  # any size will do
    image_size = made_for[1]
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


class NonFiniteError(cli.DivergedRunError):
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


def _read_cache(workdir: str, tag: str, name: str, split: str,
                image_size: int | None) -> tuple[np.ndarray, np.ndarray, int]:
  """(features, labels, num_classes) of one cache file, or FileNotFoundError.

  `image_size` None accepts any size.
  """
  path = _cache_path(workdir, tag, name, split)
  cached = _load_cached(path, name, image_size)
  if cached is None:
    size = '' if image_size is None else f' at {image_size} px'
    raise FileNotFoundError(
        f'No usable cached {name}/{split} features of {tag}{size}: {path}; '
        'run the evaluation first: `python -m otclr_jax.main --config='
        f'configs/<config>.py --workdir={workdir} --config.mode=eval`.')
  return cached


def load_features(workdir: str, step: int, name: str, split: str,
                  image_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Cached encoder features of checkpoint `step`, as `evaluate` stored them.

  Returns:
    (features float32 [N, 512], labels int32 [N]).

  Raises:
    FileNotFoundError: no cache for this step, dataset, split and size.
  """
  return _read_cache(workdir, f'step{int(step)}', name, split, image_size)[:2]


def load_cache(workdir: str, tag: str, name: str
               ) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
  """Every split's cached features of `name` under eval/features/<tag>/.

  Args:
    workdir: the run directory.
    tag: the encoder's cache directory, 'step<N>' or 'init' (random init).
    name: the dataset, as in `config.eval.datasets`.

  Returns:
    `{split: (features float32 [N, 512], labels int32 [N], num_classes)}`.

  Raises:
    FileNotFoundError: a split's file is absent, unreadable or made for
      another dataset (the reason is logged).
  """
  return {split: _read_cache(workdir, tag, name, split, None)
          for split in _SPLITS}


def dataset_features(config: ml_collections.ConfigDict, workdir: str,
                     name: str, encoder: Encoder, variables: dict[str, Any]):
  """Features of the train and test splits of one dataset for each encoder.

  Args:
    config: the run's config (image_size, data_dir, eval.batch_size).
    workdir: the run's directory (feature cache under eval/features/).
    name: dataset name.
    encoder: the frozen encoder.
    variables: {cache tag: network variables}, e.g. {'step100': ...}.

  Returns:
    `{tag: {split: (features float32 [N, 512], labels int32 [N])}}`,
    num_classes; misses are saved to eval/features/<tag>/.
  """
  out = {tag: {} for tag in variables}
  num_classes = None
  settings = cache_settings(config, name, encoder.num_devices)
  weights = {tag: variables_fingerprint(v) for tag, v in variables.items()}
  for split in _SPLITS:
    split_data = None
    for tag, tag_variables in variables.items():
      path = _cache_path(workdir, tag, name, split)
      cached = _load_cached(path, name, config.image_size, weights[tag],
                            settings)
      if cached is None:
        if split_data is None:
          split_data = data.load_split(name, split, config.image_size,
                                       config.data_dir or None)
        feats = extract_features(encoder, tag_variables, split_data.images,
                                 config.eval.batch_size,
                                 what=f'{tag} features {name}/{split}')
        check_finite_features(feats, workdir, tag, name, split)
        cached = (feats, split_data.labels.astype(np.int32),
                  split_data.num_classes)
        fileio.atomic_write(path, lambda f: np.savez(
            f, features=feats, labels=cached[1], num_classes=cached[2],
            image_size=config.image_size, dataset=name, weights=weights[tag],
            settings=settings))
      else:
        check_finite_features(cached[0], workdir, tag, name, split)
        logging.info('Using cached features %s', path)
      out[tag][split] = cached[:2]
      num_classes = cached[2]
  return out, num_classes
