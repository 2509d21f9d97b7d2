"""Entropic optimal transport on image grids and the OTCLR displacement views.

Pure JAX, reusable alone with otclr_jax/ot_checks.py; public functions are
jittable, vmappable and differentiable in the images and in `alpha`. Formulas:
docs/method.md sections 2-6.

Histograms are `[m, m]`, non-negative, summing to 1 (checked), on points
`(row, col) / (m - 1)` flattened row-major; the cost `||r_i - r_j||^2 / 2` has
max 1. Sinkhorn runs exactly `num_iters` iterations from `u = v = 1`, each
`v = b / K^T u` then `u = a / K v` (POT's iterates), `K = kron(Kx, Kx)`.
`core='ott'` uses ott-jax's solver (imported lazily: a slow import);
`'separable'`, the faster default (docs/method.md section 9), a fused loop.

Images are floats in `[0, 1]`; otherwise concrete inputs raise and traced ones
give NaN: a non-finite or out-of-range pixel (beyond
`ot_checks.IMAGE_RANGE_ATOL`) in its image, a negative mass or a total off 1
in its result, a bad `alpha` or `epsilon` (below `ot_checks.MIN_EPSILON`,
0.01145) everywhere.
`jax.experimental.checkify` locates the culprit.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from otclr_jax import ot_checks

if TYPE_CHECKING:
  from ott.geometry import grid as ott_grid

# [decision] docs/method.md sections 2, 9: keeps every cell > 0 for Sinkhorn.
DELTA = 1e-3

CORES = ot_checks.CORES
DEFAULT_CORE = 'separable'


def grid_points(grid_size: int) -> np.ndarray:
  """Grid point coordinates in `[0, 1]^2`, row-major.

  Returns:
    `[m * m, 2]` float array of `(row, col) / (m - 1)`.
  """
  m = ot_checks.check_static_int('grid_size', grid_size, 2)
  axis = np.arange(m) / (m - 1)
  rows, cols = np.meshgrid(axis, axis, indexing='ij')
  return np.stack([rows.ravel(), cols.ravel()], axis=-1)


def axis_cost(grid_size: int) -> np.ndarray:
  """Per-axis share of the normalised cost: `C = cx[ix, jx] + cx[iy, jy]`.

  Returns:
    `[m, m]` array `((i - j) / (m - 1))^2 / 2`.
  """
  m = ot_checks.check_static_int('grid_size', grid_size, 2)
  idx = np.arange(m)
  return ((idx[:, None] - idx[None, :]) / (m - 1)) ** 2 / 2.0


def grid_cost(grid_size: int) -> np.ndarray:
  """Dense ground cost `C_ij = ||r_i - r_j||^2 / max ||r_a - r_b||^2`.

  Returns:
    `[m * m, m * m]` array with maximum exactly 1.
  """
  r = grid_points(grid_size)
  sq = ((r[:, None, :] - r[None, :, :]) ** 2).sum(-1)
  return sq / sq.max()


def grid_geometry(grid_size: int, epsilon: ArrayLike) -> ott_grid.Grid:
  """ott-jax's separable `Grid` of this module's cost (max 1 on `[0, 1]^2`).

  Axes `linspace(0, 1, m) / sqrt(2)`, as `Grid` ignores `scale_cost`.

  Args:
    grid_size: `m`.
    epsilon: entropic regularisation, > 0.

  Returns:
    A 2-D `Grid` on `m x m` points.
  """
  # pylint: disable=g-import-not-at-top
  from ott.geometry import grid as ott_grid
  return ott_grid.Grid(x=[_grid_axis(grid_size)] * 2, epsilon=epsilon)


def _grid_axis(grid_size: int) -> jax.Array:
  """`grid_geometry`'s per-axis coordinates `linspace(0, 1, m) / sqrt(2)`."""
  m = ot_checks.check_static_int('grid_size', grid_size, 2)
  return jnp.linspace(0.0, 1.0, m, dtype=jnp.float32) / math.sqrt(2.0)


def axis_kernel(grid_size: int, epsilon: ArrayLike) -> jax.Array:
  """Per-axis Gibbs kernel `Kx = exp(-axis_cost / epsilon)` of `grid_geometry`.

  `K = kron(Kx, Kx)`; ott-jax's `PointCloud` float32 operations, same bits.

  Args:
    grid_size: `m`.
    epsilon: entropic regularisation, > 0.

  Returns:
    `[m, m]` symmetric float32 kernel.
  """
  x = _grid_axis(grid_size)
  norms = x * x
  cost = (norms[:, None] + norms[None, :]) + -2.0 * (x[:, None] * x[None, :])
  return jnp.exp(-cost / epsilon)


def _apply_kernel(kx: jax.Array, w: jax.Array) -> jax.Array:
  """`K w` for `K = kron(kx, kx)`, `w` `[..., m, m]`: `kx @ w @ kx`."""
  return jnp.matmul(jnp.matmul(kx, w), kx)


def resize_matrix(in_size: int, out_size: int) -> np.ndarray:
  """Per-axis weights of `jax.image.resize(..., method='linear')`.

  Antialiased triangle kernel, half-pixel centres; a matmul beats `resize`.

  Returns:
    `[out_size, in_size]` float32; `resize_matrix(n, n)` is the identity.
  """
  inv_scale = in_size / out_size
  sample = (np.arange(out_size) + 0.5) * inv_scale - 0.5
  dist = np.abs(sample[:, None] - np.arange(in_size)[None, :])
  weights = np.maximum(0.0, 1.0 - dist / max(inv_scale, 1.0))
  return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)


def image_to_measure(x: ArrayLike, grid_size: int = 16
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Turns each channel of images into a probability histogram on a grid.

  docs/method.md section 2: antialiased bilinear resize to `m x m`, shift by
  the minimum, add `DELTA`, normalise.

  Args:
    x: float images `[..., H, W, C]` in `[0, 1]` (checked as `ot_views`'s).
    grid_size: `m`.

  Returns:
    `(p, mass, offset)`: `p` `[..., C, m, m]` sums to 1 over the grid; the
    resized channel is `p * mass + offset - DELTA`, `mass, offset` `[..., C]`.
  """
  m = ot_checks.check_static_int('grid_size', grid_size, 2)
  if jnp.ndim(x) < 3:
    raise ValueError('x must be images [..., H, W, C], got shape '
                     f'{jnp.shape(x)}.')
  ot_checks.check_finite('x', x)
  x = ot_checks.check_image_values('x', x)
  ot_checks.check_grid_fits(m, x.shape[-3], x.shape[-2])
  small = jnp.einsum('rh,...hwc,sw->...crs', resize_matrix(x.shape[-3], m), x,
                     resize_matrix(x.shape[-2], m))
  return _normalise(small, (-2, -1))


def _normalise(small: jax.Array, grid_axes: tuple[int, int]):
  """`image_to_measure`'s shift and scale of grids along `grid_axes`."""
  offset = jnp.min(small, axis=grid_axes)
  shifted = small - jnp.expand_dims(offset, grid_axes) + DELTA
  mass = jnp.sum(shifted, axis=grid_axes)
  return shifted / jnp.expand_dims(mass, grid_axes), mass, offset


def measure_to_image(p: ArrayLike, mass: ArrayLike, offset: ArrayLike,
                     height: int, width: int, *, clip: bool = True
                     ) -> jax.Array:
  """Inverse of `image_to_measure`, then bilinear upsampling and clipping.

  Args:
    p: histograms `[..., C, m, m]`.
    mass: `[..., C]`.
    offset: `[..., C]`.
    height: output height `H`.
    width: output width `W`.
    clip: clip to `[0, 1]` (`ot_views`'s `clip`).

  Returns:
    Images `[..., H, W, C]`, clipped to `[0, 1]` if `clip`.
  """
  mass = jnp.asarray(mass, jnp.float32)
  offset = jnp.asarray(offset, jnp.float32)
  small = p * mass[..., None, None] + offset[..., None, None] - DELTA
  m_rows, m_cols = small.shape[-2:]
  image = jnp.einsum('hr,...crs,ws->...hwc', resize_matrix(m_rows, height),
                     small, resize_matrix(m_cols, width))
  return jnp.clip(image, 0.0, 1.0) if clip else image


def _separable_scalings(a: jax.Array, b: jax.Array, apply_kernel: Callable,
                        num_iters: int):
  """Exactly `num_iters` POT-ordered iterations of `K w = apply_kernel(w)`."""

  def body(_, uv):
    v = b / apply_kernel(uv[0])
    return a / apply_kernel(v), v

  ones = jnp.ones(jnp.broadcast_shapes(a.shape, b.shape), jnp.float32)
  # Static bounds lower to a scan: gradients unroll, assuming no convergence.
  return jax.lax.fori_loop(0, num_iters, body, (ones, ones))


def _ott_scalings(a: jax.Array, b: jax.Array, geom: ott_grid.Grid,
                  num_iters: int):
  """ott-jax's `Sinkhorn` on `geom`, exactly `num_iters` kernel-mode iterations.

  One block of exactly T iterations, unrolled: `inner < T` gives wrong
  gradients (docs/method.md section 3) and T iterations do not converge.
  """
  # pylint: disable=g-import-not-at-top
  from ott.problems.linear import linear_problem
  from ott.solvers.linear import sinkhorn as ott_sinkhorn
  solver = ott_sinkhorn.Sinkhorn(
      lse_mode=False, threshold=-1.0, min_iterations=num_iters,
      max_iterations=num_iters, inner_iterations=num_iters,
      implicit_diff=None)
  shape = jnp.broadcast_shapes(a.shape, b.shape)
  m = shape[-1]

  def one(a1, b1):
    out = solver(linear_problem.LinearProblem(geom, a1.ravel(), b1.ravel()))
    return (geom.scaling_from_potential(out.f).reshape(m, m),
            geom.scaling_from_potential(out.g).reshape(m, m))

  flat = lambda t: jnp.broadcast_to(t, shape).reshape(-1, m, m)
  u, v = jax.vmap(one)(flat(a), flat(b))
  return u.reshape(shape), v.reshape(shape)


def _scalings(a, b, m: int, epsilon, num_iters: int, core: str):
  """The chosen core's scalings and the per-axis kernel of the same `Grid`."""
  kx = axis_kernel(m, epsilon)
  if core == 'ott':
    return _ott_scalings(a, b, grid_geometry(m, epsilon), num_iters), kx
  return _separable_scalings(a, b, functools.partial(_apply_kernel, kx),
                             num_iters), kx


def sinkhorn_scalings(a: ArrayLike, b: ArrayLike, epsilon: ArrayLike = 0.05,
                      num_iters: int = 20, core: str = DEFAULT_CORE
                      ) -> tuple[jax.Array, jax.Array]:
  """Sinkhorn scalings `(u, v)` of the plan `P = diag(u) K diag(v)`.

  Iterates `v = b / K^T u`, `u = a / K v` from 1 (docs/method.md section 3).

  Args:
    a: source histograms `[..., m, m]`, non-negative, summing to 1.
    b: target histograms `[..., m, m]` (broadcast against `a`).
    epsilon: entropic regularisation on the max-1 cost, > 0.
    num_iters: exact number of Sinkhorn iterations `T`, >= 1.
    core: `'separable'` (fused loop) or `'ott'` (ott-jax's solver).

  Returns:
    `(u, v)`, each `[..., m, m]` (the broadcast shape of `a` and `b`).
  """
  m = ot_checks.check_grid('a', a)
  if jnp.shape(b)[-2:] != jnp.shape(a)[-2:]:
    raise ValueError(f'a and b must share the grid shape, got {jnp.shape(a)} '
                     f'and {jnp.shape(b)}.')
  ot_checks.check_finite('a', a)
  ot_checks.check_finite('b', b)
  a = ot_checks.check_histogram('a', a)
  b = ot_checks.check_histogram('b', b)
  num_iters = ot_checks.check_static_int('num_iters', num_iters, 1)
  epsilon = ot_checks.check_epsilon(epsilon)
  core = ot_checks.check_core(core)
  return _scalings(a, b, m, epsilon, num_iters, core)[0]


def sinkhorn_plan(a: ArrayLike, b: ArrayLike, epsilon: ArrayLike = 0.05,
                  num_iters: int = 20, core: str = DEFAULT_CORE) -> jax.Array:
  """Dense entropic transport plan (docs/method.md section 3), for tests.

  Args:
    a: source histogram `[m, m]` (non-negative, sums to 1).
    b: target histogram `[m, m]` (non-negative, sums to 1).
    epsilon: entropic regularisation on the max-1 cost.
    num_iters: exact number of Sinkhorn iterations `T`.
    core: `'separable'` or `'ott'` (module docstring).

  Returns:
    Plan `[m * m, m * m]`, `P = diag(u) K diag(v)`, rows indexing `a`
    row-major; row sums equal `a`, column sums approach `b` as `T` grows.

  Raises:
    ValueError: for a concrete histogram with a negative mass or total 0.
  """
  if jnp.ndim(a) > 2 or jnp.ndim(b) > 2:
    raise ValueError(
        f'sinkhorn_plan takes single [m, m] grids (vmap for batches), got '
        f'{jnp.shape(a)} and {jnp.shape(b)}.')
  u, v = sinkhorn_scalings(a, b, epsilon, num_iters, core)
  kx = axis_kernel(u.shape[-1], ot_checks.check_epsilon(epsilon))
  return u.reshape(-1, 1) * jnp.kron(kx, kx) * v.reshape(1, -1)


def cost_from_scalings(u: ArrayLike, v: ArrayLike,
                       epsilon: ArrayLike = 0.05) -> jax.Array:
  """`<P, C> + eps sum P (log P - 1)` of `P = diag(u) K diag(v)`, plan-free.

  With `log P_ij = log u_i - C_ij / eps + log v_j` the cost collapses to
  `eps (<P 1, log u> + <P^T 1, log v> - sum P)`, `O(m^3)`.

  Args:
    u: scalings `[..., m, m]` from `sinkhorn_scalings`.
    v: scalings `[..., m, m]`.
    epsilon: the epsilon they were computed with.

  Returns:
    `[...]` costs.
  """
  u = jnp.asarray(u, jnp.float32)
  v = jnp.asarray(v, jnp.float32)
  epsilon = ot_checks.check_epsilon(epsilon)
  kx = axis_kernel(ot_checks.check_grid('u', u), epsilon)
  row = u * _apply_kernel(kx, v)
  col = v * _apply_kernel(kx, u)
  total = jnp.sum(row, axis=(-2, -1))
  return epsilon * (jnp.sum(_xlog(row, u), axis=(-2, -1))
                    + jnp.sum(_xlog(col, v), axis=(-2, -1)) - total)


def _xlog(weight: jax.Array, scaling: jax.Array) -> jax.Array:
  """`weight * log(scaling)` with `0 log 0 = 0` and a finite gradient."""
  positive = scaling > 0
  safe = jnp.where(positive, scaling, 1.0)
  return jnp.where(positive, weight * jnp.log(safe), 0.0)


def sinkhorn_cost(a: ArrayLike, b: ArrayLike, epsilon: ArrayLike = 0.05,
                  num_iters: int = 20, core: str = DEFAULT_CORE) -> jax.Array:
  """Entropic Sinkhorn cost `S_eps(a, b)` of docs/method.md section 6.

  `S = <P, C> + eps * sum P (log P - 1)` at the plan of `sinkhorn_plan`.

  Args:
    a: source histogram `[..., m, m]`.
    b: target histogram `[..., m, m]`.
    epsilon: entropic regularisation.
    num_iters: exact number of Sinkhorn iterations.
    core: `'separable'` or `'ott'`.

  Returns:
    `[...]` costs (a scalar for single grids).
  """
  u, v = sinkhorn_scalings(a, b, epsilon, num_iters, core)
  return cost_from_scalings(u, v, epsilon)


def splat_axis(grid_size: int, alpha: ArrayLike) -> jax.Array:
  """Per-axis bilinear weights `w[l, i, j]` at `(1 - alpha) i + alpha j`.

  The hat `max(0, 1 - |l - g|)` (grid units) equals the bilinear weights of
  docs/method.md section 4 on `[0, m - 1]`. Its `alpha` gradient where a
  packet sits on a vertex (at `alpha = k / (j - i)`, e.g. 0.5) is the mean
  of the one-sided slopes, so the weights' sum keeps a zero gradient.

  Args:
    grid_size: `m`.
    alpha: interpolation coefficient in `[0, 1]` (scalar).

  Returns:
    `[m, m, m]` weights indexed `[target vertex l, source i, destination j]`.
  """
  alpha = ot_checks.check_alpha(alpha)
  idx = jnp.arange(grid_size, dtype=jnp.float32)
  g = (1.0 - alpha) * idx[:, None] + alpha * idx[None, :]
  d = idx[:, None, None] - g[None]
  # min(1 - d, 1 + d) is 1 - |d| whose ties split the gradient (abs: +1 at 0).
  return jnp.maximum(0.0, jnp.minimum(1.0 - d, 1.0 + d))


def _displace(u, v, kx, alpha):
  amat = kx[None] * splat_axis(kx.shape[0], alpha)
  z = jnp.einsum('lij,...jk->...lik', amat, v)
  y = jnp.einsum('...ab,...lac->...lbc', u, z)
  return jnp.einsum('...lbc,nbc->...ln', y, amat)


def displace_from_scalings(u: ArrayLike, v: ArrayLike, alpha: ArrayLike,
                           epsilon: ArrayLike = 0.05) -> jax.Array:
  """The factorised splat: displacement histogram without the plan.

  With `A[l,i,j] = Kx[i,j] w[l,i,j]` (`w = splat_axis`):
  `p[lx,ly] = sum u[ix,iy] v[jx,jy] A[lx,ix,jx] A[ly,iy,jy]`.

  Args:
    u: scalings `[..., m, m]` from `sinkhorn_scalings`.
    v: scalings `[..., m, m]`.
    alpha: interpolation coefficient in `[0, 1]` (scalar).
    epsilon: the epsilon the scalings were computed with.

  Returns:
    `[..., m, m]` splatted histogram (the `displace` of the same problem).
  """
  u = jnp.asarray(u, jnp.float32)
  v = jnp.asarray(v, jnp.float32)
  alpha = ot_checks.check_alpha(alpha)
  epsilon = ot_checks.check_epsilon(epsilon)
  kx = axis_kernel(ot_checks.check_grid('u', u), epsilon)
  return _displace(u, v, kx, alpha)


def displace(a: ArrayLike, b: ArrayLike, alpha: ArrayLike,
             epsilon: ArrayLike = 0.05, num_iters: int = 20,
             core: str = DEFAULT_CORE) -> jax.Array:
  """Displaced, bilinearly splatted histogram (docs/method.md section 4).

  Mass `P_ij` moving `r_i -> r_j` lands at `(1 - alpha) r_i + alpha r_j`.

  Args:
    a: source histogram `[..., m, m]` (sums to 1).
    b: target histogram `[..., m, m]` (sums to 1).
    alpha: interpolation coefficient in `[0, 1]` (scalar).
    epsilon: entropic regularisation.
    num_iters: exact number of Sinkhorn iterations.
    core: `'separable'` or `'ott'`.

  Returns:
    `[..., m, m]` histogram with total mass `sum(P)`; `alpha = 0` returns `a`
    (to rounding) and `alpha = 1` the plan's column marginal (close to `b`).
  """
  u, v = sinkhorn_scalings(a, b, epsilon, num_iters, core)
  return displace_from_scalings(u, v, alpha, epsilon)


def dense_displace(plan: ArrayLike, alpha: ArrayLike) -> jax.Array:
  """Reference splat from a dense plan (docs/method.md section 4), for tests.

  Args:
    plan: `[m * m, m * m]` transport plan.
    alpha: interpolation coefficient.

  Returns:
    `[m, m]` histogram.
  """
  plan = jnp.asarray(plan)
  m = math.isqrt(plan.shape[0])
  if plan.shape != (m * m, m * m):
    raise ValueError(f'plan must be [m*m, m*m], got {plan.shape}.')
  r = jnp.asarray(grid_points(m), jnp.float32)
  pos = (1.0 - alpha) * r[:, None, :] + alpha * r[None, :, :]
  g = pos * (m - 1)
  k = jnp.clip(jnp.floor(g), 0, m - 2)
  t = g - k
  k = k.astype(jnp.int32)
  out = jnp.zeros((m, m), plan.dtype)
  for dr, wr in ((0, 1.0 - t[..., 0]), (1, t[..., 0])):
    for dc, wc in ((0, 1.0 - t[..., 1]), (1, t[..., 1])):
      out = out.at[k[..., 0] + dr, k[..., 1] + dc].add(plan * wr * wc)
  return out


def _solve_images(x, y, y_name: str, grid_size, epsilon, num_iters, core):
  """Checked image pair -> `(measure_x, measure_y, kx, epsilon, u, v)`."""
  x, y, m, epsilon, num_iters, core = ot_checks.check_image_pair(
      x, y, y_name, grid_size, epsilon, num_iters, core)
  measure_x = image_to_measure(x, m)
  measure_y = image_to_measure(y, m)
  (u, v), kx = _scalings(measure_x[0], measure_y[0], m, epsilon, num_iters,
                         core)
  return measure_x, measure_y, kx, epsilon, u, v


# Separable views' images per `lax.map` step on CPU, to stay in cache.
CPU_CHUNK = 32


def _separable_views(x, x_strong, alpha, m: int, epsilon, num_iters: int,
                     chunk: int | None, clip: bool = True):
  """`ot_views` with the separable core, `chunk` images at a time.

  Takes checked arguments. Grids are laid out `[m, images * C, m]`, so every
  kernel product is one plain matmul, without transposes in the loop.
  """
  batch, height, width, channels = x.shape
  kx = axis_kernel(m, epsilon)
  # `_displace`'s A[l, i, j] as matrices of the first and last contraction.
  amat = kx[None] * splat_axis(m, alpha)
  a_left = amat.reshape(m * m, m)
  a_right = jnp.transpose(amat, (1, 2, 0)).reshape(m * m, m)
  down_h, down_w = resize_matrix(height, m), resize_matrix(width, m)
  up_h, up_w = resize_matrix(m, height), resize_matrix(m, width)

  def views(xs):
    images, images_strong = xs
    n = images.shape[0] * channels

    def measure(img):
      small = jnp.einsum('rh,bhwc,sw->rbcs', down_h, img, down_w)
      return _normalise(small.reshape(m, n, m), (0, 2))

    def apply(w):  # K w per problem: Kx W Kx on W [m, N, m]
      w = jnp.matmul(kx, w.reshape(m, n * m)).reshape(m * n, m)
      return jnp.matmul(w, kx).reshape(m, n, m)

    (a, mass_src, off_src), (b, mass_str, off_str) = (
        measure(images), measure(images_strong))

    u, v = _separable_scalings(a, b, apply, num_iters)
    # `_displace`'s contractions; the middle one is a per-problem batch matmul.
    z = jnp.matmul(a_left, v.reshape(m, n * m)).reshape(m, m, n, m)
    z = jnp.transpose(z, (2, 1, 0, 3)).reshape(n, m, m * m)
    y = jnp.matmul(jnp.transpose(u, (1, 2, 0)), z).reshape(n, m, m, m)
    y = jnp.transpose(y, (2, 0, 1, 3)).reshape(m * n, m * m)
    p_bar = jnp.matmul(y, a_right).reshape(m, n, m)
    mass = (1.0 - alpha) * mass_src + alpha * mass_str
    offset = (1.0 - alpha) * off_src + alpha * off_str
    small = (p_bar * mass[:, None] + offset[:, None] - DELTA).reshape(
        m, -1, channels, m)
    big = jnp.einsum('hr,rbcs,ws->bhwc', up_h, small, up_w)
    return jnp.clip(big, 0.0, 1.0) if clip else big

  if chunk is None or chunk >= batch:
    return views((x, x_strong))
  pad = -batch % chunk
  # Edge copies fill the last chunk; their views are dropped.
  x, x_strong = (jnp.pad(t, ((0, pad), (0, 0), (0, 0), (0, 0)), mode='edge')
                 for t in (x, x_strong))
  split = lambda t: t.reshape((-1, chunk) + t.shape[1:])
  out = jax.lax.map(views, (split(x), split(x_strong)))
  return out.reshape((-1,) + out.shape[2:])[:batch]


def ot_views(x: ArrayLike, x_strong: ArrayLike, alpha: ArrayLike = 0.5,
             grid_size: int = 16, epsilon: ArrayLike = 0.05,
             num_iters: int = 20, core: str = DEFAULT_CORE, *,
             clip: bool = True) -> jax.Array:
  """The OTCLR view generator `D_{alpha, eps}` (docs/method.md sections 2-5).

  Per channel: `m x m` measures, Sinkhorn plan from `x` to `x_strong`, splat at
  `alpha`, [decision] mass and offset interpolated linearly, then upsampling.
  Under `jax.jit`, `grid_size`, `num_iters` and `core` are static.

  Args:
    x: source images `[B, H, W, C]`, float in `[0, 1]`.
    x_strong: strong augmentations of `x`, `[B, H, W, C]`, same rules.
    alpha: interpolation coefficient in `[0, 1]`, a scalar (may be traced).
    grid_size: `m`, at least 2 and at most `min(H, W)`.
    epsilon: entropic regularisation on the max-1 cost, > 0.
    num_iters: exact number of Sinkhorn iterations, >= 1.
    core: `'separable'` or `'ott'`; same result to float32 rounding.
    clip: clip the views to `[0, 1]`; False returns them as upsampled,
      slightly outside where the transport overshoots, for a caller that
      adds to them first (a clip in between would cut what it restores).

  Returns:
    Generated views `[B, H, W, C]`, in `[0, 1]` if `clip`.
  """
  alpha = ot_checks.check_alpha(alpha)
  if core != 'separable':
    (_, mass_src, off_src), (_, mass_str, off_str), kx, _, u, v = (
        _solve_images(x, x_strong, 'x_strong', grid_size, epsilon, num_iters,
                      core))
    p_bar = _displace(u, v, kx, alpha)
    mass = (1.0 - alpha) * mass_src + alpha * mass_str
    offset = (1.0 - alpha) * off_src + alpha * off_str
    return measure_to_image(p_bar, mass, offset, *np.shape(x)[1:3],
                            clip=clip)
  x, x_strong, m, epsilon, num_iters, _ = ot_checks.check_image_pair(
      x, x_strong, 'x_strong', grid_size, epsilon, num_iters, core)
  chunk = CPU_CHUNK if jax.default_backend() == 'cpu' else None
  return _separable_views(x, x_strong, alpha, m, epsilon, num_iters, chunk,
                          clip)


def image_sinkhorn_cost(x: ArrayLike, y: ArrayLike, grid_size: int = 16,
                        epsilon: ArrayLike = 0.05, num_iters: int = 20,
                        core: str = DEFAULT_CORE) -> jax.Array:
  """Per-image Sinkhorn cost between two image batches, averaged over channels.

  Args:
    x: images `[B, H, W, C]`, float in `[0, 1]`.
    y: images `[B, H, W, C]`, float in `[0, 1]`.
    grid_size: `m`.
    epsilon: entropic regularisation.
    num_iters: exact number of Sinkhorn iterations.
    core: `'separable'` or `'ott'`.

  Returns:
    `[B]` costs `mean_c S_eps(x_c, y_c)` (docs/method.md sections 6 and 9).
  """
  _, _, _, epsilon, u, v = _solve_images(x, y, 'y', grid_size, epsilon,
                                         num_iters, core)
  return jnp.mean(cost_from_scalings(u, v, epsilon), axis=-1)
