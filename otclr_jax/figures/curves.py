"""Training curves: metrics.jsonl of runs, one panel per logged quantity."""

from __future__ import annotations

import os
import pathlib
from typing import Sequence

from matplotlib import figure as mpl_figure
from matplotlib import lines
import numpy as np

from otclr_jax import rundir
from otclr_jax.figures import common


# (metrics.jsonl key, panel title); panels without data are left out.
CURVES = (('loss', 'loss'),
          ('top1', 'contrastive top-1'),
          ('lr', 'learning rate'),
          ('images_per_sec', 'images / s'),
          ('monitor_knn_top1', 'kNN monitor top-1 (%)'),
          ('sinkhorn', 'Sinkhorn regulariser'),
          ('alpha', '$\\alpha$'))


def read_metrics(workdir: str) -> dict[str, np.ndarray]:
  """`<workdir>/metrics.jsonl` as {key: [T] float}, 'step' ascending.

  A step logged twice keeps its later record; missing keys are NaN.

  Raises:
    FileNotFoundError: no metrics.jsonl.
    rundir.CorruptFileError: a line before the last is not a record.
  """
  path = os.path.join(workdir, rundir.METRICS_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f'No {path}; pretrain first (`python -m '
                            f'otclr_jax.main --config=... --workdir={workdir}`).')
  records = {int(r['step']): r for r in rundir.read_metrics(workdir)}
  if not records:
    raise ValueError(f'{path} holds no records yet.')
  steps = sorted(records)
  keys = sorted({k for r in records.values() for k in r})
  return {k: np.array([records[s].get(k) for s in steps], dtype=float)
          for k in keys}


def plot_curves(runs: dict[str, dict[str, np.ndarray]],
                title: str | None = None) -> mpl_figure.Figure:
  """One panel per quantity, one line per run ({label: `read_metrics`})."""
  def logged(key, m):
    values = m.get(key, np.array([np.nan]))
    values = values[np.isfinite(values)]
    # A fixed alpha is a setting, not a curve.
    return len(values) > 0 and (key != 'alpha' or np.ptp(values) > 0)

  panels = [(key, name) for key, name in CURVES
            if any(logged(key, m) for m in runs.values())]
  if not panels:
    raise ValueError('no known quantity in the metrics '
                     f'({[k for k, _ in CURVES]}).')
  ncols = min(3, len(panels))
  nrows = -(-len(panels) // ncols)
  fig = mpl_figure.Figure(figsize=(3.6 * ncols, 2.7 * nrows + 0.5),
                          layout='constrained')
  axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
  colours = {label: f'C{i}' for i, label in enumerate(runs)}
  for ax, (key, name) in zip(axes, panels):
    for label, m in runs.items():
      if key not in m:
        continue
      # Markers show single-step runs; the monitor logs only every N steps.
      finite = np.isfinite(m[key])
      ax.plot(m['step'][finite], m[key][finite], color=colours[label],
              lw=1.2, marker='.', ms=3, label=label)
      if (key == 'loss' and 'nce' in m
          and not np.allclose(m['nce'], m['loss'], equal_nan=True)):
        ax.plot(m['step'], m['nce'], color=colours[label], lw=1.0, ls='--')
        name = 'loss (solid), InfoNCE part (dashed)'
    ax.set_title(name, fontsize=9)
    ax.set_xlabel('step', fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
  for ax in axes[len(panels):]:
    ax.axis('off')
  handles = [lines.Line2D([], [], color=colours[label], label=label)
             for label in runs]
  fig.legend(handles=handles, loc='outside lower center', ncols=len(runs),
             fontsize=8, frameon=False)
  if title:
    fig.suptitle(title, fontsize=10)
  return fig


def curves_for_runs(workdirs: Sequence[str],
                    out: str | os.PathLike[str]) -> list[str]:
  """Training-curve figure of runs, labelled by their directory names."""
  runs = {}
  for workdir in workdirs:
    path = pathlib.Path(workdir).resolve()
    # Two runs of the same name in different places: the full path.
    label = str(path) if path.name in runs else path.name
    runs[label] = read_metrics(workdir)
  return common.save_figure(plot_curves(runs, 'Pretraining (metrics.jsonl)'),
                            out)

