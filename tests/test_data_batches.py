"""Tests of otclr_jax.data.batches: epoch permutations, resumption, errors."""

import itertools

import numpy as np
import pytest

from otclr_jax import data


def _indices(n):
  return np.arange(n, dtype=np.int64).reshape(n, 1, 1, 1)


@pytest.mark.parametrize('prefetch', [0, 2])
def test_train_batches_follow_epoch_permutations(prefetch):
  n, b, seed = 50, 8, 3
  spe = data.steps_per_epoch(n, b)
  assert spe == 6
  it = data.train_batches(_indices(n), b, seed, prefetch=prefetch)
  batches = [next(it)[:, 0, 0, 0] for _ in range(3 * spe)]
  for epoch in range(3):
    got = np.concatenate(batches[epoch * spe:(epoch + 1) * spe])
    expected = np.random.default_rng([seed, epoch]).permutation(n)[:spe * b]
    np.testing.assert_array_equal(got, expected)
    assert len(np.unique(got)) == spe * b  # No repeats within an epoch.
  assert all(batch.shape == (b,) for batch in batches)


def test_train_batches_deterministic_and_seed_dependent():
  images = np.random.default_rng(0).integers(0, 256, (40, 4, 4, 3), np.uint8)
  a = list(itertools.islice(data.train_batches(images, 16, seed=7), 5))
  b = list(itertools.islice(data.train_batches(images, 16, seed=7), 5))
  c = list(itertools.islice(data.train_batches(images, 16, seed=8), 5))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert x.dtype == np.uint8 and x.shape == (16, 4, 4, 3)
  assert any(not np.array_equal(x, z) for x, z in zip(a, c))


@pytest.mark.parametrize('start_step', [0, 1, 5, 6, 7, 13])
@pytest.mark.parametrize('prefetch', [0, 2])
def test_train_batches_resume_exactly(start_step, prefetch):
  n, b = 50, 8
  full = list(itertools.islice(data.train_batches(_indices(n), b, 11), 24))
  resumed = list(itertools.islice(
      data.train_batches(_indices(n), b, 11, start_step, prefetch=prefetch),
      8))
  for x, y in zip(resumed, full[start_step:start_step + 8]):
    np.testing.assert_array_equal(x, y)


def test_eval_batches_cover_all_in_order():
  images = _indices(23)
  batches = list(data.eval_batches(images, 5))
  assert [len(x) for x in batches] == [5, 5, 5, 5, 3]
  np.testing.assert_array_equal(np.concatenate(batches), images)
  assert len(list(data.eval_batches(images, 100))) == 1


def test_bad_arguments_raise_value_error():
  images = _indices(10)
  with pytest.raises(ValueError, match='larger than the dataset'):
    data.train_batches(images, 11, 0)
  with pytest.raises(ValueError, match='larger than the dataset'):
    data.steps_per_epoch(10, 11)
  with pytest.raises(ValueError, match='batch_size'):
    data.eval_batches(images, 0)
  with pytest.raises(ValueError, match='seed'):
    data.train_batches(images, 2, -1)
  with pytest.raises(ValueError, match='start_step'):
    data.train_batches(images, 2, 0, start_step=-1)


def test_batch_larger_than_the_split_is_one_line_naming_it():
  with pytest.raises(data.BatchSizeError) as info:
    data.steps_per_epoch(1438, 4096, 'digits/train')
  message = str(info.value)
  assert isinstance(info.value, data.DataError)
  assert '\n' not in message
  for needle in ('batch_size=4096', 'digits/train', '1438 examples'):
    assert needle in message, message
