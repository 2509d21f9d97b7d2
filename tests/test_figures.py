"""Tests of otclr_jax.figures: the interpolation figure on tiny images."""

import jax
import numpy as np
import pytest
from PIL import Image

from otclr_jax import figures


def _blob_image(size, center_col, center_row=None):
  """Grey image, one bright Gaussian blob on black, `[size, size, 3]`."""
  center_row = size / 2 - 0.5 if center_row is None else center_row
  rows, cols = np.meshgrid(np.arange(size), np.arange(size), indexing='ij')
  blob = np.exp(-((rows - center_row) ** 2 + (cols - center_col) ** 2) / 4.0)
  return np.repeat(blob[..., None], 3, axis=-1).astype(np.float32)


def test_interpolation_figure_is_written(tmp_path):
  rng = np.random.default_rng(0)
  source = tmp_path / 'tiny.png'
  # Non-square, to go through the centre crop.
  Image.fromarray(rng.integers(0, 256, (20, 28, 3), np.uint8)).save(source)
  out = tmp_path / 'figs' / 'interp.png'
  assert figures.main([
      'interpolation', '--image', str(source), '--out', str(out), '--size',
      '16', '--grid_size', '4', '--num_iters', '3', '--alphas', '0', '0.5',
      '1']) == 0
  with Image.open(out) as png:
    width, height = png.size
    assert png.format == 'PNG'
  # Three columns, two rows: wider than tall.
  assert width > height > 100
  pdf = out.with_suffix('.pdf')
  assert pdf.read_bytes()[:5] == b'%PDF-'


def test_interpolation_rejects_bad_output_suffix(tmp_path):
  with pytest.raises(ValueError, match='.png'):
    figures.main(['interpolation', '--out', str(tmp_path / 'fig.jpg'),
                  '--size', '16'])


def test_rows_endpoints():
  rng = np.random.default_rng(1)
  x = rng.random((12, 12, 3)).astype(np.float32)
  xs = rng.random((12, 12, 3)).astype(np.float32)
  m = 4
  linear, displaced = figures.interpolation_rows(x, xs, [0.0, 0.5, 1.0],
                                                 grid_size=m)
  assert linear.shape == displaced.shape == (3, 12, 12, 3)
  np.testing.assert_allclose(linear[0], x, atol=1e-7)
  np.testing.assert_allclose(linear[1], 0.5 * (x + xs), atol=1e-6)
  np.testing.assert_allclose(linear[2], xs, atol=1e-7)

  # At alpha = 0 the OT view is the source seen through the m x m grid.
  def low_res(img):
    small = jax.image.resize(img, (m, m, 3), 'linear', antialias=True)
    return np.clip(jax.image.resize(small, img.shape, 'linear'), 0.0, 1.0)

  np.testing.assert_allclose(displaced[0], low_res(x), atol=1e-5)
  # At alpha = 1, the strong view up to Sinkhorn's column-marginal error.
  np.testing.assert_allclose(displaced[2], low_res(xs), atol=5e-3)


def test_ot_row_moves_mass_instead_of_ghosting():
  size = 16
  x, xs = _blob_image(size, 3.0), _blob_image(size, 12.0)
  linear, displaced = figures.interpolation_rows(x, xs, [0.5])
  profile_lin = linear[0, size // 2, :, 0]
  profile_ot = displaced[0, size // 2, :, 0]
  # Linear interpolation: two half-bright copies at the endpoints, dark between.
  assert profile_lin[3] > 0.45 and profile_lin[12] > 0.45
  assert profile_lin[7] < 0.1
  # OT: one blob half-way, nothing left at the endpoints.
  assert 6 <= int(np.argmax(profile_ot)) <= 9
  assert profile_ot[7] > 0.45
  assert max(profile_ot[3], profile_ot[12]) < 0.05


def test_load_default_image_and_strong_view():
  x = figures.load_image(None, 24)
  assert x.shape == (24, 24, 3) and x.dtype == np.float32
  assert 0.0 <= x.min() and x.max() <= 1.0 and x.std() > 0.05
  a = figures.strong_view(x, seed=3)
  np.testing.assert_array_equal(a, figures.strong_view(x, seed=3))
  assert a.shape == x.shape
  assert np.abs(a - figures.strong_view(x, seed=4)).max() > 0.05
