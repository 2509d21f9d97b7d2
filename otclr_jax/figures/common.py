"""What every figure shares: PNG + PDF output, a run's config and results."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from matplotlib import figure as mpl_figure
from matplotlib.backends import backend_agg
import ml_collections

from otclr_jax import config_files
from otclr_jax import rundir

# The paper's markers: SimCLR views, OTCLR views, clean anchors.
VIEW_STYLES = {
    'simclr': dict(color='tab:blue', marker='o', label='SimCLR views'),
    'otclr': dict(color='tab:green', marker='D', label='OTCLR views'),
    'anchor': dict(color='tab:orange', marker='*', label='clean anchors'),
}
EVALUATE_FIRST = ('run the evaluation first (`python -m otclr_jax.main '
                  '--config=configs/<config>.py --workdir={workdir} '
                  '--config.mode=eval` writes it)')


def png_path(path: str | os.PathLike[str]) -> pathlib.Path:
  """`path` as a Path, checked to end in .png."""
  out = pathlib.Path(os.path.expanduser(path))
  if out.suffix.lower() != '.png':
    raise ValueError(f'--out must end in .png, got {str(path)!r}.')
  return out


def save_figure(fig: mpl_figure.Figure, out: str | os.PathLike[str]
                ) -> list[str]:
  """Writes `fig` to the PNG `out` and a PDF beside it; returns both paths."""
  out = png_path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  backend_agg.FigureCanvasAgg(fig)
  fig.savefig(out, dpi=150)
  fig.savefig(out.with_suffix('.pdf'))
  print(f'wrote {out} and {out.with_suffix(".pdf")}')
  return [str(out), str(out.with_suffix('.pdf'))]


def figures_dir(workdir: str) -> pathlib.Path:
  """`<workdir>/eval/figures`, where the figures of a run go by default."""
  return pathlib.Path(workdir) / rundir.FIGURES_DIR


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config `workdir` was evaluated with (eval/config.json).

  Raises:
    FileNotFoundError: the run is not evaluated.
  """
  path = os.path.join(workdir, rundir.EVAL_CONFIG_FILE)
  # Only a finished evaluation's config (results.json binds it).
  rundir.read_results(workdir)
  if not os.path.exists(path):
    raise FileNotFoundError(f'No {path}; '
                            + EVALUATE_FIRST.format(workdir=workdir)
                            + ", or give the run's --config.")
  return config_files.load(path)


def run_label(workdir: str, results: dict[str, Any] | None = None) -> str:
  """'OTCLR (dir name)': the run's title from its results, else the dir name."""
  name = pathlib.Path(workdir).resolve().name
  title = (results or {}).get('title')
  return f'{title} ({name})' if title else name
