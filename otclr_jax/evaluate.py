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
import json
import os
import sys
import time
from typing import Any, NamedTuple

from absl import app
from absl import flags
from absl import logging
import jax
import ml_collections
from ml_collections import config_flags
import numpy as np

from otclr_jax import checkpoint
from otclr_jax import data
from otclr_jax import fileio
from otclr_jax import experiment
from otclr_jax import rundir
from otclr_jax import tables
from otclr_jax import views as views_lib
from otclr_jax.evaluation import clusters
from otclr_jax.evaluation import features
from otclr_jax.evaluation import knn
from otclr_jax.evaluation import probe
from otclr_jax.evaluation import view_quality


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
  return clusters._finite_or_none(tree)


def _hardware() -> str:
  devices = jax.devices()
  return (f'{len(devices)} x {devices[0].device_kind} '
          f'({devices[0].platform}, {jax.process_count()} process(es))')


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
  views: view_quality.ViewEmbeddings
  test: data.Split


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
    features.check_dataset_name(name)
  views_dataset = config.eval.views_dataset or datasets[0]
  features.check_dataset_name(views_dataset)
  batch_size = int(config.eval.batch_size)
  probe_steps = int(config.eval.probe_steps)
  num_view_images = int(config.eval.num_view_images)
  if min(batch_size, probe_steps, num_view_images) < 1:
    raise ValueError('config.eval.batch_size, probe_steps and num_view_images '
                     'must be >= 1.')
  embedding = clusters.embedding_of(config)
  recompute_bn = bool(config.eval.get('recompute_bn', False))

  start = time.perf_counter()
  model, restored, step, ckpt_path = _restore(config, workdir, step)
  logging.info('Evaluating %s (step %d) on %s', ckpt_path, step,
               ', '.join(datasets))
  trained_vars = {'params': restored['params'],
                  'batch_stats': restored['batch_stats']}
  # A diverged run can leave NaN/inf weights or BatchNorm statistics; their
  # features give chance-level numbers that look like results.
  features.check_finite_variables(trained_vars, workdir, step)
  trained_weights = features.variables_fingerprint(trained_vars)
  init_vars = experiment.initial_variables(config)
  variables = {f'step{step}': trained_vars, 'init': init_vars}
  sections = [(f'step{step}', 'linear'), ('init', 'random_init')]
  bn_images = 0
  if recompute_bn:
    clean = data.load_split(config.dataset, 'train',
                            config.image_size,
                            config.data_dir or None).images
    if len(clean) > clusters.MAX_BN_IMAGES:
      clean = clean[np.sort(np.random.default_rng(clusters.BN_SEED).choice(
          len(clean), clusters.MAX_BN_IMAGES, replace=False))]
    bn_images = len(clean)
    logging.info('Recomputing BatchNorm statistics on %d clean %s train '
                 'images.', bn_images, config.dataset)
    variables[f'step{step}_cleanbn'] = {
        'params': trained_vars['params'],
        'batch_stats': clusters.recompute_batch_stats(
            model, trained_vars, clean, batch_size)}
    sections.append((f'step{step}_cleanbn', 'linear_clean_bn'))
  encoder = features.Encoder(model)

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
    feats, num_classes = features.dataset_features(config, workdir, name,
                                                   encoder, variables)
    for tag, section in sections:
      (tr_x, tr_y), (te_x, te_y) = feats[tag]['train'], feats[tag]['test']
      t0 = time.perf_counter()
      row, fitted = probe.linear_probe(tr_x, tr_y, te_x, te_y, num_classes,
                                       max_steps=probe_steps,
                                       return_probe=True)
      if section == 'linear':
        probe.save_probe(probe.probe_path(workdir, step, name), fitted,
                         dataset=name, step=step, top1=row['top1'],
                         weights=trained_weights)
      row['knn_top1'] = knn.knn_top1(tr_x, tr_y, te_x, te_y, num_classes)
      results[section][name] = row
      logging.info('%s %s: probe top-1 %.2f%% top-5 %.2f%% (lambda %g), kNN '
                   'top-1 %.2f%% [%.1f s]', section, name, row['top1'],
                   row['top5'], row['weight_decay'], row['knn_top1'],
                   time.perf_counter() - t0)
    test_h = feats[f'step{step}']['test'][0]
    results['clusters'][name] = clusters.feature_cluster_metrics(
        clusters.project(model, trained_vars, test_h) if embedding == 'z'
        else test_h,
        num_classes)

  test = data.load_split(views_dataset, 'test', config.image_size,
                         config.data_dir or None)
  num_view_images = min(num_view_images, len(test.images))
  views = view_quality.view_embeddings(config, model, restored, test.images,
                          num_images=num_view_images, batch_size=batch_size)
  results['views'] = view_quality.summarise_views(views, test.num_classes)
  results['protocol'] = {
      'probe': 'softmax regression on standardised features, full-batch '
               'L-BFGS (optax.lbfgs)',
      'probe_max_steps': probe_steps, 'l2_grid': list(probe.L2_GRID),
      'holdout_fraction': probe.HOLDOUT_FRACTION,
      'holdout_seed': probe.HOLDOUT_SEED,
      'knn_k': knn.KNN_K, 'knn_temperature': knn.KNN_TEMPERATURE,
      'cluster_seed': clusters.CLUSTER_SEED, 'views_dataset': views_dataset,
      'views_num_images': num_view_images,
      'views_seed': view_quality.VIEWS_SEED,
      'embedding': embedding, 'embedding_desc': clusters.EMBEDDINGS[embedding],
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
