"""Tests of the weighted kNN (otclr_jax/evaluation/knn.py)."""

import numpy as np
import pytest

from otclr_jax.evaluation import knn
from tests.helpers import EPS64
from tests.helpers import rounding_tol


def _knn_reference(train_x, train_y, test_x, num_classes, k, temperature):
  norm = lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)
  sim = norm(test_x.astype(np.float64)) @ norm(train_x.astype(np.float64)).T
  k = min(k, len(train_x))
  pred = []
  for row in sim:
    nearest = np.argsort(-row)[:k]
    votes = np.zeros(num_classes)
    np.add.at(votes, train_y[nearest], np.exp(row[nearest] / temperature))
    pred.append(votes.argmax())
  return np.asarray(pred)


@pytest.mark.parametrize('k', [7, 200])
def test_knn_matches_numpy(monkeypatch, k):
  # A tiny slab bound forces several chunks and a padded last chunk.
  monkeypatch.setattr(knn, 'KNN_MAX_SLAB', 60 * 8)
  rng = np.random.default_rng(k)
  train_x = rng.normal(size=(60, 8)).astype(np.float32)
  train_y = rng.integers(0, 5, size=60).astype(np.int32)
  test_x = rng.normal(size=(21, 8)).astype(np.float32)
  test_y = rng.integers(0, 5, size=21).astype(np.int32)
  ref = _knn_reference(train_x, train_y, test_x, 5, k, 0.07)
  acc = knn.knn_top1(train_x, train_y, test_x, test_y, 5, k=k)
  # The same predictions: 100 k / 21 in float64 both ways, up to the order
  # of the mean's division and the product.
  assert acc == pytest.approx(100.0 * np.mean(ref == test_y),
                              abs=rounding_tol(stages=2, eps=EPS64) * 100)
  # Predicting the test points' own labels from themselves: a sanity anchor.
  assert knn.knn_top1(test_x, test_y, test_x, test_y, 5, k=1) == 100.0


def test_labels_outside_the_classes_are_refused():
  x = np.eye(4, dtype=np.float32)
  with pytest.raises(ValueError, match=r'train labels must lie in \[0, 2\)'):
    knn.knn_top1(x, np.array([0, 1, 2, 1]), x, np.array([0, 1, 0, 1]), 2)
  with pytest.raises(ValueError, match=r'test labels must lie in \[0, 2\)'):
    knn.knn_top1(x, np.array([0, 1, 0, 1]), x, np.array([0, -1, 0, 1]), 2)


def test_non_finite_features_are_refused():
  # NaN features had scored a plausible 10% on ten balanced classes.
  x = np.eye(4, dtype=np.float32)
  y = np.array([0, 1, 0, 1])
  for bad in (np.nan, np.inf):
    with pytest.raises(ValueError, match='finite'):
      knn.knn_top1(x.copy() * bad, y, x, y, 2)
    with pytest.raises(ValueError, match='finite'):
      knn.knn_top1(x, y, np.full_like(x, bad), y, 2)


def test_a_small_temperature_does_not_overflow_the_votes():
  # exp(cos / T) overflows float32 at T = 0.01; the nearer (class 1)
  # neighbour must still outvote the farther one.
  test_x = np.array([[1.0, 0.0]], np.float32)
  train_x = np.array([[0.90, np.sqrt(1 - 0.90**2)],
                      [0.99, np.sqrt(1 - 0.99**2)]], np.float32)
  for temperature in (0.07, 0.01, 0.002):
    assert knn.knn_top1(train_x, np.array([0, 1]), test_x, np.array([1]), 2,
                        k=2, temperature=temperature) == 100.0
