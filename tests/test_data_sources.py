"""Tests of otclr_jax.data.sources: digits, names and splits."""

import numpy as np
import pytest
from sklearn import datasets as sk_datasets

from otclr_jax import data


def _digits_reference():
  digits = sk_datasets.load_digits()
  pixels = np.round(digits.images * 255.0 / 16.0).astype(np.uint8)
  rng = np.random.default_rng(0)
  test = np.zeros(len(pixels), bool)
  for c in range(10):
    members = rng.permutation(np.flatnonzero(digits.target == c))
    test[members[:int(round(0.2 * len(members)))]] = True
  return pixels, digits.target, test


def test_digits_shapes_labels_and_documented_split(tmp_path):
  train = data.load_split('digits', 'train', 8, tmp_path)
  test = data.load_split('digits', 'test', 8, tmp_path)
  pixels, targets, test_mask = _digits_reference()
  assert len(train.labels) + len(test.labels) == 1797
  for split, mask in ((train, ~test_mask), (test, test_mask)):
    assert split.images.dtype == np.uint8 and split.labels.dtype == np.int32
    assert split.images.shape == (mask.sum(), 8, 8, 3)
    assert split.num_classes == 10
    assert split.class_names == [str(i) for i in range(10)]
    np.testing.assert_array_equal(split.labels, targets[mask])
    for channel in range(3):
      np.testing.assert_array_equal(split.images[..., channel], pixels[mask])
  assert train.images.max() == 255 and train.images.min() == 0
  test_counts = np.bincount(test.labels, minlength=10)
  all_counts = np.bincount(targets, minlength=10)
  np.testing.assert_allclose(test_counts / all_counts, 0.2, atol=0.01)


def test_digits_resized_and_deterministic(tmp_path):
  a = data.load_split('digits', 'train', 32, tmp_path / 'a')
  b = data.load_split('digits', 'train', 32, tmp_path / 'b')
  assert a.images.shape == (1438, 32, 32, 3)
  np.testing.assert_array_equal(a.images, b.images)
  np.testing.assert_array_equal(a.labels, b.labels)
  np.testing.assert_array_equal(a.images[..., 0], a.images[..., 2])
  # Upsampling by 4 keeps the mean brightness of each digit.
  small = data.load_split('digits', 'train', 8, tmp_path / 'a')
  np.testing.assert_allclose(
      a.images.mean(axis=(1, 2, 3)), small.images.mean(axis=(1, 2, 3)),
      atol=3.0)


@pytest.mark.parametrize('name, split, size, match', [
    ('mnist_typo', 'train', 32, 'unknown dataset'),
    ('digits', 'validation', 32, 'unknown split'),
    ('cifar10', 'unlabelled', 32, 'unknown split'),
    ('digits', 'train', 7, 'image_size'),
    ('folder:MISSING', 'train', 32, 'not a directory'),
    ('folder:', 'train', 32, 'names no directory'),
])
def test_bad_names_and_splits_are_one_line_data_errors(tmp_path, name, split,
                                                       size, match):
  name = name.replace('MISSING', str(tmp_path / 'missing'))
  with pytest.raises(data.DataError, match=match) as info:
    data.load_split(name, split, size, tmp_path)
  assert '\n' not in str(info.value)


@pytest.mark.parametrize('name', ['digits', 'cifar10', 'folder:TREE'])
def test_missing_split_is_one_line_naming_dataset_and_split(tmp_path, name):
  (tmp_path / 'tree' / 'train' / 'a').mkdir(parents=True)
  name = name.replace('TREE', str(tmp_path / 'tree'))
  with pytest.raises(data.SplitNotFoundError) as info:
    data.load_split(name, 'validation', 8, tmp_path / 'data')
  message = str(info.value)
  assert isinstance(info.value, data.DataError)
  assert '\n' not in message
  assert "'validation'" in message
  assert name.removeprefix('folder:') in message, message
  assert "'train'" in message  # What it does have.
  # Nothing was prepared or written for a split that does not exist.
  assert not (tmp_path / 'data').exists()
