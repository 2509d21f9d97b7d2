"""Evaluation of a pretrained run's checkpoint (docs/method.md section 7).

`evaluate_run` restores a checkpoint's network variables into a `Context`
and runs `config.eval.evaluators` in order; each `evaluate(ctx)` yields
`(key path, value)` pairs stored at that path of the results dict.
Non-finite variables or features raise `features.NonFiniteError` before
anything is written to `DIR/eval/`, where results.json (docs/method.md
section 11) is written last and binds the rest by digest.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from typing import Any, Callable, Iterator, NamedTuple

from absl import logging
import jax
import ml_collections
import numpy as np

from otclr_jax import checkpoint
from otclr_jax import cli
from otclr_jax import data
from otclr_jax import experiment
from otclr_jax import rundir
from otclr_jax import tables
from otclr_jax import views as views_lib
from otclr_jax.evaluation import clusters
from otclr_jax.evaluation import features
from otclr_jax.evaluation import floor
from otclr_jax.evaluation import knn
from otclr_jax.evaluation import probe
from otclr_jax.evaluation import view_quality

Evaluator = Callable[[Any], Iterator[tuple[tuple[str, ...], Any]]]
EVALUATORS: dict[str, Evaluator] = {
    'probe': probe.evaluate,
    'knn': knn.evaluate,
    'clusters': clusters.evaluate,
    'views': view_quality.evaluate,
}
# The evaluators that score every encoder, the random-init floor included.
FLOOR_EVALUATORS = ('probe', 'knn')
FLOOR_ROW = 'random_init'
# Re-listings allowed when a checkpoint is rotated away while being read.
MAX_LISTINGS = 10


def _list_steps(workdir: str) -> list[int]:
  ckpt = checkpoint.Checkpointer(workdir, read_only=True)
  try:
    return sorted(ckpt.all_steps(), reverse=True)
  finally:
    ckpt.close()


def restore(config: ml_collections.ConfigDict, workdir: str,
            step: int | None = None):
  """The run's network, restored variables and step.

  Read-only; with `step` None, the newest checkpoint that restores.

  Returns:
    `(model, variables, step)`, variables as in `Context`.

  Raises:
    FileNotFoundError: `workdir` holds no checkpoint.
    ValueError: no checkpoint for `step`.
    cli.BrokenRunError: no checkpoint restores.
  """
  directory = os.path.join(os.path.abspath(workdir), rundir.CHECKPOINTS_DIR)
  how = ('pretrain first, e.g. `python -m otclr_jax.main '
         '--config=configs/<config>.py --workdir=' + workdir + '`')
  if rundir.latest_checkpoint_step(workdir) is None:
    status = rundir.read_status(workdir) or {}
    if status.get('state') == 'diverged':
      raise features.NonFiniteError(
          f'{workdir} diverged at step {status.get("step")} before its first '
          f'checkpoint ({os.path.join(workdir, rundir.STATUS_FILE)}): there '
          'is nothing finite to evaluate. Retrain it, e.g. with a smaller '
          'learning rate.')
  if not os.path.isdir(directory):
    raise FileNotFoundError(f'No checkpoints in {workdir} ({directory} does '
                            f'not exist); {how}.')
  model = experiment.create_model(config)
  if step is not None:
    steps = _list_steps(workdir)
    if step not in steps:
      raise ValueError(f'No checkpoint for step {step} in {directory}; '
                       f'available steps: {sorted(steps)}.')
    return model, experiment.restore_variables(config, workdir, step), step
  failures = {}
  for _ in range(MAX_LISTINGS):
    steps = [s for s in _list_steps(workdir) if s not in failures]
    if not steps and not failures:
      raise FileNotFoundError(f'No complete checkpoint in {directory}; {how}.')
    for candidate in steps:
      try:
        return (model, experiment.restore_variables(config, workdir, candidate),
                int(candidate))
      except Exception as e:  # pylint: disable=broad-except
        path = rundir.checkpoint_dir(workdir, candidate)
        if not os.path.isdir(path):
          logging.info('Checkpoint %s was deleted while being read (a run '
                       'rotating its checkpoints); listing them again.', path)
          break
        failures[candidate] = checkpoint.describe_error(e)
        logging.warning('Skipping checkpoint %s: %s', path,
                        failures[candidate])
    else:
      break
  reasons = '; '.join(f'step {s}: {why}' for s, why in failures.items())
  raise cli.BrokenRunError(
      f'No checkpoint in {directory} restores '
      f'({reasons or "each was deleted while being read"}).')


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks a config's training and evaluation fields.

  Raises:
    experiment.ConfigError: naming the field.
  """
  experiment.validate_config(config)
  datasets = tuple(config.eval.datasets)
  if len(set(datasets)) != len(datasets):
    raise experiment.ConfigError(
        f'config.eval.datasets repeats a name: {datasets}.')
  unknown = [n for n in config.eval.evaluators if n not in EVALUATORS]
  try:
    for name in datasets + (config.eval.views_dataset or datasets[0],):
      features.check_dataset_name(name)
    if unknown or not config.eval.evaluators:
      raise ValueError(f'config.eval.evaluators must name some of '
                       f'{tuple(EVALUATORS)}, got '
                       f'{tuple(config.eval.evaluators)}.')
    clusters.embedding_of(config)
    if not isinstance(config.eval.floor_dir, str):
      raise ValueError('config.eval.floor_dir must be a directory path or '
                       f"'', got {config.eval.floor_dir!r}.")
  except ValueError as e:
    raise experiment.ConfigError(str(e)) from e


def check_data(config: ml_collections.ConfigDict) -> None:
  """Checks every dataset evaluation will read, before hours of pretraining.

  Raises:
    data.NotEvaluableError: an `eval.datasets` entry is missing, unusable,
      or too small for an evaluator (the probe's held-out rows).
  """
  names = tuple(config.eval.datasets) + (config.eval.views_dataset,)
  for name in dict.fromkeys(n for n in names if n):
    found = data.check_evaluable(name, config.image_size,
                                 config.data_dir or None)
    logging.info('Evaluation dataset %s: %d train / %d test images, %d '
                 'classes.', name, found.num_train, found.num_test,
                 found.num_classes)
    labels = np.repeat(np.arange(len(found.train_counts)), found.train_counts)
    if ('probe' in config.eval.evaluators
        and not probe.stratified_holdout(labels).any()):
      raise data.NotEvaluableError(
          f'evaluation dataset {name!r} has at most one train image per '
          'class: the probe chooses its L2 strength on held-out train images '
          'and needs a class with two; add train images or drop "probe" '
          'from config.eval.evaluators.')
    if 'knn' in config.eval.evaluators and found.num_train < knn.KNN_K:
      logging.info('kNN on %s votes with all its %d train images (k = %d '
                   'needs more); results record the k used.', name,
                   found.num_train, knn.KNN_K)
    if found.num_classes <= probe.TOP5:
      logging.info('%s has %d classes: top-5 would be 100%% by '
                   'construction and is not reported.', name,
                   found.num_classes)


class Context:
  """What the evaluators share: the restored checkpoint, encoders and data.

  Attributes:
    config: the run's config.
    workdir: the run's directory.
    step: the evaluated checkpoint's step.
    model: the run's network.
    variables: {'params', 'batch_stats'} (+ 'alpha_logit' if learnt).
    datasets: `config.eval.datasets`.
    weights: the checkpoint's `features.variables_fingerprint`.
    encoders: {results row: (feature cache tag, network variables)}; the
      floor's row only where it is not shared (`config.eval.floor_dir`).
    bn_images: clean images behind 'linear_clean_bn' (0 without it).
  """

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               step: int | None = None):
    self.config = config
    self.workdir = workdir
    self.datasets = tuple(config.eval.datasets)
    self.model, self.variables, self.step = restore(config, workdir, step)
    logging.info('Evaluating %s (step %d) on %s',
                 rundir.checkpoint_dir(workdir, self.step), self.step,
                 ', '.join(self.datasets))
    trained = {'params': self.variables['params'],
               'batch_stats': self.variables['batch_stats']}
    # Non-finite weights give chance-level numbers that look like results.
    features.check_finite_variables(trained, workdir, self.step)
    self.weights = features.variables_fingerprint(trained)
    self.encoders = {'linear': (f'step{self.step}', trained)}
    if not config.eval.floor_dir:
      self.encoders[FLOOR_ROW] = ('init', experiment.initial_variables(config))
    self.bn_images = 0
    if config.eval.recompute_bn:
      self.encoders['linear_clean_bn'] = (f'step{self.step}_cleanbn',
                                          self._clean_bn(trained))
    self._encoder = features.Encoder(self.model)
    self._features = {}
    self._views = None

  def floor_rows(self) -> Iterator[tuple[tuple[str, ...], Any]]:
    """The shared floor's rows (`floor.load_or_fit`): read, or fitted here."""
    names = [n for n in self.config.eval.evaluators if n in FLOOR_EVALUATORS]
    if not self.config.eval.floor_dir or not names:
      return
    initial = experiment.initial_variables(self.config)
    identity = {
        'weights': features.variables_fingerprint(initial),
        'datasets': {name: json.loads(features.cache_settings(
            self.config, name, self._encoder.num_devices))
                     for name in self.datasets},
        'evaluators': names,
        'probe': {**probe.PROTOCOL,
                  'probe_max_steps': int(self.config.eval.probe_steps)},
        'knn': knn.PROTOCOL}

    def fit():
      alone = copy.copy(self)
      alone.encoders, alone._features = {FLOOR_ROW: ('init', initial)}, {}
      return [(path, _json_safe(value)) for name in names
              for path, value in EVALUATORS[name](alone)
              if FLOOR_ROW in path[:2]]

    rows, path, fitted = floor.load_or_fit(self.config.eval.floor_dir,
                                           identity, fit, self.workdir)
    yield from rows
    yield ('protocol', 'floor'), {'file': path, 'fitted_here': fitted}

  def _clean_bn(self, trained: dict[str, Any]) -> dict[str, Any]:
    """`trained` with BatchNorm statistics of clean pretraining images."""
    clean = self.split(self.config.dataset, 'train').images
    if len(clean) > clusters.MAX_BN_IMAGES:
      clean = clean[np.sort(np.random.default_rng(clusters.BN_SEED).choice(
          len(clean), clusters.MAX_BN_IMAGES, replace=False))]
    self.bn_images = len(clean)
    logging.info('Recomputing BatchNorm statistics on %d clean %s train '
                 'images.', self.bn_images, self.config.dataset)
    return {'params': trained['params'],
            'batch_stats': clusters.recompute_batch_stats(
                self.model, trained, clean, int(self.config.eval.batch_size))}

  def split(self, name: str, split: str) -> data.Split:
    """A split of a dataset at the run's image size."""
    return data.load_split(name, split, self.config.image_size,
                           self.config.data_dir or None)

  def features(self, name: str):
    """Features of dataset `name` for every encoder, extracted once.

    Returns:
      `({row: {split: (features float32 [N, 512], labels int32 [N])}},
      num_classes)` with the rows of `encoders`.
    """
    if name not in self._features:
      by_tag, num_classes = features.dataset_features(
          self.config, self.workdir, name, self._encoder,
          {tag: v for tag, v in self.encoders.values()})
      self._features[name] = (
          {row: by_tag[tag] for row, (tag, _) in self.encoders.items()},
          num_classes)
    return self._features[name]

  @property
  def views_dataset(self) -> str:
    """`config.eval.views_dataset`, or the first evaluation dataset."""
    return self.config.eval.views_dataset or self.datasets[0]

  def view_embeddings(self) -> tuple[view_quality.ViewEmbeddings,
                                     data.Split]:
    """Both generators' view embeddings of the views dataset's test split."""
    if self._views is None:
      test = self.split(self.views_dataset, 'test')
      views = view_quality.view_embeddings(
          self.config, self.model, self.variables, test.images,
          num_images=int(self.config.eval.num_view_images),
          batch_size=int(self.config.eval.batch_size))
      self._views = (views, test)
    return self._views


class Evaluation(NamedTuple):
  """What `evaluate_run` computed, for the figures.

  Attributes:
    results: the dict written to `workdir/eval/results.json`.
    views: the view embeddings (None without the `views` evaluator).
    test: the test split they were drawn from (None likewise).
  """
  results: dict[str, Any]
  views: view_quality.ViewEmbeddings | None
  test: data.Split | None


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
  value = float(tree)
  return value if math.isfinite(value) else None


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def evaluate_run(config: ml_collections.ConfigDict, workdir: str,
                 step: int | None = None) -> Evaluation:
  """Evaluates a checkpoint of the run in `workdir` (module docstring).

  Args:
    config: the run's config, checked by `validate` (once per command, by
      the caller); `config.eval` chooses datasets and evaluators.
    workdir: the run's directory, holding checkpoints/.
    step: checkpoint step; None for the newest that restores.

  Returns:
    An `Evaluation`; results also go to `workdir/eval/results.json`.

  Raises:
    FileNotFoundError: `workdir` holds no checkpoint.
    ValueError: unknown dataset or evaluator, missing step, bad config.
  """
  start = time.perf_counter()
  ctx = Context(config, workdir, step)
  devices = jax.devices()
  results: dict[str, Any] = {
      'step': ctx.step, 'checkpoint': rundir.checkpoint_dir(workdir, ctx.step),
      'method': config.method,
      'view_generator': views_lib.recipe(config).views,
      'title': experiment.title_of(config),
      'seed': int(config.seed), 'batch_size': int(config.batch_size),
      'pretrain_dataset': config.dataset, 'image_size': int(config.image_size),
      'hardware': f'{len(devices)} x {devices[0].device_kind} '
                  f'({devices[0].platform}, {jax.process_count()} process(es))',
      'protocol': {
          'embedding': clusters.embedding_of(config),
          'embedding_desc': clusters.EMBEDDINGS[clusters.embedding_of(config)],
          'recompute_bn': bool(config.eval.recompute_bn),
          'bn_images': ctx.bn_images,
          'alpha': experiment.alpha_of(config, ctx.variables),
          'evaluators': list(config.eval.evaluators)}}
  for name in config.eval.evaluators:
    t0 = time.perf_counter()
    for path, value in EVALUATORS[name](ctx):
      _put(results, path, value)
      cli.check_stop()
    logging.info('Evaluator %s done in %.1f s.', name,
                 time.perf_counter() - t0)
  # Last: a run sharing the floor waits for it while another fits it.
  for path, value in ctx.floor_rows():
    _put(results, path, value)
  results['protocol']['seconds'] = time.perf_counter() - start
  # Inside the results, so the run's identity cannot come from another file.
  results['config'] = config.to_dict()
  results = write_results(_json_safe(results), workdir, config)
  if 'linear' in results:
    # kNN first: the column that separates methods where the floor's probe
    # is already high (README, "Example runs").
    print('Test accuracy (%): weighted kNN, then the linear probe; "Random '
          'init" is the untrained encoder, the floor.\n'
          + tables.linear_table([results],
                                metrics=('knn_top1', 'top1', 'top5')))
  logging.info('Evaluation of step %d done in %.1f s; results in %s',
               ctx.step, time.perf_counter() - start,
               os.path.join(workdir, rundir.EVAL_DIR))
  views, test = ctx.view_embeddings() if 'views' in config.eval.evaluators \
      else (None, None)
  return Evaluation(results, views, test)


def write_results(results: dict[str, Any], workdir: str,
                  config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Writes eval/'s files; results.json, last, binds the others by digest.

  Returns:
    The results as written to results.json.
  """
  text = json.dumps(results, indent=2, sort_keys=True, allow_nan=False) + '\n'
  files = {rundir.step_results_file(results['step']): text,
           os.path.basename(rundir.EVAL_CONFIG_FILE):
               config.to_json(indent=2) + '\n'}
  for fmt, ext in (('markdown', 'md'), ('latex', 'tex')):
    files[f'tables.{ext}'] = tables.render_report([results], fmt=fmt)
  probes = []
  if 'probe' in config.eval.evaluators:
    probes = [os.path.relpath(rundir.probe_file(
        results['step'], features.dataset_key(name)), rundir.EVAL_DIR)
              for name in config.eval.datasets]
  return rundir.write_evaluation(workdir, results, files, probes)
