"""Figures of runs, one module per figure; `python -m otclr_jax.figures`.

  interpolation  The paper's figure 5: linear pixel interpolation against the
                 OT displacement view (figures/interpolation.py).
  tsne           The paper's class-wise t-SNE of SimCLR and OTCLR views and
                 clean anchors, embedded by one run's encoder (figures/tsne.py).
  top5           The paper's figure 4: top-5 probe predictions of runs on one
                 test image (figures/top5.py).
  curves         Training curves of runs (figures/curves.py).
  report         Every figure a run supports (figures/report.py);
                 `otclr_jax.main` draws tsne and curves after an evaluation
                 through `report_single`.

Every figure is written as a PNG and a PDF beside it (matplotlib, Agg,
figures/common.py). The command line is figures/__main__.py.
"""

from otclr_jax.figures.report import report_single

__all__ = ['report_single']
