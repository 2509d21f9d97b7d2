"""ResNet encoder and projection head (Flax linen) for contrastive learning.

torchvision's layout, symmetric padding and BatchNorm settings; computations
run in ``dtype``, parameters, BatchNorm reductions and outputs in float32.
``train=True`` uses batch statistics and updates the running averages.
"""

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from otclr_jax import conv as conv_lib

STEMS = ('imagenet', 'cifar')
# BasicBlocks per stage: ResNet-18's; (3, 4, 6, 3) is ResNet-34's.
RESNET18 = (2, 2, 2, 2)


def _conv(features: int, kernel: int, stride: int, dtype: Any, conv_impl: str,
          name: str) -> nn.Conv:
  """A bias-free k x k convolution padded by k // 2 on every side."""
  pad = kernel // 2
  return nn.Conv(
      features, (kernel, kernel), strides=(stride, stride),
      padding=((pad, pad), (pad, pad)), use_bias=False,
      # He-normal with fan-out, as torchvision initialises ResNet convolutions.
      kernel_init=nn.initializers.variance_scaling(2.0, 'fan_out', 'normal'),
      dtype=dtype, param_dtype=jnp.float32,
      conv_general_dilated=conv_lib.conv_function(conv_impl), name=name)


def batch_norm(train: bool, dtype: Any, name: str,
               scale_init=nn.initializers.ones) -> nn.BatchNorm:
  """torchvision's BatchNorm (momentum 0.1, eps 1e-5), parameters float32."""
  return nn.BatchNorm(use_running_average=not train, momentum=0.9,
                      epsilon=1e-5, scale_init=scale_init, dtype=dtype,
                      param_dtype=jnp.float32, name=name)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with a residual connection (ResNet-18/34 block).

  Attributes:
    features: number of output channels.
    strides: stride of the first convolution (and of the projection shortcut).
    zero_init_residual: zero the last BatchNorm scale (Goyal et al., 2017).
    dtype: computation dtype.
    conv_impl: ``'auto'``, ``'xla'`` or ``'matmul'`` (``conv.conv_function``).
  """
  features: int
  strides: int = 1
  zero_init_residual: bool = False
  dtype: Any = jnp.float32
  conv_impl: str = 'auto'

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    """[B, H, W, C_in] -> [B, H / strides, W / strides, features]."""
    conv = lambda k, s, name: _conv(self.features, k, s, self.dtype,
                                    self.conv_impl, name)
    norm = functools.partial(batch_norm, train, self.dtype)
    residual = x
    y = nn.relu(norm('bn1')(conv(3, self.strides, 'conv1')(x)))
    y = conv(3, 1, 'conv2')(y)
    y = norm('bn2', nn.initializers.zeros if self.zero_init_residual
             else nn.initializers.ones)(y)
    if self.strides != 1 or x.shape[-1] != self.features:
      residual = norm('shortcut_bn')(
          conv(1, self.strides, 'shortcut_conv')(x))
    return nn.relu(y + residual)


class ResNet(nn.Module):
  """ResNet feature extractor of BasicBlocks (no classifier).

  Attributes:
    stage_sizes: blocks in each of the 4 stages (widths 64 to 512).
    stem: ``'imagenet'`` (7x7/2 conv + max-pool, the paper's, even at 32 x 32)
      or ``'cifar'`` (3x3/1 conv, no pool).
    dtype: computation dtype; parameters stay float32.
    zero_init_residual: zero each block's last BatchNorm scale (default off).
    conv_impl: ``'auto'``, ``'xla'`` or ``'matmul'`` (``conv.conv_function``).
  """
  stage_sizes: tuple[int, ...] = RESNET18
  stem: str = 'imagenet'
  dtype: Any = jnp.float32
  zero_init_residual: bool = False
  conv_impl: str = 'auto'

  def __post_init__(self):
    if self.stem not in STEMS:
      raise ValueError(f'Unknown stem {self.stem!r}; expected one of {STEMS}.')
    if len(self.stage_sizes) != 4 or min(self.stage_sizes) < 1:
      raise ValueError(f'stage_sizes must be 4 block counts >= 1, got '
                       f'{self.stage_sizes!r}.')
    conv_lib.conv_function(self.conv_impl)  # raises on an unknown name
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    """Images [B, H, W, C] (any range) -> pooled features [B, 512] float32."""
    if x.ndim != 4:
      raise ValueError(
          f'Expected images of shape [B, H, W, C], got shape {x.shape}.')
    kernel, stride = (7, 2) if self.stem == 'imagenet' else (3, 1)
    x = _conv(64, kernel, stride, self.dtype, self.conv_impl, 'stem_conv')(
        x.astype(self.dtype))
    x = nn.relu(batch_norm(train, self.dtype, 'stem_bn')(x))
    if self.stem == 'imagenet':
      x = conv_lib.max_pool_function(self.conv_impl)(x, (3, 3), (2, 2),
                                            ((1, 1), (1, 1)))

    for stage, features in enumerate((64, 128, 256, 512)):
      for block in range(self.stage_sizes[stage]):
        strides = 2 if stage > 0 and block == 0 else 1
        x = BasicBlock(features, strides=strides,
                       zero_init_residual=self.zero_init_residual,
                       dtype=self.dtype, conv_impl=self.conv_impl,
                       name=f'stage{stage + 1}_block{block + 1}')(x, train)

    # Pool in float32: the mean over many low-precision activations loses bits.
    return jnp.mean(x.astype(jnp.float32), axis=(1, 2))


class ProjectionHead(nn.Module):
  """Projection head g: Dense -> BatchNorm (SimCLR v2's) -> ReLU -> Dense.

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
    """Features [B, D] -> projections [B, out_dim], float32, not normalised."""
    if h.ndim != 2:
      raise ValueError(f'Expected features of shape [B, D], got {h.shape}.')
    y = nn.Dense(self.hidden_dim, use_bias=False, dtype=self.dtype,
                 param_dtype=jnp.float32, name='hidden')(h)
    y = nn.relu(batch_norm(train, self.dtype, 'bn')(y))
    y = nn.Dense(self.out_dim, dtype=self.dtype, param_dtype=jnp.float32,
                 name='out')(y)
    return y.astype(jnp.float32)


class SimCLRNet(nn.Module):
  """Encoder f followed by projection head g.

  Attributes:
    encoder: the ``ResNet`` f; the head computes in its ``dtype`` too.
    proj_hidden_dim: hidden width of the projection head.
    proj_dim: output dimension of the projection head.
  """
  encoder: ResNet = ResNet()
  proj_hidden_dim: int = 512
  proj_dim: int = 128

  @nn.compact
  def __call__(self, x: jnp.ndarray,
               train: bool) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Images [B, H, W, C] -> features h [B, 512], projections z [B, proj_dim].

    Both float32; z is not normalised.
    """
    h = self.encoder(x, train)
    z = ProjectionHead(hidden_dim=self.proj_hidden_dim, out_dim=self.proj_dim,
                       dtype=self.encoder.dtype, name='head')(h, train)
    return h, z
