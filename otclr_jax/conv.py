"""Convolution and max-pool kernels for CPU, where XLA's are slow on small maps.

``conv_function`` / ``max_pool_function`` pick them or XLA's by
``model.conv_impl``; the parameters are the same under every choice.
"""

import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CONV_IMPLS = ('auto', 'xla', 'matmul')


def _live_taps(size: int, kernel: int, stride: int, pad: int,
               out: int) -> list[int]:
  """Kernel offsets along one axis whose window touches a real pixel."""
  return [i for i in range(kernel)
          if any(pad <= i + stride * o < pad + size for o in range(out))]


def _tap_selection(size: tuple[int, int], kernel: tuple[int, int],
                   strides: tuple[int, int], pads: tuple[int, int],
                   out: tuple[int, int]) -> np.ndarray:
  """0/1 [H * W, Ho * Wo, kh * kw]: the tap joining input to output pixel."""
  (h, w), (kh, kw), (sh, sw), (pt, pl), (oh, ow) = (size, kernel, strides,
                                                    pads, out)
  sel = np.zeros((h, w, oh, ow, kh, kw), np.float32)
  for a in range(oh):
    for c in range(ow):
      for i in range(kh):
        for j in range(kw):
          r, q = a * sh + i - pt, c * sw + j - pl
          if 0 <= r < h and 0 <= q < w:
            sel[r, q, a, c, i, j] = 1.0
  return sel.reshape(h * w, oh * ow, kh * kw)


def conv_matmul(x: jnp.ndarray, kernel: jnp.ndarray,
                window_strides: Sequence[int],
                padding: Sequence[tuple[int, int]], **kwargs) -> jnp.ndarray:
  """A 2-D convolution as one matmul.

  Same result as ``lax.conv_general_dilated`` (NHWC/HWIO), from the live taps'
  shifted views or, on maps with fewer pixels than taps, the map as one row.

  Args:
    x: inputs [B, H, W, C_in].
    kernel: [kh, kw, C_in, C_out].
    window_strides: (sh, sw).
    padding: ((top, bottom), (left, right)), or ``'SAME'``/``'VALID'``.
    **kwargs: other ``lax.conv_general_dilated`` keywords (undilated, 1 group).

  Returns:
    Outputs [B, Ho, Wo, C_out].
  """
  _check_plain_conv(x.shape, kernel.shape, kwargs)
  kh, kw, cin, cout = kernel.shape
  batch, height, width, _ = x.shape
  if isinstance(padding, str):
    padding = lax.padtype_to_pads((height, width), (kh, kw), window_strides,
                                  padding)
  (sh, sw), ((pt, pb), (pl, pr)) = window_strides, padding
  out_h = (height + pt + pb - kh) // sh + 1
  out_w = (width + pl + pr - kw) // sw + 1
  rows = _live_taps(height, kh, sh, pt, out_h)
  cols = _live_taps(width, kw, sw, pl, out_w)
  precision = kwargs.get('precision')
  if height * width < len(rows) * len(cols):
    sel = _tap_selection((height, width), (kh, kw), (sh, sw), (pt, pl),
                         (out_h, out_w))
    # Each block is one tap or zero: the einsum only places the kernel.
    blocks = jnp.einsum('pqt,tio->piqo', sel.astype(kernel.dtype),
                        kernel.reshape(kh * kw, cin, cout),
                        precision=precision)
    y = jnp.dot(x.reshape(batch, height * width * cin),
                blocks.reshape(height * width * cin, out_h * out_w * cout),
                precision=precision)
    return y.reshape(batch, out_h, out_w, cout)
  xp = jnp.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
  shifts = [lax.slice(xp, (0, i, j, 0),
                      (batch, i + sh * (out_h - 1) + 1,
                       j + sw * (out_w - 1) + 1, cin), (1, sh, sw, 1))
            for i in rows for j in cols]
  patches = shifts[0] if len(shifts) == 1 else jnp.concatenate(shifts, -1)
  weights = kernel[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]
  weights = weights.reshape(len(rows) * len(cols) * cin, cout)
  y = jnp.dot(patches.reshape(-1, weights.shape[0]), weights,
              precision=precision)
  return y.reshape(batch, out_h, out_w, cout)


def _check_plain_conv(x_shape, kernel_shape, kwargs: dict[str, Any]) -> None:
  nhwc = ('NHWC', 'HWIO', 'NHWC')
  dims = lambda d: lax.conv_dimension_numbers(x_shape, kernel_shape, d)
  if (dims(kwargs.get('dimension_numbers')) != dims(nhwc)
      or kwargs.get('feature_group_count', 1) != 1
      or any(d != 1 for key in ('lhs_dilation', 'rhs_dilation')
             for d in (kwargs.get(key) or (1,)))):
    raise ValueError(f'conv_matmul computes only undilated, ungrouped '
                     f'convolutions with dimension_numbers={nhwc}, got '
                     f'{kwargs}.')


# Largest output map (Ho * Wo) on which `auto` picks `conv_matmul` on CPU:
# covers ResNet-18 at 32 x 32; larger maps keep XLA's convolution, which needs
# no copy of the input per tap.
CONV_MATMUL_MAX_OUT_PIXELS = 16 * 16


def matmul_is_faster(x_shape: Sequence[int], strides: Sequence[int]) -> bool:
  """Whether ``conv_matmul`` beats XLA:CPU's convolution on this layer.

  Args:
    x_shape: [B, H, W, C_in].
    strides: (sh, sw).

  Returns:
    True when the output has at most ``CONV_MATMUL_MAX_OUT_PIXELS`` pixels.
  """
  out_h = -(-x_shape[1] // strides[0])
  out_w = -(-x_shape[2] // strides[1])
  return out_h * out_w <= CONV_MATMUL_MAX_OUT_PIXELS


def check_conv_impl(impl: str) -> None:
  if impl not in CONV_IMPLS:
    raise ValueError(
        f'Unknown conv_impl {impl!r}; expected one of {CONV_IMPLS}.')


def conv_function(impl: str) -> Callable[..., jnp.ndarray]:
  """The convolution ``nn.Conv`` calls for ``model.conv_impl``.

  Args:
    impl: ``'xla'``, ``'matmul'`` (``conv_matmul``) or ``'auto'``: on CPU per
      layer by ``matmul_is_faster``, elsewhere XLA's.

  Returns:
    A function with ``lax.conv_general_dilated``'s signature.
  """
  check_conv_impl(impl)
  if impl == 'xla':
    return lax.conv_general_dilated
  if impl == 'matmul':
    return conv_matmul

  def auto(x, kernel, window_strides, padding, **kwargs):
    if (jax.default_backend() == 'cpu'
        and matmul_is_faster(x.shape, window_strides)):
      return conv_matmul(x, kernel, window_strides, padding, **kwargs)
    return lax.conv_general_dilated(x, kernel, window_strides, padding,
                                    **kwargs)

  return auto


def max_pool_separable(x: jnp.ndarray, window: Sequence[int],
                       strides: Sequence[int],
                       padding: Sequence[tuple[int, int]]) -> jnp.ndarray:
  """Max-pooling as a maximum over columns, then over rows, of strided views.

  Same result as ``nn.max_pool``; same gradient where maxima are unique.

  Args:
    x: inputs [B, H, W, C].
    window: (kh, kw).
    strides: (sh, sw).
    padding: ((top, bottom), (left, right)), padded with -inf.

  Returns:
    [B, Ho, Wo, C].
  """
  (kh, kw), (sh, sw), ((pt, pb), (pl, pr)) = window, strides, padding
  batch, height, width, channels = x.shape
  out_h = (height + pt + pb - kh) // sh + 1
  out_w = (width + pl + pr - kw) // sw + 1
  xp = jnp.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)),
               constant_values=-jnp.inf)
  cols = [lax.slice(xp, (0, 0, j, 0),
                    (batch, xp.shape[1], j + sw * (out_w - 1) + 1, channels),
                    (1, 1, sw, 1)) for j in range(kw)]
  y = functools.reduce(jnp.maximum, cols)
  rows = [lax.slice(y, (0, i, 0, 0),
                    (batch, i + sh * (out_h - 1) + 1, out_w, channels),
                    (1, sh, 1, 1)) for i in range(kh)]
  return functools.reduce(jnp.maximum, rows)


def max_pool_function(impl: str) -> Callable[..., jnp.ndarray]:
  """The max-pool for ``conv_impl``: separable for matmul or CPU auto."""
  check_conv_impl(impl)

  def pool(x, window, strides, padding):
    if impl == 'matmul' or (impl == 'auto'
                            and jax.default_backend() == 'cpu'):
      return max_pool_separable(x, window, strides, padding)
    return nn.max_pool(x, window, strides=strides, padding=padding)

  return pool
