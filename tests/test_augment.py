"""Tests for otclr_jax.augment: single operations against NumPy / SciPy /
colorsys references, the samplers' ranges and distributions, and the full
pipeline's probabilities, determinism and contracts."""

import colorsys
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import ndimage
from scipy import stats

from otclr_jax import augment
from tests.helpers import chain
from tests.helpers import rounding_tol

LUMA = np.array([0.2989, 0.587, 0.114])

# Tolerances of the float32 colour operations against the float64 formulas
# below, absolute on pixels in [0, 1]. Luma: a dot product of 3 with
# rounded constants. A blend f x + (1 - f) d: the factor, 1 - f, the
# product and the sum after d's own chain, on terms of at most
# f + |1 - f| <= 2 for factors in [0, 1.4]; contrast's d is the mean of the
# 6 x 7 lumas.
_LUMA = chain(3, stages=1)
_BLEND = chain(stages=4)
_LUMA_ATOL = rounding_tol(_LUMA)
_BRIGHTNESS_ATOL = rounding_tol(_BLEND) * 2
_SATURATION_ATOL = rounding_tol(_LUMA, _BLEND) * 2
_CONTRAST_ATOL = rounding_tol(_LUMA, 6 * 7, _BLEND, stages=1) * 2
# Hue, stages at the scales of their results: the chroma's reciprocal and
# product, and the value's difference (1), + 2 or + 4 (5), the shift and
# its wrap (8), k and 4 - k (11).
_HUE_ATOL = (rounding_tol(stages=3) + rounding_tol(stages=1, k=5)
             + rounding_tol(stages=7, k=8) + rounding_tol(stages=2, k=11))

# resized_crop against scipy's float64 interpolation, absolute on pixels in
# [0, 1]: each output coordinate start + (o + 0.5) extent / size - 0.5 and
# its fraction take 6 stages at the scale of the image side (up to 16),
# which move each axis's 2 bilinear weights absolutely (2 x 2 axes); then
# the weights' product and the sum of 4.
_CROP_ATOL = rounding_tol(stages=6, k=16) * 2 * 2 + rounding_tol(4, stages=1)

_X = jnp.zeros((2, 8, 8, 3))
_KEY = jax.random.key(0)

# Every operation off and the crop fixed to the whole image: the pipeline is
# then the identity, and one operation at a time can be switched on.
ALL_OFF = dict(
    crop_scale=(1.0, 1.0),
    crop_ratio=(1.0, 1.0),
    flip_prob=0.0,
    jitter_prob=0.0,
    grayscale_prob=0.0,
    blur_prob=0.0,
)


def _images(n, h, w, seed=0):
  """Random RGB images with distinct channels and no left-right symmetry."""
  rng = np.random.default_rng(seed)
  return rng.uniform(0.05, 0.95, size=(n, h, w, 3)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _jitted(**overrides):
  return jax.jit(functools.partial(augment.simclr_augment, **overrides))


def _augment(key, images, **overrides):
  # lru_cache needs hashable arguments: tuples are, and so are the floats.
  return np.asarray(_jitted(**overrides)(key, jnp.asarray(images)))


def _changed(out, images):
  return np.any(out != images, axis=(1, 2, 3))


def _assert_frequency(hits, p, name):
  """Binomial check: |freq - p| within 4.5 standard errors."""
  freq = hits.mean()
  tol = 4.5 * math.sqrt(p * (1 - p) / hits.size)
  assert abs(freq - p) <= tol, f'{name}: {freq:.4f}, expected {p} +- {tol:.4f}'


# NumPy references.


def _np_luma(x):
  return x[..., 0] * LUMA[0] + x[..., 1] * LUMA[1] + x[..., 2] * LUMA[2]


def _np_hue(x, delta):
  out = np.empty_like(x, dtype=np.float64)
  for idx in np.ndindex(x.shape[:-1]):
    h, s, v = colorsys.rgb_to_hsv(*x[idx].astype(np.float64))
    out[idx] = colorsys.hsv_to_rgb((h + delta) % 1.0, s, v)
  return out


_NP_OPS = {
    augment.BRIGHTNESS: lambda x, f: np.clip(f * x, 0, 1),
    augment.CONTRAST: lambda x, f: np.clip(
        f * x + (1 - f) * _np_luma(x).mean(), 0, 1),
    augment.SATURATION: lambda x, f: np.clip(
        f * x + (1 - f) * _np_luma(x)[..., None], 0, 1),
    augment.HUE: _np_hue,
}


def _np_resized_crop(image, box):
  """Bilinear resampling with scipy.ndimage (order 1, edge-clamped)."""
  h, w = image.shape[:2]
  top, left, bh, bw = [float(v) for v in box]
  ys = top + (np.arange(h) + 0.5) * bh / h - 0.5
  xs = left + (np.arange(w) + 0.5) * bw / w - 0.5
  yy, xx = np.meshgrid(ys, xs, indexing='ij')
  return np.stack([
      ndimage.map_coordinates(image[..., c].astype(np.float64), [yy, xx],
                              order=1, mode='nearest')
      for c in range(image.shape[-1])
  ], axis=-1)


class TestCrop:
  """sample_crop_box and resized_crop."""

  # max_area: the largest box with ratio <= 4/3 that fits (24 x 32 in 24 x 40).
  @pytest.mark.parametrize('height,width,max_area', [(32, 32, 1.0),
                                                     (24, 40, 0.8)])
  def test_crop_box_within_ranges(self, height, width, max_area):
    keys = jax.random.split(jax.random.key(1), 4000)
    boxes = np.asarray(jax.vmap(
        lambda k: augment.sample_crop_box(k, height, width))(keys))
    top, left, bh, bw = boxes.T
    area = bh * bw / (height * width)
    ratio = bw / bh
    assert area.min() >= 0.08 * (1 - 1e-5)
    assert area.max() <= max_area * (1 + 1e-5)
    assert ratio.min() >= 0.75 * (1 - 1e-5)
    assert ratio.max() <= (4 / 3) * (1 + 1e-5)
    assert top.min() >= 0 and left.min() >= 0
    assert (top + bh).max() <= height + 1e-4
    assert (left + bw).max() <= width + 1e-4
    # Both ends of the ranges are actually reached.
    assert area.min() < 0.1 and area.max() > 0.95 * max_area
    assert ratio.min() < 0.77 and ratio.max() > 1.3

  def test_crop_box_distribution(self):
    # With scale <= 0.5 every draw fits on a square image, so no rejection:
    # area fraction and log aspect ratio are uniform, offsets uniform in range.
    n, side = 3000, 32
    keys = jax.random.split(jax.random.key(2), n)
    boxes = np.asarray(jax.vmap(lambda k: augment.sample_crop_box(
        k, side, side, scale=(0.08, 0.5)))(keys)).astype(np.float64)
    top, left, bh, bw = boxes.T
    area = bh * bw / side**2
    log_ratio = np.log(bw / bh)
    lo, hi = math.log(3 / 4), math.log(4 / 3)
    assert stats.kstest(area, stats.uniform(0.08, 0.42).cdf).pvalue > 1e-3
    assert stats.kstest(log_ratio, stats.uniform(lo, hi - lo).cdf).pvalue > 1e-3
    assert stats.kstest(top / (side - bh), 'uniform').pvalue > 1e-3
    assert stats.kstest(left / (side - bw), 'uniform').pvalue > 1e-3

  @pytest.mark.parametrize('height,width,ratio,expected', [
      # Square image, ratio range above 1: full width, height W / 1.2.
      (32, 32, (1.2, 1.3), (32 / 1.2, 32.0)),
      # Wide image, ratio range below its own: full height, width H * 4/3.
      (12, 40, (0.75, 4 / 3), (12.0, 16.0)),
  ])
  def test_crop_box_fallback_is_centred(self, height, width, ratio, expected):
    # scale = 1 never fits with these ratios: every draw falls back.
    keys = jax.random.split(jax.random.key(3), 16)
    boxes = np.asarray(jax.vmap(lambda k: augment.sample_crop_box(
        k, height, width, scale=(1.0, 1.0), ratio=ratio))(keys))
    bh, bw = expected
    want = np.array([(height - bh) / 2, (width - bw) / 2, bh, bw])
    # The fallback is computed in float64 and rounded to float32 once.
    np.testing.assert_allclose(boxes, np.broadcast_to(want, boxes.shape),
                               rtol=rounding_tol(stages=1), atol=0)

  def test_resized_crop_matches_scipy(self):
    image = _images(1, 12, 16, seed=4)[0]
    boxes = [np.asarray(augment.sample_crop_box(key, 12, 16))
             for key in jax.random.split(jax.random.key(4), 8)]
    # A sub-pixel box touching the border, where the edge clamp matters.
    for box in boxes + [np.array([0.0, 11.3, 3.7, 4.7], np.float32)]:
      got = augment.resized_crop(jnp.asarray(image), jnp.asarray(box))
      np.testing.assert_allclose(got, _np_resized_crop(image, box), rtol=0,
                                 atol=_CROP_ATOL)

  def test_resized_crop_full_box_is_identity_and_flip_mirrors(self):
    image = jnp.asarray(_images(1, 10, 14, seed=5)[0])
    full = jnp.array([0.0, 0.0, 10.0, 14.0])
    np.testing.assert_array_equal(augment.resized_crop(image, full), image)
    np.testing.assert_array_equal(
        augment.resized_crop(image, full, flip=True), image[:, ::-1])
    box = jnp.array([1.5, 2.25, 6.0, 9.5])
    # The same weights, reversed: each output pixel sums the same 4 products
    # of two weights and a pixel <= 1, possibly in another lane or order.
    np.testing.assert_allclose(
        augment.resized_crop(image, box, flip=True),
        augment.resized_crop(image, box)[:, ::-1], rtol=0,
        atol=rounding_tol(4, stages=2))
    np.testing.assert_array_equal(augment.horizontal_flip(image),
                                  np.flip(np.asarray(image), axis=1))


def _one_op(op, image, factor):
  """The library's jitter with `op` at `factor`, the others exact no-ops."""
  factors = np.array(augment.IDENTITY_FACTORS, np.float32)
  factors[op] = factor
  return augment.apply_jitter(jnp.asarray(image), jnp.asarray(factors),
                              jnp.arange(4, dtype=jnp.int32))


class TestColour:
  """The colour jitter against NumPy and colorsys."""

  @pytest.mark.parametrize('factor', [0.0, 0.6, 1.3, 1.4])
  @pytest.mark.parametrize('op, atol', [
      (augment.BRIGHTNESS, _BRIGHTNESS_ATOL),
      (augment.CONTRAST, _CONTRAST_ATOL),
      (augment.SATURATION, _SATURATION_ATOL)])
  def test_blend_ops_match_closed_forms(self, op, atol, factor):
    x = _images(1, 6, 7, seed=6)[0]
    np.testing.assert_allclose(_one_op(op, x, factor), _NP_OPS[op](x, factor),
                               rtol=0, atol=atol)

  @pytest.mark.parametrize('delta', [0.1, -0.1, 0.037, 0.5, -0.5])
  def test_hue_matches_colorsys(self, delta):
    x = _images(1, 6, 7, seed=7)[0]
    # Include grey, saturated and boundary colours.
    x[0, :5] = [[0.5, 0.5, 0.5], [1, 0, 0], [0, 1, 1], [0, 0, 0], [1, 1, 1]]
    np.testing.assert_allclose(augment.adjust_hue(jnp.asarray(x), delta),
                               _np_hue(x, delta), rtol=0, atol=_HUE_ATOL)

  def test_zero_strength_is_identity(self):
    x = jnp.asarray(_images(1, 8, 8, seed=8)[0])
    for op in (augment.BRIGHTNESS, augment.CONTRAST, augment.SATURATION):
      np.testing.assert_array_equal(_one_op(op, x, 1.0), x)
    np.testing.assert_array_equal(augment.adjust_hue(x, 0.0), x)
    # Strength 0 samples exactly those identity factors.
    factors, _ = augment.sample_jitter(jax.random.key(0), 0.0, 0.0, 0.0, 0.0)
    np.testing.assert_array_equal(factors, augment.IDENTITY_FACTORS)
    for seed in range(3):
      out = augment.apply_jitter(x, *augment.sample_jitter(
          jax.random.key(seed), 0.0, 0.0, 0.0, 0.0))
      np.testing.assert_array_equal(out, x)

  def test_grayscale_equal_channels_and_luma(self):
    x = _images(1, 5, 6, seed=9)[0]
    g = np.asarray(augment.grayscale(jnp.asarray(x)))
    np.testing.assert_array_equal(g[..., 0], g[..., 1])
    np.testing.assert_array_equal(g[..., 0], g[..., 2])
    np.testing.assert_allclose(g[..., 0], _np_luma(x), rtol=0, atol=_LUMA_ATOL)

  @pytest.mark.parametrize('order', [
      (0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2), (2, 0, 3, 1), (0, 2, 1, 3),
      (3, 0, 1, 2)])
  def test_apply_jitter_follows_order(self, order):
    x = _images(1, 6, 6, seed=10)[0]
    factors = np.array([1.35, 0.65, 1.3, -0.08], np.float32)
    want = x.astype(np.float64)
    for op in order:
      want = _NP_OPS[op](want, factors[op])
    got = augment.apply_jitter(jnp.asarray(x), jnp.asarray(factors),
                               jnp.asarray(order, jnp.int32))
    # Each operation adds its own error (the atols above) and passes on the
    # earlier ones amplified by at most f + |1 - f| (1.35, 1, 1.6) or, for
    # hue, by the 3 of its three-way differences at scale 1: a product of 6.5
    # bounds every order.
    atol = 6.5 * (_BRIGHTNESS_ATOL + _CONTRAST_ATOL + _SATURATION_ATOL
                  + _HUE_ATOL)
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    identity = jnp.array(augment.IDENTITY_FACTORS)
    np.testing.assert_array_equal(augment.apply_jitter(
        jnp.asarray(x), identity, jnp.asarray(order, jnp.int32)), x)

  def test_order_matters(self):
    # The previous test can tell orders apart.
    x = jnp.asarray(_images(1, 6, 6, seed=11)[0])
    factors = jnp.array([1.4, 0.6, 1.4, 0.1])
    a, b = (augment.apply_jitter(x, factors, jnp.array(order))
            for order in ((0, 1, 2, 3), (3, 2, 1, 0)))
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3

  def test_sample_jitter_ranges_and_uniform_order(self):
    n = 4800
    keys = jax.random.split(jax.random.key(12), n)
    factors, orders = jax.vmap(augment.sample_jitter)(keys)
    factors, orders = np.asarray(factors), np.asarray(orders)
    uniform = lambda a, low, width: stats.kstest(
        a, stats.uniform(low, width).cdf).pvalue > 1e-3
    for i in range(3):
      assert factors[:, i].min() >= 0.6 and factors[:, i].max() <= 1.4
      assert uniform(factors[:, i], 0.6, 0.8)
    assert uniform(factors[:, 3], -0.1, 0.2)
    np.testing.assert_array_equal(np.sort(orders, axis=1),
                                  np.broadcast_to(np.arange(4), orders.shape))
    perms = {p: i for i, p in enumerate(itertools.permutations(range(4)))}
    counts = np.bincount([perms[tuple(o)] for o in orders], minlength=24)
    assert stats.chisquare(counts).pvalue > 1e-4, counts
    _, fixed = jax.vmap(functools.partial(augment.sample_jitter,
                                          random_order=False))(keys[:10])
    np.testing.assert_array_equal(fixed, np.broadcast_to(np.arange(4), (10, 4)))


def _blur(image, sigma, kernel_size):
  """The pipeline's blur: `gaussian_kernel` weights by `separable_filter`."""
  return augment.separable_filter(image,
                                  augment.gaussian_kernel(sigma, kernel_size))


class TestBlur:
  """The Gaussian blur against scipy."""

  def test_blur_kernel_size(self):
    for side, size in ((32, 3), (224, 23), (96, 9), (40, 5), (16, 1)):
      assert augment.blur_kernel_size(side) == size, side

  @pytest.mark.parametrize('sigma,size', [(0.5, 3), (1.7, 5), (2.0, 9)])
  def test_gaussian_blur_matches_scipy(self, sigma, size):
    x = _images(1, 11, 13, seed=13)[0]
    taps = np.arange(size) - size // 2
    w = np.exp(-taps**2 / (2 * sigma**2))
    w /= w.sum()
    # The exponent's 3 stages, absolute at its scale, at most (r / sigma)^2 / 2
    # = 2 here (k = 2); exp, the sum over the taps and the division.
    w_rtol = rounding_tol(stages=3, k=2) + rounding_tol(size, stages=1, funcs=1)
    np.testing.assert_allclose(augment.gaussian_kernel(sigma, size), w,
                               rtol=w_rtol)
    # scipy's 'mirror' is reflection without repeating the edge pixel.
    want = ndimage.correlate1d(x.astype(np.float64), w, axis=0, mode='mirror')
    want = ndimage.correlate1d(want, w, axis=1, mode='mirror')
    # Two passes, each moved by the weights' relative error on pixels <= 1,
    # and each a dot product of `size`.
    np.testing.assert_allclose(_blur(jnp.asarray(x), sigma, size),
                               want, rtol=0,
                               atol=2 * w_rtol + rounding_tol(size, size))

  def test_blur_preserves_constant_image(self):
    x = jnp.full((9, 12, 3), 0.37, jnp.float32)
    # Two passes of a dot product of 5 with weights that sum to 1 up to their
    # sum and division.
    for sigma in (0.1, 1.0, 2.0):
      np.testing.assert_allclose(
          _blur(x, sigma, 5), x, rtol=rounding_tol(5, 5, 5, 5, stages=2),
          atol=0)


class TestPipeline:
  """simclr_augment: probabilities, determinism, contracts."""

  def test_all_off_is_identity(self):
    x = _images(16, 8, 8, seed=14)
    np.testing.assert_array_equal(_augment(jax.random.key(0), x, **ALL_OFF), x)

  @pytest.mark.parametrize('name, seed, p, extra', [
      ('flip', 15, 0.5, {}), ('jitter', 16, 0.8, {}),
      ('grayscale', 17, 0.2, {}),
      # sigma >= 1 so that every blurred image differs visibly from its input
      # (at sigma 0.1 the neighbour weights underflow to ~1e-22).
      ('blur', 18, 0.5, {'blur_sigma': (1.0, 2.0),
                         'blur_kernel_fraction': 0.2})])
  def test_operation_frequency(self, name, seed, p, extra):
    n, size = (1000, 16) if name == 'blur' else (2000, 8)
    x = _images(n, size, size, seed=seed)
    out = _augment(jax.random.key(seed), x,
                   **{**ALL_OFF, f'{name}_prob': p, **extra})
    hits = _changed(out, x)
    if name == 'flip':
      hits = np.all(out == x[:, :, ::-1], axis=(1, 2, 3))
      assert np.all(hits ^ np.all(out == x, axis=(1, 2, 3)))
    if name == 'grayscale':
      gray = np.all(out == out[..., :1], axis=(1, 2, 3))
      np.testing.assert_array_equal(gray, hits)
      np.testing.assert_allclose(out[gray][..., 0], _np_luma(x[gray]), rtol=0,
                                 atol=_LUMA_ATOL)
    _assert_frequency(hits, p, name)

  def test_determinism_shape_range(self):
    x = _images(8, 32, 32, seed=19)
    x[0] = 0.0
    x[1] = 1.0
    a = _augment(jax.random.key(7), x)
    b = _augment(jax.random.key(7), x)
    c = _augment(jax.random.key(8), x)
    assert a.shape == x.shape and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    # Rows 0 and 1 are constant images, which many draws leave unchanged.
    assert np.all(np.abs(a - c)[2:].reshape(6, -1).max(axis=1) > 1e-3)
    assert a.min() >= 0.0 and a.max() <= 1.0
    # One independent key per example: identical inputs get different views.
    # A batch of x's shape, so x's compiled augmentation draws them.
    same = np.repeat(x[2:3], len(x), axis=0)
    views = _augment(jax.random.key(9), same)
    for i, j in itertools.combinations(range(len(x)), 2):
      assert np.abs(views[i] - views[j]).max() > 1e-3

  def test_vmap_matches_single_image_and_eager(self):
    # test_determinism_shape_range's shape: one compiled augmentation for both.
    x = jnp.asarray(_images(8, 32, 32, seed=20))
    key = jax.random.key(21)
    batched = augment.simclr_augment(key, x)
    keys = jax.random.split(key, len(x))
    single = jax.jit(augment.augment_image)
    for i in range(len(x)):
      np.testing.assert_allclose(batched[i], single(keys[i], x[i]),
                                 rtol=0, atol=1e-5)
    np.testing.assert_allclose(_augment(key, np.asarray(x)), batched,
                               rtol=0, atol=1e-5)
    # Raw uint32 keys work as well as typed keys.
    raw = augment.simclr_augment(jax.random.PRNGKey(0), x)
    assert raw.shape == x.shape

  def test_non_square_images(self):
    x = _images(2, 20, 36, seed=22)
    out = _augment(jax.random.key(22), x)
    assert out.shape == x.shape and out.dtype == np.float32
    assert out.min() >= 0.0 and out.max() <= 1.0
    assert np.all(np.abs(out - x).reshape(2, -1).max(axis=1) > 1e-3)

  @pytest.mark.parametrize('call, error, match', [
      (lambda: _blur(_X[0], 1.0, 4), ValueError, 'odd'),
      (lambda: _blur(_X[0], 1.0, 17), ValueError, 'too large'),
      (lambda: augment.simclr_augment(_KEY, _X[0]), ValueError,
       r'\[B, H, W, 3\]'),
      (lambda: augment.simclr_augment(_KEY, _X[..., :1]), ValueError,
       r'\[B, H, W, 3\]'),
      (lambda: augment.simclr_augment(_KEY, _X.astype(jnp.uint8)), ValueError,
       'float'),
      (lambda: augment.augment_image(_KEY, _X), ValueError, r'\[H, W, 3\]'),
      (lambda: augment.augment_image(_KEY, _X[0].astype(jnp.int32)),
       ValueError, 'float'),
      (lambda: augment.simclr_augment(_KEY, _X, flip_prob=1.5), ValueError,
       'flip_prob'),
      (lambda: augment.AugmentParams(hue=0.6), ValueError, 'hue'),
      (lambda: augment.AugmentParams(crop_scale=(0.0, 1.0)), ValueError,
       'crop_scale'),
      (lambda: augment.simclr_augment(_KEY, _X, no_such_field=1.0), TypeError,
       None),
  ])
  def test_bad_inputs_raise(self, call, error, match):
    with pytest.raises(error, match=match):
      call()

  def test_geometric_then_photometric_halves_are_the_whole_augmentation(self):
    x = jnp.asarray(_images(8, 32, 32, seed=23))
    key = jax.random.key(24)
    whole = _jitted()(key, x)
    # Jitted apart, as a view generator that acts between the halves runs them.
    crops = jax.jit(augment.geometric_batch)(key, x)
    halves = jax.jit(augment.photometric_batch)(key, crops)
    np.testing.assert_array_equal(halves, whole)
    # The crops alone: bilinear resampling of the image, no colour change.
    no_colour = dict(jitter_prob=0.0, grayscale_prob=0.0, blur_prob=0.0)
    np.testing.assert_array_equal(
        crops, _jitted(**no_colour)(key, x))
