"""Clustering and view metrics on embeddings, defined in docs/method.md
section 7.

Clustering metrics take `z` [n, d] and ids `assign` [n]; empty clusters are
masked out. All need 2 <= #non-empty clusters <= n - 1 (else ValueError, or
NaN when traced). Pairwise distances take O(block_size * n) memory, ~1e-3
absolute error between near-duplicates in float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

# Rows of the pairwise-distance slab per `lax.map` step (40 MB at n = 10k).
DEFAULT_BLOCK_SIZE = 1024


def _check_num_clusters(num_clusters: Any) -> None:
  if (isinstance(num_clusters, bool)
      or not isinstance(num_clusters, (int, np.integer))
      or num_clusters < 2):
    raise ValueError(
        f'num_clusters must be an int >= 2, got {num_clusters!r}.')


def _check_clustering_inputs(z: Any, assign: Any, num_clusters: Any,
                             block_size: Any = None) -> None:
  """Validates the arguments shared by the clustering metrics."""
  _check_num_clusters(num_clusters)
  _check_paired({'z': z}, 2, '[n, d]')
  if jnp.ndim(assign) != 1:
    raise ValueError(
        f'assign must have shape [n], got shape {jnp.shape(assign)}.')
  if not jnp.issubdtype(jnp.result_type(assign), jnp.integer):
    raise ValueError(
        f'assign must hold integer cluster ids, got dtype '
        f'{jnp.result_type(assign)}.')
  n = jnp.shape(z)[0]
  if jnp.shape(assign)[0] != n:
    raise ValueError(
        f'z has {n} rows but assign has {jnp.shape(assign)[0]} entries; '
        'they must match.')
  if block_size is not None and (
      isinstance(block_size, bool)
      or not isinstance(block_size, (int, np.integer)) or block_size < 1):
    raise ValueError(
        f'block_size must be a positive int or None, got {block_size!r}.')
  if not isinstance(assign, jax.core.Tracer):
    ids = np.asarray(assign)
    if ids.min() < 0 or ids.max() >= num_clusters:
      raise ValueError(
          f'assign must lie in [0, num_clusters={num_clusters}), got values '
          f'in [{ids.min()}, {ids.max()}].')
    num_used = np.unique(ids).size
    if not 2 <= num_used <= n - 1:
      raise ValueError(
          f'The clustering metrics need 2 <= #non-empty clusters <= n - 1; '
          f'assign uses {num_used} cluster(s) for n = {n} points.')


def _check_paired(arrays: dict[str, Any], rank: int, layout: str) -> None:
  """Checks that arrays are floating, of the given rank and the same shape."""
  shapes = set()
  for name, x in arrays.items():
    if jnp.ndim(x) != rank:
      raise ValueError(
          f'{name} must have shape {layout}, got shape {jnp.shape(x)}.')
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise ValueError(
          f'{name} must be a floating array, got dtype {jnp.result_type(x)}.')
    if jnp.shape(x)[0] < 1:
      raise ValueError(f'{name} must contain at least one row.')
    shapes.add(tuple(jnp.shape(x)))
  if len(shapes) != 1:
    described = ', '.join(f'{k} {jnp.shape(v)}' for k, v in arrays.items())
    raise ValueError(f'Shapes must match, got {described}.')


def _cluster_distance_sums(z: jax.Array, onehot: jax.Array,
                           block_size: int | None) -> jax.Array:
  """[n, K]: (i, c) = sum over j in cluster c of ||z_i - z_j||."""
  n = z.shape[0]
  sq_norms = jnp.sum(z * z, axis=1)
  block = n if block_size is None else min(block_size, n)
  num_blocks = -(-n // block)
  pad = num_blocks * block - n
  rows = jnp.pad(z, ((0, pad), (0, 0)))
  row_sq = jnp.pad(sq_norms, (0, pad))
  row_idx = jnp.arange(num_blocks * block)

  def one_block(args):
    x, x_sq, idx = args
    # No TF32: its error would swamp small within-cluster distances.
    gram = jnp.dot(x, z.T, precision=lax.Precision.HIGHEST)
    sq = jnp.maximum(x_sq[:, None] + sq_norms[None, :] - 2.0 * gram, 0.0)
    # Rounding leaves self-distances above zero.
    sq = jnp.where(idx[:, None] == jnp.arange(n)[None, :], 0.0, sq)
    return jnp.dot(jnp.sqrt(sq), onehot, precision=lax.Precision.HIGHEST)

  sums = lax.map(one_block, (rows.reshape(num_blocks, block, -1),
                             row_sq.reshape(num_blocks, block),
                             row_idx.reshape(num_blocks, block)))
  return sums.reshape(num_blocks * block, -1)[:n]


@functools.partial(jax.jit, static_argnames=('num_clusters', 'block_size'))
def _all_cluster_metrics(z, assign, *, num_clusters, block_size):
  """All four clustering metrics sharing one pairwise-distance pass."""
  z = z.astype(jnp.float32)
  onehot = jax.nn.one_hot(assign, num_clusters, dtype=z.dtype)  # [n, K]
  counts = jax.ops.segment_sum(jnp.ones_like(z[:, 0]), assign, num_clusters)
  centroids = (jax.ops.segment_sum(z, assign, num_clusters)
               / jnp.maximum(counts, 1.0)[:, None])
  dist_sums = _cluster_distance_sums(z, onehot, block_size)
  own_sum = jnp.take_along_axis(dist_sums, assign[:, None], axis=1)[:, 0]
  nonempty = counts > 0
  num_nonempty = jnp.sum(nonempty)
  # [K, K]: ordered pairs of distinct non-empty clusters, centroid distances.
  pairs = (nonempty[:, None] & nonempty[None, :]
           & ~jnp.eye(num_clusters, dtype=bool))
  diff = centroids[:, None, :] - centroids[None, :, :]
  between = jnp.sqrt(jnp.sum(diff * diff, axis=-1))
  # Silhouette: a_i, b_i the mean distance to i's own, nearest other cluster.
  own_count = counts[assign]
  a = own_sum / jnp.maximum(own_count - 1.0, 1.0)
  mean_to = dist_sums / jnp.maximum(counts, 1.0)[None, :]
  not_other = (onehot > 0) | (counts[None, :] == 0)
  b = jnp.min(jnp.where(not_other, jnp.inf, mean_to), axis=1)
  denom = jnp.maximum(a, b)
  # sklearn's convention: singletons, and a = b = 0, score 0.
  s = jnp.where((own_count > 1) & (denom > 0),
                (b - a) / jnp.where(denom > 0, denom, 1.0), 0.0)
  # Compactness, centroid margin, inter/intra ratio.
  resid = z - centroids[assign]
  per_cluster = jax.ops.segment_sum(
      jnp.sum(resid * resid, axis=1), assign, num_clusters) / jnp.maximum(
          counts, 1.0)
  nearest = jnp.min(jnp.where(pairs, between, jnp.inf), axis=1)
  inter = jnp.sum(jnp.where(pairs, between, 0.0)) / jnp.sum(pairs)
  # Ordered pairs count each pair twice, hence n_c (n_c - 1).
  cluster_sum = jax.ops.segment_sum(own_sum, assign, num_clusters)
  has_pairs = counts >= 2
  cluster_mean = cluster_sum / jnp.where(has_pairs, counts * (counts - 1.0),
                                         1.0)
  intra = jnp.sum(jnp.where(has_pairs, cluster_mean, 0.0)) / jnp.sum(
      has_pairs)
  # With a single non-empty cluster every b is inf: undefined.
  defined = num_nonempty >= 2
  return {
      'silhouette': jnp.where(defined, jnp.mean(s), jnp.nan),
      'compactness': jnp.sum(jnp.where(nonempty, per_cluster, 0.0))
                     / num_nonempty,
      'centroid_margin': jnp.where(
          defined, jnp.sum(jnp.where(nonempty, nearest, 0.0)) / num_nonempty,
          jnp.nan),
      'inter_intra_ratio': inter / intra,
  }


@functools.partial(jax.jit, static_argnames='rms')
def _mean_distance(a, b, rms=False):
  """Mean over rows of the L2 (or RMS) norm of a - b [n, ...], flattened."""
  diff = (a.astype(jnp.float32) - b.astype(jnp.float32)).reshape(
      a.shape[0], -1)
  reduce = jnp.mean if rms else jnp.sum
  return jnp.mean(jnp.sqrt(reduce(diff * diff, axis=-1)))


@jax.jit
def _view_cosine(z1, z2):
  z1 = z1.astype(jnp.float32)
  z2 = z2.astype(jnp.float32)
  # The floor only matters for all-zero rows, whose cosine is then 0.
  n1 = jnp.maximum(jnp.linalg.norm(z1, axis=-1), 1e-12)
  n2 = jnp.maximum(jnp.linalg.norm(z2, axis=-1), 1e-12)
  return jnp.mean(jnp.sum(z1 * z2, axis=-1) / (n1 * n2))


def clustering_scores(z: jax.Array, assign: jax.Array, *, num_clusters: int,
                      block_size: int | None = DEFAULT_BLOCK_SIZE
                      ) -> dict[str, jax.Array]:
  """The four clustering metrics, from one pairwise-distance pass.

  Args:
    z: [n, d] l2-normalised embeddings, computed in float32.
    assign: [n] integer cluster ids in [0, num_clusters).
    num_clusters: number of cluster ids K >= 2 (static); unused ids ignored.
    block_size: rows of the distance slab per step (static); None for all.

  Returns:
    [] float32 each: 'silhouette' (as `sklearn.metrics.silhouette_score`,
    in [-1, 1]), 'compactness' (mean squared distance to the centroid over
    clusters, >= 0), 'centroid_margin' (mean distance from each centroid to
    the nearest other one) and 'inter_intra_ratio' (inf if every
    within-cluster distance is 0); NaN where undefined under tracing.

  Raises:
    ValueError: on bad shapes or dtypes, num_clusters < 2, or (for concrete
      `assign`) ids out of range or not 2 <= #non-empty clusters <= n - 1.
  """
  _check_clustering_inputs(z, assign, num_clusters, block_size)
  return _all_cluster_metrics(z, assign, num_clusters=num_clusters,
                              block_size=block_size)


def view_distance(z1: jax.Array, z2: jax.Array) -> jax.Array:
  """Mean Euclidean distance between paired embeddings (not normalised).

  Args:
    z1: [n, d] embeddings of the first views.
    z2: [n, d] embeddings of the second views, row i paired with z1[i].

  Returns:
    [] float32, mean_i ||z1_i - z2_i||; in [0, 2] for unit rows.
  """
  _check_paired({'z1': z1, 'z2': z2}, 2, '[n, d]')
  return _mean_distance(z1, z2)


def view_cosine(z1: jax.Array, z2: jax.Array) -> jax.Array:
  """Mean cosine similarity between paired rows; an all-zero row gives 0.

  Args:
    z1: [n, d] embeddings of the first views.
    z2: [n, d] embeddings of the second views, row i paired with z1[i].

  Returns:
    [] float32 in [-1, 1].
  """
  _check_paired({'z1': z1, 'z2': z2}, 2, '[n, d]')
  return _view_cosine(z1, z2)


def anchor_distance(z1: jax.Array, z2: jax.Array,
                    z_anchor: jax.Array) -> jax.Array:
  """Mean distance of both views to the unaugmented source's embedding.

  Args:
    z1: [n, d] embeddings of the first views.
    z2: [n, d] embeddings of the second views.
    z_anchor: [n, d] embeddings of the unaugmented images the views came from.

  Returns:
    [] float32, (mean_i ||z1_i - a_i|| + mean_i ||z2_i - a_i||) / 2.
  """
  _check_paired({'z1': z1, 'z2': z2, 'z_anchor': z_anchor}, 2, '[n, d]')
  return 0.5 * (_mean_distance(z1, z_anchor) + _mean_distance(z2, z_anchor))


def pixel_l2(views: jax.Array, strong: jax.Array) -> jax.Array:
  """The paper's Pixel L2: mean L2 norm of the flattened view - strong.

  Args:
    views: [n, H, W, C] views (e.g. OT-interpolated), values in [0, 1].
    strong: [n, H, W, C] the strong augmentations they were made from.

  Returns:
    [] float32, mean over images of ||views_i - strong_i||_2.
  """
  _check_paired({'views': views, 'strong': strong}, 4, '[n, H, W, C]')
  return _mean_distance(views, strong)


def pixel_rms(views: jax.Array, strong: jax.Array) -> jax.Array:
  """Mean per-image RMS pixel difference: `pixel_l2` / sqrt(H * W * C).

  Args:
    views: [n, H, W, C] views, values in [0, 1].
    strong: [n, H, W, C] the strong augmentations they were made from.

  Returns:
    [] float32 in pixel units, mean over images of the RMS difference.
  """
  _check_paired({'views': views, 'strong': strong}, 4, '[n, H, W, C]')
  return _mean_distance(views, strong, rms=True)


def high_frequency_power(images: np.ndarray, cutoff: float = 0.25) -> float:
  """Mean power of the images' spatial frequencies above `cutoff`.

  Per image and channel, the 2-D DFT's power |F(f)|^2 / (H W)^2 summed over
  the radial frequencies |f| > `cutoff` cycles per pixel (Nyquist is 0.5):
  by Parseval, the mean square of the part of the channel above the cutoff.

  Args:
    images: [n, H, W, C] float images.
    cutoff: radial frequency in cycles per pixel.

  Returns:
    The mean over images and channels.
  """
  _check_paired({'images': images}, 4, '[n, H, W, C]')
  images = np.asarray(images, np.float64)
  height, width = images.shape[1:3]
  radius = np.hypot(np.fft.fftfreq(height)[:, None],
                    np.fft.fftfreq(width)[None, :])
  power = np.abs(np.fft.fft2(images, axes=(1, 2))) ** 2 / (height * width)**2
  return float(np.mean(np.sum(power[:, radius > cutoff], axis=1)))


def border_centre_ratio(images: np.ndarray, width: int = 3) -> float:
  """Mean brightness of the outer `width`-pixel ring over the inside's.

  Args:
    images: [n, H, W, C] float images, H and W above 2 `width`.
    width: ring width in pixels.

  Returns:
    Mean over images, channels and ring pixels, divided by the same mean
    over the pixels inside the ring (nan if that is 0).
  """
  _check_paired({'images': images}, 4, '[n, H, W, C]')
  images = np.asarray(images, np.float64)
  height, side = images.shape[1:3]
  if min(height, side) <= 2 * width:
    raise ValueError(f'images of {height} x {side} have no pixels inside a '
                     f'{width}-pixel ring.')
  inside = np.zeros((height, side), bool)
  inside[width:-width, width:-width] = True
  centre = images[:, inside].mean()
  return float(images[:, ~inside].mean() / centre) if centre else math.nan


def retrieval_rate(queries: np.ndarray, keys: np.ndarray) -> float:
  """Fraction of queries whose most cosine-similar key is their partner.

  Args:
    queries: [n, d] features; row i's partner is row i of `keys`.
    keys: [n, d] features.

  Returns:
    In [0, 1]; 1 / n is chance. Ties go to the lower key index.
  """
  _check_paired({'queries': queries, 'keys': keys}, 2, '[n, d]')
  q = np.asarray(queries, np.float64)
  k = np.asarray(keys, np.float64)
  q = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)
  k = k / np.maximum(np.linalg.norm(k, axis=1, keepdims=True), 1e-12)
  nearest = np.argmax(q @ k.T, axis=1)
  return float(np.mean(nearest == np.arange(len(q))))


def cluster_metrics(z: np.ndarray, num_clusters: int,
                    seed: int) -> dict[str, Any]:
  """Scores a K-means clustering (sklearn, n_init=10) of the embeddings.

  Args:
    z: [n, d] l2-normalised embeddings (NumPy or JAX), n > num_clusters.
    num_clusters: K >= 2, normally the number of classes.
    seed: K-means random state; same seed, same result.

  Returns:
    Dict with float entries 'silhouette', 'compactness', 'centroid_margin',
    'inter_intra_ratio' and 'assign', the int32 [n] K-means labels.

  Raises:
    ValueError: on bad shapes, num_clusters < 2 or num_clusters >= n.
  """
  _check_num_clusters(num_clusters)
  _check_paired({'z': z}, 2, '[n, d]')
  z = np.asarray(z, dtype=np.float32)
  if num_clusters >= z.shape[0]:
    raise ValueError(
        f'num_clusters ({num_clusters}) must be smaller than the number of '
        f'points ({z.shape[0]}).')
  # Late: only this needs scikit-learn, whose import would slow every
  # command's start-up.
  from sklearn import cluster  # pylint: disable=g-import-not-at-top
  kmeans = cluster.KMeans(
      n_clusters=num_clusters, random_state=seed, n_init=10)
  assign = kmeans.fit_predict(z).astype(np.int32)
  if not 2 <= np.unique(assign).size <= z.shape[0] - 1:
    raise ValueError(
        'K-means found a degenerate clustering (e.g. too few distinct '
        'points); the clustering metrics are undefined.')
  values = clustering_scores(z, assign, num_clusters=num_clusters)
  result: dict[str, Any] = {k: float(v) for k, v in values.items()}
  result['assign'] = assign
  return result
