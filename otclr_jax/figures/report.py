"""Every figure a run supports, into `<workdir>/eval/figures/`."""

from __future__ import annotations

import os
from typing import Any

import ml_collections

from otclr_jax import aggregate
from otclr_jax import data
from otclr_jax import rundir
from otclr_jax.evaluation import view_quality
from otclr_jax.figures import common
from otclr_jax.figures import curves
from otclr_jax.figures import top5
from otclr_jax.figures import tsne


def report_single(config: ml_collections.ConfigDict, workdir: str, *,
                  results: dict[str, Any],
                  views: view_quality.ViewEmbeddings | None,
                  test: data.Split | None) -> list[str]:
  """Draws t-SNE and curves into `<workdir>/eval/figures/` during evaluation.

  `views` (of `test`) are those behind `results['views']`, None when the
  views evaluator did not run (then no t-SNE); returns the paths.
  """
  out = common.figures_dir(workdir)
  dataset = (results.get('protocol', {}).get('views_dataset')
             or tsne.views_dataset(config))
  paths = []
  if views is not None and 'views' in results:
    paths = tsne.draw_tsne(
        views, test, out / 'tsne.png', view_rows=results['views'],
        table_note=f'metrics: {rundir.RESULTS_FILE}',
        title=tsne.figure_title(config, results['step'], dataset,
                                len(views.indices)))
  if os.path.exists(os.path.join(workdir, rundir.METRICS_FILE)):
    paths += curves.curves_for_runs([workdir], out / 'curves.png')
  return paths


def report(workdir: str, config: ml_collections.ConfigDict | None = None, *,
           compare: str | None = None, num_images: int | None = None,
           perplexity: float = tsne.DEFAULT_PERPLEXITY,
           max_classes: int = tsne.DEFAULT_MAX_CLASSES,
           index: int | None = None,
           dataset: str | None = None) -> tuple[list[str], list[str]]:
  """Draws tsne, curves and, with `compare`, top5; skips those lacking inputs.

  Args:
    config: the run's config; None reads `<workdir>/eval/config.json`.
    compare: a second run (e.g. the SimCLR baseline) for curves and top5.
    num_images: t-SNE images; default `config.eval.num_view_images`.
    index: top-5 test image; default the first the runs disagree on.
    dataset: top-5's dataset; default the first both runs evaluated.

  Returns:
    `(paths written, 'figure: why' of each figure skipped)`.
  """
  out = common.figures_dir(workdir)
  written, skipped = [], []

  def attempt(name, draw):
    try:
      written.extend(draw())
    except (FileNotFoundError, ValueError) as e:
      # Missing or unmatched inputs (runs with no dataset in common): say
      # which, go on.
      skipped.append(f'{name}: {e}')

  if config is None:
    try:
      config = common.load_run_config(workdir)
    except FileNotFoundError as e:
      skipped.append(f'tsne: {e}')
  if config is not None:
    attempt('tsne', lambda: tsne.tsne_for_run(
        workdir, config, out / 'tsne.png', num_images=num_images,
        perplexity=perplexity, max_classes=max_classes))
  runs = [workdir] + ([compare] if compare else [])
  attempt('curves', lambda: curves.curves_for_runs(runs, out / 'curves.png'))
  if compare:
    # The paper's order: the SimCLR baseline's panel first.
    order = sorted(runs, key=lambda w: aggregate.run_id(
        rundir.read_results(w) or {'method': ''}) != 'simclr')
    attempt('top5', lambda: top5.top5_for_runs(order, out / 'top5.png',
                                               dataset=dataset, index=index))
  return written, skipped
