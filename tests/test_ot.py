"""Tests of otclr_jax.ot against POT, ott-jax, NumPy and closed forms."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import ot as pot
import pytest
from ott.geometry import grid
from ott.problems.linear import linear_problem
from ott.solvers.linear import sinkhorn

from otclr_jax import ot
from otclr_jax import ot_checks
from tests import folder_trees
from tests.helpers import EPS64
from tests.helpers import chain
from tests.helpers import ot_chain
from tests.helpers import ot_cost_scale
from tests.helpers import rounding_tol

EPS = 0.05
ITERS = [1, 5, 20]


def _histogram(rng, m=16):
  h = rng.random((m, m)) + 1e-3
  return (h / h.sum()).astype(np.float32)


@pytest.fixture
def pair():
  rng = np.random.default_rng(0)
  return _histogram(rng), _histogram(rng)


def _blob(m, center, width=1.2):
  rows, cols = np.meshgrid(np.arange(m), np.arange(m), indexing='ij')
  h = np.exp(-((rows - center[0]) ** 2 + (cols - center[1]) ** 2) / width**2)
  h += 1e-6
  return (h / h.sum()).astype(np.float32)


def _centroid(h):
  r = ot.grid_points(h.shape[-1])
  return (np.asarray(h, np.float64).reshape(-1, 1) * r).sum(0)


def _pot_plan(a, b, num_iters=20, **kwargs):
  """POT's float64 plan of `num_iters` Sinkhorn iterations."""
  return pot.sinkhorn(a.ravel().astype(np.float64),
                      b.ravel().astype(np.float64),
                      ot.grid_cost(a.shape[-1]), reg=EPS,
                      numItermax=num_iters, stopThr=0, **kwargs)


# The kernel's exponent -cost / eps: 8 stages, absolute on a cost of at
# most 1, which exp turns into relative errors up to 1 / eps times larger.
_KERNEL_RTOL = rounding_tol(stages=8, k=1 / EPS)
# |log u|, |log v| <= L = 1 / eps + 2 |log(DELTA / m^2)| + log(m^2) for
# histograms of at least DELTA / m^2 on a kernel in [exp(-1 / eps), 1].
_LOG_SCALING = 1 / EPS + 2 * abs(math.log(ot.DELTA / 256)) + math.log(256)
# Potentials eps log u (or scalings exp(f / eps)): a product and a function
# each, absolute at |log u| <= L, which the plan's exp makes relative.
_POTENTIALS_RTOL = rounding_tol(stages=2, funcs=2, k=_LOG_SCALING)
# `ot.displace`'s splat: the hat weights on rounded positions and their
# product (5), then three sums of m = 16.
_SPLAT = chain(16, 16, 16, stages=5)


def _plan_rtol(num_iters):
  """Relative error of float32 plan entries u_i K_ij v_j, m = 16: the
  scalings, the kernel, the kron and two products."""
  return rounding_tol(ot_chain(16, num_iters), stages=3) + _KERNEL_RTOL


class TestGrid:

  def test_cost_is_normalised_squared_distance(self):
    c = ot.grid_cost(4)
    r = ot.grid_points(4)
    # The same float64 operations in the same order (the maximum squared
    # distance is 2, and dividing by it is exact); x / x is exactly 1.
    assert c[1, 4] == np.sum((r[1] - r[4]) ** 2) / 2.0
    assert c.max() == 1.0
    assert c[0, 15] == 1.0

  def test_cost_is_separable(self):
    m = 5
    cx = ot.axis_cost(m)
    full = cx[:, None, :, None] + cx[None, :, None, :]
    # float64 on entries <= 1: coordinates, difference, square, sum and the
    # division by the maximum.
    np.testing.assert_allclose(full.reshape(m * m, m * m), ot.grid_cost(m),
                               rtol=0, atol=rounding_tol(stages=6, eps=EPS64))


class TestSinkhorn:

  @pytest.mark.parametrize('core', ot.CORES)
  @pytest.mark.parametrize('num_iters', ITERS)
  def test_plan_matches_pot(self, pair, num_iters, core):
    a, b = pair
    plan = np.asarray(ot.sinkhorn_plan(a, b, EPS, num_iters, core=core))
    assert plan.shape == (256, 256)
    # float32 against POT's float64 iterations; ott-jax's scalings are
    # exp(f / eps) of its potentials.
    rtol = _plan_rtol(num_iters) + (_POTENTIALS_RTOL if core == 'ott' else 0)
    np.testing.assert_allclose(plan, _pot_plan(a, b, num_iters), rtol=rtol,
                               atol=0)

  @pytest.mark.parametrize('num_iters', ITERS)
  def test_plan_matches_ott_grid_solver(self, pair, num_iters):
    a, b = pair
    axis = jnp.linspace(0.0, 1.0, 16) / np.sqrt(2.0)  # max cost 1 on [0,1]^2
    geom = grid.Grid(x=[axis, axis], epsilon=EPS)
    prob = linear_problem.LinearProblem(geom, a.ravel(), b.ravel())
    solver = sinkhorn.Sinkhorn(
        lse_mode=False, min_iterations=num_iters, max_iterations=num_iters,
        inner_iterations=num_iters, implicit_diff=None)
    out = solver(prob)
    f, g = np.asarray(out.f, np.float64), np.asarray(out.g, np.float64)
    expected = np.exp((f[:, None] + g[None, :] - ot.grid_cost(16)) / EPS)
    plan = np.asarray(ot.sinkhorn_plan(a, b, EPS, num_iters))
    # Two float32 programs; ott-jax's potentials f = eps log u, g = eps log v.
    np.testing.assert_allclose(
        plan, expected, rtol=_plan_rtol(num_iters) + _POTENTIALS_RTOL, atol=0)

  def test_marginals(self, pair):
    a, b = pair
    plan = np.asarray(ot.sinkhorn_plan(a, b), np.float64)
    # The last half-iteration set u = a / (K v): K v's two sums of 16 and
    # the division, against the plan's kron and two products.
    np.testing.assert_allclose(plan.sum(1), a.ravel(),
                               rtol=rounding_tol(16, 16, stages=4))
    np.testing.assert_allclose(plan.sum(0), b.ravel(), rtol=1e-3, atol=1e-7)

  def test_cost_matches_numpy_formula_and_batches(self, pair):
    a, b = pair
    plan = _pot_plan(a, b)
    expected = (plan * ot.grid_cost(16)).sum() + EPS * (
        plan * (np.log(plan) - 1.0)).sum()
    # float32 against POT's float64 iterations on the same histograms.
    atol = (rounding_tol(ot_chain(16, 20, result='cost'))
            * ot_cost_scale(a, b, EPS, 20))
    cost = float(ot.sinkhorn_cost(a, b))
    assert cost == pytest.approx(expected, rel=0, abs=atol)
    batch = ot.sinkhorn_cost(np.stack([a, b]), np.stack([b, a]))
    assert batch.shape == (2,)
    # Two programs (a batch of two against one problem).
    assert float(batch[0]) == pytest.approx(cost, rel=0, abs=atol)


class TestDisplace:

  @pytest.mark.parametrize('alpha', [0.0, 0.25, 0.5, 0.8, 1.0])
  def test_fast_matches_dense_splat(self, pair, alpha):
    a, b = pair
    plan = ot.sinkhorn_plan(a, b)
    expected = np.asarray(ot.dense_displace(plan, alpha))
    np.testing.assert_allclose(ot.displace(a, b, alpha), expected, rtol=1e-4,
                               atol=1e-8)

  def test_dense_splat_matches_python_loop(self):
    rng = np.random.default_rng(3)
    m, alpha = 4, 0.3
    plan = rng.random((m * m, m * m))
    r = ot.grid_points(m)
    expected = np.zeros((m, m))
    for i in range(m * m):
      for j in range(m * m):
        g = ((1 - alpha) * r[i] + alpha * r[j]) * (m - 1)
        k = np.clip(np.floor(g), 0, m - 2).astype(int)
        t = g - k
        for dr in (0, 1):
          for dc in (0, 1):
            w = (t[0] if dr else 1 - t[0]) * (t[1] if dc else 1 - t[1])
            expected[k[0] + dr, k[1] + dc] += plan[i, j] * w
    got = ot.dense_displace(jnp.asarray(plan, jnp.float32), alpha)
    # float32 against float64: the plan's rounding, each packet's position,
    # fraction and weights (8 stages) and product, and up to all 16 x 16 x 4
    # packets scattered into one vertex. Positions are rounded in grid
    # units, up to m - 1 = 3, and a weight's error is absolute: k = 3.
    np.testing.assert_allclose(got, expected,
                               rtol=rounding_tol(1024, stages=10, k=3))

  @pytest.mark.parametrize('alpha', [0.1, 0.5, 0.9])
  def test_mass_and_centroid_are_exact(self, pair, alpha):
    a, b = pair
    plan = np.asarray(ot.sinkhorn_plan(a, b), np.float64)
    out = np.asarray(ot.displace(a, b, alpha), np.float64)
    # Each packet's hat weights sum to 1 and keep its centroid; the same
    # scalings make both sides: the splat against the plan's kron and two
    # products, all terms positive.
    rtol = rounding_tol(_SPLAT, stages=3)
    assert out.sum() == pytest.approx(plan.sum(), rel=rtol)
    r = ot.grid_points(16)
    expected = ((1 - alpha) * (plan.sum(1)[:, None] * r).sum(0)
                + alpha * (plan.sum(0)[:, None] * r).sum(0))
    np.testing.assert_allclose(_centroid(out), expected, rtol=rtol)

  def test_alpha_endpoints_return_the_marginals(self, pair):
    a, b = pair
    # alpha = 0 splats u K v onto each source vertex: its row sums, which
    # the last half-iteration set to a (test_marginals).
    np.testing.assert_allclose(ot.displace(a, b, 0.0), a,
                               rtol=rounding_tol(_SPLAT, 16, 16, stages=4))
    # alpha = 1: the plan's column sums, by the splat against the kron and
    # products.
    plan = np.asarray(ot.sinkhorn_plan(a, b), np.float64)
    out = np.asarray(ot.displace(a, b, 1.0))
    np.testing.assert_allclose(out.ravel(), plan.sum(0),
                               rtol=rounding_tol(_SPLAT, stages=3))
    np.testing.assert_allclose(out, b, rtol=1e-3)

  def test_translated_blob_moves_half_way(self):
    src, dst = _blob(16, (4.0, 5.0)), _blob(16, (10.0, 9.0))
    mid = ot.displace(src, dst, 0.5)
    np.testing.assert_allclose(
        _centroid(mid), (_centroid(src) + _centroid(dst)) / 2, atol=1e-5)
    # Mass moves rather than cross-fades: the peak sits half-way, not at the
    # endpoints (a linear blend would keep two peaks at the endpoints).
    peak = np.unravel_index(np.argmax(mid), mid.shape)
    assert peak == (7, 7)

  def test_gradients_are_finite(self, pair):
    a, b = pair
    fn = lambda a, b, alpha: jnp.sum(ot.displace(a, b, alpha) ** 2)
    grads = jax.grad(fn, argnums=(0, 1, 2))(a, b, 0.5)
    for g in grads:
      assert np.all(np.isfinite(g))
    assert float(grads[2]) != 0.0

  def test_alpha_gradient_matches_finite_difference(self):
    src, dst = _blob(16, (4.0, 5.0)), _blob(16, (10.0, 9.0))
    weights = np.random.default_rng(0).random((16, 16)).astype(np.float32)
    fn = lambda alpha: jnp.sum(weights * ot.displace(src, dst, alpha))
    # Splatting is piecewise linear in alpha with kinks where a packet lands
    # on a vertex, at alpha = k / (j - i); 0.37 +- 1e-3 holds none for m = 16.
    alpha, h = 0.37, 1e-3
    kinks = [k / d for d in range(1, 16) for k in range(d + 1)]
    assert all(abs(alpha - kink) > h for kink in kinks)
    fd = (fn(alpha + h) - fn(alpha - h)) / (2 * h)
    assert float(jax.grad(fn)(alpha)) == pytest.approx(float(fd), rel=1e-2)

  @pytest.mark.parametrize('alpha', [0.25, 0.5])
  def test_alpha_gradient_on_a_kink_is_the_mean_slope(self, alpha):
    # At alpha = 0.5 (the default, and a learnt alpha's start) every packet
    # with j - i even sits on a vertex. The splat is linear on each side
    # within h (no other kink k / d, d < 8), so the differences are exact
    # slopes; the gradient is their mean, and each packet's weights, which
    # sum to 1 for every alpha, have a zero gradient.
    m, h = 8, 1 / 64
    weights = np.random.default_rng(0).random((m, m, m)).astype(np.float32)
    fn = lambda alpha: jnp.sum(weights * ot.splat_axis(m, alpha))
    idx = np.arange(m, dtype=np.float64)
    hat = lambda a: np.sum(weights * np.maximum(0.0, 1.0 - np.abs(
        idx[:, None, None] - ((1 - a) * idx[:, None] + a * idx[None]))))
    slopes = (hat(alpha + h) - hat(alpha - h)) / (2 * h)
    assert float(jax.grad(fn)(alpha)) == pytest.approx(float(slopes),
                                                       rel=1e-5)
    mass = jax.jacobian(lambda a: ot.splat_axis(m, a).sum(0))(alpha)
    np.testing.assert_array_equal(mass, 0.0)


def _images(seed, shape, count=2):
  """`count` float32 batches of `shape`, uniform in [0, 1)."""
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.random(shape), jnp.float32) for _ in range(count)]


class TestOTViews:

  @pytest.mark.parametrize('size', [32, 96])
  def test_jit_vmap_shapes(self, size):
    x, xs = _images(size, (2, 3, size, size, 3))
    fn = jax.jit(jax.vmap(ot.ot_views))
    out = fn(x, xs)
    assert out.shape == (2, 3, size, size, 3)
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    np.testing.assert_allclose(out[1], ot.ot_views(x[1], xs[1]), atol=1e-5)

  def test_alpha_endpoints_return_low_resolution_inputs(self):
    x, xs = _images(1, (2, 32, 32, 3))
    low = lambda img: ot.measure_to_image(*ot.image_to_measure(img, 16), 32,
                                          32)
    for alpha, end, atol in ((0.0, x, 1e-5), (1.0, xs, 1e-3)):
      np.testing.assert_allclose(ot.ot_views(x, xs, alpha=alpha), low(end),
                                 atol=atol)

  @pytest.mark.parametrize('alpha', [0.25, 0.5])
  def test_channel_means_interpolate_linearly(self, alpha):
    # At grid resolution (16 x 16 images, m = 16) resizing is the identity, so
    # conservation of mass and offset makes each channel mean move linearly.
    x, xs = (0.2 + 0.6 * t for t in _images(2, (2, 16, 16, 3)))
    out = ot.ot_views(x, xs, alpha=alpha, grid_size=16)
    expected = (1 - alpha) * x.mean(axis=(1, 2)) + alpha * xs.mean(axis=(1, 2))
    np.testing.assert_allclose(out.mean(axis=(1, 2)), expected, atol=1e-4)

  def test_gradients_are_finite(self):
    x, xs = _images(3, (2, 32, 32, 3))
    loss = lambda x, xs, alpha: jnp.sum(ot.ot_views(x, xs, alpha) ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, xs, 0.5)
    for g in grads:
      assert np.all(np.isfinite(g))
    assert float(jnp.abs(grads[0]).sum()) > 0
    assert float(grads[2]) != 0.0

  def test_image_sinkhorn_cost_averages_channels(self):
    x, y = _images(4, (2, 32, 32, 3))
    p, _, _ = ot.image_to_measure(x, 16)
    q, _, _ = ot.image_to_measure(y, 16)
    expected = np.mean(np.asarray(ot.sinkhorn_cost(p, q)), axis=-1)
    # Two programs: the measures, the cost and the mean over 3 channels.
    # The cost is linear in the measures with coefficients (eps log u)
    # inside its terms' scale, so both chains count relative to that scale.
    n = ot_chain(16, 20, (32, 32), 'cost')
    np.testing.assert_allclose(
        ot.image_sinkhorn_cost(x, y), expected, rtol=0,
        atol=rounding_tol(n, 3, stages=1) * ot_cost_scale(p, q, EPS, 20))


_X = jnp.zeros((2, 32, 32, 3)) + 0.5
_A = np.full((4, 4), 1 / 16, np.float32)
_VIEWS = jax.jit(ot.ot_views, static_argnames='grid_size')


class TestErrors:
  """Every public entry point rejects bad input with a clear message."""

  x = _X

  @pytest.mark.parametrize('kwargs, match', [
      ({'alpha': -0.1}, 'alpha'),
      ({'alpha': 1.5}, 'alpha'),
      ({'epsilon': 0.0}, 'epsilon'),
      ({'epsilon': -1.0}, 'epsilon'),
      ({'epsilon': 0.011}, r'epsilon must lie in \[0.01145, inf\]'),
      ({'num_iters': 0}, 'num_iters'),
      ({'num_iters': 2.5}, 'num_iters'),
      ({'grid_size': 1}, 'grid_size'),
      ({'grid_size': 33}, 'grid_size'),
  ])
  def test_bad_arguments(self, kwargs, match):
    with pytest.raises(ValueError, match=match):
      ot.ot_views(self.x, self.x, **kwargs)

  @pytest.mark.parametrize('call, match', [
      (lambda: ot.ot_views(_X[0], _X[0]), r'\[B, H, W, C\]'),
      (lambda: ot.ot_views(_X, _X[:1]), 'shape'),
      (lambda: ot.ot_views(_X.at[0, 1, 2, 0].set(np.nan), _X),
       'NaN or infinite'),
      (lambda: ot.ot_views(_X.at[0, 1, 2, 0].set(np.inf), _X),
       'NaN or infinite'),
      # Shapes are checked under jit too.
      (lambda: jax.jit(ot.ot_views)(_X, _X[:1]), 'shape'),
      (lambda: _VIEWS(_X, _X, grid_size=64), 'grid_size'),
      # A uint8 image had become an all-white reconstruction, NaN a NaN grid.
      (lambda: ot.image_to_measure(np.full((1, 8, 8, 3), 128, np.uint8), 4),
       'dtype uint8'),
      (lambda: ot.image_to_measure(_X.at[0, 1, 2, 0].set(jnp.nan), 4), 'NaN'),
      (lambda: ot.image_to_measure(255 * _X.at[0, 0, 0, 0].set(0.0), 4),
       r'pixels in \[0, 127.5\]'),
      (lambda: ot.image_to_measure([[0.5, 0.5]], 4), r'got shape \(1, 2\)'),
      # Read as 3 x 32 images of 32 channels, [B, C, H, W] data fails on
      # grid_size; the message must not only suggest a smaller grid_size.
      (lambda: ot.ot_views(*[jnp.transpose(_X, (0, 3, 1, 2))] * 2),
       r'\(3 x 32 as \[B, H, W, C\]\).*'
       r'transpose channels-first \[B, C, H, W\]'),
      (lambda: ot.displace(_A[:, :3], _A[:, :3], 0.5), 'square'),
      (lambda: ot.sinkhorn_cost(_A, np.full((5, 5), 1 / 25, np.float32)),
       'share'),
      (lambda: ot.sinkhorn_plan(_A[None], _A[None]), 'single'),
      (lambda: ot.displace(_A, _A, 2.0), 'alpha'),
      (lambda: ot.sinkhorn_cost(_A * np.nan, _A), 'NaN'),
      (lambda: ot.splat_axis(4, 1.5), 'alpha'),
      (lambda: ot.sinkhorn_cost(_A, _A, core='lse'), 'core must be one of'),
      (lambda: ot.ot_views(*[np.zeros((2, 8, 8, 0), np.float32)] * 2,
                           grid_size=4), 'at least one channel'),
      (lambda: ot.image_sinkhorn_cost(*[np.zeros((2, 8, 8, 0), np.float32)]
                                      * 2, grid_size=4),
       'at least one channel'),
  ])
  def test_bad_inputs(self, call, match):
    with pytest.raises(ValueError, match=match):
      call()

  def test_traced_values_propagate_nan(self):
    out = jax.jit(ot.ot_views)(self.x, self.x, 1.5)
    assert bool(jnp.all(jnp.isnan(out)))
    # A bad pixel poisons only its own image, so a batch stays debuggable.
    bad = self.x.at[0, 1, 2, 0].set(jnp.nan)
    out = jax.jit(ot.ot_views)(bad, self.x)
    assert bool(jnp.any(jnp.isnan(out[0])))
    assert bool(jnp.all(jnp.isfinite(out[1])))

  def test_closed_over_constants_are_checked_under_jit(self):
    x = np.full((2, 32, 32, 3), 0.5, np.float32)
    out = jax.jit(lambda: ot.ot_views(x, x, alpha=0.25))()
    assert out.shape == x.shape
    bad = x.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match='NaN or infinite'):
      jax.jit(lambda: ot.ot_views(bad, x))()
    with pytest.raises(ValueError, match='alpha'):
      jax.jit(lambda: ot.ot_views(x, x, alpha=2.0))()

  def test_epsilon_below_the_safe_minimum(self):
    # At 0.008 the plan's float32 kernel flushes entries that the scalings
    # (fitted to unflushed separable products) count on: it lost 13% of the
    # mass, silently; the composables took even a negative epsilon.
    a = _A
    u, v = ot.sinkhorn_scalings(a, a)
    for fn in (lambda e: ot.sinkhorn_plan(a, a, e),
               lambda e: ot.sinkhorn_cost(a, a, e),
               lambda e: ot.displace(a, a, 0.5, e),
               lambda e: ot.cost_from_scalings(u, v, e),
               lambda e: ot.displace_from_scalings(u, v, 0.5, e)):
      for epsilon in (0.008, -0.05):
        with pytest.raises(ValueError, match='epsilon must lie in'):
          fn(epsilon)
      assert bool(jnp.all(jnp.isnan(jax.jit(fn)(0.008))))

  def test_smallest_safe_epsilon_keeps_views_finite(self):
    # Worst case: all mass in opposite corners, so the plan needs the
    # smallest kernel entry exp(-1 / epsilon).
    x = np.zeros((1, 16, 16, 3), np.float32)
    y = np.zeros((1, 16, 16, 3), np.float32)
    x[:, :2, :2] = y[:, -2:, -2:] = 1.0
    assert ot_checks.MIN_EPSILON == pytest.approx(1 / 87.336, rel=1e-4)
    views = ot.ot_views(x, y, alpha=0.5, grid_size=16,
                        epsilon=ot_checks.MIN_EPSILON, num_iters=20)
    assert np.all(np.isfinite(views))


class TestCores:
  """The ott-jax solver core and the fused separable core agree."""

  @pytest.mark.parametrize('num_iters', ITERS)
  def test_cores_agree_on_views(self, num_iters):
    x, xs = _images(num_iters, (2, 16, 16, 3))
    views = {core: ot.ot_views(x, xs, 0.3, grid_size=8, num_iters=num_iters,
                               core=core) for core in ot.CORES}
    np.testing.assert_allclose(views['ott'], views['separable'], atol=1e-5)

  def test_cores_agree_on_gradients(self):
    x, xs, weights = _images(7, (2, 16, 16, 3), 3)

    def loss(xs, alpha, core):
      views = ot.ot_views(x, xs, alpha, grid_size=8, num_iters=20, core=core)
      cost = ot.image_sinkhorn_cost(x, xs, grid_size=8, core=core)
      return jnp.sum(weights * views) + jnp.sum(cost)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    grads = {core: grad(xs, 0.37, core) for core in ot.CORES}
    assert float(jnp.abs(grads['separable'][0]).max()) > 0
    np.testing.assert_allclose(grads['ott'][0], grads['separable'][0],
                               rtol=1e-3, atol=1e-5)
    assert float(grads['ott'][1]) == pytest.approx(
        float(grads['separable'][1]), rel=1e-3)

  def test_ott_core_gradient_matches_finite_difference(self):
    # Against finite differences, so the unrolled ott backward pass is checked
    # independently of the separable core.
    src, dst = _blob(8, (2.0, 2.5)), _blob(8, (5.0, 4.5))
    fn = jax.jit(lambda b: ot.sinkhorn_cost(src, b, num_iters=5, core='ott'))
    # Relative to dst, so dst +- h * direction stays a non-negative histogram.
    direction = dst * np.random.default_rng(0).standard_normal((8, 8))
    direction = (direction - dst * direction.sum()).astype(np.float32)
    h = 1e-3
    b64 = dst.astype(np.float64)
    fd = (float(fn((b64 + h * direction).astype(np.float32)))
          - float(fn((b64 - h * direction).astype(np.float32)))) / (2 * h)
    got = float(jnp.sum(jax.grad(fn)(dst) * direction))
    assert got == pytest.approx(fd, rel=2e-2, abs=1e-4)

  def test_kernel_comes_from_ott_grid(self):
    kx = ot.axis_kernel(6, EPS)
    # float32 against float64: the exponent, then exp.
    np.testing.assert_allclose(kx, np.exp(-ot.axis_cost(6) / EPS),
                               rtol=_KERNEL_RTOL + rounding_tol(funcs=1))
    geom = ot.grid_geometry(6, EPS)
    assert geom.shape == (36, 36)

  @pytest.mark.parametrize('grid_size', [2, 8, 16, 31])
  def test_kernel_has_the_ott_grid_kernels_bits(self, grid_size):
    # The views' kernel is computed without importing ott-jax; it must be
    # the Grid's to the bit, or every documented run would change.
    ott_kernel = lambda m, eps: ot.grid_geometry(m, eps).geometries[
        0].kernel_matrix
    for eps in (0.05, 0.013, 0.5, 2.0):
      np.testing.assert_array_equal(ot.axis_kernel(grid_size, eps),
                                    ott_kernel(grid_size, eps))
      jitted = [jax.jit(fn, static_argnums=0)(grid_size, jnp.float32(eps))
                for fn in (ot.axis_kernel, ott_kernel)]
      np.testing.assert_array_equal(*jitted)

  def test_views_do_not_import_ott(self):
    out = folder_trees.run_python("""
        import sys
        import numpy as np
        from otclr_jax import ot
        ot.ot_views(np.full((1, 8, 8, 3), 0.5, np.float32),
                    np.full((1, 8, 8, 3), 0.4, np.float32), grid_size=4)
        print(sorted(m for m in sys.modules if m.split('.')[0] == 'ott'))
        """, cwd=folder_trees.REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == '[]'

  def test_public_scalings_and_splat_compose_to_displace(self, pair):
    a, b = pair
    u, v = ot.sinkhorn_scalings(a, b, EPS, 5)
    # The same eager operations on the same arrays as displace and
    # sinkhorn_cost run inside: equal bit for bit.
    np.testing.assert_array_equal(ot.displace_from_scalings(u, v, 0.4, EPS),
                                  ot.displace(a, b, 0.4, EPS, 5))
    np.testing.assert_array_equal(ot.cost_from_scalings(u, v, EPS),
                                  ot.sinkhorn_cost(a, b, EPS, 5))

  def test_jit_with_static_core(self):
    x = jnp.full((1, 8, 8, 3), 0.5)
    fn = jax.jit(ot.ot_views,
                 static_argnames=('grid_size', 'num_iters', 'core'))
    out = fn(x, x, 0.5, grid_size=4, num_iters=3, core='ott')
    assert out.shape == x.shape


class TestInputRanges:
  """No garbage from wrong image ranges or histograms."""

  x = jnp.full((1, 8, 8, 3), 0.5)

  @pytest.mark.parametrize('dtype', [np.uint8, np.int32, bool])
  def test_integer_images_are_refused(self, dtype):
    bad = np.full((1, 8, 8, 3), 1, dtype)
    with pytest.raises(ValueError, match=r'astype\(jnp.float32\) / 255'):
      ot.ot_views(bad, self.x, grid_size=4)
    with pytest.raises(ValueError, match='dtype'):
      jax.jit(ot.ot_views, static_argnames='grid_size')(self.x, bad,
                                                        grid_size=4)

  @pytest.mark.parametrize('low, high', [(0.0, 255.0), (-1.0, 1.0),
                                         (0.0, 1.01)])
  def test_float_images_outside_unit_range_are_refused(self, low, high):
    bad = np.linspace(low, high, 8 * 8 * 3, dtype=np.float32).reshape(
        1, 8, 8, 3)
    with pytest.raises(ValueError, match=r'in \[0, 1\]'):
      ot.ot_views(bad, self.x, grid_size=4)
    with pytest.raises(ValueError, match='x_strong'):
      ot.ot_views(self.x, bad, grid_size=4)
    with pytest.raises(ValueError, match=r'in \[0, 1\]'):
      ot.image_sinkhorn_cost(bad, self.x, grid_size=4)

  def test_traced_out_of_range_image_is_nan_not_clipped(self):
    good = jnp.full((1, 8, 8, 3), 0.25)
    minus_one_to_one = 2.0 * good - 1.0
    out = jax.jit(ot.ot_views, static_argnames='grid_size')(
        jnp.concatenate([minus_one_to_one, good]),
        jnp.concatenate([good, good]), grid_size=4)
    assert bool(jnp.all(jnp.isnan(out[0])))
    np.testing.assert_allclose(out[1], good[0], atol=1e-4)

  def test_rounding_at_the_ends_is_allowed(self):
    x = jnp.full((1, 8, 8, 3), 1.0 + 1e-6).at[0, 0, 0, 0].set(-1e-6)
    assert bool(jnp.all(jnp.isfinite(ot.ot_views(x, x, grid_size=4))))

  def test_an_empty_batch_gives_an_empty_result(self):
    grids = np.zeros((0, 4, 4), np.float32)
    assert ot.sinkhorn_cost(grids, grids).shape == (0,)
    images = np.zeros((0, 8, 8, 3), np.float32)
    assert ot.ot_views(images, images, grid_size=4).shape == (0, 8, 8, 3)
    assert ot.image_sinkhorn_cost(images, images, grid_size=4).shape == (0,)

  def test_negative_masses_are_refused(self):
    a = _A
    bad = a.copy()
    bad[0, 0], bad[0, 1] = -0.05, 1 / 16 + 0.05
    for fn in (ot.sinkhorn_plan, ot.sinkhorn_cost, ot.sinkhorn_scalings):
      with pytest.raises(ValueError, match='negative masses'):
        fn(bad, a)
    with pytest.raises(ValueError, match='b has negative'):
      ot.displace(a, bad, 0.5)
    plan = jax.jit(ot.sinkhorn_plan)(bad, a)
    assert bool(jnp.all(jnp.isnan(plan)))

  def test_histograms_must_sum_to_one(self):
    # A plan between totals 3 and 1 had column sums 0.23 off b, displace(.., 1)
    # mass 3; an all-zero source under jit with one iteration cost 0.
    a = _A
    with pytest.raises(ValueError, match='total mass 0;'):
      ot.sinkhorn_plan(np.zeros_like(a), a)
    with pytest.raises(ValueError, match='total mass 0;'):
      ot.sinkhorn_cost(np.stack([a, 0 * a]), np.stack([a, a]))
    for fn in (ot.sinkhorn_plan, ot.sinkhorn_cost, ot.sinkhorn_scalings,
               lambda a, b: ot.displace(a, b, 1.0)):
      with pytest.raises(ValueError, match='total mass 3;'):
        fn(3 * a, a)
    jitted = jax.jit(ot.sinkhorn_cost, static_argnames='num_iters')
    for bad in (0 * a, 3 * a):
      assert bool(jnp.isnan(jitted(bad, a, num_iters=1)))
    assert bool(jnp.isfinite(jitted(a * (1 + 1e-4), a, num_iters=1)))
    # Rounding is not a wrong total: normalised in bfloat16, it is 2e-3 off.
    h = jnp.asarray(np.random.default_rng(0).random((16, 16)), jnp.bfloat16)
    assert bool(jnp.isfinite(ot.sinkhorn_cost(h / h.sum(), h / h.sum())))


class TestSeparableViewsLayout:
  """`ot_views`' separable path: resize matrices, chunks, vmap, gradients."""

  @pytest.mark.parametrize('in_size,out_size',
                           [(32, 16), (32, 8), (96, 16), (17, 5), (16, 16),
                            (16, 32), (16, 96), (5, 17)])
  def test_resize_matrix_equals_jax_image_resize(self, in_size, out_size):
    rng = np.random.default_rng(in_size * 100 + out_size)
    x = rng.random((2, in_size, 3)).astype(np.float32)
    expected = jax.image.resize(x, (2, out_size, 3), method='linear')
    mat = ot.resize_matrix(in_size, out_size)
    assert mat.shape == (out_size, in_size)
    # Two programs of one weighted mean of pixels in [0, 1]: each output sums
    # the 2 ceil(max(in / out, 1)) + 1 pixels its triangle covers (the rest
    # add exact zeros) on either side, with weights of 6 float32 stages.
    taps = 2 * math.ceil(max(in_size / out_size, 1)) + 1
    np.testing.assert_allclose(np.einsum('oi,bic->boc', mat, x), expected,
                               rtol=0, atol=rounding_tol(taps, taps, stages=6))

  def test_chunks_give_the_views_and_gradients_of_one_call(self):
    # 10 images in chunks of 4: two full chunks and one padded with copies.
    x, xs, weights = _images(11, (10, 16, 16, 3), 3)

    def loss(x, alpha, chunk):
      views = ot._separable_views(x, xs, alpha, 8, jnp.float32(0.05), 20,
                                  chunk)
      return jnp.sum(weights * views), views

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True),
                   static_argnums=2)
    (gx_one, ga_one), views_one = grad(x, 0.4, None)
    (gx_chunk, ga_chunk), views_chunk = grad(x, 0.4, 4)
    # Two programs (chunks of 4 against the batch) of one float32
    # computation; pixels are at most 1.
    np.testing.assert_allclose(
        views_chunk, views_one, rtol=0,
        atol=rounding_tol(ot_chain(8, 20, (16, 16), 'views')))
    np.testing.assert_allclose(
        views_one, ot.ot_views(x, xs, 0.4, grid_size=8, core='ott'),
        atol=1e-5)
    assert float(jnp.abs(gx_one).max()) > 0
    # Float32 rounding through 20 unrolled iterations: ~1e-5 relative.
    np.testing.assert_allclose(gx_chunk, gx_one, rtol=1e-4, atol=1e-5)
    assert float(ga_chunk) == pytest.approx(float(ga_one), rel=1e-4)

  def test_vmap_over_a_chunked_batch(self):
    x, xs = _images(12, (2, ot.CPU_CHUNK + 3, 8, 8, 3))
    views = jax.jit(jax.vmap(
        lambda a, b: ot._separable_views(a, b, 0.5, 4, 0.05, 5,
                                         ot.CPU_CHUNK)))(x, xs)
    for i in range(2):
      np.testing.assert_allclose(
          views[i], ot.ot_views(x[i], xs[i], grid_size=4, num_iters=5,
                                core='ott'), atol=1e-5)


class TestZeroMass:
  """A histogram with empty cells is valid input: no NaN value or gradient."""

  @staticmethod
  def _with_zeros(m=8):
    rng = np.random.default_rng(5)
    a = rng.random((m, m)).astype(np.float32)
    b = rng.random((m, m)).astype(np.float32)
    a[0, :3] = 0.0
    b[m - 1, 2] = 0.0
    return a / a.sum(), b / b.sum()

  @pytest.mark.parametrize('core', ot.CORES)
  def test_cost_matches_pot_with_zero_cells(self, core):
    a, b = self._with_zeros()
    m = a.shape[0]
    # POT's log-domain solver: its plain one stops at iteration 0 when both
    # histograms have empty cells ("numerical errors").
    plan = _pot_plan(a, b, method='sinkhorn_log')
    # 0 log 0 = 0: the entropy of an empty cell.
    entropy = np.where(plan > 0, plan * (np.log(np.where(plan > 0, plan, 1))
                                         - 1.0), 0.0)
    expected = (plan * ot.grid_cost(m)).sum() + EPS * entropy.sum()
    got = float(ot.sinkhorn_cost(a, b, core=core))
    assert got == pytest.approx(expected, rel=1e-4)

  def test_gradients_are_finite(self):
    a, b = self._with_zeros()
    value, grads = jax.value_and_grad(ot.sinkhorn_cost, argnums=(0, 1))(
        jnp.asarray(a), jnp.asarray(b))
    assert np.isfinite(float(value))
    for g in grads:
      assert np.isfinite(np.asarray(g)).all()


class TestUnclipped:

  @pytest.mark.parametrize('core', ot.CORES)
  def test_clipping_the_unclipped_views_gives_the_views(self, core):
    # More images than one CPU chunk: the chunks and their padding too.
    rng = np.random.default_rng(13)
    shape = (ot.CPU_CHUNK + 3, 8, 8, 3)
    # Black and white 2 x 2 blocks sent to themselves: the entropic plan's
    # midpoint overshoots 1 where white blocks meet.
    blocks = (rng.random((shape[0], 4, 4, 3)) < 0.5).astype(np.float32)
    x = jnp.asarray(np.repeat(np.repeat(blocks, 2, axis=1), 2, axis=2))
    views = jax.jit(ot.ot_views, static_argnames=('grid_size', 'core',
                                                  'clip'))
    clipped = views(x, x, 0.5, grid_size=8, core=core)
    raw = views(x, x, 0.5, grid_size=8, core=core, clip=False)
    assert float(raw.max()) > 1.1
    np.testing.assert_array_equal(jnp.clip(raw, 0.0, 1.0), clipped)
