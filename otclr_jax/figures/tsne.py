"""The paper's class-wise t-SNE of one run's views, made as evaluation does."""

from __future__ import annotations

import os
from typing import Any, Sequence

from matplotlib import figure as mpl_figure
from matplotlib import lines
from matplotlib import patches
import ml_collections
import numpy as np
from scipy import stats
from sklearn import manifold
from sklearn import metrics as sk_metrics
import threadpoolctl

from otclr_jax import data
from otclr_jax import experiment
from otclr_jax import rundir
from otclr_jax import tables
from otclr_jax import threads
from otclr_jax.evaluation import clusters
from otclr_jax.evaluation import evaluate
from otclr_jax.evaluation import view_quality
from otclr_jax.figures import common

# Share of a set's points in its shaded KDE HDR (a hull would chase strays).
COVERAGE_MASS = 0.5
DEFAULT_PERPLEXITY = 30.0
DEFAULT_MAX_CLASSES = 12
# Images on the t-SNE map (5 points each): the map of the 500 the evaluation
# embeds took ~35 s of a 2-core machine (1,000 Barnes-Hut steps over 2,500
# points), this one about a sixth; the table and silhouettes use all n.
MAP_IMAGES = 200


def tsne_points(views: view_quality.ViewEmbeddings, *,
                perplexity: float = DEFAULT_PERPLEXITY,
                seed: int = 0) -> dict[str, np.ndarray]:
  """Joint 2-d t-SNE of the anchors and both generators' views (one map).

  Args:
    views: `view_quality.view_embeddings` of n images.
    perplexity: t-SNE perplexity, in (0, 5n).

  Returns:
    {'anchor': [n, 2], 'simclr': [2n, 2], 'otclr': [2n, 2]}; view rows are
    [first views; second views], in image order.
  """
  n = len(views.anchors)
  points = np.concatenate([views.anchors, *views.simclr, *views.otclr])
  if not 0 < perplexity < len(points):
    raise ValueError(f'perplexity must lie in (0, {len(points)}) for 5 x {n} '
                     f'points, got {perplexity}.')
  # The idle cores (JAX is done; the map is thread-count independent).
  with threadpoolctl.threadpool_limits(limits=threads.host_threads()):
    xy = manifold.TSNE(n_components=2, perplexity=perplexity, init='pca',
                       random_state=seed).fit_transform(
                           points.astype(np.float64))
  return {'anchor': xy[:n], 'simclr': xy[n:3 * n], 'otclr': xy[3 * n:]}


def classwise_silhouette(views: view_quality.ViewEmbeddings, labels: np.ndarray,
                         num_classes: int) -> dict[str, np.ndarray]:
  """Per generator, each class's mean view silhouette (true-label clusters).

  Returns:
    {'simclr': [num_classes], 'otclr': [num_classes]}; NaN for no views.
  """
  labels = np.asarray(labels)
  if len(np.unique(labels)) < 2:
    return {g: np.full(num_classes, np.nan) for g in ('simclr', 'otclr')}
  both = np.concatenate([labels, labels])
  out = {}
  for generator in ('simclr', 'otclr'):
    z = np.concatenate(getattr(views, generator))
    values = sk_metrics.silhouette_samples(z, both)
    out[generator] = np.array([values[both == c].mean() if np.any(both == c)
                               else np.nan for c in range(num_classes)])
  return out


def density_level(density_at_points: np.ndarray, mass: float) -> float:
  """The HDR level: the (1 - mass) quantile of [N] densities (Hyndman 1996)."""
  if not 0.0 < mass < 1.0:
    raise ValueError(f'mass must lie in (0, 1), got {mass}.')
  return float(np.quantile(density_at_points, 1.0 - mass))


def _shade_coverage(ax, xy: np.ndarray, colour: str, lo: np.ndarray,
                    hi: np.ndarray) -> None:
  """Fills the KDE highest-density region of `xy` [N, 2] holding
  `COVERAGE_MASS`."""
  if len(xy) < 4:
    return
  try:
    kde = stats.gaussian_kde(xy.T)
  except np.linalg.LinAlgError:  # Collinear points: no 2-d density.
    return
  level = density_level(kde(xy.T), COVERAGE_MASS)
  gx, gy = np.meshgrid(np.linspace(lo[0], hi[0], 120),
                       np.linspace(lo[1], hi[1], 120))
  density = kde(np.stack([gx.ravel(), gy.ravel()])).reshape(gx.shape)
  if density.max() <= level:
    return
  ax.contourf(gx, gy, density, levels=[level, density.max()], colors=[colour],
              alpha=0.18)
  ax.contour(gx, gy, density, levels=[level], colors=[colour], linewidths=0.9)


def _view_table(ax, rows: dict[str, dict[str, Any]], note: str) -> None:
  """P (OTCLR) vs S (SimCLR) view metrics, the better one in bold."""
  ax.axis('off')
  cells, bold = [], []
  for key, header, direction in tables.VIEW_METRICS + tables.CLUSTER_METRICS:
    p, q = rows['otclr'].get(key), rows['simclr'].get(key)
    arrow = '↑' if direction > 0 else '↓'
    cells.append([f'{header} {arrow}', _fmt(p), _fmt(q)])
    if p is None or q is None or p == q or key in tables.NOT_RANKED:
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


def _fmt(value: Any) -> str:
  return '–' if value is None else f'{value:.4f}'


def plot_tsne(points: dict[str, np.ndarray], labels: np.ndarray,
              class_names: Sequence[str], *,
              thumbnails: dict[int, np.ndarray] | None = None,
              view_rows: dict[str, dict[str, Any]] | None = None,
              silhouettes: dict[str, np.ndarray] | None = None,
              table_note: str = '', title: str | None = None,
              max_classes: int = DEFAULT_MAX_CLASSES) -> mpl_figure.Figure:
  """Class-wise t-SNE panels, plus view-metric table and silhouette panels.

  Args:
    points, silhouettes: `tsne_points`, `classwise_silhouette` outputs.
    labels, class_names: int [n], the anchors' classes; their [K] names.
    thumbnails: {class: uint8 [S, S, 3]} for the corner insets.
    view_rows: the results' 'views' section, {'simclr': ..., 'otclr': ...}.
  """
  labels = np.asarray(labels)
  n = len(labels)
  if points['anchor'].shape != (n, 2) or points['simclr'].shape != (2 * n, 2):
    raise ValueError(f'points do not match {n} labels: '
                     f'{ {k: v.shape for k, v in points.items()} }.')
  classes = [c for c in range(len(class_names))
             if np.any(labels == c)][:max_classes]
  num_extra = sum(x is not None for x in (view_rows, silhouettes))
  total = len(classes) + num_extra
  ncols = 4 if total <= 16 else int(np.ceil(np.sqrt(total)))
  nrows = -(-total // ncols)
  fig = mpl_figure.Figure(figsize=(3.0 * ncols, 3.0 * nrows + 0.6),
                          layout='constrained')
  grid = fig.add_gridspec(nrows, ncols)
  # Extras in column 0: silhouette labels widen the margin, not a gap.
  first = [0, ncols][:num_extra] if nrows > 1 else list(range(num_extra))
  order = first + [i for i in range(total) if i not in first]
  cells = [grid[i // ncols, i % ncols] for i in order]
  every = np.concatenate([points['anchor'], points['simclr'], points['otclr']])
  pad = 0.05 * (every.max(axis=0) - every.min(axis=0))
  lo, hi = every.min(axis=0) - pad, every.max(axis=0) + pad
  both = np.concatenate([labels, labels])

  extra_cells = iter(cells[:num_extra])
  if view_rows is not None:
    _view_table(fig.add_subplot(next(extra_cells)), view_rows, table_note)
  for c, cell in zip(classes, cells[num_extra:]):
    ax = fig.add_subplot(cell)
    ax.scatter(every[:, 0], every[:, 1], s=1.5, color='0.85', lw=0,
               rasterized=True)
    for kind, xy in (('simclr', points['simclr'][both == c]),
                     ('otclr', points['otclr'][both == c]),
                     ('anchor', points['anchor'][labels == c])):
      style = common.VIEW_STYLES[kind]
      _shade_coverage(ax, xy, style['color'], lo, hi)
      big = kind == 'anchor'
      ax.scatter(xy[:, 0], xy[:, 1], s=28 if big else 7,
                 marker=style['marker'], color=style['color'],
                 alpha=1.0 if big else 0.6, lw=0.3 if big else 0,
                 ec='black' if big else None, zorder=3 if big else 2)
    ax.set(xlim=(lo[0], hi[0]), ylim=(lo[1], hi[1]), xticks=[], yticks=[])
    count = int(np.sum(labels == c))
    ax.set_title(f'{class_names[c]} ({count} image{"" if count == 1 else "s"})',
                 fontsize=9)
    if thumbnails and c in thumbnails:
      inset = ax.inset_axes([0.76, 0.76, 0.22, 0.22])
      inset.imshow(thumbnails[c], interpolation='nearest')
      inset.set(xticks=[], yticks=[])
  if silhouettes is not None:
    ax = fig.add_subplot(next(extra_cells))
    delta = silhouettes['otclr'] - silhouettes['simclr']
    shown = [c for c in range(len(class_names)) if np.isfinite(delta[c])]
    shown = shown[:max(max_classes, 1)]
    values = delta[shown]
    ax.barh(np.arange(len(shown)), values,
            color=[common.VIEW_STYLES['otclr' if v > 0 else 'simclr']['color']
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
             for k, s in common.VIEW_STYLES.items()]
  handles.append(patches.Patch(color='0.5', alpha=0.3,
                               label=f'coverage: {COVERAGE_MASS:.0%} '
                                     'highest-density region (KDE)'))
  fig.legend(handles=handles, loc='outside lower center', ncols=4,
             fontsize=8, frameon=False)
  if title:
    fig.suptitle(title, fontsize=10)
  return fig


def draw_tsne(views: view_quality.ViewEmbeddings, test: data.Split,
              out: str | os.PathLike[str], *,
              view_rows: dict[str, dict[str, Any]] | None = None,
              table_note: str = '', title: str | None = None,
              perplexity: float = DEFAULT_PERPLEXITY, seed: int = 0,
              max_classes: int = DEFAULT_MAX_CLASSES,
              map_images: int = MAP_IMAGES) -> list[str]:
  """Draws the t-SNE of `views` of `test.images` to PNG `out` and a PDF.

  `view_rows` (P vs S metrics for the table) defaults to those of `views`;
  the map shows at most `map_images` of them; `perplexity` is lowered to
  (5n - 1) / 3 for small n. Returns the paths.
  """
  if view_rows is None:
    view_rows = view_quality.summarise_views(views, test.num_classes)
  silhouettes = classwise_silhouette(views, test.labels[views.indices],
                                     test.num_classes)
  n = len(views.indices)
  if n > map_images:
    # A seeded sample: the test split may be ordered by class.
    keep = np.sort(np.random.default_rng(seed).choice(n, map_images,
                                                      replace=False))
    views = views._replace(
        indices=views.indices[keep], anchors=views.anchors[keep],
        simclr=tuple(z[keep] for z in views.simclr),
        otclr=tuple(z[keep] for z in views.otclr))
    title = title and f'{title} (map: {map_images} of the {n})'
  labels = test.labels[views.indices]
  points = tsne_points(views, perplexity=min(
      perplexity, (5 * len(labels) - 1) / 3), seed=seed)
  thumbnails = {}
  for row, label in zip(views.indices, labels):
    thumbnails.setdefault(int(label), test.images[row])
  fig = plot_tsne(points, labels, test.class_names, thumbnails=thumbnails,
                  view_rows=view_rows, silhouettes=silhouettes,
                  table_note=table_note, title=title, max_classes=max_classes)
  return common.save_figure(fig, out)


def views_dataset(config: ml_collections.ConfigDict) -> str:
  """The test split the evaluation makes its views from."""
  return config.eval.views_dataset or tuple(config.eval.datasets)[0]


def figure_title(config, step: int, dataset: str, n: int) -> str:
  """What the figure shows: n images of `dataset`, the network and its step."""
  embedding = clusters.embedding_of(config)
  return (f'Views of {n} {tables.dataset_name(dataset)} test images, '
          f'embedded by the {experiment.title_of(config)} network '
          f'(step {step}; {clusters.EMBEDDINGS[embedding]}); joint t-SNE of '
          f'anchors and both view pairs')


def tsne_for_run(workdir: str, config: ml_collections.ConfigDict,
                 out: str | os.PathLike[str], *, step: int | None = None,
                 dataset: str | None = None, num_images: int | None = None,
                 perplexity: float = DEFAULT_PERPLEXITY, seed: int = 0,
                 max_classes: int = DEFAULT_MAX_CLASSES) -> list[str]:
  """Restores a run's encoder; `draw_tsne` of the views evaluation makes.

  Args:
    step: checkpoint step; None for the latest.
    dataset: test split; default the run's views dataset.
    num_images: n; default `config.eval.num_view_images` (the evaluation's).
  """
  dataset = dataset or views_dataset(config)
  n = int(num_images or config.eval.num_view_images)
  if n < 2:
    raise ValueError(f'need at least 2 images, got n = {n}.')
  model, variables, step = evaluate.restore(config, workdir, step)
  test = data.load_split(dataset, 'test', config.image_size,
                         config.data_dir or None)
  views = view_quality.view_embeddings(config, model, variables, test.images,
                                       num_images=n,
                                       batch_size=int(config.eval.batch_size))
  results = rundir.read_results(workdir) or {}
  protocol = results.get('protocol', {})
  if (results.get('views') and results.get('step') == step
      and protocol.get('views_dataset') == dataset
      and protocol.get('views_num_images') == len(views.indices)
      and protocol.get('embedding', 'h') == views.embedding
      and protocol.get('views_seed', view_quality.VIEWS_SEED)
      == view_quality.VIEWS_SEED):
    rows, note = results['views'], f'metrics: {rundir.RESULTS_FILE}'
  else:
    rows, note = None, 'metrics: computed on these views'
  return draw_tsne(views, test, out, view_rows=rows, table_note=note,
                   title=figure_title(config, step, dataset,
                                      len(views.indices)),
                   perplexity=perplexity, seed=seed, max_classes=max_classes)

