"""Entropic optimal transport on image grids and the OTCLR displacement views.

Pure JAX: no Flax or TensorFlow import, so other projects can take this module
alone. Every public function is jittable, vmappable and differentiable in the
images and in `alpha`. docs/method.md sections 2-6 give the formulas.

Conventions:
  * A grid histogram is an `[m, m]` array of non-negative masses summing to 1.
    Grid point `(row, col)` sits at `r = (row, col) / (m - 1)` in `[0, 1]^2` and
    flattens row-major to index `row * m + col`.
  * The ground cost is `C_ij = ||r_i - r_j||^2 / 2`, the squared distance divided
    by its maximum over the grid (2 on the unit square), so `max C = 1`.
  * Sinkhorn runs exactly `num_iters` iterations from `u = v = 1`, each
    `v = b / K^T u` then `u = a / K v`: the same iterates as
    `ot.sinkhorn(a, b, C, reg=epsilon, numItermax=num_iters, stopThr=0)` in POT,
    not only at convergence.

Why a hand-written separable loop rather than ott-jax's solver: the kernel
`K = exp(-C / eps)` factorises as `kron(Kx, Kx)` because the cost is a sum of
per-axis costs, so `K v` is `Kx V Kx` for `V` the `[m, m]` reshape of `v`. This is
what ott-jax's `ott.geometry.grid.Grid` does too; the tests check that our
iterates equal ott-jax's `Sinkhorn` on a `Grid` for every `num_iters`. At
`m = 16`, however, the ott solver's per-iteration bookkeeping (convergence state,
error evaluation, generic `tensordot` + transpose per axis) makes it 2-3x slower
than two batched matmuls per half-iteration, and this loop runs on every training
step (`python -m otclr_jax.bench ot` prints both).

Values inside `jit`: shapes and static arguments are checked at trace time.
Values cannot raise under `jit` (`checkify.check` needs a `checkify` transform
around the caller), so they are checked eagerly when the arguments are concrete
and otherwise propagate as NaN: a NaN or infinite pixel makes that image's
channel NaN, and an `alpha` outside `[0, 1]` or a non-positive `epsilon` makes
the whole output NaN. Wrap the caller in `jax.experimental.checkify` with
`errors=checkify.float_checks` or set `jax_debug_nans` to locate the culprit.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

# [decision] docs/method.md sections 2 and 9: added after the min-shift so
# every cell is strictly positive; Sinkhorn then never divides by zero.
DELTA = 1e-3


# ----------------------------------------------------------------------------
# Input checks.


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_static_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(
        f'{name} must be a Python int (it fixes shapes or the loop length), '
        f'got {value!r}.')
  if value < minimum:
    raise ValueError(f'{name} must be >= {minimum}, got {value}.')
  return int(value)


def _check_scalar_range(name: str, value, low: float, high: float | None,
                        low_inclusive: bool):
  """Raises for a concrete out-of-range scalar; NaN-poisons a traced one."""
  if _is_concrete(value):
    # NumPy, not jnp: inside a jit trace even ops on constants are staged.
    concrete = np.asarray(value, np.float32)
    if concrete.ndim != 0:
      raise ValueError(f'{name} must be a scalar, got shape {concrete.shape}.')
    ok = concrete >= low if low_inclusive else concrete > low
    if high is not None:
      ok = ok and concrete <= high
    if not ok:
      bounds = (f"{'[' if low_inclusive else '('}{low}, "
                f"{high if high is not None else 'inf'}]")
      raise ValueError(f'{name} must lie in {bounds}, got {float(concrete)}.')
    return jnp.float32(concrete)
  value = jnp.asarray(value, jnp.float32)
  if value.ndim != 0:
    raise ValueError(f'{name} must be a scalar, got shape {value.shape}.')
  ok = value >= low if low_inclusive else value > low
  if high is not None:
    ok = jnp.logical_and(ok, value <= high)
  return jnp.where(ok, value, jnp.nan)


def _check_finite(name: str, x) -> None:
  if _is_concrete(x) and not np.isfinite(np.asarray(x)).all():
    raise ValueError(
        f'{name} contains NaN or infinite values; OT views need finite '
        'pixels (see the module docstring for the behaviour under jit).')


def _check_grid(name: str, x: jax.Array) -> int:
  if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
    raise ValueError(
        f'{name} must be a square grid [..., m, m], got shape {x.shape}.')
  if x.shape[-1] < 2:
    raise ValueError(f'{name} grid size must be >= 2, got {x.shape[-1]}.')
  return x.shape[-1]


def _check_images(x: jax.Array, y: jax.Array, y_name: str) -> None:
  if x.ndim != 4:
    raise ValueError(f'x must be images [B, H, W, C], got shape {x.shape}.')
  if y.shape != x.shape:
    raise ValueError(
        f'{y_name} must have the shape of x {x.shape}, got {y.shape}.')


# ----------------------------------------------------------------------------
# Grid, cost and kernel.


def grid_points(grid_size: int) -> np.ndarray:
  """Grid point coordinates in `[0, 1]^2`, row-major.

  Returns:
    `[m * m, 2]` float array of `(row, col) / (m - 1)`.
  """
  m = _check_static_int('grid_size', grid_size, 2)
  axis = np.arange(m) / (m - 1)
  rows, cols = np.meshgrid(axis, axis, indexing='ij')
  return np.stack([rows.ravel(), cols.ravel()], axis=-1)


def axis_cost(grid_size: int) -> np.ndarray:
  """Per-axis share of the normalised cost: `C = cx[ix, jx] + cx[iy, jy]`.

  Returns:
    `[m, m]` array `((i - j) / (m - 1))^2 / 2`.
  """
  m = _check_static_int('grid_size', grid_size, 2)
  idx = np.arange(m)
  return ((idx[:, None] - idx[None, :]) / (m - 1)) ** 2 / 2.0


def grid_cost(grid_size: int) -> np.ndarray:
  """Dense normalised ground cost `C_ij = ||r_i - r_j||^2 / max ||r_a - r_b||^2`.

  Returns:
    `[m * m, m * m]` array with maximum exactly 1.
  """
  r = grid_points(grid_size)
  sq = ((r[:, None, :] - r[None, :, :]) ** 2).sum(-1)
  return sq / sq.max()


def _axis_kernel(grid_size: int, epsilon) -> jax.Array:
  return jnp.exp(-jnp.asarray(axis_cost(grid_size), jnp.float32) / epsilon)


def _apply_kernel(kx: jax.Array, w: jax.Array) -> jax.Array:
  """`K w` for `K = kron(kx, kx)` and `w` reshaped `[..., m, m]` (kx symmetric)."""
  return jnp.matmul(jnp.matmul(kx, w), kx)


# ----------------------------------------------------------------------------
# Image <-> measure.


def image_to_measure(x: jax.Array, grid_size: int = 16):
  """Turns each channel of images into a probability histogram on a grid.

  docs/method.md section 2: antialiased bilinear resize to `m x m`, shift by the
  minimum, add `DELTA`, normalise.

  Args:
    x: images `[..., H, W, C]`.
    grid_size: `m`.

  Returns:
    `(p, mass, offset)`: `p` `[..., C, m, m]` sums to 1 over the grid, `mass`
    and `offset` `[..., C]` such that `p * mass + offset - DELTA` is the resized
    channel.
  """
  m = _check_static_int('grid_size', grid_size, 2)
  if x.ndim < 3:
    raise ValueError(f'x must be images [..., H, W, C], got shape {x.shape}.')
  if m > min(x.shape[-3], x.shape[-2]):
    raise ValueError(
        f'grid_size {m} is larger than the image ({x.shape[-3]} x '
        f'{x.shape[-2]}); OT views downsample, pick grid_size <= image side.')
  x = jnp.asarray(x, jnp.float32)
  small = jax.image.resize(
      x, x.shape[:-3] + (m, m, x.shape[-1]), method='linear', antialias=True)
  small = jnp.moveaxis(small, -1, -3)
  offset = jnp.min(small, axis=(-2, -1))
  shifted = small - offset[..., None, None] + DELTA
  mass = jnp.sum(shifted, axis=(-2, -1))
  return shifted / mass[..., None, None], mass, offset


def measure_to_image(p: jax.Array, mass: jax.Array, offset: jax.Array,
                     height: int, width: int) -> jax.Array:
  """Inverse of `image_to_measure`, then bilinear upsampling and clipping.

  Args:
    p: histograms `[..., C, m, m]`.
    mass: `[..., C]`.
    offset: `[..., C]`.
    height: output height `H`.
    width: output width `W`.

  Returns:
    Images `[..., H, W, C]` clipped to `[0, 1]`.
  """
  small = p * mass[..., None, None] + offset[..., None, None] - DELTA
  small = jnp.moveaxis(small, -3, -1)
  big = jax.image.resize(
      small, small.shape[:-3] + (height, width, small.shape[-1]),
      method='linear')
  return jnp.clip(big, 0.0, 1.0)


# ----------------------------------------------------------------------------
# Sinkhorn.


def _sinkhorn_scalings(a: jax.Array, b: jax.Array, kx: jax.Array,
                       num_iters: int):
  """Exactly `num_iters` POT-ordered Sinkhorn iterations on `[..., m, m]` grids."""

  def body(_, uv):
    u, _ = uv
    v = b / _apply_kernel(kx, u)
    return a / _apply_kernel(kx, v), v

  ones = jnp.ones(jnp.broadcast_shapes(a.shape, b.shape), jnp.float32)
  # fori_loop with static bounds lowers to a scan, so reverse-mode gradients
  # unroll through every iteration rather than assuming convergence.
  return jax.lax.fori_loop(0, num_iters, body, (ones, ones))


def _prepare(a, b, epsilon, num_iters):
  _check_finite('a', a)
  _check_finite('b', b)
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  m = _check_grid('a', a)
  if b.shape[-2:] != a.shape[-2:]:
    raise ValueError(
        f'a and b must share the grid shape, got {a.shape} and {b.shape}.')
  num_iters = _check_static_int('num_iters', num_iters, 1)
  epsilon = _check_scalar_range('epsilon', epsilon, 0.0, None,
                                low_inclusive=False)
  return a, b, m, epsilon, num_iters


def sinkhorn_plan(a, b, epsilon=0.05, num_iters: int = 20) -> jax.Array:
  """Dense entropic plan (docs/method.md section 3), for reference and tests.

  Args:
    a: source histogram `[m, m]` (sums to 1).
    b: target histogram `[m, m]` (sums to 1).
    epsilon: entropic regularisation on the max-1 cost.
    num_iters: exact number of Sinkhorn iterations `T`.

  Returns:
    Plan `[m * m, m * m]`, `P = diag(u) K diag(v)`, rows indexing `a` row-major.
    Its row sums equal `a`; its column sums approach `b` as `T` grows.
  """
  a, b, m, epsilon, num_iters = _prepare(a, b, epsilon, num_iters)
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(
        f'sinkhorn_plan takes single [m, m] grids (vmap for batches), got '
        f'{a.shape} and {b.shape}.')
  kx = _axis_kernel(m, epsilon)
  u, v = _sinkhorn_scalings(a, b, kx, num_iters)
  return u.reshape(-1, 1) * jnp.kron(kx, kx) * v.reshape(1, -1)


def _cost_from_scalings(u, v, kx, epsilon):
  """`<P, C> + eps sum P (log P - 1)` without building `P`.

  With `log P_ij = log u_i - C_ij / eps + log v_j` the cost collapses to
  `eps (<P 1, log u> + <P^T 1, log v> - sum P)`.
  """
  row = u * _apply_kernel(kx, v)
  col = v * _apply_kernel(kx, u)
  total = jnp.sum(row, axis=(-2, -1))
  return epsilon * (jnp.sum(row * jnp.log(u), axis=(-2, -1))
                    + jnp.sum(col * jnp.log(v), axis=(-2, -1)) - total)


def sinkhorn_cost(a, b, epsilon=0.05, num_iters: int = 20) -> jax.Array:
  """Entropic Sinkhorn cost `S_eps(a, b)` of docs/method.md section 6.

  `S = <P, C> + eps * sum P (log P - 1)` at the plan of `sinkhorn_plan`,
  evaluated in `O(m^3)` from the scalings.

  Args:
    a: source histogram `[..., m, m]`.
    b: target histogram `[..., m, m]`.
    epsilon: entropic regularisation.
    num_iters: exact number of Sinkhorn iterations.

  Returns:
    `[...]` costs (a scalar for single grids).
  """
  a, b, m, epsilon, num_iters = _prepare(a, b, epsilon, num_iters)
  kx = _axis_kernel(m, epsilon)
  u, v = _sinkhorn_scalings(a, b, kx, num_iters)
  return _cost_from_scalings(u, v, kx, epsilon)


# ----------------------------------------------------------------------------
# Displacement interpolation with bilinear splatting.


def _splat_axis(grid_size: int, alpha) -> jax.Array:
  """Per-axis bilinear weights `w[l, i, j]` of position `(1 - alpha) i + alpha j`.

  Positions are in grid units; the hat function `max(0, 1 - |l - g|)` equals
  the floor/fraction bilinear weights of docs/method.md section 4 for `g` in
  `[0, m - 1]` (including the last vertex) and is differentiable in `alpha`.
  """
  idx = jnp.arange(grid_size, dtype=jnp.float32)
  g = (1.0 - alpha) * idx[:, None] + alpha * idx[None, :]
  return jnp.maximum(0.0, 1.0 - jnp.abs(idx[:, None, None] - g[None]))


def _displace_from_scalings(u, v, kx, alpha):
  """Splatted displacement histogram without materialising the plan.

  `P[(ix,iy),(jx,jy)] = u[ix,iy] Kx[ix,jx] Kx[iy,jy] v[jx,jy]` and the splat
  weight factorises over the axes, so with `A[l,i,j] = Kx[i,j] w[l,i,j]`:
  `p[lx,ly] = sum u[ix,iy] v[jx,jy] A[lx,ix,jx] A[ly,iy,jy]`, three contractions
  of `O(m^4)` each.
  """
  amat = kx[None] * _splat_axis(kx.shape[0], alpha)
  z = jnp.einsum('lij,...jk->...lik', amat, v)
  y = jnp.einsum('...ab,...lac->...lbc', u, z)
  return jnp.einsum('...lbc,nbc->...ln', y, amat)


def displace(a, b, alpha, epsilon=0.05, num_iters: int = 20) -> jax.Array:
  """Displaced, bilinearly splatted histogram (docs/method.md section 4).

  Mass `P_ij` moving `r_i -> r_j` is deposited at `(1 - alpha) r_i + alpha r_j`.
  The fast path never builds the `[m^2, m^2]` plan.

  Args:
    a: source histogram `[..., m, m]` (sums to 1).
    b: target histogram `[..., m, m]` (sums to 1).
    alpha: interpolation coefficient in `[0, 1]` (scalar).
    epsilon: entropic regularisation.
    num_iters: exact number of Sinkhorn iterations.

  Returns:
    `[..., m, m]` histogram with total mass `sum(P)`; `alpha = 0` returns `a`
    (to rounding) and `alpha = 1` the plan's column marginal (close to `b`).
  """
  a, b, m, epsilon, num_iters = _prepare(a, b, epsilon, num_iters)
  alpha = _check_scalar_range('alpha', alpha, 0.0, 1.0, low_inclusive=True)
  kx = _axis_kernel(m, epsilon)
  u, v = _sinkhorn_scalings(a, b, kx, num_iters)
  return _displace_from_scalings(u, v, kx, alpha)


def dense_displace(plan: jax.Array, alpha) -> jax.Array:
  """Reference splat from a materialised plan: scatter every packet.

  Uses the floor/fraction form of docs/method.md section 4 with
  `jnp.ndarray.at`, independent of the factorised fast path.

  Args:
    plan: `[m * m, m * m]` transport plan.
    alpha: interpolation coefficient.

  Returns:
    `[m, m]` histogram.
  """
  n = plan.shape[0]
  m = math.isqrt(n)
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


# ----------------------------------------------------------------------------
# Images.


def _solve_images(x, y, y_name: str, grid_size, epsilon, num_iters):
  """Checks an image pair, puts its channels on the grid and runs Sinkhorn.

  Returns:
    `(measure_x, measure_y, kx, epsilon, u, v)`: the `image_to_measure`
    triples of both images, the axis kernel, the checked epsilon and the
    scalings `[B, C, m, m]` of the plans from `x` to `y`.
  """
  _check_finite('x', x)
  _check_finite(y_name, y)
  x = jnp.asarray(x, jnp.float32)
  y = jnp.asarray(y, jnp.float32)
  _check_images(x, y, y_name)
  m = _check_static_int('grid_size', grid_size, 2)
  num_iters = _check_static_int('num_iters', num_iters, 1)
  epsilon = _check_scalar_range('epsilon', epsilon, 0.0, None,
                                low_inclusive=False)
  measure_x = image_to_measure(x, m)
  measure_y = image_to_measure(y, m)
  kx = _axis_kernel(m, epsilon)
  u, v = _sinkhorn_scalings(measure_x[0], measure_y[0], kx, num_iters)
  return measure_x, measure_y, kx, epsilon, u, v


def ot_views(x, x_strong, alpha=0.5, grid_size: int = 16, epsilon=0.05,
             num_iters: int = 20) -> jax.Array:
  """The OTCLR view generator `D_{alpha, eps}` (docs/method.md sections 2-5).

  Per channel: measure on an `m x m` grid, Sinkhorn plan from `x` to
  `x_strong`, displacement splat at `alpha`; then [decision] mass and offset
  interpolated linearly like the measure, channels stacked, bilinear upsampling
  to the input size and clipping to `[0, 1]`.

  Args:
    x: source images `[B, H, W, C]` in `[0, 1]`.
    x_strong: strong augmentations of `x`, `[B, H, W, C]`.
    alpha: interpolation coefficient in `[0, 1]`, a scalar (may be traced, e.g.
      a learnt coefficient).
    grid_size: `m`, at least 2 and at most `min(H, W)`.
    epsilon: entropic regularisation on the max-1 cost, > 0.
    num_iters: exact number of Sinkhorn iterations, >= 1.

  Returns:
    Generated views `[B, H, W, C]` in `[0, 1]`.
  """
  alpha = _check_scalar_range('alpha', alpha, 0.0, 1.0, low_inclusive=True)
  (_, mass_src, off_src), (_, mass_str, off_str), kx, _, u, v = (
      _solve_images(x, x_strong, 'x_strong', grid_size, epsilon, num_iters))
  p_bar = _displace_from_scalings(u, v, kx, alpha)
  mass = (1.0 - alpha) * mass_src + alpha * mass_str
  offset = (1.0 - alpha) * off_src + alpha * off_str
  return measure_to_image(p_bar, mass, offset, x.shape[1], x.shape[2])


def image_sinkhorn_cost(x, y, grid_size: int = 16, epsilon=0.05,
                        num_iters: int = 20) -> jax.Array:
  """Per-image Sinkhorn cost between two image batches, averaged over channels.

  Args:
    x: images `[B, H, W, C]`.
    y: images `[B, H, W, C]`.
    grid_size: `m`.
    epsilon: entropic regularisation.
    num_iters: exact number of Sinkhorn iterations.

  Returns:
    `[B]` costs `mean_c S_eps(x_c, y_c)` (docs/method.md section 6 [decision]).
  """
  _, _, kx, epsilon, u, v = _solve_images(x, y, 'y', grid_size, epsilon,
                                          num_iters)
  return jnp.mean(_cost_from_scalings(u, v, kx, epsilon), axis=-1)
