"""SimCLR strong augmentations on the accelerator (docs/method.md section 1).

Static shapes; every operation always runs (a `lax.cond` is a select under
`vmap`), with identity parameters when not drawn, so skipped steps are exact.
Unlike torchvision, the crop box is continuous (exact area and aspect ranges)
and resampling near its border reads pixels outside it. The box never exceeds
the image, so resampling needs no antialiasing.
"""

import dataclasses
import functools
import math
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

Array = jax.Array
PRNGKey = Any

# Jitter operation ids, in torchvision's fixed order.
BRIGHTNESS, CONTRAST, SATURATION, HUE = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class AugmentParams:
  """SimCLR augmentation probabilities, strengths (docs/method.md section 1).

  Attributes:
    crop_scale: (min, max) fraction of the image area covered by the crop box.
    crop_ratio: (min, max) width / height of the box, sampled log-uniformly.
    crop_attempts: draws before falling back to a centre crop.
    flip_prob: probability of a horizontal flip.
    jitter_prob: probability of applying colour jitter.
    brightness: brightness factor drawn from [max(0, 1 - b), 1 + b].
    contrast: contrast factor drawn from [max(0, 1 - c), 1 + c].
    saturation: saturation factor drawn from [max(0, 1 - s), 1 + s].
    hue: hue shift drawn from [-hue, hue] (fraction of a turn, at most 0.5).
    jitter_random_order: random jitter order per example (torchvision), else
      brightness, contrast, saturation, hue.
    grayscale_prob: probability of converting to 3-channel grayscale.
    blur_prob: probability of a Gaussian blur.
    blur_sigma: (min, max) of the blur standard deviation, in pixels.
    blur_kernel_fraction: kernel size / shorter side, floored and made odd.
  """
  crop_scale: Tuple[float, float] = (0.08, 1.0)
  crop_ratio: Tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
  crop_attempts: int = 10
  flip_prob: float = 0.5
  jitter_prob: float = 0.8
  brightness: float = 0.4
  contrast: float = 0.4
  saturation: float = 0.4
  hue: float = 0.1
  jitter_random_order: bool = True
  grayscale_prob: float = 0.2
  blur_prob: float = 0.5
  blur_sigma: Tuple[float, float] = (0.1, 2.0)
  blur_kernel_fraction: float = 0.1

  def __post_init__(self):
    for name in ('flip_prob', 'jitter_prob', 'grayscale_prob', 'blur_prob'):
      value = getattr(self, name)
      if not 0.0 <= value <= 1.0:
        raise ValueError(f'{name} must lie in [0, 1], got {value}.')
    for name in ('brightness', 'contrast', 'saturation', 'blur_kernel_fraction'):
      value = getattr(self, name)
      if value < 0.0:
        raise ValueError(f'{name} must be >= 0, got {value}.')
    if not 0.0 <= self.hue <= 0.5:
      raise ValueError(f'hue must lie in [0, 0.5], got {self.hue}.')
    lo, hi = self.crop_scale
    if not 0.0 < lo <= hi <= 1.0:
      raise ValueError(
          f'crop_scale must satisfy 0 < min <= max <= 1, got {self.crop_scale}.')
    for name in ('crop_ratio', 'blur_sigma'):
      lo, hi = getattr(self, name)
      if not 0.0 < lo <= hi:
        raise ValueError(f'{name} must satisfy 0 < min <= max, got '
                         f'{getattr(self, name)}.')
    if self.crop_attempts < 1:
      raise ValueError(f'crop_attempts must be >= 1, got {self.crop_attempts}.')


def sample_crop_box(key: PRNGKey,
                    height: int,
                    width: int,
                    scale: Tuple[float, float] = (0.08, 1.0),
                    ratio: Tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
                    attempts: int = 10) -> Array:
  """Samples a crop box like torchvision's `RandomResizedCrop.get_params`.

  Args:
    key: PRNG key.
    height: image height H in pixels (static).
    width: image width W in pixels (static).
    scale: (min, max) fraction of the image area.
    ratio: (min, max) aspect ratio width / height, sampled log-uniformly.
    attempts: draws; the first that fits is used, else a centre crop.

  Returns:
    float32 [4] (top, left, box_height, box_width) in pixels, in the image.
  """
  k_area, k_ratio, k_top, k_left = jax.random.split(key, 4)
  area = float(height * width)
  target = area * jax.random.uniform(
      k_area, (attempts,), minval=scale[0], maxval=scale[1])
  log_ratio = jax.random.uniform(
      k_ratio, (attempts,), minval=math.log(ratio[0]), maxval=math.log(ratio[1]))
  aspect = jnp.exp(log_ratio)
  box_w = jnp.sqrt(target * aspect)
  box_h = jnp.sqrt(target / aspect)
  fits = (box_w <= width) & (box_h <= height)
  first = jnp.argmax(fits)
  found = fits[first]
  box_h, box_w = box_h[first], box_w[first]
  top = jax.random.uniform(k_top) * (height - box_h)
  left = jax.random.uniform(k_left) * (width - box_w)

  in_ratio = width / height
  if in_ratio < ratio[0]:
    fb_w, fb_h = float(width), width / ratio[0]
  elif in_ratio > ratio[1]:
    fb_w, fb_h = height * ratio[1], float(height)
  else:
    fb_w, fb_h = float(width), float(height)
  fallback = jnp.array(
      [(height - fb_h) / 2, (width - fb_w) / 2, fb_h, fb_w], jnp.float32)
  box = jnp.stack([top, left, box_h, box_w]).astype(jnp.float32)
  return jnp.where(found, box, fallback)


def _interpolation_matrix(start: Array, extent: Array, size: int) -> Array:
  """Bilinear matrix [size, size] resampling `[start, start + extent)`.

  Output pixel o reads `start + (o + 0.5) * extent / size - 0.5`, clamped.
  """
  centres = jnp.arange(size, dtype=jnp.float32)
  coords = start + (centres + 0.5) * (extent / size) - 0.5
  coords = jnp.clip(coords, 0.0, size - 1)
  return jnp.maximum(0.0, 1.0 - jnp.abs(coords[:, None] - centres[None, :]))


def resized_crop(image: Array, box: Array, flip: Array = False) -> Array:
  """Crops `box` from `image` and resamples it bilinearly to the input size.

  Args:
    image: float [H, W, C].
    box: [4] (top, left, box_height, box_width) from `sample_crop_box`.
    flip: bool scalar (may be traced); mirror the result left-right.

  Returns:
    float32 [H, W, C]; the box (0, 0, H, W) returns the image.
  """
  height, width = image.shape[0], image.shape[1]
  rows = _interpolation_matrix(box[0], box[2], height)
  cols = _interpolation_matrix(box[1], box[3], width)
  # Flipping reverses the column matrix's rows: free next to the resampling.
  cols = jnp.where(flip, cols[::-1], cols)
  # Matmuls, not gathers: XLA:CPU recomputes gathers fused into each consumer.
  return jnp.einsum('oh,hwc,pw->opc', rows, image.astype(jnp.float32), cols,
                    precision=jax.lax.Precision.HIGHEST)


def horizontal_flip(image: Array) -> Array:
  """Mirrors [H, W, C] left-right."""
  return image[:, ::-1, :]


def luma(image: Array) -> Array:
  """Luma of an RGB image [H, W, 3] -> [H, W, 1].

  ITU-R 601 weights as torchvision uses them for float tensors.
  """
  r, g, b = image[..., 0:1], image[..., 1:2], image[..., 2:3]
  return 0.2989 * r + 0.587 * g + 0.114 * b


def grayscale(image: Array) -> Array:
  """Grayscale with three equal channels, [H, W, 3] -> [H, W, 3]."""
  return jnp.broadcast_to(luma(image), image.shape)


def adjust_hue(image: Array, delta: Array) -> Array:
  """Rotates the HSV hue of [H, W, 3] in [0, 1] by `delta` turns.

  Args:
    image: float [H, W, 3] RGB in [0, 1].
    delta: hue shift in turns; 0 returns the image unchanged.

  Returns:
    [H, W, 3] RGB in [0, 1].
  """
  r, g, b = image[..., 0], image[..., 1], image[..., 2]
  # Elementwise max/min fuse; a reduce over the 3-wide channel axis does not.
  value = jnp.maximum(jnp.maximum(r, g), b)
  chroma = value - jnp.minimum(jnp.minimum(r, g), b)
  inv_chroma = 1.0 / jnp.where(chroma > 0.0, chroma, 1.0)
  # Hue / 60 degrees in [-1, 5]; floor, not jnp.mod (slow on XLA:CPU).
  hue6 = jnp.where(
      value == r, (g - b) * inv_chroma,
      jnp.where(value == g, (b - r) * inv_chroma + 2.0,
                (r - g) * inv_chroma + 4.0))
  hue6 = hue6 + 6.0 * delta
  hue6 = hue6 - 6.0 * jnp.floor(hue6 * (1.0 / 6.0))
  # Branch-free HSV -> RGB: channel n (R=5, G=3, B=1) equals
  # V - C * clip(min(k, 4 - k), 0, 1) with k = (n + H/60) mod 6.
  offsets = jnp.array([5.0, 3.0, 1.0], image.dtype)
  k = offsets + hue6[..., None]
  k = jnp.where(k >= 6.0, k - 6.0, k)
  ramp = jnp.clip(jnp.minimum(k, 4.0 - k), 0.0, 1.0)
  rotated = jnp.clip(value[..., None] - chroma[..., None] * ramp, 0.0, 1.0)
  # The HSV round trip rounds; delta = 0 must leave the image bit-identical.
  return jnp.where(delta == 0.0, image, rotated)


def sample_jitter(key: PRNGKey,
                  brightness: float = 0.4,
                  contrast: float = 0.4,
                  saturation: float = 0.4,
                  hue: float = 0.1,
                  random_order: bool = True) -> Tuple[Array, Array]:
  """Samples colour-jitter factors and the order of the operations.

  Args:
    key: PRNG key.
    brightness: strength b; factor ~ U[max(0, 1 - b), 1 + b].
    contrast: strength c; factor ~ U[max(0, 1 - c), 1 + c].
    saturation: strength s; factor ~ U[max(0, 1 - s), 1 + s].
    hue: strength h; shift ~ U[-h, h] turns.
    random_order: uniform random permutation if True, else (0, 1, 2, 3).

  Returns:
    factors: float32 [4] (brightness, contrast, saturation, hue shift).
    order: int32 [4] permutation of the operation ids, in application order.
  """
  keys = jax.random.split(key, 5)

  def factor(k, strength):
    return jax.random.uniform(
        k, minval=max(0.0, 1.0 - strength), maxval=1.0 + strength)

  factors = jnp.stack([
      factor(keys[0], brightness),
      factor(keys[1], contrast),
      factor(keys[2], saturation),
      jax.random.uniform(keys[3], minval=-hue, maxval=hue),
  ])
  if random_order:
    order = jax.random.permutation(keys[4], 4).astype(jnp.int32)
  else:
    order = jnp.arange(4, dtype=jnp.int32)
  return factors, order


# Jitter factors that leave an image exactly unchanged.
IDENTITY_FACTORS = (1.0, 1.0, 1.0, 0.0)


def apply_jitter(image: Array, factors: Array, order: Array,
                 to_grayscale: Array = False) -> Array:
  """Applies brightness, contrast, saturation and hue in a given order.

  Args:
    image: float32 [H, W, 3] in [0, 1].
    factors: [4] as from `sample_jitter`; `IDENTITY_FACTORS` is a no-op.
    order: int [4] permutation of the operation ids, applied first to last.
    to_grayscale: bool scalar (may be traced); convert to grayscale last.

  Returns:
    [H, W, 3] in [0, 1].
  """
  # Brightness, contrast, saturation and grayscale (saturation 0) are blends,
  # exact no-ops at factor 1. The costly hue runs once, between three blend
  # slots before it and four after it; unused slots get factor 1.
  hue_pos = jnp.argmax(order == HUE)
  slot = jnp.arange(3)
  blends = jnp.where(slot < hue_pos, order[:3], order[1:])
  pre_factors = jnp.where(slot < hue_pos, factors[blends], 1.0)
  post_ops = jnp.concatenate([blends, jnp.array([SATURATION])])
  post_factors = jnp.concatenate([
      jnp.where(slot >= hue_pos, factors[blends], 1.0),
      jnp.where(to_grayscale, 0.0, 1.0)[None],
  ])

  def blend_slot(x, op, factor):
    y = luma(x)
    degenerate = jnp.where(op == BRIGHTNESS, 0.0,
                           jnp.where(op == CONTRAST, jnp.mean(y), y))
    return jnp.clip(factor * x + (1.0 - factor) * degenerate, 0.0, 1.0)

  # Loops: carries are materialised; unrolled, XLA:CPU recomputes the chain.
  image = jax.lax.fori_loop(
      0, 3, lambda k, x: blend_slot(x, blends[k], pre_factors[k]), image)
  image = adjust_hue(image, factors[HUE])
  return jax.lax.fori_loop(
      0, 4, lambda k, x: blend_slot(x, post_ops[k], post_factors[k]), image)


def blur_kernel_size(side: int, fraction: float = 0.1) -> int:
  """Odd kernel size of about `fraction` of `side` pixels (at least 1)."""
  size = int(fraction * side)
  return size + 1 if size % 2 == 0 else size


def gaussian_kernel(sigma: Array, kernel_size: int) -> Array:
  """Normalised 1-D Gaussian weights [kernel_size] centred on the middle tap."""
  if kernel_size % 2 != 1:
    raise ValueError(f'kernel_size must be odd, got {kernel_size}.')
  radius = kernel_size // 2
  taps = jnp.arange(-radius, radius + 1, dtype=jnp.float32)
  weights = jnp.exp(-0.5 * jnp.square(taps / sigma))
  return weights / jnp.sum(weights)


def separable_filter(image: Array, weights: Array) -> Array:
  """Filters [H, W, C] by odd `weights` [K] along H then W, reflect padding.

  With `gaussian_kernel` weights: a Gaussian blur. Raises ValueError for
  K // 2 >= min(H, W).
  """
  kernel_size = weights.shape[0]
  radius = kernel_size // 2
  height, width = image.shape[0], image.shape[1]
  if radius >= min(height, width):
    raise ValueError(
        f'kernel_size {kernel_size} too large for image {image.shape}.')
  # One pad, then static slices: a second pad would land inside the fusion.
  padded = jnp.pad(image, ((radius, radius), (radius, radius), (0, 0)),
                   mode='reflect')
  rows = weights[0] * padded[:height]
  for t in range(1, kernel_size):
    rows = rows + weights[t] * padded[t:t + height]
  out = weights[0] * rows[:, :width]
  for t in range(1, kernel_size):
    out = out + weights[t] * rows[:, t:t + width]
  return out


def _subkeys(key: PRNGKey) -> Tuple[PRNGKey, ...]:
  """The seven per-operation keys of one strong augmentation.

  All subkeys always: switching one operation off keeps the others' draws,
  and the geometric and photometric halves draw what the whole would.
  """
  return tuple(jax.random.split(key, 7))


def _check_image(name: str, image: Array) -> Array:
  image = jnp.asarray(image)
  if image.ndim != 3 or image.shape[-1] != 3:
    raise ValueError(f'{name} expects [H, W, 3], got {image.shape}.')
  if not jnp.issubdtype(image.dtype, jnp.floating):
    raise ValueError(
        f'{name} expects float images in [0, 1], got dtype '
        f'{image.dtype}; convert e.g. uint8 with image / 255.')
  return image.astype(jnp.float32)


def geometric_augment(key: PRNGKey,
                      image: Array,
                      params: AugmentParams = AugmentParams()) -> Array:
  """The random resized crop and flip of `augment_image`'s draws for `key`.

  Args:
    key: PRNG key for this example, as given to `augment_image`.
    image: float [H, W, 3] in [0, 1].
    params: probabilities and strengths (crop and flip fields used).

  Returns:
    float32 [H, W, 3], unclipped: a bilinear resampling, so in [0, 1] up to
    rounding.

  Raises:
    ValueError: if `image` is not a float array of shape [H, W, 3].
  """
  image = _check_image('geometric_augment', image)
  k_crop, k_flip = _subkeys(key)[:2]
  box = sample_crop_box(k_crop, image.shape[0], image.shape[1],
                        params.crop_scale, params.crop_ratio,
                        params.crop_attempts)
  return resized_crop(image, box, jax.random.uniform(k_flip) < params.flip_prob)


def photometric_augment(key: PRNGKey,
                        image: Array,
                        params: AugmentParams = AugmentParams()) -> Array:
  """Colour jitter, grayscale and blur of `augment_image`'s draws for `key`.

  `photometric_augment(k, geometric_augment(k, x))` is `augment_image(k, x)`
  bit for bit, so the photometric half can act on another image (an OT view
  of the crop) with the draws the strong view had.

  Args:
    key: PRNG key for this example, as given to `augment_image`.
    image: float [H, W, 3] in [0, 1].
    params: probabilities and strengths (jitter, grayscale, blur fields).

  Returns:
    float32 [H, W, 3] in [0, 1].

  Raises:
    ValueError: if `image` is not a float array of shape [H, W, 3], or the
      blur kernel does not fit it.
  """
  x = _check_image('photometric_augment', image)
  height, width = x.shape[0], x.shape[1]
  (_, _, k_jitter, k_jitter_on, k_gray, k_blur, k_blur_on) = _subkeys(key)
  if params.jitter_prob > 0 or params.grayscale_prob > 0:
    factors, order = sample_jitter(k_jitter, params.brightness,
                                   params.contrast, params.saturation,
                                   params.hue, params.jitter_random_order)
    jitter_on = jax.random.uniform(k_jitter_on) < params.jitter_prob
    factors = jnp.where(jitter_on, factors, jnp.array(IDENTITY_FACTORS))
    to_grayscale = jax.random.uniform(k_gray) < params.grayscale_prob
    # One pass materialises a buffer for the blur's shifted reads.
    x = apply_jitter(x, factors, order, to_grayscale)
  kernel_size = blur_kernel_size(min(height, width),
                                 params.blur_kernel_fraction)
  if kernel_size // 2 >= min(height, width):
    raise ValueError(
        f'blur_kernel_fraction {params.blur_kernel_fraction} gives a kernel of '
        f'{kernel_size} taps, too large for a {height} x {width} image.')
  if params.blur_prob > 0 and kernel_size > 1:
    sigma = jax.random.uniform(
        k_blur, minval=params.blur_sigma[0], maxval=params.blur_sigma[1])
    identity = jnp.eye(kernel_size, dtype=jnp.float32)[kernel_size // 2]
    weights = jnp.where(jax.random.uniform(k_blur_on) < params.blur_prob,
                        gaussian_kernel(sigma, kernel_size), identity)
    x = separable_filter(x, weights)
  # The convex combinations above can round a hair outside [0, 1].
  return jnp.clip(x, 0.0, 1.0)


def augment_image(key: PRNGKey,
                  image: Array,
                  params: AugmentParams = AugmentParams()) -> Array:
  """SimCLR strong augmentation of one image.

  Args:
    key: PRNG key for this example.
    image: float [H, W, 3] in [0, 1].
    params: probabilities and strengths.

  Returns:
    float32 [H, W, 3] in [0, 1].

  Raises:
    ValueError: if `image` is not a float array of shape [H, W, 3].
  """
  image = _check_image('augment_image', image)
  return photometric_augment(key, geometric_augment(key, image, params),
                             params)


def simclr_augment(key: PRNGKey,
                   images: Array,
                   params: Optional[AugmentParams] = None,
                   **overrides) -> Array:
  """SimCLR strong augmentation of a batch, one independent key per example.

  Jittable (bind `params`/overrides with `functools.partial`). Values outside
  [0, 1] are not checked (that needs a host sync); the output is clipped.

  Args:
    key: PRNG key, split into B per-example keys.
    images: float [B, H, W, 3] in [0, 1].
    params: probabilities and strengths; defaults to `AugmentParams()`.
    **overrides: fields of `AugmentParams` to replace, e.g. `blur_prob=0.0`.

  Returns:
    float32 [B, H, W, 3] in [0, 1].

  Raises:
    ValueError: if `images` is not a float array of shape [B, H, W, 3].
  """
  images = jnp.asarray(images)
  if images.ndim != 4 or images.shape[-1] != 3:
    raise ValueError(
        f'simclr_augment expects images of shape [B, H, W, 3], got '
        f'{images.shape}; add a batch axis or convert to RGB first.')
  if not jnp.issubdtype(images.dtype, jnp.floating):
    raise ValueError(
        f'simclr_augment expects float images in [0, 1], got dtype '
        f'{images.dtype}; convert e.g. uint8 with images / 255.')
  params = dataclasses.replace(params or AugmentParams(), **overrides)
  return _per_example(augment_image, key, images, params)


def _per_example(fn, key: PRNGKey, images: Array,
                 params: Optional[AugmentParams]) -> Array:
  """`fn(key_i, image_i, params)` over the batch, keys as `simclr_augment`'s."""
  keys = jax.random.split(key, jnp.shape(images)[0])
  return jax.vmap(functools.partial(fn, params=params or AugmentParams()))(
      keys, jnp.asarray(images, jnp.float32))


def geometric_batch(key: PRNGKey, images: Array,
                    params: Optional[AugmentParams] = None) -> Array:
  """`geometric_augment` of a batch, with `simclr_augment`'s per-example keys.

  Args:
    key: PRNG key, split into B per-example keys.
    images: float [B, H, W, 3] in [0, 1].
    params: probabilities and strengths; defaults to `AugmentParams()`.

  Returns:
    float32 [B, H, W, 3]: the crops and flips `simclr_augment(key, ...)`
    starts from.
  """
  return _per_example(geometric_augment, key, images, params)


def photometric_batch(key: PRNGKey, images: Array,
                      params: Optional[AugmentParams] = None) -> Array:
  """`photometric_augment` of a batch, with `simclr_augment`'s keys.

  `photometric_batch(k, geometric_batch(k, x))` is `simclr_augment(k, x)`.

  Args:
    key: PRNG key, split into B per-example keys.
    images: float [B, H, W, 3] in [0, 1].
    params: probabilities and strengths; defaults to `AugmentParams()`.

  Returns:
    float32 [B, H, W, 3] in [0, 1].
  """
  return _per_example(photometric_augment, key, images, params)
