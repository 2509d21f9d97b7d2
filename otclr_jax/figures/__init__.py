"""Figures of runs, one module each; `python -m otclr_jax.figures`."""

from otclr_jax.figures.report import report_single

__all__ = ['report_single']
