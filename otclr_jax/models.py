"""ResNet-18 encoder and projection head (Flax linen) for contrastive learning.

The encoder follows the torchvision ResNet-18 layout (the paper's setting),
without the final classifier:

* ``stem='imagenet'``: 7x7/2 convolution, BatchNorm, ReLU, 3x3/2 max-pool. The
  paper uses this stem even at 32 x 32 inputs (its 11.18M parameters and 0.074
  GFLOPs per image match it), so a 32 x 32 image reaches the last stage at
  1 x 1.
* ``stem='cifar'``: 3x3/1 convolution, BatchNorm, ReLU, no pooling (the usual
  CIFAR variant; offered for comparison, not used by the paper).

Then four stages of two ``BasicBlock``s with widths 64-128-256-512 (stride 2 at
the first block of stages 2-4, with a 1x1/2 convolution + BatchNorm shortcut),
and a global average pool giving features ``h`` of shape [B, 512].

Padding is explicit and symmetric, as in torchvision (``'SAME'`` would pad
stride-2 layers asymmetrically on even sizes). Convolutions have no bias
(BatchNorm follows) and use He-normal initialisation with fan-out, like
torchvision.

Convolutions run as XLA's ``lax.conv`` or as ``conv_matmul`` (one GEMM, of
shifted views or, on maps with fewer pixels than the kernel has live taps,
of the whole map), chosen by ``conv_impl``; ``'auto'`` takes the matmul on
CPU for small maps, where XLA:CPU's convolution is slow, and with it the
stem's max-pool as separable shifted maxima (``max_pool_separable``). The
parameters are the same under every choice.

BatchNorm uses momentum 0.9 and epsilon 1e-5 (torchvision's 0.1 update rate and
epsilon). Under ``jax.jit`` with the batch sharded over devices the arrays are
global, so the batch statistics are those of the global batch without any
``axis_name``.

Mixed precision: computations run in ``dtype`` (e.g. ``jnp.bfloat16``);
parameters are always float32 and BatchNorm reductions are done in float32; the
returned features and projections are float32.
"""

import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

STEMS = ('imagenet', 'cifar')
CONV_IMPLS = ('auto', 'xla', 'matmul')

# He-normal with fan-out, as torchvision initialises ResNet convolutions.
_conv_init = nn.initializers.variance_scaling(2.0, 'fan_out', 'normal')


def _live_taps(size: int, kernel: int, stride: int, pad: int,
               out: int) -> list[int]:
  """Kernel offsets along one axis whose window touches a real pixel.

  Offset ``i`` reads padded rows ``i, i + stride, ..., i + stride * (out - 1)``;
  an offset reading only padding contributes zero (its kernel gradient too),
  so the matmul skips it: a 3 x 3 convolution of a 1 x 1 map is one tap.
  """
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

  Same arguments and result as ``lax.conv_general_dilated`` with NHWC/HWIO
  dimension numbers and explicit padding (how ``nn.Conv`` calls it), without
  dilation or feature groups. Usually the live taps' shifted views are
  concatenated along channels, ``[B * Ho * Wo, taps * C_in]``, and multiplied
  by the matching rows of the kernel; XLA:CPU runs that as one large GEMM
  (forward and both gradients), which on small spatial maps is 5-20x faster
  than its convolution. When the input map has fewer pixels than there are
  live taps (a 3 x 3 convolution of a 2 x 2 map), the whole map is one row
  instead, ``[B, H * W * C_in] @ [H * W * C_in, Ho * Wo * C_out]``, with the
  kernel's taps placed in that block matrix: it multiplies only pixel-tap
  pairs that exist, 4 of the shifted form's 9 per output pixel there.

  Args:
    x: inputs [B, H, W, C_in].
    kernel: [kh, kw, C_in, C_out].
    window_strides: (sh, sw).
    padding: ((top, bottom), (left, right)), or ``'SAME'``/``'VALID'``.
    **kwargs: the rest of ``lax.conv_general_dilated``'s keywords; dilations
      must be 1, feature groups 1 and dimension numbers NHWC/HWIO/NHWC.

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


# Largest output map (Ho * Wo pixels) on which `auto` picks `conv_matmul` on
# CPU: every convolution of ResNet-18 with the imagenet stem at 32 x 32 (the
# stem's output is 16 x 16). Measured at batch 256 on a 2-core x86 CPU
# (`python -m otclr_jax.bench resnet --per_layer`): the matmul is 1.2-100x
# faster on outputs of 4 x 4 and smaller, as fast as XLA on 8 x 8 and 16 x 16
# alone and 5-10% faster inside the network (no layout changes between
# convolutions). Larger maps keep XLA's convolution, which is good there and
# needs no copy of the input per kernel tap.
CONV_MATMUL_MAX_OUT_PIXELS = 16 * 16


def matmul_is_faster(x_shape: Sequence[int], kernel_shape: Sequence[int],
                     strides: Sequence[int]) -> bool:
  """Whether ``conv_matmul`` beats XLA:CPU's convolution on this layer.

  Args:
    x_shape: [B, H, W, C_in].
    kernel_shape: [kh, kw, C_in, C_out].
    strides: (sh, sw).

  Returns:
    True when the output map, ``ceil(H / sh) * ceil(W / sw)`` pixels, has at
    most ``CONV_MATMUL_MAX_OUT_PIXELS``.
  """
  del kernel_shape
  out_h = -(-x_shape[1] // strides[0])
  out_w = -(-x_shape[2] // strides[1])
  return out_h * out_w <= CONV_MATMUL_MAX_OUT_PIXELS


def _check_conv_impl(impl: str) -> None:
  if impl not in CONV_IMPLS:
    raise ValueError(
        f'Unknown conv_impl {impl!r}; expected one of {CONV_IMPLS}.')


def conv_function(impl: str) -> Callable[..., jnp.ndarray]:
  """The convolution ``nn.Conv`` calls for ``model.conv_impl``.

  Args:
    impl: ``'xla'`` (``lax.conv_general_dilated``), ``'matmul'``
      (``conv_matmul``) or ``'auto'``: on CPU, per layer, whichever
      ``matmul_is_faster`` says; on GPU and TPU always XLA's (cuDNN).

  Returns:
    A function with ``lax.conv_general_dilated``'s signature. Every choice
    computes the same convolution with the same parameters, so checkpoints
    load under any of them.
  """
  _check_conv_impl(impl)
  if impl == 'xla':
    return lax.conv_general_dilated
  if impl == 'matmul':
    return conv_matmul

  def auto(x, kernel, window_strides, padding, **kwargs):
    if (jax.default_backend() == 'cpu'
        and matmul_is_faster(x.shape, kernel.shape, window_strides)):
      return conv_matmul(x, kernel, window_strides, padding, **kwargs)
    return lax.conv_general_dilated(x, kernel, window_strides, padding,
                                    **kwargs)

  return auto


def max_pool_separable(x: jnp.ndarray, window: Sequence[int],
                       strides: Sequence[int],
                       padding: Sequence[tuple[int, int]]) -> jnp.ndarray:
  """Max-pooling as a maximum over columns, then over rows, of strided views.

  Same result as ``nn.max_pool`` with these arguments (a maximum is exact,
  so bit for bit), and the same gradient to float32 rounding wherever the
  maximum of a window is unique: the gradient of each maximum goes to its
  largest input. Ties split it instead of giving it to the first one;
  a tie between equal patches sends the same gradient to the parameters
  either way.
  XLA:CPU differentiates ``nn.max_pool`` through a reduce-window over one
  index array per input dimension, [B, H + 2, W + 2, C] each; these
  shifted maxima cost a third of that forward and backward.

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
  """The max-pool for ``model.conv_impl``: separable on CPU, else XLA's.

  ``'xla'`` keeps ``nn.max_pool`` everywhere; ``'matmul'`` and ``'auto'`` on
  CPU take ``max_pool_separable``; ``'auto'`` elsewhere keeps
  ``nn.max_pool``.
  """
  _check_conv_impl(impl)

  def pool(x, window, strides, padding):
    if impl == 'matmul' or (impl == 'auto'
                            and jax.default_backend() == 'cpu'):
      return max_pool_separable(x, window, strides, padding)
    return nn.max_pool(x, window, strides=strides, padding=padding)

  return pool


def _check_images(x: jnp.ndarray) -> None:
  if x.ndim != 4:
    raise ValueError(
        f'Expected images of shape [B, H, W, C], got shape {x.shape}.')


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with a residual connection (ResNet-18/34 block).

  Attributes:
    features: number of output channels.
    strides: stride of the first convolution (and of the projection shortcut).
    zero_init_residual: initialise the scale of the block's last BatchNorm to
      zero so the block starts as the identity (Goyal et al., 2017).
    dtype: computation dtype.
    conv_impl: ``'auto'``, ``'xla'`` or ``'matmul'`` (``conv_function``).
  """
  features: int
  strides: int = 1
  zero_init_residual: bool = False
  dtype: Any = jnp.float32
  conv_impl: str = 'auto'

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    """Applies the block.

    Args:
      x: activations [B, H, W, C_in].
      train: use batch statistics and update the running averages.

    Returns:
      Activations [B, H / strides, W / strides, features].
    """
    conv = lambda f, k, s, p, name: nn.Conv(
        f, (k, k), strides=(s, s), padding=((p, p), (p, p)), use_bias=False,
        kernel_init=_conv_init, dtype=self.dtype, param_dtype=jnp.float32,
        conv_general_dilated=conv_function(self.conv_impl), name=name)
    norm = lambda name, scale_init=nn.initializers.ones: nn.BatchNorm(
        use_running_average=not train, momentum=0.9, epsilon=1e-5,
        scale_init=scale_init, dtype=self.dtype, param_dtype=jnp.float32,
        name=name)

    residual = x
    y = conv(self.features, 3, self.strides, 1, 'conv1')(x)
    y = nn.relu(norm('bn1')(y))
    y = conv(self.features, 3, 1, 1, 'conv2')(y)
    last_scale_init = (nn.initializers.zeros if self.zero_init_residual
                       else nn.initializers.ones)
    y = norm('bn2', last_scale_init)(y)
    if self.strides != 1 or x.shape[-1] != self.features:
      residual = conv(self.features, 1, self.strides, 0, 'shortcut_conv')(x)
      residual = norm('shortcut_bn')(residual)
    return nn.relu(y + residual)


class ResNet18(nn.Module):
  """ResNet-18 feature extractor (no classifier).

  Attributes:
    stem: ``'imagenet'`` (7x7/2 conv + 3x3/2 max-pool, the paper's setting) or
      ``'cifar'`` (3x3/1 conv, no pool).
    dtype: computation dtype; parameters stay float32.
    zero_init_residual: zero-initialise the last BatchNorm scale of every block.
      Off by default, as in torchvision (and presumably the paper).
    conv_impl: how convolutions run, ``'auto'``, ``'xla'`` or ``'matmul'``
      (``conv_function``); the parameters are the same under every choice.
  """
  stem: str = 'imagenet'
  dtype: Any = jnp.float32
  zero_init_residual: bool = False
  conv_impl: str = 'auto'

  def __post_init__(self):
    if self.stem not in STEMS:
      raise ValueError(f'Unknown stem {self.stem!r}; expected one of {STEMS}.')
    conv_function(self.conv_impl)  # raises on an unknown name
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    """Computes pooled features.

    Args:
      x: images [B, H, W, C] (float, any range the input pipeline chooses).
      train: use batch statistics and update the running averages
        (requires ``mutable=['batch_stats']``).

    Returns:
      Globally average-pooled features [B, 512], float32.
    """
    _check_images(x)
    x = x.astype(self.dtype)
    if self.stem == 'imagenet':
      kernel, stride, pad = 7, 2, 3
    else:
      kernel, stride, pad = 3, 1, 1
    x = nn.Conv(64, (kernel, kernel), strides=(stride, stride),
                padding=((pad, pad), (pad, pad)), use_bias=False,
                kernel_init=_conv_init, dtype=self.dtype,
                param_dtype=jnp.float32,
                conv_general_dilated=conv_function(self.conv_impl),
                name='stem_conv')(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                     dtype=self.dtype, param_dtype=jnp.float32,
                     name='stem_bn')(x)
    x = nn.relu(x)
    if self.stem == 'imagenet':
      x = max_pool_function(self.conv_impl)(x, (3, 3), (2, 2),
                                            ((1, 1), (1, 1)))

    for stage, features in enumerate((64, 128, 256, 512)):
      for block in range(2):
        strides = 2 if stage > 0 and block == 0 else 1
        x = BasicBlock(features, strides=strides,
                       zero_init_residual=self.zero_init_residual,
                       dtype=self.dtype, conv_impl=self.conv_impl,
                       name=f'stage{stage + 1}_block{block + 1}')(x, train)

    # Pool in float32: the mean over many low-precision activations loses bits.
    return jnp.mean(x.astype(jnp.float32), axis=(1, 2))


class ProjectionHead(nn.Module):
  """Two-layer MLP projection head g: Dense -> BatchNorm -> ReLU -> Dense.

  SimCLR v1 has no BatchNorm in the head; we follow the common SimCLR v2 /
  PyTorch practice of a BatchNorm after the hidden layer (the paper only says
  "2-layer"). The hidden Dense has no bias because BatchNorm follows it.

  Attributes:
    hidden_dim: width of the hidden layer.
    out_dim: dimension of the projection z.
    dtype: computation dtype; parameters stay float32.
  """
  hidden_dim: int = 512
  out_dim: int = 128
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, h: jnp.ndarray, train: bool) -> jnp.ndarray:
    """Projects features.

    Args:
      h: features [B, D].
      train: use batch statistics and update the running averages.

    Returns:
      Projections [B, out_dim], float32, not normalised.
    """
    if h.ndim != 2:
      raise ValueError(f'Expected features of shape [B, D], got {h.shape}.')
    y = nn.Dense(self.hidden_dim, use_bias=False, dtype=self.dtype,
                 param_dtype=jnp.float32, name='hidden')(h)
    y = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                     dtype=self.dtype, param_dtype=jnp.float32, name='bn')(y)
    y = nn.relu(y)
    y = nn.Dense(self.out_dim, dtype=self.dtype, param_dtype=jnp.float32,
                 name='out')(y)
    return y.astype(jnp.float32)


class SimCLRNet(nn.Module):
  """Encoder f (ResNet-18) followed by projection head g.

  Attributes:
    stem: ResNet stem, ``'imagenet'`` or ``'cifar'``.
    proj_hidden_dim: hidden width of the projection head.
    proj_dim: output dimension of the projection head.
    dtype: computation dtype; parameters stay float32.
    zero_init_residual: see ``ResNet18``.
    conv_impl: see ``ResNet18``.
  """
  stem: str = 'imagenet'
  proj_hidden_dim: int = 512
  proj_dim: int = 128
  dtype: Any = jnp.float32
  zero_init_residual: bool = False
  conv_impl: str = 'auto'

  def __post_init__(self):
    if self.stem not in STEMS:
      raise ValueError(f'Unknown stem {self.stem!r}; expected one of {STEMS}.')
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jnp.ndarray,
               train: bool) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Encodes and projects a batch of views.

    Args:
      x: images [B, H, W, C].
      train: use batch statistics and update the running averages.

    Returns:
      h: encoder features [B, 512], float32 (used by the linear probe).
      z: projections [B, proj_dim], float32, not normalised (the loss does it).
    """
    h = ResNet18(stem=self.stem, dtype=self.dtype,
                 zero_init_residual=self.zero_init_residual,
                 conv_impl=self.conv_impl, name='encoder')(x, train)
    z = ProjectionHead(hidden_dim=self.proj_hidden_dim, out_dim=self.proj_dim,
                       dtype=self.dtype, name='head')(h, train)
    return h, z
