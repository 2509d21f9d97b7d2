"""Figures of runs, one module per figure; `python -m otclr_jax.figures`.

  interpolation  Paper figure 5: pixel interpolation vs the OT view.
  tsne           Paper's class-wise t-SNE of one run's views.
  top5           Paper figure 4: top-5 probe predictions on one test image.
  curves         Training curves of runs.
  report         Every figure a run supports (`report_single` after eval).

Each figure is written as a PNG with a PDF beside it.
"""

from otclr_jax.figures.report import report_single

__all__ = ['report_single']
