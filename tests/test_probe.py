"""Tests of the linear probe (otclr_jax/evaluation/probe.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import datasets
from sklearn import linear_model

from otclr_jax.evaluation import probe


def _blobs(num_classes, per_class, dim, seed, spread=0.3, noise_seed=None):
  """Gaussian blobs: centres drawn from `seed`, noise from `noise_seed`."""
  centres = 3.0 * np.random.default_rng(seed).normal(size=(num_classes, dim))
  rng = np.random.default_rng(seed if noise_seed is None else noise_seed + 1000)
  labels = np.repeat(np.arange(num_classes), per_class)
  x = centres[labels] + spread * rng.normal(size=(len(labels), dim))
  order = rng.permutation(len(labels))
  return x[order].astype(np.float32), labels[order].astype(np.int32)



def test_probe_separates_blobs():
  train_x, train_y = _blobs(6, 40, 16, seed=0)
  test_x, test_y = _blobs(6, 15, 16, seed=0, noise_seed=1)
  result = probe.linear_probe(train_x, train_y, test_x, test_y, 6,
                                 max_steps=50)
  assert result['top1'] == pytest.approx(100.0)
  assert result['top5'] == pytest.approx(100.0)
  assert result['val_top1'] == pytest.approx(100.0)
  assert result['weight_decay'] in probe.L2_GRID
  assert (result['num_train'], result['num_test']) == (240, 90)


def test_scores_top1_top5_match_numpy_count():
  rng = np.random.default_rng(0)
  for num_classes in (3, 9):
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = rng.integers(0, num_classes, size=64).astype(np.int32)
    params = {'w': rng.normal(size=(5, num_classes)).astype(np.float32),
              'b': rng.normal(size=num_classes).astype(np.float32)}
    top1, top5, ce = (np.asarray(a) for a in probe._scores(
        params, jnp.asarray(x), jnp.asarray(y)))
    logits = x.astype(np.float64) @ params['w'] + params['b']
    np.testing.assert_array_equal(top1, logits.argmax(1) == y)
    # Label among the five largest logits (all of them with < 5 classes).
    top5_ref = [y[i] in np.argsort(-logits[i])[:5] for i in range(64)]
    np.testing.assert_array_equal(top5, top5_ref)
    if num_classes < 5:
      assert top5.all()
    else:
      assert 0 < top5.mean() < 1
    log_z = np.log(np.exp(logits).sum(1))
    np.testing.assert_allclose(ce, log_z - logits[np.arange(64), y],
                               rtol=1e-5, atol=1e-5)


def test_regularisation_choice_never_reads_test():
  # Overlapping blobs with few examples per dimension: test accuracy depends
  # on lambda, and a selection that peeked at the test labels would pick a
  # different lambda once they are shuffled.
  train_x, train_y = _blobs(4, 30, 64, seed=2, spread=10.0)
  test_x, test_y = _blobs(4, 25, 64, seed=2, spread=10.0, noise_seed=3)
  first = probe.linear_probe(train_x, train_y, test_x, test_y, 4,
                                max_steps=40)
  shuffled = probe.linear_probe(
      train_x, train_y, test_x, np.random.default_rng(0).permutation(test_y),
      4, max_steps=40)
  garbage = probe.linear_probe(train_x, train_y,
                                  np.full_like(test_x, 1e3), test_y, 4,
                                  max_steps=40)
  for other in (shuffled, garbage):
    assert other['weight_decay'] == first['weight_decay']
    assert other['val_top1'] == first['val_top1']


def test_stratified_holdout():
  labels = np.repeat([0, 1, 2, 3], [30, 11, 2, 1])
  held = probe.stratified_holdout(labels, 0.1, seed=0)
  np.testing.assert_array_equal(
      [held[labels == c].sum() for c in range(4)], [3, 1, 1, 0])
  np.testing.assert_array_equal(held, probe.stratified_holdout(labels))
  assert not np.array_equal(held, probe.stratified_holdout(labels, seed=1))
  with pytest.raises(ValueError, match='fraction'):
    probe.stratified_holdout(labels, 1.0)


def test_probe_rejects_bad_labels():
  x, y = _blobs(3, 5, 4, seed=0)
  with pytest.raises(ValueError, match='labels'):
    probe.linear_probe(x, y, x, np.full_like(y, -1), 3)


def _digits_features():
  """Random ReLU features [1797, 256] of sklearn's digits, split 1000 / 797."""
  images, labels = datasets.load_digits(return_X_y=True)
  projection = np.random.default_rng(0).normal(size=(64, 256)) / 8.0
  x = np.maximum(images @ projection, 0.0).astype(np.float32)
  order = np.random.default_rng(1).permutation(len(x))
  x, y = x[order], labels[order].astype(np.int32)
  return (x[:1000], y[:1000]), (x[1000:], y[1000:])


def _sklearn_top1(train_x, train_y, test_x, test_y, l2):
  """Top-1 (percent) of sklearn's multinomial LogisticRegression, same loss.

  Ours is mean cross-entropy + l2 / 2 ||W||^2 with the bias unpenalised on
  features standardised with the train rows' moments; sklearn minimises
  sum cross-entropy + 1 / (2 C) ||W||^2, so C = 1 / (l2 N).
  """
  mean, std = train_x.mean(0), train_x.std(0)
  std = np.where(std > 0, std, 1.0)
  scale = lambda v: (v - mean) / std
  model = linear_model.LogisticRegression(
      C=1.0 / (l2 * len(train_x)), tol=1e-10, max_iter=100_000)
  model.fit(scale(train_x), train_y)
  return 100.0 * np.mean(model.predict(scale(test_x)) == test_y)


@pytest.mark.parametrize('l2', [1e-4, 1e-3, 1e-2])
def test_probe_matches_sklearn_logistic_regression(l2):
  (train_x, train_y), (test_x, test_y) = _digits_features()
  ours = probe.linear_probe(train_x, train_y, test_x, test_y, 10,
                            l2_grid=(l2,))
  reference = _sklearn_top1(train_x, train_y, test_x, test_y, l2)
  assert 80.0 < reference < 100.0  # a problem where the optimum matters
  assert ours['top1'] == pytest.approx(reference, abs=0.2)


def test_probe_with_the_grid_matches_sklearn_at_the_chosen_strength():
  (train_x, train_y), (test_x, test_y) = _digits_features()
  ours = probe.linear_probe(train_x, train_y, test_x, test_y, 10)
  assert ours['weight_decay'] > 0.0
  reference = _sklearn_top1(train_x, train_y, test_x, test_y,
                            ours['weight_decay'])
  assert ours['top1'] == pytest.approx(reference, abs=0.2)


@pytest.mark.parametrize('n', [37, probe.BLOCK_ROWS + 5])
def test_weighted_ce_and_its_gradient_equal_numpy(n):
  # One block, and several blocks with padding rows.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 6)).astype(np.float32)
  y = rng.integers(0, 4, size=n).astype(np.int32)
  weights = (rng.random(n) > 0.2).astype(np.float32)
  w = rng.normal(size=(4, 6)).astype(np.float32)
  b = rng.normal(size=4).astype(np.float32)
  blocks = probe._blocks(jnp.asarray(x), jnp.asarray(y), jnp.asarray(weights))
  assert blocks[0].shape[0] == -(-n // probe.BLOCK_ROWS)
  value, (grad_w, grad_b) = jax.value_and_grad(
      lambda w_, b_: 3.0 * probe._weighted_ce(w_, b_, *blocks),
      argnums=(0, 1))(jnp.asarray(w), jnp.asarray(b))

  logits = x.astype(np.float64) @ w.T.astype(np.float64) + b
  log_p = logits - logits.max(1, keepdims=True)
  log_p -= np.log(np.exp(log_p).sum(1, keepdims=True))
  onehot = np.eye(4)[y]
  delta = weights[:, None] * (np.exp(log_p) - onehot)
  np.testing.assert_allclose(
      value, -3.0 * np.sum(weights * log_p[np.arange(n), y]), rtol=1e-5)
  np.testing.assert_allclose(grad_w, 3.0 * delta.T @ x, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(grad_b, 3.0 * delta.sum(0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('l2', [1e-6, 1e-3])
def test_a_fit_stops_at_the_tolerance_of_its_weight_space_gradient(l2):
  # Rank-deficient features (every column twice): half the eigenvalues are
  # zero, where the preconditioned gradient is inflated; the stopping rule
  # must still mean "the gradient in (W, b) is small", checked here in
  # float64 NumPy at the returned weights.
  (train_x, train_y), _ = _digits_features()
  x = np.concatenate([train_x, train_x], axis=1)
  x = (x - x.mean(0)) / np.where(x.std(0) > 0, x.std(0), 1.0)
  weights = np.ones(len(x), np.float32)
  eigenvalues, basis = probe._eigenbasis(jnp.asarray(x, jnp.float32),
                                         jnp.asarray(weights))
  xb = np.asarray(probe._matmul(jnp.asarray(x, jnp.float32), basis))
  init = {'w': jnp.zeros((x.shape[1], 10)), 'b': jnp.zeros(10)}
  params, steps = probe._fit_probe(
      probe._blocks(jnp.asarray(xb), jnp.asarray(train_y),
                    jnp.asarray(weights)),
      jnp.float32(l2), eigenvalues, init, max_steps=5000)

  def grad_norm(w, b):
    logits = xb.astype(np.float64) @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(p)), train_y] -= 1.0
    return np.sqrt(np.sum((xb.T @ p / len(p) + l2 * w)**2)
                   + np.sum((p.sum(0) / len(p))**2))

  w, b = (np.asarray(v, np.float64) for v in (params['w'], params['b']))
  assert int(steps) < 5000
  assert grad_norm(w, b) <= 1.5 * probe.PROBE_TOLERANCE * grad_norm(
      np.zeros_like(w), np.zeros_like(b))


def test_separable_features_get_a_penalised_probe_at_its_optimum():
  # Without a penalty the loss of separable features has no minimum: a fit
  # there stops wherever the solver does, so the grid must not offer one,
  # and the chosen probe must equal the penalised optimum (sklearn).
  train_x, train_y = _blobs(4, 30, 64, seed=2, spread=3.0)
  test_x, test_y = _blobs(4, 15, 64, seed=2, spread=3.0, noise_seed=5)
  ours = probe.linear_probe(train_x, train_y, test_x, test_y, 4)
  assert ours['val_top1'] == pytest.approx(100.0)  # separable held-out rows
  assert ours['weight_decay'] > 0.0
  reference = _sklearn_top1(train_x, train_y, test_x, test_y,
                            ours['weight_decay'])
  assert ours['top1'] == pytest.approx(reference, abs=0.2)
