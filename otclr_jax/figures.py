"""Figures: `python -m otclr_jax.figures <subcommand> [flags]`.

Every figure is written as a PNG and a PDF beside it (matplotlib, Agg).

Subcommands:
  interpolation   The paper's figure 5: linear pixel interpolation
                  `(1 - a) x + a x_s` against the OT displacement view
                  `ot.ot_views(x, x_s, alpha=a)` for a few `a`, between an image
                  and a strong augmentation of it.
  tsne            The paper's class-wise t-SNE: SimCLR views (blue circles),
                  OTCLR views (green diamonds) and clean anchors (orange stars)
                  of n test images, all embedded by ONE run's restored encoder
                  (l2-normalised z by default, or h: config.eval.embedding,
                  named in the title), made exactly as the evaluation's
                  view metrics make them (`view_quality.view_embeddings`); one
                  panel per class with each set's coverage shaded, a panel
                  with the view metrics (P = OTCLR vs S = SimCLR, from
                  eval/results.json when it describes these views) and one
                  with the class-wise change of silhouette.
  top5            The paper's figure 4: a test image and, for each run, the
                  5 most probable classes of its linear probe (saved by the
                  evaluation), the true class highlighted.
  curves          Training curves (metrics.jsonl) of one or more runs.
  report          Every figure a run supports, into `<workdir>/eval/figures/`:
                  tsne, curves (with `--compare`, of both runs) and, with
                  `--compare`, top5. `otclr_jax.main` draws the tsne and
                  curves figures itself at the end (`report_single`).

Commands that restore an encoder read the run's config from
`<workdir>/eval/config.json` (written by the evaluation) unless `--config`
is given; overrides use `main`'s spelling and parser (`config_files`),
`--config.ot.epsilon=0.1` or `--set ot.epsilon=0.1`, and a typo fails with a
suggestion.

Each subcommand registers its own argparse sub-parser in `build_parser`; a new
figure adds an `_add_<name>_parser` function there.

The strong view defaults to the geometric part of the SimCLR augmentation
(random resized crop and horizontal flip, `augment.simclr_augment` with colour
jitter, grayscale and blur switched off): moving objects is what displacement
interpolation does and linear interpolation cannot, so that is what the figure
shows. `--strong simclr` uses the full augmentation.

What to expect with the method's settings (m = 16, eps = 0.05): the OT row at
`a = 0` and `a = 1` is the source and the strong view seen through the 16 x 16
grid (bilinearly upsampled); in between, one object moves and rescales, with
no double exposure, but blurred: the kernel `exp(-C / eps)` on the max-1 cost
has a standard deviation of `sqrt(eps)`, about a fifth of the image side, so
each source cell spreads its mass over a wide patch of the target. Smaller
`--epsilon` (e.g. 0.01, with `--grid_size 32`) gives sharper intermediates.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from matplotlib import figure as mpl_figure
from matplotlib import lines
from matplotlib import patches
from matplotlib.backends import backend_agg
import ml_collections
import numpy as np
from PIL import Image
from scipy import stats
from sklearn import datasets
from sklearn import manifold
from sklearn import metrics as sk_metrics
import threadpoolctl

from otclr_jax import augment
from otclr_jax import config_files
from otclr_jax.evaluation import clusters
from otclr_jax.evaluation import evaluate
from otclr_jax.evaluation import features
from otclr_jax.evaluation import probe
from otclr_jax.evaluation import view_quality
from otclr_jax import input_pipeline
from otclr_jax import ot
from otclr_jax import tables

DEFAULT_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
# Bundled with scikit-learn, so the figure needs no download.
DEFAULT_SAMPLE_IMAGE = 'flower.jpg'


def _png_path(path: str | os.PathLike[str]) -> pathlib.Path:
  out = pathlib.Path(path)
  if out.suffix.lower() != '.png':
    raise ValueError(f'--out must end in .png, got {str(path)!r}.')
  return out


def save_figure(fig: mpl_figure.Figure, out: str | os.PathLike[str]
                ) -> list[str]:
  """Writes `fig` as the PNG `out` and as a PDF beside it (Agg canvas).

  Returns:
    The two paths written.
  """
  out = _png_path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  backend_agg.FigureCanvasAgg(fig)
  fig.savefig(out, dpi=150)
  fig.savefig(out.with_suffix('.pdf'))
  print(f'wrote {out} and {out.with_suffix(".pdf")}')
  return [str(out), str(out.with_suffix('.pdf'))]


def load_image(path: str | None, size: int) -> np.ndarray:
  """Reads an image, centre-crops it to a square and resizes it.

  Args:
    path: image file readable by Pillow; None loads scikit-learn's bundled
      sample image `flower.jpg`.
    size: output side in pixels.

  Returns:
    float32 `[size, size, 3]` RGB in `[0, 1]`.
  """
  if size < 2:
    raise ValueError(f'size must be >= 2 pixels, got {size}.')
  if path is None:
    image = Image.fromarray(datasets.load_sample_image(DEFAULT_SAMPLE_IMAGE))
  else:
    if not pathlib.Path(path).is_file():
      raise ValueError(f'image path {path!r} is not a file.')
    with Image.open(path) as f:
      image = f.convert('RGB')
  width, height = image.size
  side = min(width, height)
  left, top = (width - side) // 2, (height - side) // 2
  image = image.crop((left, top, left + side, top + side))
  image = image.resize((size, size), Image.Resampling.LANCZOS)
  return np.asarray(image, np.float32) / 255.0


def strong_view(image: np.ndarray, seed: int, kind: str = 'geometric'
                ) -> np.ndarray:
  """A deterministic strong augmentation of one image.

  Args:
    image: `[H, W, 3]` in `[0, 1]`.
    seed: PRNG seed of the augmentation.
    kind: 'geometric' (random resized crop + flip) or 'simclr' (the full
      SimCLR augmentation, colour included).

  Returns:
    `[H, W, 3]` float32 in `[0, 1]`.
  """
  if kind == 'geometric':
    overrides = dict(jitter_prob=0.0, grayscale_prob=0.0, blur_prob=0.0)
  elif kind == 'simclr':
    overrides = {}
  else:
    raise ValueError(f"kind must be 'geometric' or 'simclr', got {kind!r}.")
  out = augment.simclr_augment(jax.random.key(seed), jnp.asarray(image)[None],
                               **overrides)
  return np.asarray(out[0])


def interpolation_rows(x: np.ndarray, x_strong: np.ndarray,
                       alphas: Sequence[float], grid_size: int = 16,
                       epsilon: float = 0.05, num_iters: int = 20):
  """Both rows of the interpolation figure.

  Args:
    x: source image `[H, W, 3]` in `[0, 1]`.
    x_strong: strong view `[H, W, 3]`.
    alphas: interpolation coefficients in `[0, 1]`, one per column.
    grid_size: OT grid side `m`.
    epsilon: entropic regularisation.
    num_iters: Sinkhorn iterations.

  Returns:
    `(linear, displaced)`, each `[len(alphas), H, W, 3]` float32:
    `(1 - a) x + a x_strong` and `ot.ot_views(x, x_strong, alpha=a)`.
  """
  x = jnp.asarray(x, jnp.float32)
  x_strong = jnp.asarray(x_strong, jnp.float32)
  if x.ndim != 3 or x.shape != x_strong.shape:
    raise ValueError(
        f'x and x_strong must be [H, W, C] of equal shape, got {x.shape} and '
        f'{x_strong.shape}.')
  alphas = jnp.asarray(alphas, jnp.float32)
  if alphas.ndim != 1 or alphas.size == 0:
    raise ValueError(f'alphas must be a non-empty list, got {alphas}.')
  linear = ((1.0 - alphas[:, None, None, None]) * x
            + alphas[:, None, None, None] * x_strong)
  displaced = jax.vmap(
      lambda a: ot.ot_views(x[None], x_strong[None], alpha=a,
                            grid_size=grid_size, epsilon=epsilon,
                            num_iters=num_iters)[0])(alphas)
  return np.asarray(linear), np.asarray(displaced)


def plot_interpolation(linear: np.ndarray, displaced: np.ndarray,
                       alphas: Sequence[float], title: str | None = None):
  """Two-row figure: linear interpolation above, OT displacement below.

  Args:
    linear: `[n, H, W, 3]` images.
    displaced: `[n, H, W, 3]` images.
    alphas: the `n` coefficients, used as column titles.
    title: optional figure title.

  Returns:
    A `matplotlib.figure.Figure` (not attached to pyplot).
  """
  n = len(alphas)
  fig = mpl_figure.Figure(figsize=(1.9 * n + 1.0, 4.4), layout='constrained')
  axes = fig.subplots(2, n, squeeze=False)
  labels = ('linear\n$(1-\\alpha)\\,x + \\alpha\\,x_s$',
            'OT displacement\n$D_\\alpha(x, x_s)$')
  for row, (images, label) in enumerate(zip((linear, displaced), labels)):
    for col, alpha in enumerate(alphas):
      ax = axes[row, col]
      ax.imshow(np.clip(images[col], 0.0, 1.0), interpolation='nearest')
      ax.set_xticks([])
      ax.set_yticks([])
      if row == 0:
        ax.set_title(f'$\\alpha = {alpha:g}$')
      if col == 0:
        ax.set_ylabel(label)
  if title:
    fig.suptitle(title)
  return fig


def run_interpolation(args: argparse.Namespace) -> int:
  """The `interpolation` subcommand: writes `--out` (PNG) and a PDF too."""
  out = _png_path(args.out)
  if not all(0.0 <= a <= 1.0 for a in args.alphas):
    raise ValueError(f'--alphas must lie in [0, 1], got {args.alphas}.')
  if not 2 <= args.grid_size <= args.size:
    raise ValueError(
        f'--grid_size must lie in [2, --size={args.size}], got '
        f'{args.grid_size}.')
  x = load_image(args.image, args.size)
  x_strong = strong_view(x, args.seed, args.strong)
  linear, displaced = interpolation_rows(
      x, x_strong, args.alphas, args.grid_size, args.epsilon, args.num_iters)
  title = (f'{args.strong} strong view (seed {args.seed}); OT: m = '
           f'{args.grid_size}, $\\varepsilon$ = {args.epsilon:g}, '
           f'T = {args.num_iters}')
  fig = plot_interpolation(linear, displaced, args.alphas, title)
  save_figure(fig, out)
  return 0


def _add_interpolation_parser(subparsers) -> None:
  p = subparsers.add_parser(
      'interpolation', help='linear vs OT displacement interpolation (fig. 5)')
  p.add_argument('--image', default=None,
                 help="image file; default scikit-learn's flower.jpg")
  p.add_argument('--out', required=True, help='output .png (a .pdf is '
                 'written beside it)')
  p.add_argument('--size', type=int, default=128,
                 help='side of the square centre crop, in pixels')
  p.add_argument('--grid_size', type=int, default=16, help='OT grid side m')
  p.add_argument('--epsilon', type=float, default=0.05)
  p.add_argument('--num_iters', type=int, default=20)
  p.add_argument('--alphas', type=float, nargs='+',
                 default=list(DEFAULT_ALPHAS))
  p.add_argument('--strong', choices=('geometric', 'simclr'),
                 default='geometric', help='strong augmentation of the image')
  # Seed 1 moves the flower of the default image up-left and enlarges it.
  p.add_argument('--seed', type=int, default=1,
                 help='seed of the strong augmentation')
  p.set_defaults(func=run_interpolation)


# ----------------------------------------------------------------------------
# Runs: config, results and output directory.


def figures_dir(workdir: str) -> pathlib.Path:
  """`<workdir>/eval/figures`, where `report` writes."""
  return pathlib.Path(workdir) / 'eval' / 'figures'


def load_run_config(workdir: str, config_path: str | None = None,
                    overrides: Sequence[str] = ()
                    ) -> ml_collections.ConfigDict:
  """The config of the run in `workdir`.

  Args:
    workdir: the run's directory.
    config_path: a config file (`configs/X.py` with `get_config()`, or a JSON
      dump); None reads `<workdir>/eval/config.json`, which
      `otclr_jax.evaluation.evaluate` writes.
    overrides: `key=value` or `--config.key=value` strings applied on top
      with the training command line's parser (`config_files.apply_overrides`:
      values parsed by the field's type, unknown fields refused).

  Raises:
    FileNotFoundError: no config file.
  """
  if config_path is None:
    config_path = os.path.join(workdir, 'eval', 'config.json')
    if not os.path.exists(config_path):
      raise FileNotFoundError(
          f'No {config_path}; run the evaluation first (`python -m '
          f'otclr_jax.main --config=configs/<config>.py --workdir='
          f'{workdir} --config.mode=eval` writes it), or pass the run\'s --config and --set '
          'overrides.')
  return config_files.apply_overrides(config_files.load(config_path),
                                      overrides)


def load_results(workdir: str) -> dict[str, Any] | None:
  """`<workdir>/eval/results.json`, or None when the run is not evaluated."""
  path = os.path.join(workdir, 'eval', 'results.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def run_label(workdir: str, results: dict[str, Any] | None = None) -> str:
  """'SimCLR (dir name)' when the method is known, else the dir name."""
  name = pathlib.Path(workdir).resolve().name
  if results and results.get('method'):
    return f'{tables.method_name(results["method"])} ({name})'
  return name


# ----------------------------------------------------------------------------
# t-SNE of the views (the paper's t-SNE figure).

# The paper's markers: SimCLR views, OTCLR views, clean anchors.
VIEW_STYLES = {
    'simclr': dict(color='tab:blue', marker='o', label='SimCLR views'),
    'otclr': dict(color='tab:green', marker='D', label='OTCLR views'),
    'anchor': dict(color='tab:orange', marker='*', label='clean anchors'),
}
# The coverage region of a point set is its highest-density region holding
# this share of the points, under a Gaussian KDE of the 2-d map: unlike a
# hull, it shows where a set concentrates, and stray points do not paint it.
COVERAGE_MASS = 0.5
DEFAULT_PERPLEXITY = 30.0
DEFAULT_MAX_CLASSES = 12


def tsne_points(views: view_quality.ViewEmbeddings, *,
                perplexity: float = DEFAULT_PERPLEXITY,
                seed: int = 0) -> dict[str, np.ndarray]:
  """Joint 2-d t-SNE of the anchors and both generators' views.

  The 5n embeddings (anchors, SimCLR pair, OTCLR pair; l2-normalised, so the
  Euclidean distance is a function of the cosine) are embedded together, so
  the three sets share one map.

  Args:
    views: `view_quality.view_embeddings` of n images.
    perplexity: t-SNE perplexity, below 5n.
    seed: `random_state` of the t-SNE.

  Returns:
    {'anchor': [n, 2], 'simclr': [2n, 2], 'otclr': [2n, 2]}; view rows are
    [first views; second views], in image order.
  """
  n = len(views.anchors)
  points = np.concatenate([views.anchors, *views.simclr, *views.otclr])
  if not 0 < perplexity < len(points):
    raise ValueError(f'perplexity must lie in (0, {len(points)}) for 5 x {n} '
                     f'points, got {perplexity}.')
  # One thread: scikit-learn's OpenMP gradient spins on its barriers when
  # the cores are busy (e.g. with JAX's threads) and then runs tens of times
  # slower than serially.
  with threadpoolctl.threadpool_limits(limits=1):
    xy = manifold.TSNE(n_components=2, perplexity=perplexity, init='pca',
                       random_state=seed).fit_transform(
                           points.astype(np.float64))
  return {'anchor': xy[:n], 'simclr': xy[n:3 * n], 'otclr': xy[3 * n:]}


def classwise_silhouette(views: view_quality.ViewEmbeddings, labels: np.ndarray,
                         num_classes: int) -> dict[str, np.ndarray]:
  """Mean silhouette of each class's view embeddings, per generator.

  Silhouette of the 2n view embeddings (z or h as `views.embedding` says,
  Euclidean on the l2-normalised rows) with the TRUE labels as clusters, averaged over the views of each
  class; NaN for a class without views.

  Returns:
    {'simclr': [num_classes], 'otclr': [num_classes]}.
  """
  labels = np.asarray(labels)
  both = np.concatenate([labels, labels])
  out = {}
  for generator in ('simclr', 'otclr'):
    z = np.concatenate(getattr(views, generator))
    if len(np.unique(both)) < 2:
      out[generator] = np.full(num_classes, np.nan)
      continue
    values = sk_metrics.silhouette_samples(z, both)
    out[generator] = np.array([values[both == c].mean() if np.any(both == c)
                               else np.nan for c in range(num_classes)])
  return out


def density_level(density_at_points: np.ndarray, mass: float) -> float:
  """Density threshold of the highest-density region holding `mass`.

  The region {x: p(x) >= level} contains the share `mass` of the sample
  points when `level` is the (1 - mass) quantile of the density at them
  (Hyndman 1996, the sample estimate of an HDR).

  Args:
    density_at_points: [N] density at each sample point.
    mass: share of the points inside, in (0, 1).
  """
  if not 0.0 < mass < 1.0:
    raise ValueError(f'mass must lie in (0, 1), got {mass}.')
  return float(np.quantile(density_at_points, 1.0 - mass))


def _shade_coverage(ax, xy: np.ndarray, colour: str, lo: np.ndarray,
                    hi: np.ndarray, mass: float = COVERAGE_MASS) -> None:
  """Fills the KDE highest-density region of `xy` [N, 2] holding `mass`."""
  if len(xy) < 4:
    return
  try:
    kde = stats.gaussian_kde(xy.T)
  except np.linalg.LinAlgError:  # Collinear points: no 2-d density.
    return
  level = density_level(kde(xy.T), mass)
  gx, gy = np.meshgrid(np.linspace(lo[0], hi[0], 120),
                       np.linspace(lo[1], hi[1], 120))
  density = kde(np.stack([gx.ravel(), gy.ravel()])).reshape(gx.shape)
  if density.max() <= level:
    return
  ax.contourf(gx, gy, density, levels=[level, density.max()], colors=[colour],
              alpha=0.18)
  ax.contour(gx, gy, density, levels=[level], colors=[colour],
             linewidths=0.9)


def _view_table(ax, rows: dict[str, dict[str, Any]], note: str) -> None:
  """P (OTCLR) vs S (SimCLR) view metrics, the better one in bold."""
  ax.axis('off')
  cells, bold = [], []
  for key, header, direction in tables.VIEW_METRICS + tables.CLUSTER_METRICS:
    p, q = rows['otclr'].get(key), rows['simclr'].get(key)
    arrow = '↑' if direction > 0 else '↓'
    cells.append([f'{header} {arrow}', _fmt(p), _fmt(q)])
    # SimCLR views are their own strong endpoints: pixel L2 is 0 by
    # construction, not better.
    if p is None or q is None or p == q or key == 'pixel_l2':
      bold.append(None)
    else:
      bold.append(1 if (p - q) * direction > 0 else 2)
  table = ax.table(cellText=cells, colLabels=['', 'P', 'S'], loc='upper center',
                   cellLoc='right', colLoc='right', colWidths=[0.5, 0.25, 0.25])
  table.auto_set_font_size(False)
  table.set_fontsize(7)
  table.scale(1.0, 1.15)
  for (r, c), cell in table.get_celld().items():
    cell.set_linewidth(0.3)
    if r >= 1 and bold[r - 1] == c:
      cell.get_text().set_fontweight('bold')
  ax.set_title('P = OTCLR views, S = SimCLR views', fontsize=8)
  ax.text(0.5, -0.02, note, transform=ax.transAxes, ha='center', va='top',
          fontsize=6, wrap=True)


def _count(name: str, count: int) -> str:
  return f'{name} ({count} image{"" if count == 1 else "s"})'


def _fmt(value: Any) -> str:
  return '–' if value is None else f'{value:.4f}'


def plot_tsne(points: dict[str, np.ndarray], labels: np.ndarray,
              class_names: Sequence[str], *,
              thumbnails: dict[int, np.ndarray] | None = None,
              view_rows: dict[str, dict[str, Any]] | None = None,
              silhouettes: dict[str, np.ndarray] | None = None,
              table_note: str = '', title: str | None = None,
              max_classes: int = DEFAULT_MAX_CLASSES) -> mpl_figure.Figure:
  """Class-wise t-SNE panels of the views, with the paper's insets as panels.

  One panel per class (the first `max_classes` classes): every point of the
  map in light grey for context, then this class's SimCLR views (blue
  circles), OTCLR views (green diamonds) and clean anchors (orange stars),
  each set's coverage shaded (the KDE region holding half of its points),
  and a representative image of the class in the corner. Extra panels: the
  view-metric table (P vs S) and the class-wise change of silhouette (P - S).

  Args:
    points: `tsne_points` output.
    labels: int [n], the anchors' classes.
    class_names: [K] names.
    thumbnails: {class: image [S, S, 3] uint8} for the corner insets.
    view_rows: the results' 'views' section, {'simclr': {...}, 'otclr': {...}}.
    silhouettes: `classwise_silhouette` output.
    table_note: small print under the table (where its numbers come from).
    title: figure title.
    max_classes: at most this many class panels.

  Returns:
    The figure.
  """
  labels = np.asarray(labels)
  n = len(labels)
  if points['anchor'].shape != (n, 2) or points['simclr'].shape != (2 * n, 2):
    raise ValueError(f'points do not match {n} labels: '
                     f'{ {k: v.shape for k, v in points.items()} }.')
  classes = [c for c in range(len(class_names)) if np.any(labels == c)]
  classes = classes[:max_classes]
  extra = [p for p in ('table', 'silhouette')
           if (view_rows if p == 'table' else silhouettes) is not None]
  total = len(classes) + len(extra)
  ncols = 4 if total <= 16 else int(np.ceil(np.sqrt(total)))
  nrows = -(-total // ncols)
  fig = mpl_figure.Figure(figsize=(3.0 * ncols, 3.0 * nrows + 0.6),
                          layout='constrained')
  grid = fig.add_gridspec(nrows, ncols)
  # The extra panels go down the first column, so that the silhouette
  # panel's class labels widen the figure's margin, not a gap between maps.
  first = [0, ncols][:len(extra)] if nrows > 1 else list(range(len(extra)))
  order = first + [i for i in range(total) if i not in first]
  cells = [grid[i // ncols, i % ncols] for i in order]
  every = np.concatenate([points['anchor'], points['simclr'], points['otclr']])
  pad = 0.05 * (every.max(axis=0) - every.min(axis=0))
  lo, hi = every.min(axis=0) - pad, every.max(axis=0) + pad
  both = np.concatenate([labels, labels])

  extra_cells = dict(zip(extra, cells))
  cell = iter(cells[len(extra):])
  if 'table' in extra:
    _view_table(fig.add_subplot(extra_cells['table']), view_rows, table_note)
  for c in classes:
    ax = fig.add_subplot(next(cell))
    ax.scatter(every[:, 0], every[:, 1], s=1.5, color='0.85', lw=0,
               rasterized=True)
    for kind, xy in (('simclr', points['simclr'][both == c]),
                     ('otclr', points['otclr'][both == c]),
                     ('anchor', points['anchor'][labels == c])):
      style = VIEW_STYLES[kind]
      _shade_coverage(ax, xy, style['color'], lo, hi)
      big = kind == 'anchor'
      ax.scatter(xy[:, 0], xy[:, 1], s=28 if big else 7,
                 marker=style['marker'], color=style['color'],
                 alpha=1.0 if big else 0.6, lw=0.3 if big else 0,
                 ec='black' if big else None, zorder=3 if big else 2)
    ax.set_xlim(lo[0], hi[0])
    ax.set_ylim(lo[1], hi[1])
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(_count(class_names[c], int(np.sum(labels == c))),
                 fontsize=9)
    if thumbnails and c in thumbnails:
      inset = ax.inset_axes([0.76, 0.76, 0.22, 0.22])
      inset.imshow(thumbnails[c], interpolation='nearest')
      inset.set_xticks([])
      inset.set_yticks([])
  if 'silhouette' in extra:
    ax = fig.add_subplot(extra_cells['silhouette'])
    delta = silhouettes['otclr'] - silhouettes['simclr']
    shown = [c for c in range(len(class_names)) if np.isfinite(delta[c])]
    shown = shown[:max(max_classes, 1)]
    values = np.array([delta[c] for c in shown])
    ax.barh(np.arange(len(shown)), values,
            color=[VIEW_STYLES['otclr' if v > 0 else 'simclr']['color']
                   for v in values])
    ax.set_yticks(np.arange(len(shown)),
                  [class_names[c] for c in shown], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(0.0, color='black', lw=0.6)
    ax.tick_params(axis='x', labelsize=7)
    ax.set_title('class-wise $\\Delta$ silhouette (P $-$ S)', fontsize=8)
    ax.set_xlabel('view silhouette, true classes', fontsize=7)
  handles = [lines.Line2D([], [], ls='', marker=s['marker'], color=s['color'],
                          mec='black' if k == 'anchor' else s['color'],
                          mew=0.3, ms=9 if k == 'anchor' else 5,
                          label=s['label'])
             for k, s in VIEW_STYLES.items()]
  handles.append(patches.Patch(color='0.5', alpha=0.3,
                               label=f'coverage: {COVERAGE_MASS:.0%} '
                                     'highest-density region (KDE)'))
  fig.legend(handles=handles, loc='outside lower center', ncols=4,
             fontsize=8, frameon=False)
  if title:
    fig.suptitle(title, fontsize=10)
  return fig


def draw_tsne(views: view_quality.ViewEmbeddings, test: input_pipeline.Split,
              out: str | os.PathLike[str], *,
              view_rows: dict[str, dict[str, Any]] | None = None,
              table_note: str = '', title: str | None = None,
              perplexity: float = DEFAULT_PERPLEXITY, seed: int = 0,
              max_classes: int = DEFAULT_MAX_CLASSES) -> list[str]:
  """t-SNE figure of `views` (of images `test.images[views.indices]`).

  Args:
    views: `view_quality.view_embeddings` output on `test.images`.
    test: the test split the views were made from.
    out: output PNG (a PDF is written beside it).
    view_rows: P vs S metrics for the table; None computes them from `views`
      (`view_quality.summarise_views`).
    table_note: where the table's numbers come from.
    title: figure title.
    perplexity: t-SNE perplexity; lowered to (5n - 1) / 3 for small n.
    seed: t-SNE seed.
    max_classes: at most this many class panels.

  Returns:
    The paths written.
  """
  labels = test.labels[views.indices]
  if view_rows is None:
    view_rows = view_quality.summarise_views(views, test.num_classes)
  points = tsne_points(views, perplexity=min(
      perplexity, (5 * len(labels) - 1) / 3), seed=seed)
  thumbnails = {}
  for row, label in zip(views.indices, labels):
    thumbnails.setdefault(int(label), test.images[row])
  fig = plot_tsne(points, labels, test.class_names, thumbnails=thumbnails,
                  view_rows=view_rows,
                  silhouettes=classwise_silhouette(views, labels,
                                                   test.num_classes),
                  table_note=table_note, title=title, max_classes=max_classes)
  return save_figure(fig, out)


def _views_dataset(config: ml_collections.ConfigDict) -> str:
  return config.eval.views_dataset or tuple(config.eval.datasets)[0]


def _tsne_title(config, step: int, dataset: str, n: int) -> str:
  embedding = clusters.embedding_of(config)
  return (f'Views of {n} {tables.dataset_name(dataset)} test images, '
          f'embedded by the {tables.method_name(config.method)} network '
          f'(step {step}; {clusters.EMBEDDINGS[embedding]}); joint t-SNE of '
          f'anchors and both view pairs')


def tsne_for_run(workdir: str, config: ml_collections.ConfigDict,
                 out: str | os.PathLike[str], *, step: int | None = None,
                 dataset: str | None = None, num_images: int | None = None,
                 perplexity: float = DEFAULT_PERPLEXITY, seed: int = 0,
                 max_classes: int = DEFAULT_MAX_CLASSES) -> list[str]:
  """Restores a run's encoder, makes the views as evaluation does, draws.

  Args:
    workdir: the run's directory.
    config: the run's config.
    out: output PNG.
    step: checkpoint step; None for the latest.
    dataset: test split to use; default the run's views dataset.
    num_images: n; default `config.eval.num_view_images`, so that the views
      and the table are those of the evaluation.
    perplexity: t-SNE perplexity.
    seed: t-SNE seed.
    max_classes: at most this many class panels.

  Returns:
    The paths written.
  """
  dataset = dataset or _views_dataset(config)
  n = int(num_images or config.eval.num_view_images)
  if n < 2:
    raise ValueError(f'need at least 2 images, got n = {n}.')
  model, variables, step = evaluate.restore(config, workdir, step)
  test = input_pipeline.load_split(dataset, 'test', config.image_size,
                                   config.data_dir or None)
  views = view_quality.view_embeddings(config, model, variables, test.images,
                                   num_images=n,
                                   batch_size=int(config.eval.batch_size))
  results = load_results(workdir)
  protocol = (results or {}).get('protocol', {})
  if (results and results.get('views') and results.get('step') == step
      and protocol.get('views_dataset') == dataset
      and protocol.get('views_num_images') == len(views.indices)
      and protocol.get('embedding', 'h') == views.embedding
      and protocol.get('views_seed', view_quality.VIEWS_SEED)
      == view_quality.VIEWS_SEED):
    rows, note = results['views'], 'metrics: eval/results.json'
  else:
    rows, note = None, 'metrics: computed on these views'
  return draw_tsne(views, test, out, view_rows=rows, table_note=note,
                   title=_tsne_title(config, step, dataset,
                                     len(views.indices)),
                   perplexity=perplexity, seed=seed, max_classes=max_classes)


def run_tsne(args: argparse.Namespace) -> int:
  """The `tsne` subcommand."""
  config = load_run_config(args.workdir, args.config, args.set)
  out = args.out or figures_dir(args.workdir) / 'tsne.png'
  tsne_for_run(args.workdir, config, _png_path(out), step=args.step,
               dataset=args.dataset, num_images=args.n,
               perplexity=args.perplexity, seed=args.seed,
               max_classes=args.max_classes)
  return 0


def _add_run_config_args(p) -> None:
  p.add_argument('--config', default=None,
                 help="the run's config file (configs/X.py or JSON); default "
                 '<workdir>/eval/config.json, written by the evaluation')
  p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                 help='config override as on the training command line, e.g. '
                 '--set method=simclr --set ot.epsilon=0.1 (repeatable); '
                 '--config.ot.epsilon=0.1 works too')


def _add_tsne_parser(subparsers) -> None:
  p = subparsers.add_parser(
      'tsne', help='class-wise t-SNE of SimCLR / OTCLR views and anchors')
  p.add_argument('--workdir', required=True, help='the run whose encoder '
                 'embeds the views')
  _add_run_config_args(p)
  p.add_argument('--out', default=None, help='output .png; default '
                 '<workdir>/eval/figures/tsne.png (a .pdf beside it)')
  p.add_argument('--step', type=int, default=None,
                 help='checkpoint step; default the latest')
  p.add_argument('--dataset', default=None, help="test split; default the "
                 "run's config.eval.views_dataset or first eval dataset")
  p.add_argument('--n', type=int, default=None, help='test images; default '
                 'config.eval.num_view_images (the evaluation\'s views)')
  p.add_argument('--perplexity', type=float, default=DEFAULT_PERPLEXITY)
  p.add_argument('--seed', type=int, default=0, help='t-SNE random_state')
  p.add_argument('--max_classes', type=int, default=DEFAULT_MAX_CLASSES,
                 help='at most this many class panels')
  p.set_defaults(func=run_tsne)


# ----------------------------------------------------------------------------
# Top-5 predictions of two models on one image (the paper's figure 4).


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
  fitted = probe.load_probe(probe.probe_path(workdir, step, dataset))
  feats, labels = features.load_features(workdir, step, dataset, 'test',
                                         image_size)
  logits = fitted.logits(feats).astype(np.float64)
  logits -= logits.max(axis=1, keepdims=True)
  probs = np.exp(logits)
  probs /= probs.sum(axis=1, keepdims=True)
  return Predictions(run_label(workdir, results), probs, labels, image_size)


def pick_index(preds: Sequence[Predictions]) -> int:
  """The first test image on which the runs' top-1 classes differ, else 0."""
  top1 = np.stack([p.probs.argmax(axis=1) for p in preds])
  differ = np.flatnonzero(np.any(top1 != top1[:1], axis=0))
  return int(differ[0]) if len(differ) else 0


def plot_top5(image: np.ndarray, true_label: int, class_names: Sequence[str],
              preds: Sequence[Predictions], index: int,
              title: str | None = None) -> mpl_figure.Figure:
  """The image and, per run, bars of its 5 most probable classes.

  The true class's bar is orange, the others grey; the panel title says the
  run's prediction, and where the true class is not among the five, its
  rank and probability are written under the bars.
  """
  k = min(5, len(class_names))
  fig = mpl_figure.Figure(figsize=(2.6 + 3.3 * len(preds), 2.8),
                          layout='constrained')
  axes = fig.subplots(1, 1 + len(preds), squeeze=False,
                      width_ratios=[0.8] + [1.0] * len(preds))[0]
  axes[0].imshow(image, interpolation='nearest')
  axes[0].set_xticks([])
  axes[0].set_yticks([])
  axes[0].set_title(f'test image #{index}\ntrue: {class_names[true_label]}',
                    fontsize=9)
  for ax, pred in zip(axes[1:], preds):
    probs = pred.probs[index]
    order = np.argsort(-probs, kind='stable')
    top = order[:k]
    colours = [VIEW_STYLES['anchor']['color'] if c == true_label else '0.6'
               for c in top]
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
  """Top-5 figure for evaluated runs (probe files and feature caches).

  Args:
    workdirs: the runs, in panel order.
    out: output PNG.
    dataset: evaluated dataset; default the first one all runs share.
    index: test image; default `pick_index`.

  Returns:
    The paths written.

  Raises:
    FileNotFoundError: a run is not evaluated (no results, probe or
      features); the message says to run the evaluation.
    ValueError: the runs were evaluated on different test sets.
  """
  if not workdirs:
    raise ValueError('top5 needs at least one --workdirs run.')
  runs = []
  for workdir in workdirs:
    results = load_results(workdir)
    if results is None:
      raise FileNotFoundError(
          f'{workdir} has no eval/results.json; run the evaluation first: '
          f'`python -m otclr_jax.main --config=configs/<config>.py '
          f'--workdir={workdir} --config.mode=eval`.')
    runs.append((results, load_run_config(workdir)))
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
  test = input_pipeline.load_split(dataset, 'test', preds[0].image_size,
                                   config.data_dir or None)
  true_label = int(preds[0].labels[index])
  if int(test.labels[index]) != true_label:
    raise ValueError(f'the cached features of {dataset} do not match its test '
                     'split; re-run the evaluation.')
  steps = ', '.join(f'step {r["step"]}' for r, _ in runs)
  fig = plot_top5(test.images[index], true_label, test.class_names, preds,
                  index, title=f'{tables.dataset_name(dataset)} test image '
                  f'#{index}, linear probes on frozen features ({steps})')
  return save_figure(fig, out)


def run_top5(args: argparse.Namespace) -> int:
  """The `top5` subcommand."""
  out = args.out or figures_dir(args.workdirs[0]) / 'top5.png'
  top5_for_runs(args.workdirs, _png_path(out), dataset=args.dataset,
                index=args.index)
  return 0


def _add_top5_parser(subparsers) -> None:
  p = subparsers.add_parser(
      'top5', help='top-5 probe predictions of runs on one test image '
      '(fig. 4)')
  p.add_argument('--workdirs', nargs='+', required=True,
                 help='evaluated runs, one bar panel each (e.g. the SimCLR '
                 'run, then the OTCLR run)')
  p.add_argument('--dataset', default=None, help='evaluated dataset; default '
                 'the first one the runs share')
  p.add_argument('--index', type=int, default=None, help='test image index; '
                 'default the first image the runs disagree on, else 0')
  p.add_argument('--out', default=None, help='output .png; default '
                 '<first workdir>/eval/figures/top5.png')
  p.set_defaults(func=run_top5)


# ----------------------------------------------------------------------------
# Training curves.

# (metrics.jsonl key, panel title); panels without data are left out.
CURVES = (('loss', 'loss'),
          ('top1', 'contrastive top-1'),
          ('lr', 'learning rate'),
          ('images_per_sec', 'images / s'),
          ('monitor_knn_top1', 'kNN monitor top-1 (%)'),
          ('sinkhorn', 'Sinkhorn regulariser'),
          ('alpha', '$\\alpha$'))


def read_metrics(workdir: str) -> dict[str, np.ndarray]:
  """`<workdir>/metrics.jsonl` as {key: [T] float} with 'step' ascending.

  A resumed run may log a step twice; the later record wins. Keys missing
  from a record are NaN there.

  Raises:
    FileNotFoundError: no metrics.jsonl.
  """
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    raise FileNotFoundError(f'No {path}; pretrain first (`python -m '
                            f'otclr_jax.main --config=... --workdir={workdir}`).')
  records = {}
  with open(path) as f:
    for line in f:
      if line.strip():
        record = json.loads(line)
        records[int(record['step'])] = record
  if not records:
    raise ValueError(f'{path} holds no records yet.')
  steps = sorted(records)
  keys = sorted({k for r in records.values() for k in r})
  return {k: np.array([_float(records[s].get(k)) for s in steps])
          for k in keys}


def _float(value: Any) -> float:
  return np.nan if value is None else float(value)


def plot_curves(runs: dict[str, dict[str, np.ndarray]],
                title: str | None = None) -> mpl_figure.Figure:
  """One panel per logged quantity, one line per run.

  Args:
    runs: {run label: `read_metrics` output}.
    title: figure title.
  """
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
      # Markers, so that a run with a single log step still shows; only the
      # steps that logged the quantity (the monitor runs every N steps).
      finite = np.isfinite(m[key])
      ax.plot(m['step'][finite], m[key][finite], color=colours[label],
              lw=1.2, marker='.', ms=3, label=label)
      if (key == 'loss' and 'nce' in m
          and not np.allclose(m['nce'], m['loss'], equal_nan=True)):
        ax.plot(m['step'], m['nce'], color=colours[label], lw=1.0, ls='--')
    if key == 'loss' and len(ax.get_lines()) > len(
        [m for m in runs.values() if key in m]):
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
  if not workdirs:
    raise ValueError('curves needs at least one --workdirs run.')
  runs = {}
  for workdir in workdirs:
    label = pathlib.Path(workdir).resolve().name
    if label in runs:  # Two runs of the same name in different places.
      label = str(pathlib.Path(workdir).resolve())
    runs[label] = read_metrics(workdir)
  return save_figure(plot_curves(runs, 'Pretraining (metrics.jsonl)'), out)


def run_curves(args: argparse.Namespace) -> int:
  """The `curves` subcommand."""
  out = args.out or figures_dir(args.workdirs[0]) / 'curves.png'
  curves_for_runs(args.workdirs, _png_path(out))
  return 0


def _add_curves_parser(subparsers) -> None:
  p = subparsers.add_parser('curves', help='training curves of runs')
  p.add_argument('--workdirs', nargs='+', required=True,
                 help='run directories holding metrics.jsonl')
  p.add_argument('--out', default=None, help='output .png; default '
                 '<first workdir>/eval/figures/curves.png')
  p.set_defaults(func=run_curves)


# ----------------------------------------------------------------------------
# Everything a run supports.


def report_single(config: ml_collections.ConfigDict, workdir: str, *,
                  results: dict[str, Any], views: view_quality.ViewEmbeddings,
                  test: input_pipeline.Split) -> list[str]:
  """t-SNE and training curves of a run, from an evaluation in progress.

  `otclr_jax.main` calls this with the view embeddings the evaluation has
  just measured, so the t-SNE shows exactly the views of the results' table.

  Args:
    config: the run's config.
    workdir: the run's directory; figures go to `<workdir>/eval/figures/`.
    results: the evaluation results (for the table and the step).
    views: the embeddings behind `results['views']`.
    test: the test split the views came from.

  Returns:
    The paths written.
  """
  out = figures_dir(workdir)
  dataset = results.get('protocol', {}).get('views_dataset') or \
      _views_dataset(config)
  paths = draw_tsne(views, test, out / 'tsne.png', view_rows=results['views'],
                    table_note='metrics: eval/results.json',
                    title=_tsne_title(config, results['step'], dataset,
                                      len(views.indices)))
  if os.path.exists(os.path.join(workdir, 'metrics.jsonl')):
    paths += curves_for_runs([workdir], out / 'curves.png')
  return paths


def run_report(args: argparse.Namespace) -> int:
  """The `report` subcommand: every figure the run(s) support."""
  workdir = args.workdir
  out = figures_dir(workdir)
  written, skipped = [], []

  def attempt(name, draw):
    try:
      written.extend(draw())
    except FileNotFoundError as e:  # Missing inputs: say which, go on.
      skipped.append(f'{name}: {e}')

  config = None
  try:
    config = load_run_config(workdir, args.config, args.set)
  except FileNotFoundError as e:
    skipped.append(f'tsne: {e}')
  if config is not None:
    attempt('tsne', lambda: tsne_for_run(
        workdir, config, out / 'tsne.png', num_images=args.n,
        perplexity=args.perplexity, max_classes=args.max_classes))
  runs = [workdir] + ([args.compare] if args.compare else [])
  attempt('curves', lambda: curves_for_runs(runs, out / 'curves.png'))
  if args.compare:
    # The paper's order: the SimCLR baseline's panel first.
    order = sorted(runs, key=lambda w: (load_results(w) or {}).get(
        'method') != 'simclr')
    attempt('top5', lambda: top5_for_runs(order, out / 'top5.png',
                                          index=args.index))
  for line in skipped:
    print(f'skipped {line}')
  print(f'{len(written) // 2} figure(s) in {out}')
  return 0


def _add_report_parser(subparsers) -> None:
  p = subparsers.add_parser(
      'report', help='every figure a run supports, into <workdir>/eval/'
      'figures/')
  p.add_argument('--workdir', required=True, help='the evaluated run')
  p.add_argument('--compare', default=None, help='a second run (e.g. the '
                 'SimCLR baseline): curves of both and the top-5 figure')
  _add_run_config_args(p)
  p.add_argument('--n', type=int, default=None, help='t-SNE images; default '
                 'config.eval.num_view_images')
  p.add_argument('--perplexity', type=float, default=DEFAULT_PERPLEXITY)
  p.add_argument('--max_classes', type=int, default=DEFAULT_MAX_CLASSES)
  p.add_argument('--index', type=int, default=None, help='top-5 test image; '
                 'default the first the runs disagree on')
  p.set_defaults(func=run_report)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m otclr_jax.figures', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  subparsers = parser.add_subparsers(dest='command', required=True)
  _add_interpolation_parser(subparsers)
  _add_tsne_parser(subparsers)
  _add_top5_parser(subparsers)
  _add_curves_parser(subparsers)
  _add_report_parser(subparsers)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  # `--config.a.b=v` overrides, as `main` takes them, join `--set`.
  argv, overrides = config_files.split_config_flags(argv)
  args = build_parser().parse_args(argv)
  if overrides:
    if not hasattr(args, 'set'):
      raise ValueError(f'figures {args.command} reads no run config; '
                       f'overrides {overrides} do not apply.')
    args.set = list(args.set) + overrides
  return args.func(args)


if __name__ == '__main__':
  sys.exit(main())
