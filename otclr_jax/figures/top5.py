"""The paper's figure 4: top-5 probe predictions of runs on one test image."""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Sequence

from matplotlib import figure as mpl_figure
import numpy as np
from scipy import special

from otclr_jax import data
from otclr_jax import rundir
from otclr_jax import tables
from otclr_jax.evaluation import features
from otclr_jax.evaluation import probe
from otclr_jax.figures import common


class Predictions(NamedTuple):
  """One run's linear-probe predictions on a test split.

  Attributes:
    label: the run's name in the figure.
    probs: float [N, C] softmax probabilities.
    labels: int [N] true classes.
    image_size: the run's resolution.
  """
  label: str
  probs: np.ndarray
  labels: np.ndarray
  image_size: int


def _common_dataset(runs: Sequence[tuple[dict[str, Any], Any]]) -> str:
  """The first evaluated dataset (in config order) that every run has."""
  for name in tuple(runs[0][1].eval.datasets):
    if all(name in results['linear'] for results, _ in runs):
      return name
  raise ValueError('the runs share no evaluated dataset; pass --dataset.')


def probe_predictions(workdir: str, dataset: str,
                      results: dict[str, Any],
                      image_size: int) -> Predictions:
  """Softmax of the saved probe on the cached test features of a run."""
  step = int(results['step'])
  path = probe.probe_path(workdir, step, dataset)
  if os.path.relpath(path, os.path.join(workdir, rundir.EVAL_DIR)) not in (
      results.get('files') or {}):
    results_file = os.path.join(workdir, rundir.RESULTS_FILE)
    raise FileNotFoundError(
        f'{path} is not the probe of {results_file} (that evaluation fitted '
        'none on this dataset, or a stopped one wrote it); '
        + common.EVALUATE_FIRST.format(workdir=workdir) + '.')
  fitted = probe.load_probe(path)
  feats, labels = features.load_features(workdir, step, dataset, 'test',
                                         image_size)
  probs = special.softmax(fitted.logits(feats).astype(np.float64), axis=1)
  return Predictions(common.run_label(workdir, results), probs, labels,
                     image_size)


def pick_index(preds: Sequence[Predictions]) -> int:
  """The first test image on which the runs' top-1 classes differ, else 0."""
  top1 = np.stack([p.probs.argmax(axis=1) for p in preds])
  differ = np.flatnonzero(np.any(top1 != top1[:1], axis=0))
  return int(differ[0]) if len(differ) else 0


def plot_top5(image: np.ndarray, true_label: int, class_names: Sequence[str],
              preds: Sequence[Predictions], index: int,
              title: str | None = None) -> mpl_figure.Figure:
  """The image and, per run, bars of its 5 most probable classes."""
  k = min(5, len(class_names))
  fig = mpl_figure.Figure(figsize=(2.6 + 3.3 * len(preds), 2.8),
                          layout='constrained')
  axes = fig.subplots(1, 1 + len(preds), squeeze=False,
                      width_ratios=[0.8] + [1.0] * len(preds))[0]
  axes[0].imshow(image, interpolation='nearest')
  axes[0].set(xticks=[], yticks=[])
  axes[0].set_title(f'test image #{index}\ntrue: {class_names[true_label]}',
                    fontsize=9)
  for ax, pred in zip(axes[1:], preds):
    probs = pred.probs[index]
    order = np.argsort(-probs, kind='stable')
    top = order[:k]
    colours = [common.VIEW_STYLES['anchor']['color'] if c == true_label
               else '0.6' for c in top]
    ax.barh(np.arange(k), probs[top], color=colours)
    for y, c in enumerate(top):
      ax.text(probs[c] + 0.02, y, f'{probs[c]:.2f}', va='center', fontsize=7)
    ax.set_yticks(np.arange(k), [class_names[c] for c in top], fontsize=8)
    for tick, c in zip(ax.get_yticklabels(), top):
      if c == true_label:
        tick.set_fontweight('bold')
    ax.invert_yaxis()
    ax.set_xlim(0.0, 1.15)
    ax.tick_params(axis='x', labelsize=7)
    ax.set_xlabel('probability (linear probe)', fontsize=7)
    verdict = 'correct' if top[0] == true_label else 'wrong'
    ax.set_title(f'{pred.label}\npredicts {class_names[top[0]]} ({verdict})',
                 fontsize=9)
    rank = int(np.flatnonzero(order == true_label)[0]) + 1
    if rank > k:
      ax.text(0.98, 0.02, f'true class: rank {rank}, p = '
              f'{probs[true_label]:.3f}', transform=ax.transAxes, ha='right',
              va='bottom', fontsize=7)
  if title:
    fig.suptitle(title, fontsize=9)
  return fig


def top5_for_runs(workdirs: Sequence[str], out: str | os.PathLike[str], *,
                  dataset: str | None = None,
                  index: int | None = None) -> list[str]:
  """Top-5 figure of evaluated runs (panel order) to PNG `out`; returns paths.

  Args:
    dataset: evaluated dataset; default the first one all runs share.
    index: test image; default `pick_index`.

  Raises:
    FileNotFoundError: a run is not evaluated (no results, probe or features).
    ValueError: the runs were evaluated on different test sets.
  """
  runs = []
  for workdir in workdirs:
    results = rundir.read_results(workdir)
    if results is None:
      raise FileNotFoundError(f'{workdir} has no eval/results.json; '
                              + common.EVALUATE_FIRST.format(workdir=workdir)
                              + '.')
    runs.append((results, common.load_run_config(workdir)))
  dataset = dataset or _common_dataset(runs)
  preds = [probe_predictions(w, dataset, results, int(results['image_size']))
           for w, (results, _) in zip(workdirs, runs)]
  for p in preds[1:]:
    if (p.probs.shape != preds[0].probs.shape
        or not np.array_equal(p.labels, preds[0].labels)):
      raise ValueError(f'the runs were evaluated on different {dataset} test '
                       'sets (labels differ); compare runs of one dataset.')
  if index is None:
    index = pick_index(preds)
  if not 0 <= index < len(preds[0].labels):
    raise ValueError(f'--index must lie in [0, {len(preds[0].labels)}), got '
                     f'{index}.')
  config = runs[0][1]
  test = data.load_split(dataset, 'test', preds[0].image_size,
                         config.data_dir or None)
  true_label = int(preds[0].labels[index])
  if int(test.labels[index]) != true_label:
    raise ValueError(f'the cached features of {dataset} do not match its test '
                     'split; re-run the evaluation.')
  steps = ', '.join(f'step {r["step"]}' for r, _ in runs)
  fig = plot_top5(test.images[index], true_label, test.class_names, preds,
                  index, title=f'{tables.dataset_name(dataset)} test image '
                  f'#{index}, linear probes on frozen features ({steps})')
  return common.save_figure(fig, out)

