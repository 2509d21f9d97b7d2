"""Tests of otclr_jax.data.images: cropping and antialiased resizing."""

import numpy as np

from otclr_jax.data import images


def test_square_resize_identity_crop_and_gray():
  rng = np.random.default_rng(1)
  image = rng.integers(0, 256, (20, 12, 3), dtype=np.uint8)
  out = images.square_resize(image, 12)
  np.testing.assert_array_equal(out, image[4:16])
  g = rng.integers(0, 256, (12, 15), dtype=np.uint8)
  out = images.square_resize(g, 12)
  np.testing.assert_array_equal(out, np.repeat(g[:, 1:13, None], 3, axis=-1))
  assert out.dtype == np.uint8 and out.shape == (12, 12, 3)


def test_square_resize_is_antialiased():
  checker = ((np.indices((64, 64)).sum(0) % 2) * 255).astype(np.uint8)
  out = images.square_resize(checker, 16).astype(np.float64)
  # Point sampling would return only 0 or 255; an antialiased filter averages.
  np.testing.assert_allclose(out, 127.5, atol=2.0)
  ramp = np.tile(np.arange(0, 256, 4, dtype=np.uint8)[None, :, None],
                 (64, 1, 3))
  out = images.square_resize(ramp, 32).astype(np.float64)
  block_mean = ramp.reshape(32, 2, 32, 2, 3).mean(axis=(1, 3))
  np.testing.assert_allclose(out[:, 2:-2], block_mean[:, 2:-2], atol=1.0)
  constant = np.full((50, 70, 3), 77, np.uint8)
  np.testing.assert_array_equal(images.square_resize(constant, 9), 77)
