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
from tests.helpers import measure_chain
from tests.helpers import ot_views_chain
from tests.helpers import rounding_tol
from tests.helpers import sinkhorn_chain
from tests.helpers import sinkhorn_cost_chain

EPS = 0.05


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


def _cost_scale(a, b, num_iters=20, epsilon=EPS):
  """The magnitudes `ot.cost_from_scalings` adds up, for its tolerance.

  eps (sum |row log u| + sum |col log v| + sum row), in float64 from the
  float32 scalings; the largest over a batch.
  """
  u, v = (np.asarray(t, np.float64)
          for t in ot.sinkhorn_scalings(a, b, epsilon, num_iters))
  kx = np.exp(-ot.axis_cost(u.shape[-1]) / epsilon)
  row = u * (kx @ v @ kx)
  col = v * (kx @ u @ kx)
  return epsilon * float(np.max(np.sum(
      np.abs(row * np.log(u)) + np.abs(col * np.log(v)) + row,
      axis=(-2, -1))))


def _plan_rtol(num_iters):
  """Relative error of a float32 plan entry u_i K_ij v_j, m = 16.

  The scalings' chain and the plan's kron and two products (3); the
  kernel's exponent takes 11 roundings (test_kernel_comes_from_ott_grid),
  each absolute at the cost's scale, amplified by up to 1 / eps in an entry.
  """
  return (rounding_tol(sinkhorn_chain(16, num_iters) + 3)
          + rounding_tol(11, k=1 / EPS))


# The scalings' |log u| and |log v| are at most L = 1 / eps +
# 2 |log(DELTA / m^2)| + log(m^2) for histograms of at least DELTA / m^2
# on a kernel in [exp(-1 / eps), 1] (here the histograms' floor is 1e-3 /
# (1.001 m^2), larger).
_LOG_SCALING = 1 / EPS + 2 * abs(math.log(ot.DELTA / 256)) + math.log(256)


# The splat of `ot.displace`: the factors Kx w (7: the hat weights' four
# operations on rounded positions, the product), then three contractions of
# m = 16 terms.
_SPLAT = 7 + 3 * 16


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
    # float64, entries <= 1: i / (m - 1) or (i - j) / (m - 1) (1-2), the
    # difference (1), the square (1), the sum (1), the division by the
    # maximum (1): n = 6 on either side.
    np.testing.assert_allclose(full.reshape(m * m, m * m), ot.grid_cost(m),
                               rtol=0, atol=rounding_tol(6, eps=EPS64))


class TestSinkhorn:

  @pytest.mark.parametrize('num_iters', [1, 5, 20])
  def test_plan_matches_pot(self, pair, num_iters):
    a, b = pair
    c = ot.grid_cost(16)
    expected = pot.sinkhorn(a.ravel().astype(np.float64),
                            b.ravel().astype(np.float64), c, reg=EPS,
                            numItermax=num_iters, stopThr=0)
    plan = np.asarray(ot.sinkhorn_plan(a, b, EPS, num_iters))
    assert plan.shape == (256, 256)
    # float32 against POT's float64 iterations.
    np.testing.assert_allclose(plan, expected, rtol=_plan_rtol(num_iters),
                               atol=0)

  @pytest.mark.parametrize('num_iters', [1, 5, 20])
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
    # Two float32 programs; ott-jax's potentials f = eps log u, g = eps log v
    # round log and product (13 each), absolutely at |log u|, |log v| <= L,
    # which exp((f + g - C) / eps) turns into a relative error.
    np.testing.assert_allclose(
        plan, expected,
        rtol=_plan_rtol(num_iters) + rounding_tol(2 * 13, k=_LOG_SCALING),
        atol=0)

  def test_marginals(self, pair):
    a, b = pair
    plan = np.asarray(ot.sinkhorn_plan(a, b), np.float64)
    # The last half-iteration sets u = a / (K v), and the plan's rows sum
    # u K v again: K v by two matmuls of m = 16 terms (32) and the division
    # (1), against the plan's kron and two products (3, summed in float64):
    # n = 36, all terms positive.
    np.testing.assert_allclose(plan.sum(1), a.ravel(), rtol=rounding_tol(36))
    np.testing.assert_allclose(plan.sum(0), b.ravel(), rtol=1e-3, atol=1e-7)

  def test_cost_matches_numpy_formula(self, pair):
    a, b = pair
    plan = pot.sinkhorn(a.ravel().astype(np.float64),
                        b.ravel().astype(np.float64), ot.grid_cost(16),
                        reg=EPS, numItermax=20, stopThr=0)
    expected = (plan * ot.grid_cost(16)).sum() + EPS * (
        plan * (np.log(plan) - 1.0)).sum()
    # float32 against POT's float64 iterations on the same histograms.
    assert float(ot.sinkhorn_cost(a, b)) == pytest.approx(
        expected, rel=0,
        abs=rounding_tol(sinkhorn_cost_chain(16, 20)) * _cost_scale(a, b))

  def test_cost_batched(self, pair):
    a, b = pair
    batch = ot.sinkhorn_cost(np.stack([a, b]), np.stack([b, a]))
    assert batch.shape == (2,)
    # Two programs (a batch of two against one problem) of one float32
    # computation.
    assert float(batch[0]) == pytest.approx(
        float(ot.sinkhorn_cost(a, b)), rel=0,
        abs=rounding_tol(sinkhorn_cost_chain(16, 20)) * _cost_scale(a, b))


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
    # float32 against float64: the plan's rounding (1), each packet's weight
    # (positions (1 - alpha) r_i + alpha r_j and their scaling by m - 1,
    # the fraction, the weights' product: 8) and product (1), and up to all
    # 16 x 16 x 4 packets scattered into one vertex. Positions are rounded
    # in grid units, up to m - 1 = 3, and a weight's error is absolute: k = 3.
    np.testing.assert_allclose(got, expected,
                               rtol=rounding_tol(1 + 8 + 1 + 1024, k=3))

  @pytest.mark.parametrize('alpha', [0.1, 0.5, 0.9])
  def test_mass_and_centroid_are_exact(self, pair, alpha):
    a, b = pair
    plan = np.asarray(ot.sinkhorn_plan(a, b), np.float64)
    out = np.asarray(ot.displace(a, b, alpha), np.float64)
    # The splat's hat weights of each packet sum to 1 and keep its centroid;
    # the same scalings make both sides, so the difference is the splat's
    # chain against the plan's kron and two products (3); all terms are
    # positive, and the float64 sums add nothing.
    rtol = rounding_tol(_SPLAT + 3)
    assert out.sum() == pytest.approx(plan.sum(), rel=rtol)
    r = ot.grid_points(16)
    expected = ((1 - alpha) * (plan.sum(1)[:, None] * r).sum(0)
                + alpha * (plan.sum(0)[:, None] * r).sum(0))
    np.testing.assert_allclose(_centroid(out), expected, rtol=rtol)

  def test_alpha_zero_returns_source(self, pair):
    a, b = pair
    # alpha = 0 splats u K v onto each source vertex: its row sums, which
    # the last half-iteration set to a (test_marginals, 36), by the splat's
    # chain: all terms positive.
    np.testing.assert_allclose(ot.displace(a, b, 0.0), a,
                               rtol=rounding_tol(36 + _SPLAT))

  def test_alpha_one_returns_column_marginal(self, pair):
    a, b = pair
    plan = np.asarray(ot.sinkhorn_plan(a, b), np.float64)
    out = np.asarray(ot.displace(a, b, 1.0))
    # The plan's column sums, by the splat's chain against the plan's kron
    # and two products (3).
    np.testing.assert_allclose(out.ravel(), plan.sum(0),
                               rtol=rounding_tol(_SPLAT + 3))
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


def _images(rng, shape):
  return jnp.asarray(rng.random(shape), jnp.float32)


class TestOTViews:

  @pytest.mark.parametrize('size', [32, 96])
  def test_jit_vmap_shapes(self, size):
    rng = np.random.default_rng(size)
    x, xs = _images(rng, (2, 3, size, size, 3)), _images(rng, (2, 3, size, size, 3))
    fn = jax.jit(jax.vmap(ot.ot_views))
    out = fn(x, xs)
    assert out.shape == (2, 3, size, size, 3)
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    np.testing.assert_allclose(out[1], ot.ot_views(x[1], xs[1]), atol=1e-5)

  def test_alpha_endpoints_return_low_resolution_inputs(self):
    rng = np.random.default_rng(1)
    x, xs = _images(rng, (2, 32, 32, 3)), _images(rng, (2, 32, 32, 3))
    low = lambda img: ot.measure_to_image(*ot.image_to_measure(img, 16), 32, 32)
    np.testing.assert_allclose(ot.ot_views(x, xs, alpha=0.0), low(x), atol=1e-5)
    np.testing.assert_allclose(ot.ot_views(x, xs, alpha=1.0), low(xs), atol=1e-3)

  @pytest.mark.parametrize('alpha', [0.25, 0.5])
  def test_channel_means_interpolate_linearly(self, alpha):
    # At grid resolution (16 x 16 images, m = 16) resizing is the identity, so
    # conservation of mass and offset makes each channel mean move linearly.
    rng = np.random.default_rng(2)
    x = 0.2 + 0.6 * _images(rng, (2, 16, 16, 3))
    xs = 0.2 + 0.6 * _images(rng, (2, 16, 16, 3))
    out = ot.ot_views(x, xs, alpha=alpha, grid_size=16)
    expected = (1 - alpha) * x.mean(axis=(1, 2)) + alpha * xs.mean(axis=(1, 2))
    np.testing.assert_allclose(out.mean(axis=(1, 2)), expected, atol=1e-4)

  def test_gradients_are_finite(self):
    rng = np.random.default_rng(3)
    x, xs = _images(rng, (2, 32, 32, 3)), _images(rng, (2, 32, 32, 3))
    loss = lambda x, xs, alpha: jnp.sum(ot.ot_views(x, xs, alpha) ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, xs, 0.5)
    for g in grads:
      assert np.all(np.isfinite(g))
    assert float(jnp.abs(grads[0]).sum()) > 0
    assert float(grads[2]) != 0.0

  def test_image_sinkhorn_cost_averages_channels(self):
    rng = np.random.default_rng(4)
    x, y = _images(rng, (2, 32, 32, 3)), _images(rng, (2, 32, 32, 3))
    p, _, _ = ot.image_to_measure(x, 16)
    q, _, _ = ot.image_to_measure(y, 16)
    expected = np.mean(np.asarray(ot.sinkhorn_cost(p, q)), axis=-1)
    # Two programs: the measures (32 x 32 images on a 16 x 16 grid), the
    # cost and the mean over 3 channels. The cost is linear in the measures
    # with coefficients (the potentials eps log u) inside the cost's terms'
    # scale, so both chains count relative to that scale.
    n = measure_chain(32, 32, 16) + sinkhorn_cost_chain(16, 20) + 3
    np.testing.assert_allclose(ot.image_sinkhorn_cost(x, y), expected, rtol=0,
                               atol=rounding_tol(n) * _cost_scale(p, q))


class TestErrors:
  """Every public entry point rejects bad input with a clear message."""

  x = jnp.zeros((2, 32, 32, 3)) + 0.5

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

  def test_wrong_rank(self):
    with pytest.raises(ValueError, match=r'\[B, H, W, C\]'):
      ot.ot_views(self.x[0], self.x[0])

  def test_image_to_measure_checks_its_images(self):
    # A uint8 image had become an all-white reconstruction, NaN a NaN grid.
    with pytest.raises(ValueError, match='dtype uint8'):
      ot.image_to_measure(np.full((1, 8, 8, 3), 128, np.uint8), 4)
    with pytest.raises(ValueError, match='NaN'):
      ot.image_to_measure(self.x.at[0, 1, 2, 0].set(jnp.nan), 4)
    with pytest.raises(ValueError, match=r'pixels in \[0, 127.5\]'):
      ot.image_to_measure(255 * self.x.at[0, 0, 0, 0].set(0.0), 4)
    with pytest.raises(ValueError, match=r'got shape \(1, 2\)'):
      ot.image_to_measure([[0.5, 0.5]], 4)  # a list: no .shape to name

  def test_channels_first_images_are_named(self):
    # Read as 3 x 32 images of 32 channels, [B, C, H, W] data fails on
    # grid_size; the message must not only suggest a smaller grid_size.
    x = jnp.transpose(self.x, (0, 3, 1, 2))
    with pytest.raises(ValueError, match=r'\(3 x 32 as \[B, H, W, C\]\).*'
                       r'transpose channels-first \[B, C, H, W\]'):
      ot.ot_views(x, x)

  def test_mismatched_shapes(self):
    with pytest.raises(ValueError, match='shape'):
      ot.ot_views(self.x, self.x[:1])

  @pytest.mark.parametrize('bad', [np.nan, np.inf])
  def test_non_finite_pixels(self, bad):
    with pytest.raises(ValueError, match='NaN or infinite'):
      ot.ot_views(self.x.at[0, 1, 2, 0].set(bad), self.x)

  def test_shape_errors_raise_under_jit(self):
    with pytest.raises(ValueError, match='shape'):
      jax.jit(ot.ot_views)(self.x, self.x[:1])
    with pytest.raises(ValueError, match='grid_size'):
      jax.jit(ot.ot_views, static_argnames='grid_size')(self.x, self.x,
                                                        grid_size=64)

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

  def test_grid_functions(self):
    a = np.full((4, 4), 1 / 16, np.float32)
    with pytest.raises(ValueError, match='square'):
      ot.displace(a[:, :3], a[:, :3], 0.5)
    with pytest.raises(ValueError, match='share'):
      ot.sinkhorn_cost(a, np.full((5, 5), 1 / 25, np.float32))
    with pytest.raises(ValueError, match='single'):
      ot.sinkhorn_plan(a[None], a[None])
    with pytest.raises(ValueError, match='alpha'):
      ot.displace(a, a, 2.0)
    with pytest.raises(ValueError, match='NaN'):
      ot.sinkhorn_cost(a * np.nan, a)
    with pytest.raises(ValueError, match='alpha'):
      ot.splat_axis(4, 1.5)

  def test_epsilon_below_the_safe_minimum(self):
    # At 0.008 the plan's float32 kernel flushes entries that the scalings
    # (fitted to unflushed separable products) count on: it lost 13% of the
    # mass, silently; the composables took even a negative epsilon.
    a = np.full((4, 4), 1 / 16, np.float32)
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
  """The ott-jax solver core and the fused separable core agree with POT."""

  @pytest.mark.parametrize('num_iters', [1, 5, 20])
  def test_ott_core_plan_matches_pot(self, pair, num_iters):
    a, b = pair
    expected = pot.sinkhorn(a.ravel().astype(np.float64),
                            b.ravel().astype(np.float64), ot.grid_cost(16),
                            reg=EPS, numItermax=num_iters, stopThr=0)
    plan = np.asarray(ot.sinkhorn_plan(a, b, EPS, num_iters, core='ott'))
    # ott-jax's scalings come from its potentials (exp(f / eps): 13 more
    # roundings each, absolute at |log u| <= L).
    np.testing.assert_allclose(
        plan, expected,
        rtol=_plan_rtol(num_iters) + rounding_tol(2 * 13, k=_LOG_SCALING),
        atol=0)

  @pytest.mark.parametrize('num_iters', [1, 5, 20])
  def test_cores_agree_on_views(self, num_iters):
    rng = np.random.default_rng(num_iters)
    x, xs = _images(rng, (2, 16, 16, 3)), _images(rng, (2, 16, 16, 3))
    views = {core: ot.ot_views(x, xs, 0.3, grid_size=8, num_iters=num_iters,
                               core=core) for core in ot.CORES}
    np.testing.assert_allclose(views['ott'], views['separable'], atol=1e-5)

  def test_cores_agree_on_gradients(self):
    rng = np.random.default_rng(7)
    x, xs = _images(rng, (2, 16, 16, 3)), _images(rng, (2, 16, 16, 3))
    weights = _images(rng, (2, 16, 16, 3))

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
    # float32 against float64. The exponent -cost / eps takes 11 roundings
    # (coordinates (2), / sqrt 2 and its constant (2), two squares and a
    # product (3), two sums (2), / eps and its constant (2)), each absolute
    # on terms of at most 1, so amplified by 1 / eps in exp's relative
    # error; exp itself 12.
    np.testing.assert_allclose(
        kx, np.exp(-ot.axis_cost(6) / EPS),
        rtol=rounding_tol(11, k=1 / EPS) + rounding_tol(12))
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

  def test_unknown_core(self, pair):
    with pytest.raises(ValueError, match="core must be one of"):
      ot.sinkhorn_cost(*pair, core='lse')


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

  def test_images_without_channels_are_refused(self):
    empty = np.zeros((2, 8, 8, 0), np.float32)
    for fn in (ot.ot_views, ot.image_sinkhorn_cost):
      with pytest.raises(ValueError, match='at least one channel'):
        fn(empty, empty, grid_size=4)

  def test_an_empty_batch_gives_an_empty_result(self):
    grids = np.zeros((0, 4, 4), np.float32)
    assert ot.sinkhorn_cost(grids, grids).shape == (0,)
    images = np.zeros((0, 8, 8, 3), np.float32)
    assert ot.ot_views(images, images, grid_size=4).shape == (0, 8, 8, 3)
    assert ot.image_sinkhorn_cost(images, images, grid_size=4).shape == (0,)

  def test_negative_masses_are_refused(self):
    a = np.full((4, 4), 1 / 16, np.float32)
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
    a = np.full((4, 4), 1 / 16, np.float32)
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
    # add exact zeros), on either side, and resize computes its weights in
    # float32 (offsets, scale, hat, normalising: 6).
    taps = 2 * math.ceil(max(in_size / out_size, 1)) + 1
    np.testing.assert_allclose(np.einsum('oi,bic->boc', mat, x), expected,
                               rtol=0, atol=rounding_tol(2 * taps + 6))

  def test_chunks_give_the_views_and_gradients_of_one_call(self):
    # 10 images in chunks of 4: two full chunks and one padded with copies.
    rng = np.random.default_rng(11)
    x, xs = _images(rng, (10, 16, 16, 3)), _images(rng, (10, 16, 16, 3))
    weights = _images(rng, (10, 16, 16, 3))

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
    np.testing.assert_allclose(views_chunk, views_one, rtol=0,
                               atol=rounding_tol(ot_views_chain(16, 16, 8, 20)))
    np.testing.assert_allclose(
        views_one, ot.ot_views(x, xs, 0.4, grid_size=8, core='ott'),
        atol=1e-5)
    assert float(jnp.abs(gx_one).max()) > 0
    # Float32 rounding through 20 unrolled iterations: ~1e-5 relative.
    np.testing.assert_allclose(gx_chunk, gx_one, rtol=1e-4, atol=1e-5)
    assert float(ga_chunk) == pytest.approx(float(ga_one), rel=1e-4)

  def test_vmap_over_a_chunked_batch(self):
    rng = np.random.default_rng(12)
    shape = (2, ot.CPU_CHUNK + 3, 8, 8, 3)
    x, xs = _images(rng, shape), _images(rng, shape)
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
    plan = pot.sinkhorn(a.ravel().astype(np.float64),
                        b.ravel().astype(np.float64), ot.grid_cost(m),
                        reg=EPS, numItermax=20, stopThr=0,
                        method='sinkhorn_log')
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
