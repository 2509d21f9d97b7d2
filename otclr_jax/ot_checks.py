"""Validation of otclr_jax.ot's inputs: static ints, scalars, grids, images.

Concrete bad arguments raise ValueError; traced ones become NaN (values cannot
raise under `jit`). Pure NumPy and JAX, so `otclr_jax.ot` needs nothing else.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

# Rounding allowed beyond [0, 1]; too small to pass 0-255 or [-1, 1] data.
IMAGE_RANGE_ATOL = 1e-4

CORES = ('separable', 'ott')


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_static_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(
        f'{name} must be a Python int (it fixes shapes or the loop length), '
        f'got {value!r}.')
  if value < minimum:
    raise ValueError(f'{name} must be >= {minimum}, got {value}.')
  return int(value)


def check_scalar_range(name: str, value, low: float, high: float = math.inf):
  """Raises for a concrete scalar outside `[low, high]`; NaN-poisons traced."""
  concrete = is_concrete(value)
  # NumPy, not jnp: inside a jit trace even ops on constants are staged.
  value = (np.asarray(value, np.float32) if concrete
           else jnp.asarray(value, jnp.float32))
  if value.ndim != 0:
    raise ValueError(f'{name} must be a scalar, got shape {value.shape}.')
  ok = (value >= low) & (value <= high)
  if not concrete:
    return jnp.where(ok, value, jnp.nan)
  if not ok:
    raise ValueError(
        f'{name} must lie in [{low:.5g}, {high:.5g}], got {float(value):g}.')
  return jnp.float32(value)


# Smallest safe epsilon: below, float32 exp(-C / epsilon) on the max-1 cost
# underflows (smallest normal 2^-126): plans lose mass, views turn NaN.
MIN_EPSILON = 1.0 / (126 * math.log(2))


def check_epsilon(epsilon):
  """The entropic regularisation: a scalar >= `MIN_EPSILON` (0.01145)."""
  return check_scalar_range('epsilon', epsilon, MIN_EPSILON)


def check_alpha(alpha):
  """The interpolation coefficient: a scalar in `[0, 1]`."""
  return check_scalar_range('alpha', alpha, 0.0, 1.0)


def check_grid_fits(grid_size: int, height: int, width: int) -> None:
  if grid_size > min(height, width):
    raise ValueError(
        f'grid_size {grid_size} is larger than the image ({height} x {width} '
        'as [B, H, W, C]); OT views downsample: pick grid_size <= image side, '
        'or transpose channels-first [B, C, H, W] images.')


def check_finite(name: str, x) -> None:
  if is_concrete(x) and not np.isfinite(np.asarray(x)).all():
    raise ValueError(
        f'{name} contains NaN or infinite values; OT views need finite '
        'pixels (see the module docstring for the behaviour under jit).')


def check_grid(name: str, x: jax.Array) -> int:
  shape = jnp.shape(x)
  if len(shape) < 2 or shape[-1] != shape[-2]:
    raise ValueError(
        f'{name} must be a square grid [..., m, m], got shape {shape}.')
  if shape[-1] < 2:
    raise ValueError(f'{name} grid size must be >= 2, got {shape[-1]}.')
  return shape[-1]


# How far a histogram's total may be from 1: above any rounding (grids
# normalised in bfloat16 included), below any unnormalised input.
HISTOGRAM_SUM_ATOL = 1e-2


def check_histogram(name: str, h) -> jax.Array:
  """Refuses negative masses and totals off 1; NaN-poisons traced ones.

  Args:
    name: argument name for the message.
    h: histograms `[..., m, m]` (already checked finite).

  Returns:
    `h` as float32.
  """
  if is_concrete(h):
    concrete = np.asarray(h, np.float64)
    if (concrete < 0).any():
      raise ValueError(
          f'{name} has negative masses (min {concrete.min():.3g}); a histogram '
          'must be non-negative (shift it by its minimum, as image_to_measure '
          'does).')
    totals = np.ravel(concrete.sum(axis=(-2, -1)))
    # An empty batch of grids has no total to check (its result is empty).
    worst = totals[np.argmax(np.abs(totals - 1.0))] if totals.size else 1.0
    if abs(worst - 1.0) > HISTOGRAM_SUM_ATOL:
      raise ValueError(f'{name} has a grid with total mass {worst:.6g}; a '
                       'histogram sums to 1 (divide it by its sum).')
    return jnp.asarray(h, jnp.float32)
  h = jnp.asarray(h, jnp.float32)
  ok = jnp.logical_and(
      jnp.all(h >= 0, axis=(-2, -1), keepdims=True),
      jnp.abs(jnp.sum(h, axis=(-2, -1), keepdims=True) - 1.0)
      <= HISTOGRAM_SUM_ATOL)
  return jnp.where(ok, h, jnp.nan)


def check_image_values(name: str, x) -> jax.Array:
  """Refuses integer dtypes and pixels outside `[0, 1]`; NaN-poisons traced.

  Integers are refused, not converted: a wrong divisor would look valid.

  Args:
    name: argument name for the message.
    x: images `[B, H, W, C]`.

  Returns:
    `x` as float32.
  """
  concrete = np.asarray(x) if is_concrete(x) else None
  dtype = x.dtype if concrete is None else concrete.dtype
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
        f'{name} has dtype {dtype}; OT views take float images in [0, 1]. '
        f'Convert explicitly, e.g. {name}.astype(jnp.float32) / 255 for uint8.')
  low, high = -IMAGE_RANGE_ATOL, 1.0 + IMAGE_RANGE_ATOL
  if concrete is not None:
    concrete = concrete.astype(np.float32, copy=False)
    if concrete.size and (concrete.min() < low or concrete.max() > high):
      raise ValueError(
          f'{name} has pixels in [{concrete.min():.4g}, {concrete.max():.4g}]; '
          'OT views take float images in [0, 1] (divide 0-255 data by 255, map '
          '[-1, 1] data with (x + 1) / 2).')
    return jnp.asarray(concrete)
  x = jnp.asarray(x, jnp.float32)
  ok = jnp.logical_and(jnp.min(x, axis=(-3, -2, -1), keepdims=True) >= low,
                       jnp.max(x, axis=(-3, -2, -1), keepdims=True) <= high)
  return jnp.where(ok, x, jnp.nan)


def check_core(core: str) -> str:
  if core not in CORES:
    raise ValueError(f'core must be one of {CORES} (ot.core in the config), '
                     f'got {core!r}.')
  return core


def check_image_pair(x, y, y_name: str, grid_size, epsilon, num_iters, core):
  """All checks of an image-pair function (`ot_views`, `image_sinkhorn_cost`).

  Returns:
    `(x, y, grid_size, epsilon, num_iters, core)`: float32 images
    `[B, H, W, C]` (NaN if traced and invalid), epsilon a float32 scalar.
  """
  check_finite('x', x)
  check_finite(y_name, y)
  x = check_image_values('x', x)
  y = check_image_values(y_name, y)
  if x.ndim != 4:
    raise ValueError(f'x must be images [B, H, W, C], got shape {x.shape}.')
  if x.shape[-1] == 0:
    raise ValueError(f'x must have at least one channel, got shape '
                     f'{x.shape}: each channel is one measure.')
  if y.shape != x.shape:
    raise ValueError(
        f'{y_name} must have the shape of x {x.shape}, got {y.shape}.')
  m = check_static_int('grid_size', grid_size, 2)
  num_iters = check_static_int('num_iters', num_iters, 1)
  epsilon = check_epsilon(epsilon)
  core = check_core(core)
  check_grid_fits(m, x.shape[1], x.shape[2])
  return x, y, m, epsilon, num_iters, core
