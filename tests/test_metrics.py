"""Tests of otclr_jax.evaluation.metrics: sklearn, NumPy, closed forms."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import metrics as sk_metrics

from otclr_jax.evaluation import metrics
from tests.helpers import rounding_tol

RTOL = 1e-4
ATOL = 1e-5


def _one_score(name):
  """`metrics.clustering_scores`' `name` alone, with its arguments."""
  def score(z, assign, **kwargs):
    return metrics.clustering_scores(z, assign, **kwargs)[name]
  score.__name__ = name
  return score


_silhouette, _compactness, _centroid_margin, _inter_intra_ratio = (
    _one_score(name) for name in ('silhouette', 'compactness',
                                  'centroid_margin', 'inter_intra_ratio'))


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


# Tolerances of float32 evaluations: rounding_tol over each metric's chain,
# with growth factors read off the data.


def _distance_sums_rtol(z, assign):
  """Relative error of float32 sums of Gram-form distances to each cluster.

  sq = |z_i|^2 + |z_j|^2 - 2 z_i.z_j, a dot product of d and two stages,
  rounds absolutely at the scale 4 max |z|^2, and sqrt turns an error e of
  sq into e / (2 d_ij); sqrt then rounds once. Summed over the
  members j of a cluster, the errors make a relative error of at most
  2 max |z|^2 sum_j 1 / d_ij / sum_j d_ij of the sum, whose largest ratio
  over points and clusters (k) also bounds every sum of such sums. The
  data hold no two coincident points.
  """
  z = np.asarray(z, np.float64)
  dist = np.linalg.norm(z[:, None] - z[None], axis=-1)
  np.fill_diagonal(dist, np.nan)
  assert np.nanmin(dist) > 0
  ratio = 0.0
  for c in np.unique(assign):
    members = dist[:, assign == c]
    count = np.sum(~np.isnan(members), axis=1)
    sums = np.nansum(members, axis=1)
    inverse = np.nansum(1.0 / members, axis=1)
    ratio = max(ratio, float(np.max((inverse / sums)[count > 0])))
  k = 2 * np.max(np.sum(z * z, 1)) * ratio
  return rounding_tol(z.shape[1], stages=2, k=k) + rounding_tol(stages=1)


def _silhouette_atol(z, assign):
  """s_i = (b - a) / max(a, b) with a and b means of Gram distances.

  a and b: the distance sums' error, then sums over at most n points and the
  division. s_i moves by at most 3 times their relative error (its terms
  are at most max(a, b)); its division and the mean over n points round
  relative to |s_i| <= 1.
  """
  n = len(z)
  rel_ab = _distance_sums_rtol(z, assign) + rounding_tol(n, stages=1)
  return 3 * rel_ab + rounding_tol(n, stages=2)


def _centroid_rtol(z, assign):
  """Relative error of float32 distances between cluster centroids.

  Centroids: a sum over at most n members and the division, each relative
  to max |z|, so amplified in the centroids' difference by 2 max |z| / (the
  smallest distance between centroids); then the squares' sum over d and
  sqrt.
  """
  z = np.asarray(z, np.float64)
  mu = np.stack([z[assign == c].mean(0) for c in np.unique(assign)])
  dist = np.linalg.norm(mu[:, None] - mu[None], axis=-1)[
      np.triu_indices(len(mu), 1)]
  k = 2 * np.max(np.linalg.norm(z, axis=1)) / np.min(dist)
  return (rounding_tol(len(z), stages=1, k=k)
          + rounding_tol(z.shape[1], stages=1))


def _inter_intra_rtol(z, assign):
  """D_inter / D_intra: centroid distances over Gram-form pair distances.

  D_inter: centroid distances and their mean over at most K^2 pairs;
  D_intra: the distances, sums over members and clusters, the division and
  the mean over K; the ratio. All sums are of positive terms.
  """
  num = len(np.unique(assign))
  inter = _centroid_rtol(z, assign) + rounding_tol(num * num, stages=1)
  intra = _distance_sums_rtol(z, assign) + rounding_tol(
      len(z), len(z), num, stages=2)
  return inter + intra + rounding_tol(stages=1)


def _compactness_rtol(z, assign):
  """Mean squared distance of members to their centroid.

  The residual z - mu carries the centroid's error (_centroid_rtol's first
  part, on terms of at most 2 max |z|); its squared norm then moves by at
  most 2 sqrt(d) max|residual| x that, relative to the smallest cluster's
  compactness c; the squares' sum, the sums over members and the means
  round positive terms.
  """
  z = np.asarray(z, np.float64)
  ids = np.unique(assign)
  resid = np.concatenate([z[assign == c] - z[assign == c].mean(0)
                          for c in ids])
  c = min(np.mean(np.sum((z[assign == i] - z[assign == i].mean(0)) ** 2, 1))
          for i in ids if np.sum(assign == i) > 1)
  max_z = np.max(np.linalg.norm(z, axis=1))
  k = 2 * np.sqrt(z.shape[1]) * np.max(np.abs(resid)) * 2 * max_z / c
  return (rounding_tol(len(z), stages=1, k=k)
          + rounding_tol(z.shape[1], len(z), len(ids), stages=2))


def _np_inter_intra(z, mu, assign):
  """The paper's D_inter / D_intra, D_intra = (1/K) sum_k mean_k: cluster
  k's mean of ||z_i - z_j|| over pairs i < j; clusters without a pair
  (singletons) are left out of the 1/K average."""
  inter = [np.linalg.norm(mu[i] - mu[j])
           for i in range(len(mu)) for j in range(i + 1, len(mu))]
  per_cluster = []
  for c in np.unique(assign):
    members = z[assign == c]
    pairs = [np.linalg.norm(members[i] - members[j])
             for i in range(len(members)) for j in range(i + 1, len(members))]
    if pairs:
      per_cluster.append(np.mean(pairs))
  return np.mean(inter) / np.mean(per_cluster)


def _references(z, assign):
  """The four scores in float64, from their definitions (sklearn's
  silhouette)."""
  z = z.astype(np.float64)
  ids = np.unique(assign)
  mu = np.stack([z[assign == c].mean(axis=0) for c in ids])
  dist = np.linalg.norm(mu[:, None] - mu[None], axis=-1)
  np.fill_diagonal(dist, np.inf)
  return {
      'silhouette': sk_metrics.silhouette_score(z, assign),
      'compactness': np.mean([np.mean(np.sum(
          (z[assign == c] - z[assign == c].mean(0))**2, axis=1))
                              for c in ids]),
      'centroid_margin': dist.min(axis=1).mean(),
      'inter_intra_ratio': _np_inter_intra(z, mu, assign)}


class TestClusterScores:
  """The clustering scores against sklearn, NumPy and closed forms."""

  @pytest.mark.parametrize('make', [_random_data, _clustered_data])
  @pytest.mark.parametrize('singleton', [None, 'next', 5])
  def test_scores_match_their_definitions(self, make, singleton):
    z, assign = make()
    k = int(assign.max()) + 1
    if singleton:
      # A singleton cluster, with empty ids below it if its id is 5.
      k = k if singleton == 'next' else singleton
      z, assign = _with_singleton(z, assign, k)
      k += 1
    got = metrics.clustering_scores(z, assign, num_clusters=k)
    for name, expected in _references(z, assign).items():
      atol = 0 if name == 'inter_intra_ratio' else ATOL
      np.testing.assert_allclose(got[name], expected, rtol=RTOL, atol=atol,
                                 err_msg=name)

  def test_silhouette_clustered_is_high_random_is_low(self):
    z, assign = _clustered_data(spread=0.1)
    z_r, assign_r = _random_data()
    assert _silhouette(z, assign, num_clusters=3) > 0.5
    assert abs(float(_silhouette(z_r, assign_r, num_clusters=4))) < 0.1

  @pytest.mark.parametrize('block_size', [1, 7, 16, 59, 1024])
  def test_silhouette_chunked_equals_unchunked(self, block_size):
    z, assign = _clustered_data(n=60, spread=0.5)
    full = _silhouette(z, assign, num_clusters=3, block_size=None)
    chunked = _silhouette(z, assign, num_clusters=3,
                                 block_size=block_size)
    # Two programs (row blocks against one block) of one float32 computation.
    np.testing.assert_allclose(chunked, full, rtol=0,
                               atol=_silhouette_atol(z, assign))
    full_r = _inter_intra_ratio(z, assign, num_clusters=3,
                                       block_size=None)
    chunked_r = _inter_intra_ratio(z, assign, num_clusters=3,
                                          block_size=block_size)
    np.testing.assert_allclose(chunked_r, full_r,
                               rtol=_inter_intra_rtol(z, assign))

  def test_silhouette_identical_points_is_one(self):
    z = np.array([[1, 0, 0]] * 3 + [[0, 1, 0]] * 2, np.float32)
    assign = np.array([0, 0, 0, 1, 1], np.int32)
    # The Gram form of 0/1 vectors is exact: a = 0, so every s_i = b / b; then
    # the mean over 5, on terms of 1.
    np.testing.assert_allclose(
        _silhouette(z, assign, num_clusters=2), 1.0, rtol=0,
        atol=rounding_tol(5, stages=2))

  def test_inter_intra_is_mean_of_per_cluster_means(self):
    # Cluster 0: 3 collinear points (pair distances 1, 1, 2; mean 4/3),
    # cluster 1: a pair at distance 4. The paper's D_intra is (4/3 + 4) / 2 =
    # 8/3; pooling all four pairs would give (1 + 1 + 2 + 4) / 4 = 2.
    z = np.array([[0, 0], [1, 0], [2, 0], [10, 0], [10, 4]], np.float32)
    assign = np.array([0, 0, 0, 1, 1], np.int32)
    inter = np.linalg.norm(np.array([1.0, 0.0]) - np.array([10.0, 2.0]))
    # Small integers: the Gram form, the distances 1, 2 and 4 and the sums
    # are exact in float32. The centroids, their difference, squares' sum of
    # 2 and sqrt, the mean over 2 pairs; the cluster means, their mean over
    # 2; the ratio: terms of one sign.
    np.testing.assert_allclose(
        _inter_intra_ratio(z, assign, num_clusters=2),
        inter / (8.0 / 3.0), rtol=rounding_tol(2, 2, 2, stages=6))

  def test_inter_intra_unequal_clusters_match_paper_equation(self):
    # Very unequal sizes (40 vs 3 points, different spreads) separate the
    # paper's mean of per-cluster means from a pooled mean by far more than
    # the tolerance; a singleton is left out of D_intra only.
    rng = np.random.default_rng(3)
    z = np.concatenate([0.1 * rng.normal(size=(40, 6)),
                        3.0 + 2.0 * rng.normal(size=(3, 6)),
                        [np.full(6, -5.0)]]).astype(np.float32)
    assign = np.array([0] * 40 + [1] * 3 + [2], np.int32)
    expected = _references(z, assign)['inter_intra_ratio']
    got = _inter_intra_ratio(z, assign, num_clusters=3)
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    # The path `cluster_metrics` takes (one shared distance pass, chunked).
    values = metrics._all_cluster_metrics(z, assign, num_clusters=3,
                                          block_size=7)
    np.testing.assert_allclose(values['inter_intra_ratio'], expected, rtol=1e-4)

  def test_identical_point_clusters_closed_form(self):
    z = np.array([[1, 0, 0]] * 3 + [[0, 1, 0]] * 2 + [[0, 0, 1]] * 4,
                 np.float32)
    assign = np.array([0] * 3 + [1] * 2 + [2] * 4, np.int32)
    # Sums of equal unit vectors are exact; dividing by the count leaves each
    # residual entry at most rounding_tol(stages=1), and compactness, a mean
    # of 3 squared entries, at most 3 of its squares.
    np.testing.assert_allclose(
        _compactness(z, assign, num_clusters=3), 0.0, rtol=0,
        atol=3 * rounding_tol(stages=1) ** 2)
    # Centroids, their difference, squares' sum of 3 and sqrt, the mean over 3.
    np.testing.assert_allclose(
        _centroid_margin(z, assign, num_clusters=3), np.sqrt(2.0),
        rtol=rounding_tol(3, 3, stages=4))
    assert np.isinf(_inter_intra_ratio(z, assign, num_clusters=3))

  def test_two_antipodal_pairs_closed_form(self):
    # Clusters {e1, e2} and {-e1, -e2}: centroids +-(e1 + e2) / 2.
    e1, e2 = np.eye(2, dtype=np.float32)
    z = np.stack([e1, e2, -e1, -e2])
    assign = np.array([0, 0, 1, 1], np.int32)
    # Compactness: centroids (a sum of 2, the division) and the residual,
    # cancelling |z| = 1 to |residual| = 0.71 (k = 1.5); squares' sum,
    # per-cluster sum and the mean over 2 clusters, of 2 each, two divisions.
    np.testing.assert_allclose(
        _compactness(z, assign, num_clusters=2), 0.5,
        rtol=rounding_tol(2, stages=2, k=1.5) + rounding_tol(2, 2, 2, stages=2))
    # Centroids, difference, squares' sum, sqrt, the mean over 2.
    np.testing.assert_allclose(
        _centroid_margin(z, assign, num_clusters=2), np.sqrt(2.0),
        rtol=rounding_tol(2, 2, 2, stages=4))
    # D_inter as the margin; D_intra: the Gram form's dot product, sqrt, sums
    # over members and clusters, divisions and the mean over 2; the ratio.
    np.testing.assert_allclose(
        _inter_intra_ratio(z, assign, num_clusters=2), 1.0,
        rtol=rounding_tol(*[2] * 7, stages=10))
    a, b = np.sqrt(2.0), (2.0 + np.sqrt(2.0)) / 2.0
    # The Gram form's dot product of 2 and sqrt; b's sum of 2 and division;
    # a's division; b - a and the division; the mean of four. b - a = 0.29
    # cancels terms of up to a + b = 3.1: k = 11.
    np.testing.assert_allclose(
        _silhouette(z, assign, num_clusters=2), (b - a) / b,
        rtol=rounding_tol(2, 2, 4, stages=8, k=11))

  def test_empty_cluster_ids_are_masked(self):
    z, assign = _clustered_data()
    # Relabel 0, 1, 2 -> 0, 3, 5 inside K = 7: ids 1, 2, 4, 6 stay empty.
    sparse = np.array([0, 3, 5], np.int32)[assign]
    # Two programs (K = 7 against K = 3) of one float32 computation.
    tolerances = {
        _silhouette: dict(rtol=0, atol=_silhouette_atol(z, assign)),
        _compactness: dict(rtol=_compactness_rtol(z, assign)),
        _centroid_margin: dict(rtol=_centroid_rtol(z, assign)
                               + rounding_tol(3, stages=1)),
        _inter_intra_ratio: dict(rtol=_inter_intra_rtol(z, assign)),
    }
    for fn, tolerance in tolerances.items():
      dense = fn(z, assign, num_clusters=3)
      got = fn(z, sparse, num_clusters=7)
      assert np.isfinite(got), fn.__name__
      np.testing.assert_allclose(got, dense, err_msg=fn.__name__, **tolerance)

  def test_jit_and_traced_assign(self):
    z, assign = _clustered_data()
    for fn in (_silhouette, _compactness,
               _centroid_margin, _inter_intra_ratio):
      eager = fn(z, assign, num_clusters=3)
      jitted = jax.jit(functools.partial(fn, num_clusters=3))(
          jnp.asarray(z), jnp.asarray(assign))
      # The public functions check their inputs and make one jitted call; jit
      # around them traces the same computation into the same program.
      np.testing.assert_array_equal(jitted, eager, err_msg=fn.__name__)

  def test_traced_single_cluster_is_nan(self):
    z, _ = _clustered_data()
    one = jnp.zeros(z.shape[0], jnp.int32)
    for fn in (_silhouette, _centroid_margin,
               _inter_intra_ratio):
      got = jax.jit(functools.partial(fn, num_clusters=3))(z, one)
      assert np.isnan(got), fn.__name__

  def test_bfloat16_input_is_computed_in_float32(self):
    z, assign = _clustered_data()
    z16 = jnp.asarray(z, jnp.bfloat16)
    expected = sk_metrics.silhouette_score(
        np.asarray(z16.astype(jnp.float32), np.float64), assign)
    np.testing.assert_allclose(
        _silhouette(z16, assign, num_clusters=3), expected, rtol=RTOL)

  def test_cluster_metrics_deterministic_and_consistent(self):
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
    for name, expected in _references(z, assign).items():
      np.testing.assert_allclose(first[name], expected, rtol=RTOL,
                                 err_msg=name)


class TestViewMetrics:
  """The view, anchor and pixel distances."""

  def test_view_metrics_match_numpy(self):
    rng = np.random.default_rng(3)
    z1, z2, za = (_unit(rng.normal(size=(20, 8))).astype(np.float32)
                  for _ in range(3))
    d = lambda x, y: np.linalg.norm(x.astype(np.float64) - y, axis=1).mean()
    # float32 against float64 on the same float32 inputs: the difference
    # (relative to itself), the squares' sum over 8 and sqrt, the mean over
    # 20; anchor_distance adds two and halves.
    np.testing.assert_allclose(metrics.view_distance(z1, z2), d(z1, z2),
                               rtol=rounding_tol(8, 20, stages=3))
    np.testing.assert_allclose(metrics.anchor_distance(z1, z2, za),
                               (d(z1, za) + d(z2, za)) / 2,
                               rtol=rounding_tol(8, 20, stages=5))
    raw1, raw2 = 3.0 * rng.normal(size=(2, 20, 8)).astype(np.float32)
    cos = np.mean(np.sum(raw1 * raw2, 1) / np.linalg.norm(raw1, axis=1)
                  / np.linalg.norm(raw2, axis=1))
    # Both float32: a cosine's dot product over 8 rounds relative to
    # |raw1| |raw2|, so absolutely in units of 1; the norms (a sum of 8 and
    # sqrt), their product and the division, the mean over 20.
    np.testing.assert_allclose(metrics.view_cosine(raw1, raw2), cos, rtol=0,
                               atol=rounding_tol(8, 8, 20, stages=4))

  def test_view_metrics_closed_forms(self):
    z = _unit(np.random.default_rng(4).normal(size=(10, 6))).astype(np.float32)
    # z - z is exactly 0, and so is everything after it.
    assert float(metrics.view_distance(z, z)) == 0.0
    # |z| = 1 up to rounding the unit rows to float32. The cosine: the dot
    # product and each norm's squares (of 6), sqrt, the norms' product and the
    # division, the mean over 10.
    cos_rtol = rounding_tol(6, 6, 10, stages=5)
    np.testing.assert_allclose(metrics.view_cosine(z, z), 1.0, rtol=cos_rtol)
    np.testing.assert_allclose(metrics.view_cosine(z, -z), -1.0, rtol=cos_rtol)
    # z - (-z) = 2z exactly; |z|, the squares' sum, sqrt, the mean over 10;
    # anchor_distance adds 0 and halves.
    np.testing.assert_allclose(metrics.view_distance(z, -z), 2.0,
                               rtol=rounding_tol(6, 10, stages=3))
    np.testing.assert_allclose(metrics.anchor_distance(z, -z, z), 1.0,
                               rtol=rounding_tol(6, 10, stages=4))
    zero = np.zeros_like(z)
    # A zero dot product over the floored norm: exactly 0.
    assert float(metrics.view_cosine(z, zero)) == 0.0

  def test_pixel_l2_is_plain_norm_of_flattened_difference(self):
    # The paper: (1 / 2n) sum_i sum_k ||x_hat_k^(i) - x_s,k^(i)||_2 on the
    # flattened images; one call covers one k, so this is the mean over i.
    rng = np.random.default_rng(5)
    views = rng.uniform(size=(4, 8, 8, 3)).astype(np.float32)
    strong = rng.uniform(size=(4, 8, 8, 3)).astype(np.float32)
    diff = (views.astype(np.float64) - strong).reshape(4, -1)
    expected = np.mean(np.sqrt(np.sum(diff**2, axis=1)))
    # float32 against float64 on the same inputs: the difference, the
    # squares' sum over an image, sqrt, the mean over 4.
    np.testing.assert_allclose(metrics.pixel_l2(views, strong), expected,
                               rtol=rounding_tol(views.shape[1:], 4, stages=3))
    assert float(metrics.pixel_l2(views, views)) == 0.0
    # A uniform offset of 0.25 on 32 x 32 x 3: 0.25 * sqrt(3072) = 13.86.
    # Every partial sum of 0.0625s is exact; sqrt, and the mean of 2.
    big = np.full((2, 32, 32, 3), 0.5, np.float32)
    np.testing.assert_allclose(metrics.pixel_l2(big, big - 0.25),
                               0.25 * np.sqrt(32 * 32 * 3),
                               rtol=rounding_tol(2, stages=2))

  def test_pixel_rms_is_per_image_rms(self):
    rng = np.random.default_rng(5)
    views = rng.uniform(size=(4, 8, 8, 3)).astype(np.float32)
    strong = rng.uniform(size=(4, 8, 8, 3)).astype(np.float32)
    diff = (views.astype(np.float64) - strong).reshape(4, -1)
    expected = np.mean(np.sqrt(np.mean(diff**2, axis=1)))
    # As pixel_l2, the sum over an image a mean.
    np.testing.assert_allclose(metrics.pixel_rms(views, strong), expected,
                               rtol=rounding_tol(views.shape[1:], 4, stages=4))
    # 0.0625 summed 3072 times is exact; the division by 3072, sqrt, the mean
    # of 2.
    big = np.full((2, 32, 32, 3), 0.5, np.float32)
    np.testing.assert_allclose(metrics.pixel_rms(big, big - 0.25), 0.25,
                               rtol=rounding_tol(2, stages=3))

  def test_view_metrics_match_paper_equations(self):
    # ViewDist = mean_i ||z1_i - z2_i||, ViewCos = mean_i z1_i . z2_i on
    # l2-normalised rows, AnchorDist = (1 / 2n) sum_i sum_k ||z_k,i - z(x_i)||.
    rng = np.random.default_rng(11)
    z1, z2, za = (_unit(rng.normal(size=(30, 16))) for _ in range(3))
    # Against float64 on the unrounded rows: rounding the inputs moves a
    # difference of unit rows by up to 2 / (its norm) relative; then the
    # difference, the squares' sum over 16 and sqrt, the mean over 30
    # (anchor_distance: over 60).
    min_dist = lambda a, b: np.min(np.linalg.norm(a - b, axis=1))
    np.testing.assert_allclose(metrics.view_distance(
        z1.astype(np.float32), z2.astype(np.float32)),
        np.mean(np.linalg.norm(z1 - z2, axis=1)),
        rtol=rounding_tol(stages=1, k=2 / min_dist(z1, z2))
        + rounding_tol(16, 30, stages=3))
    # The cosine of unit rows: rounding them, the dot product and both norms
    # (of 16, sqrt), the product and the division, absolute in units of 1;
    # the mean over 30.
    np.testing.assert_allclose(metrics.view_cosine(
        z1.astype(np.float32), z2.astype(np.float32)),
        np.mean(np.sum(z1 * z2, axis=1)), rtol=0,
        atol=rounding_tol(16, 16, 30, stages=5))
    anchor = sum(np.linalg.norm(zk - za, axis=1).sum() for zk in (z1, z2)) / 60
    np.testing.assert_allclose(metrics.anchor_distance(
        *(a.astype(np.float32) for a in (z1, z2, za))), anchor,
        rtol=rounding_tol(stages=1,
                          k=2 / min(min_dist(z1, za), min_dist(z2, za)))
        + rounding_tol(16, 60, stages=3))

  def test_view_metrics_jit(self):
    z1, z2 = np.random.default_rng(6).normal(size=(2, 5, 4)).astype(np.float32)
    # One jitted call inside each public function: the same program.
    np.testing.assert_array_equal(jax.jit(metrics.view_distance)(z1, z2),
                                  metrics.view_distance(z1, z2))
    np.testing.assert_array_equal(jax.jit(metrics.view_cosine)(z1, z2),
                                  metrics.view_cosine(z1, z2))


class TestErrors:
  """Bad arguments and inputs raise."""

  @pytest.mark.parametrize('kwargs, match', [
      (dict(num_clusters=1), 'num_clusters'),
      (dict(num_clusters=2.0), 'num_clusters'),
      (dict(num_clusters=True), 'num_clusters'),
      (dict(num_clusters=3, block_size=0), 'block_size'),
  ])
  def test_bad_arguments_raise(self, kwargs, match):
    z, assign = _clustered_data()
    with pytest.raises(ValueError, match=match):
      _silhouette(z, assign, **kwargs)

  @pytest.mark.parametrize('fn', [
      _silhouette, _compactness, _centroid_margin,
      _inter_intra_ratio])
  def test_bad_clustering_inputs_raise(self, fn):
    z, a = _clustered_data()
    for args, match in (
        ((z[None], a), r'\[n, d\]'), ((z[:-1], a), 'match'),
        ((z, a[:, None]), r'\[n\]'), ((z, a.astype(np.float32)), 'integer'),
        ((z.astype(np.int32), a), 'floating'),
        ((z, a + 1), r'\[0, num_clusters=3\)'),
        ((z, a - 1), r'\[0, num_clusters=3\)'),
        ((z, np.zeros_like(a)), 'non-empty clusters'),
        ((z[:3], np.arange(3, dtype=np.int32)), 'non-empty clusters')):
      with pytest.raises(ValueError, match=match):
        fn(*args, num_clusters=3)

  def test_bad_view_inputs_raise(self):
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

  def test_cluster_metrics_bad_inputs_raise(self):
    z, _ = _clustered_data()
    with pytest.raises(ValueError, match='num_clusters'):
      metrics.cluster_metrics(z, num_clusters=1, seed=0)
    with pytest.raises(ValueError, match='smaller than the number of points'):
      metrics.cluster_metrics(z[:3], num_clusters=3, seed=0)
    with pytest.raises(ValueError, match=r'\[n, d\]'):
      metrics.cluster_metrics(z[0], num_clusters=3, seed=0)


class TestImageMetrics:
  """Frequency, border and retrieval metrics."""

  def test_high_frequency_power_is_the_mean_square_above_the_cutoff(self):
    rows, cols = np.meshgrid(np.arange(16), np.arange(16), indexing='ij')
    checker = ((rows + cols) % 2).astype(np.float32)  # 0.5 cycles/pixel
    slow = 0.5 + 0.5 * np.cos(2 * np.pi * rows / 16)  # 1/16 cycle/pixel
    images = np.stack([np.stack([checker] * 3, -1), np.stack([slow] * 3, -1),
                       np.full((16, 16, 3), 0.7)])
    # The checkerboard's zero-mean part is +-0.5: mean square 0.25.
    assert metrics.high_frequency_power(images[:1]) == pytest.approx(0.25)
    for smooth in (images[1:2], images[2:]):
      assert metrics.high_frequency_power(smooth) == pytest.approx(0, abs=1e-20)
    # A mean over images.
    assert metrics.high_frequency_power(images) == pytest.approx(0.25 / 3)
    # The cutoff is radial: the vertical stripes at 1/4 cycle per pixel
    # count above 0.2 and not above 0.3.
    stripes = np.broadcast_to((cols % 4 < 2)[None, :, :, None], (1, 16, 16, 3))
    assert metrics.high_frequency_power(stripes * 1.0, 0.2) > 0.1
    assert metrics.high_frequency_power(stripes * 1.0, 0.3) == pytest.approx(
        0, abs=1e-20)

  def test_border_centre_ratio_compares_the_ring_with_the_inside(self):
    image = np.full((2, 10, 10, 3), 0.5)
    image[:, 3:-3, 3:-3] = 1.0
    assert metrics.border_centre_ratio(image) == pytest.approx(0.5)
    # Inside a 2-pixel ring: the 4 x 4 bright square and 20 pixels at 0.5.
    assert metrics.border_centre_ratio(image, width=2) == pytest.approx(
        0.5 / ((16 * 1.0 + 20 * 0.5) / 36), rel=1e-12)
    with pytest.raises(ValueError, match='no pixels inside'):
      metrics.border_centre_ratio(image, width=5)

  def test_retrieval_rate_counts_partners_that_are_nearest(self):
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(50, 8))
    assert metrics.retrieval_rate(3.0 * keys, keys) == 1.0
    # Cosine similarity: a query's scale does not matter, its direction does.
    assert metrics.retrieval_rate(keys[::-1], keys) == 0.0
    queries = keys.copy()
    queries[:10] = keys[10:20]
    assert metrics.retrieval_rate(queries, keys) == pytest.approx(0.8)
