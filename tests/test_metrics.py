"""Tests for otclr_jax.evaluation.metrics against sklearn, NumPy and closed forms."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import metrics as sk_metrics

from otclr_jax.evaluation import metrics

RTOL = 1e-4
ATOL = 1e-5


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _random_data(n=60, d=8, k=4, seed=0):
  rng = np.random.default_rng(seed)
  z = _unit(rng.normal(size=(n, d))).astype(np.float32)
  assign = rng.integers(0, k, size=n).astype(np.int32)
  assign[:k] = np.arange(k)
  return z, assign


def _clustered_data(n=90, d=16, k=3, spread=0.3, seed=1):
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(k, d))
  assign = np.repeat(np.arange(k), n // k).astype(np.int32)
  z = _unit(centres[assign] + spread * rng.normal(size=(n, d)))
  return z.astype(np.float32), assign


def _with_singleton(z, assign, k):
  """Puts the last point alone in a new cluster id k."""
  assign = assign.copy()
  assign[-1] = k
  return z, assign


# Plain NumPy float64 references, written from the definitions.


def _np_centroids(z, assign):
  ids = np.unique(assign)
  return ids, np.stack([z[assign == c].mean(axis=0) for c in ids])


def _np_compactness(z, assign):
  z = z.astype(np.float64)
  return np.mean([
      np.mean(np.sum((z[assign == c] - z[assign == c].mean(0))**2, axis=1))
      for c in np.unique(assign)])


def _np_centroid_margin(z, assign):
  _, mu = _np_centroids(z.astype(np.float64), assign)
  dist = np.linalg.norm(mu[:, None] - mu[None], axis=-1)
  np.fill_diagonal(dist, np.inf)
  return dist.min(axis=1).mean()


def _np_inter_intra(z, assign):
  """The paper's equation: D_inter / D_intra, D_intra = (1/K) sum_k mean_k.

  mean_k is cluster k's mean of ||z_i - z_j|| over pairs i < j; clusters
  without a pair (singletons) are left out of the 1/K average.
  """
  z = z.astype(np.float64)
  _, mu = _np_centroids(z, assign)
  k = len(mu)
  inter = [np.linalg.norm(mu[i] - mu[j])
           for i in range(k) for j in range(i + 1, k)]
  per_cluster = []
  for c in np.unique(assign):
    members = z[assign == c]
    pairs = [np.linalg.norm(members[i] - members[j])
             for i in range(len(members)) for j in range(i + 1, len(members))]
    if pairs:
      per_cluster.append(np.mean(pairs))
  return np.mean(inter) / np.mean(per_cluster)


# Silhouette.


@pytest.mark.parametrize('make', [_random_data, _clustered_data])
@pytest.mark.parametrize('singleton', [False, True])
def test_silhouette_matches_sklearn(make, singleton):
  z, assign = make()
  k = int(assign.max()) + 1
  if singleton:
    z, assign = _with_singleton(z, assign, k)
    k += 1
  expected = sk_metrics.silhouette_score(z.astype(np.float64), assign)
  got = metrics.silhouette(z, assign, num_clusters=k)
  np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_silhouette_clustered_is_high_random_is_low():
  z, assign = _clustered_data(spread=0.1)
  z_r, assign_r = _random_data()
  assert metrics.silhouette(z, assign, num_clusters=3) > 0.5
  assert abs(float(metrics.silhouette(z_r, assign_r, num_clusters=4))) < 0.1


@pytest.mark.parametrize('block_size', [1, 7, 16, 59, 1024])
def test_silhouette_chunked_equals_unchunked(block_size):
  z, assign = _clustered_data(n=60, spread=0.5)
  full = metrics.silhouette(z, assign, num_clusters=3, block_size=None)
  chunked = metrics.silhouette(z, assign, num_clusters=3,
                               block_size=block_size)
  np.testing.assert_allclose(chunked, full, rtol=1e-6, atol=1e-7)
  full_r = metrics.inter_intra_ratio(z, assign, num_clusters=3,
                                     block_size=None)
  chunked_r = metrics.inter_intra_ratio(z, assign, num_clusters=3,
                                        block_size=block_size)
  np.testing.assert_allclose(chunked_r, full_r, rtol=1e-6)


def test_silhouette_identical_points_is_one():
  z = np.array([[1, 0, 0]] * 3 + [[0, 1, 0]] * 2, np.float32)
  assign = np.array([0, 0, 0, 1, 1], np.int32)
  np.testing.assert_allclose(
      metrics.silhouette(z, assign, num_clusters=2), 1.0, atol=1e-6)


# Compactness, centroid margin, inter/intra.


@pytest.mark.parametrize('make', [_random_data, _clustered_data])
def test_cluster_metrics_match_numpy(make):
  z, assign = _with_singleton(*make(), k=5)
  k = 6
  np.testing.assert_allclose(
      metrics.compactness(z, assign, num_clusters=k),
      _np_compactness(z, assign), rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(
      metrics.centroid_margin(z, assign, num_clusters=k),
      _np_centroid_margin(z, assign), rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(
      metrics.inter_intra_ratio(z, assign, num_clusters=k),
      _np_inter_intra(z, assign), rtol=RTOL)


def test_inter_intra_is_mean_of_per_cluster_means():
  # Cluster 0: 3 collinear points (pair distances 1, 1, 2; mean 4/3),
  # cluster 1: a pair at distance 4. The paper's D_intra is (4/3 + 4) / 2 =
  # 8/3; pooling all four pairs would give (1 + 1 + 2 + 4) / 4 = 2.
  z = np.array([[0, 0], [1, 0], [2, 0], [10, 0], [10, 4]], np.float32)
  assign = np.array([0, 0, 0, 1, 1], np.int32)
  inter = np.linalg.norm(np.array([1.0, 0.0]) - np.array([10.0, 2.0]))
  np.testing.assert_allclose(
      metrics.inter_intra_ratio(z, assign, num_clusters=2),
      inter / (8.0 / 3.0), rtol=1e-5)


def test_inter_intra_unequal_clusters_match_paper_equation():
  # Very unequal sizes (40 vs 3 points, different spreads) separate the
  # paper's mean of per-cluster means from a pooled mean by far more than
  # the tolerance; a singleton is left out of D_intra only.
  rng = np.random.default_rng(3)
  z = np.concatenate([0.1 * rng.normal(size=(40, 6)),
                      3.0 + 2.0 * rng.normal(size=(3, 6)),
                      [np.full(6, -5.0)]]).astype(np.float32)
  assign = np.array([0] * 40 + [1] * 3 + [2], np.int32)
  got = metrics.inter_intra_ratio(z, assign, num_clusters=3)
  np.testing.assert_allclose(got, _np_inter_intra(z, assign), rtol=1e-4)
  # The path `cluster_metrics` takes (one shared distance pass, chunked).
  values = metrics._all_cluster_metrics(z, assign, num_clusters=3,
                                        block_size=7)
  np.testing.assert_allclose(values['inter_intra_ratio'],
                             _np_inter_intra(z, assign), rtol=1e-4)


def test_identical_point_clusters_closed_form():
  z = np.array([[1, 0, 0]] * 3 + [[0, 1, 0]] * 2 + [[0, 0, 1]] * 4,
               np.float32)
  assign = np.array([0] * 3 + [1] * 2 + [2] * 4, np.int32)
  np.testing.assert_allclose(
      metrics.compactness(z, assign, num_clusters=3), 0.0, atol=1e-7)
  np.testing.assert_allclose(
      metrics.centroid_margin(z, assign, num_clusters=3), np.sqrt(2.0),
      rtol=1e-6)
  assert np.isinf(metrics.inter_intra_ratio(z, assign, num_clusters=3))


def test_two_antipodal_pairs_closed_form():
  # Clusters {e1, e2} and {-e1, -e2}: centroids +-(e1 + e2) / 2.
  e1, e2 = np.eye(2, dtype=np.float32)
  z = np.stack([e1, e2, -e1, -e2])
  assign = np.array([0, 0, 1, 1], np.int32)
  np.testing.assert_allclose(
      metrics.compactness(z, assign, num_clusters=2), 0.5, rtol=1e-6)
  np.testing.assert_allclose(
      metrics.centroid_margin(z, assign, num_clusters=2), np.sqrt(2.0),
      rtol=1e-6)
  np.testing.assert_allclose(
      metrics.inter_intra_ratio(z, assign, num_clusters=2), 1.0, rtol=1e-6)
  a, b = np.sqrt(2.0), (2.0 + np.sqrt(2.0)) / 2.0
  np.testing.assert_allclose(
      metrics.silhouette(z, assign, num_clusters=2), (b - a) / b, rtol=1e-5)


def test_empty_cluster_ids_are_masked():
  z, assign = _clustered_data()
  # Relabel 0, 1, 2 -> 0, 3, 5 inside K = 7: ids 1, 2, 4, 6 stay empty.
  sparse = np.array([0, 3, 5], np.int32)[assign]
  for fn in (metrics.silhouette, metrics.compactness,
             metrics.centroid_margin, metrics.inter_intra_ratio):
    dense = fn(z, assign, num_clusters=3)
    got = fn(z, sparse, num_clusters=7)
    assert np.isfinite(got), fn.__name__
    np.testing.assert_allclose(got, dense, rtol=1e-6, err_msg=fn.__name__)


def test_jit_and_traced_assign():
  z, assign = _clustered_data()
  for fn in (metrics.silhouette, metrics.compactness,
             metrics.centroid_margin, metrics.inter_intra_ratio):
    eager = fn(z, assign, num_clusters=3)
    jitted = jax.jit(functools.partial(fn, num_clusters=3))(
        jnp.asarray(z), jnp.asarray(assign))
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, err_msg=fn.__name__)


def test_traced_single_cluster_is_nan():
  z, _ = _clustered_data()
  one = jnp.zeros(z.shape[0], jnp.int32)
  for fn in (metrics.silhouette, metrics.centroid_margin,
             metrics.inter_intra_ratio):
    got = jax.jit(functools.partial(fn, num_clusters=3))(z, one)
    assert np.isnan(got), fn.__name__


def test_bfloat16_input_is_computed_in_float32():
  z, assign = _clustered_data()
  z16 = jnp.asarray(z, jnp.bfloat16)
  expected = sk_metrics.silhouette_score(
      np.asarray(z16.astype(jnp.float32), np.float64), assign)
  np.testing.assert_allclose(
      metrics.silhouette(z16, assign, num_clusters=3), expected, rtol=RTOL)


# cluster_metrics.


def test_cluster_metrics_deterministic_and_consistent():
  z, _ = _clustered_data(n=90, spread=0.2)
  first = metrics.cluster_metrics(z, num_clusters=3, seed=0)
  second = metrics.cluster_metrics(z, num_clusters=3, seed=0)
  assert set(first) == {'silhouette', 'compactness', 'centroid_margin',
                        'inter_intra_ratio', 'assign'}
  np.testing.assert_array_equal(first['assign'], second['assign'])
  for key in ('silhouette', 'compactness', 'centroid_margin',
              'inter_intra_ratio'):
    assert isinstance(first[key], float)
    assert first[key] == second[key]
  assign = first['assign']
  assert assign.shape == (90,) and assign.dtype == np.int32
  np.testing.assert_allclose(
      first['silhouette'],
      sk_metrics.silhouette_score(z.astype(np.float64), assign), rtol=RTOL)
  np.testing.assert_allclose(first['compactness'],
                             _np_compactness(z, assign), rtol=RTOL)
  np.testing.assert_allclose(first['centroid_margin'],
                             _np_centroid_margin(z, assign), rtol=RTOL)
  np.testing.assert_allclose(first['inter_intra_ratio'],
                             _np_inter_intra(z, assign), rtol=RTOL)


# View metrics.


def test_view_metrics_match_numpy():
  rng = np.random.default_rng(3)
  z1, z2, za = (_unit(rng.normal(size=(20, 8))).astype(np.float32)
                for _ in range(3))
  d = lambda x, y: np.linalg.norm(x.astype(np.float64) - y, axis=1).mean()
  np.testing.assert_allclose(metrics.view_distance(z1, z2), d(z1, z2),
                             rtol=1e-5)
  np.testing.assert_allclose(metrics.anchor_distance(z1, z2, za),
                             (d(z1, za) + d(z2, za)) / 2, rtol=1e-5)
  raw1, raw2 = 3.0 * rng.normal(size=(2, 20, 8)).astype(np.float32)
  cos = np.mean(np.sum(raw1 * raw2, 1) / np.linalg.norm(raw1, axis=1)
                / np.linalg.norm(raw2, axis=1))
  np.testing.assert_allclose(metrics.view_cosine(raw1, raw2), cos,
                             rtol=1e-5, atol=1e-6)


def test_view_metrics_closed_forms():
  z = _unit(np.random.default_rng(4).normal(size=(10, 6))).astype(np.float32)
  np.testing.assert_allclose(metrics.view_distance(z, z), 0.0, atol=1e-7)
  np.testing.assert_allclose(metrics.view_cosine(z, z), 1.0, rtol=1e-6)
  np.testing.assert_allclose(metrics.view_distance(z, -z), 2.0, rtol=1e-6)
  np.testing.assert_allclose(metrics.view_cosine(z, -z), -1.0, rtol=1e-6)
  np.testing.assert_allclose(metrics.anchor_distance(z, -z, z), 1.0,
                             rtol=1e-6)
  zero = np.zeros_like(z)
  np.testing.assert_allclose(metrics.view_cosine(z, zero), 0.0, atol=1e-7)


def test_pixel_l2_is_plain_norm_of_flattened_difference():
  # The paper: (1 / 2n) sum_i sum_k ||x_hat_k^(i) - x_s,k^(i)||_2 on the
  # flattened images; one call covers one k, so this is the mean over i.
  rng = np.random.default_rng(5)
  views = rng.uniform(size=(4, 8, 8, 3)).astype(np.float32)
  strong = rng.uniform(size=(4, 8, 8, 3)).astype(np.float32)
  diff = (views.astype(np.float64) - strong).reshape(4, -1)
  expected = np.mean(np.sqrt(np.sum(diff**2, axis=1)))
  np.testing.assert_allclose(metrics.pixel_l2(views, strong), expected,
                             rtol=1e-5)
  np.testing.assert_allclose(metrics.pixel_l2(views, views), 0.0, atol=1e-7)
  # A uniform offset of 0.25 on 32 x 32 x 3: 0.25 * sqrt(3072) = 13.86.
  big = np.full((2, 32, 32, 3), 0.5, np.float32)
  np.testing.assert_allclose(metrics.pixel_l2(big, big - 0.25),
                             0.25 * np.sqrt(32 * 32 * 3), rtol=1e-6)


def test_pixel_rms_is_per_image_rms():
  rng = np.random.default_rng(5)
  views = rng.uniform(size=(4, 8, 8, 3)).astype(np.float32)
  strong = rng.uniform(size=(4, 8, 8, 3)).astype(np.float32)
  diff = (views.astype(np.float64) - strong).reshape(4, -1)
  expected = np.mean(np.sqrt(np.mean(diff**2, axis=1)))
  np.testing.assert_allclose(metrics.pixel_rms(views, strong), expected,
                             rtol=1e-5)
  big = np.full((2, 32, 32, 3), 0.5, np.float32)
  np.testing.assert_allclose(metrics.pixel_rms(big, big - 0.25), 0.25,
                             rtol=1e-6)


def test_view_metrics_match_paper_equations():
  # ViewDist = mean_i ||z1_i - z2_i||, ViewCos = mean_i z1_i . z2_i on
  # l2-normalised rows, AnchorDist = (1 / 2n) sum_i sum_k ||z_k,i - z(x_i)||.
  rng = np.random.default_rng(11)
  z1, z2, za = (_unit(rng.normal(size=(30, 16))) for _ in range(3))
  np.testing.assert_allclose(metrics.view_distance(
      z1.astype(np.float32), z2.astype(np.float32)),
      np.mean(np.linalg.norm(z1 - z2, axis=1)), rtol=1e-5)
  np.testing.assert_allclose(metrics.view_cosine(
      z1.astype(np.float32), z2.astype(np.float32)),
      np.mean(np.sum(z1 * z2, axis=1)), rtol=1e-5, atol=1e-6)
  anchor = sum(np.linalg.norm(zk - za, axis=1).sum() for zk in (z1, z2)) / 60
  np.testing.assert_allclose(metrics.anchor_distance(
      *(a.astype(np.float32) for a in (z1, z2, za))), anchor, rtol=1e-5)


def test_view_metrics_jit():
  z1, z2 = np.random.default_rng(6).normal(size=(2, 5, 4)).astype(np.float32)
  np.testing.assert_allclose(jax.jit(metrics.view_distance)(z1, z2),
                             metrics.view_distance(z1, z2), rtol=1e-6)
  np.testing.assert_allclose(jax.jit(metrics.view_cosine)(z1, z2),
                             metrics.view_cosine(z1, z2), rtol=1e-6)


# Error paths.


@pytest.mark.parametrize('kwargs, match', [
    (dict(num_clusters=1), 'num_clusters'),
    (dict(num_clusters=2.0), 'num_clusters'),
    (dict(num_clusters=True), 'num_clusters'),
    (dict(num_clusters=3, block_size=0), 'block_size'),
])
def test_bad_arguments_raise(kwargs, match):
  z, assign = _clustered_data()
  with pytest.raises(ValueError, match=match):
    metrics.silhouette(z, assign, **kwargs)


@pytest.mark.parametrize('fn', [
    metrics.silhouette, metrics.compactness, metrics.centroid_margin,
    metrics.inter_intra_ratio])
def test_bad_clustering_inputs_raise(fn):
  z, assign = _clustered_data()
  with pytest.raises(ValueError, match=r'\[n, d\]'):
    fn(z[None], assign, num_clusters=3)
  with pytest.raises(ValueError, match='match'):
    fn(z[:-1], assign, num_clusters=3)
  with pytest.raises(ValueError, match=r'\[n\]'):
    fn(z, assign[:, None], num_clusters=3)
  with pytest.raises(ValueError, match='integer'):
    fn(z, assign.astype(np.float32), num_clusters=3)
  with pytest.raises(ValueError, match='floating'):
    fn(z.astype(np.int32), assign, num_clusters=3)
  with pytest.raises(ValueError, match=r'\[0, num_clusters=3\)'):
    fn(z, assign + 1, num_clusters=3)
  with pytest.raises(ValueError, match=r'\[0, num_clusters=3\)'):
    fn(z, assign - 1, num_clusters=3)
  with pytest.raises(ValueError, match='non-empty clusters'):
    fn(z, np.zeros_like(assign), num_clusters=3)
  with pytest.raises(ValueError, match='non-empty clusters'):
    fn(z[:3], np.arange(3, dtype=np.int32), num_clusters=3)


def test_bad_view_inputs_raise():
  z = np.zeros((4, 3), np.float32)
  with pytest.raises(ValueError, match='Shapes must match'):
    metrics.view_distance(z, z[:3])
  with pytest.raises(ValueError, match=r'\[n, d\]'):
    metrics.view_cosine(z[0], z[0])
  with pytest.raises(ValueError, match='Shapes must match'):
    metrics.anchor_distance(z, z, z[:, :2])
  img = np.zeros((2, 4, 4, 3), np.float32)
  with pytest.raises(ValueError, match=r'\[n, H, W, C\]'):
    metrics.pixel_l2(img[0], img[0])
  with pytest.raises(ValueError, match='Shapes must match'):
    metrics.pixel_l2(img, img[:, :2])
  with pytest.raises(ValueError, match='floating'):
    metrics.pixel_l2(img.astype(np.uint8), img)


def test_cluster_metrics_bad_inputs_raise():
  z, _ = _clustered_data()
  with pytest.raises(ValueError, match='num_clusters'):
    metrics.cluster_metrics(z, num_clusters=1, seed=0)
  with pytest.raises(ValueError, match='smaller than the number of points'):
    metrics.cluster_metrics(z[:3], num_clusters=3, seed=0)
  with pytest.raises(ValueError, match=r'\[n, d\]'):
    metrics.cluster_metrics(z[0], num_clusters=3, seed=0)
