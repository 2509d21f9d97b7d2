"""Tests of the linear probe (otclr_jax/evaluation/probe.py)."""

import functools

import numpy as np
import pytest
from sklearn import datasets
from sklearn import linear_model

from otclr_jax.evaluation import probe
from tests.helpers import rounding_tol


def _blobs(num_classes, per_class, dim, seed, spread=0.3, noise_seed=None):
  """Gaussian blobs: centres drawn from `seed`, noise from `noise_seed`."""
  centres = 3.0 * np.random.default_rng(seed).normal(size=(num_classes, dim))
  rng = np.random.default_rng(seed if noise_seed is None else noise_seed + 1000)
  labels = np.repeat(np.arange(num_classes), per_class)
  x = centres[labels] + spread * rng.normal(size=(len(labels), dim))
  order = rng.permutation(len(labels))
  return x[order].astype(np.float32), labels[order].astype(np.int32)


def _digits_features(dim=256, duplicate=False):
  """Random ReLU features [1797, dim] of sklearn's digits, split 1000 / 797."""
  images, labels = datasets.load_digits(return_X_y=True)
  projection = np.random.default_rng(0).normal(size=(64, dim)) / 8.0
  x = np.maximum(images @ projection, 0.0).astype(np.float32)
  if duplicate:  # rank-deficient: every column twice
    x = np.concatenate([x, x], axis=1)
  order = np.random.default_rng(1).permutation(len(x))
  x, y = x[order], labels[order].astype(np.int32)
  return (x[:1000], y[:1000]), (x[1000:], y[1000:])


# The probe's kernels in both array libraries (JAX on this CPU here).
BACKENDS = {'numpy': probe.NUMPY, 'jax': probe.JAX}


def _objective(l2=1e-3, n=50, d=6, c=4, seed=0, backend='numpy'):
  rng = np.random.default_rng(seed)
  x, y = rng.normal(size=(n, d)), rng.integers(0, c, size=n)
  return probe._Objective(x, y, l2, c, BACKENDS[backend]), x, y


def _preconditioned_newton_error(num_classes, coupled=False,
                                 backend='numpy'):
  """max |H M^-1 g - g| at a random point, and the gradient's max |g_W|."""
  objective, _, _ = _objective(l2=1e-2, c=num_classes, backend=backend)
  rng = np.random.default_rng(3)
  w, b = rng.normal(size=(6, num_classes)), rng.normal(size=num_classes)
  w, b = w - w.mean(1, keepdims=True), b - b.mean()
  with objective.backend.context():
    _, p = objective.value(w, b)
    gw, gb = objective.gradient(w, p)
    sw, sb = probe._class_preconditioner(objective, p, coupled)(gw, gb)
    hw, hb = objective.hessp(objective.steering(p), sw, sb)
    error = np.abs(np.concatenate([np.asarray(hw - gw).ravel(),
                                   np.asarray(hb - gb)])).max()
    return error, float(np.abs(gw).max())


def _reference_protocol(train_x, train_y, test_x, test_y, grid):
  """The probe's protocol solved by scikit-learn, float64, tol 1e-10.

  The same held-out split, standardisation, grid, tie-breaks (held-out
  top-1, then held-out cross-entropy, then grid order) and refit; sklearn
  minimises sum CE + 1 / (2 C) ||W||^2 with the bias unpenalised, i.e. ours
  times n with C = 1 / (lambda n). Newton-CG: at tol 1e-10 its weights agree
  with sklearn's Newton-Cholesky to 1e-7 where L-BFGS's stop 3e-5 away, in a
  tenth of L-BFGS's time.
  """
  train_x = train_x.astype(np.float64)
  test_x = test_x.astype(np.float64)
  held = probe.stratified_holdout(train_y)

  def fit(x, y, l2):
    return linear_model.LogisticRegression(
        C=1.0 / (l2 * len(x)), solver='newton-cg', tol=1e-10,
        max_iter=100_000).fit(x, y)

  def standardise(rows):
    std = rows.std(0)
    return rows.mean(0), np.where(std > 0, std, 1.0)

  mean, std = standardise(train_x[~held])
  x = (train_x - mean) / std
  candidates = []
  for index, l2 in enumerate(grid):
    model = fit(x[~held], train_y[~held], l2)
    log_p = model.predict_log_proba(x[held])
    top1 = np.mean(model.classes_[log_p.argmax(1)] == train_y[held])
    ce = -np.mean(log_p[np.arange(held.sum()), train_y[held]])
    candidates.append((-top1, ce, index))
  index = min(candidates)[2]
  mean, std = standardise(train_x)
  model = fit((train_x - mean) / std, train_y, grid[index])
  top1 = np.mean(model.predict((test_x - mean) / std) == test_y)
  return grid[index], 100.0 * top1


FEATURE_SETS = {
    # name: (train, test, number of classes)
    'digits_relu': _digits_features() + (10,),
    'digits_rank_deficient': _digits_features(96, duplicate=True) + (10,),
    # Fewer examples than dimensions: the solve drops the empty directions.
    'fewer_examples_than_dimensions': (
        _blobs(4, 15, 96, seed=4, spread=2.0),
        _blobs(4, 25, 96, seed=4, spread=2.0, noise_seed=9), 4),
    'nearly_separable_blobs': (_blobs(4, 60, 64, seed=2, spread=3.0),
                               _blobs(4, 40, 64, seed=2, spread=3.0,
                                      noise_seed=5), 4),
    'overlapping_blobs': (_blobs(5, 80, 32, seed=3, spread=6.0),
                          _blobs(5, 60, 32, seed=3, spread=6.0, noise_seed=7),
                          5),
}


@functools.lru_cache
def _reference(name):
  """`_reference_protocol` on FEATURE_SETS[name], once per session."""
  (train_x, train_y), (test_x, test_y), _ = FEATURE_SETS[name]
  return _reference_protocol(train_x, train_y, test_x, test_y, probe.L2_GRID)


class TestKernels:
  """The probe's scores, objective, Hessian and preconditioners."""

  def test_probe_separates_blobs(self):
    train_x, train_y = _blobs(6, 40, 16, seed=0)
    test_x, test_y = _blobs(6, 15, 16, seed=0, noise_seed=1)
    result = probe.linear_probe(train_x, train_y, test_x, test_y, 6)
    assert result['top1'] == pytest.approx(100.0)
    assert result['top5'] == pytest.approx(100.0)
    assert result['val_top1'] == pytest.approx(100.0)
    assert result['weight_decay'] in probe.L2_GRID
    assert (result['num_train'], result['num_test']) == (240, 90)
    # With at most five classes top-5 is 100% by construction: not reported.
    few = [probe.linear_probe(train_x[train_y < c], train_y[train_y < c],
                              test_x[test_y < c], test_y[test_y < c], c)
           for c in (probe.TOP5, probe.TOP5 + 1)]
    assert 'top5' not in few[0] and few[1]['top5'] == pytest.approx(100.0)

  def test_scores_top1_top5_match_a_count(self):
    rng = np.random.default_rng(0)
    for num_classes in (3, 9):
      x = rng.normal(size=(64, 5))
      y = rng.integers(0, num_classes, size=64)
      w, b = rng.normal(size=(5, num_classes)), rng.normal(size=num_classes)
      top1, top5, ce = probe._scores(w, b, x, y)
      logits = x @ w + b
      np.testing.assert_array_equal(top1, logits.argmax(1) == y)
      # Label among the five largest logits (all of them with < 5 classes).
      top5_ref = [y[i] in np.argsort(-logits[i])[:5] for i in range(64)]
      np.testing.assert_array_equal(top5, top5_ref)
      if num_classes < 5:
        assert top5.all()
      else:
        assert 0 < top5.mean() < 1
      log_z = np.log(np.exp(logits).sum(1))
      # Both float64; logsumexp shifts by the max, the reference does not:
      # they differ by a few ulps of log_z (|log_z| < 20 here).
      np.testing.assert_allclose(ce, log_z - logits[np.arange(64), y],
                                 rtol=0, atol=1e-12)

  @pytest.mark.parametrize('backend', sorted(BACKENDS))
  def test_objective_value_and_gradient_equal_their_definition(self, backend):
    objective, x, y = _objective(backend=backend)
    rng = np.random.default_rng(1)
    w, b = rng.normal(size=(6, 4)), rng.normal(size=4)
    value, p = objective.value(w, b)
    grad_w, grad_b = objective.gradient(w, p)
    logits = x @ w + b
    log_p = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    expected = -np.mean(log_p[np.arange(50), y]) + 0.5e-3 * np.sum(w * w)
    # float64 sums of 50 terms of size < 10: far below 1e-12.
    assert value == pytest.approx(expected, rel=0, abs=1e-12)
    np.testing.assert_allclose(p, np.exp(log_p), rtol=0, atol=1e-15)
    # The gradient against central differences of the value: truncation
    # error h^2 f''' / 6 ~ 1e-11 and rounding eps f / h ~ 1e-10 at h = 1e-5.
    h = 1e-5
    theta = np.concatenate([w.ravel(), b])
    loss = lambda t: objective.value(t[:24].reshape(6, 4), t[24:])[0]
    numeric = np.array([(loss(theta + h * e) - loss(theta - h * e)) / (2 * h)
                        for e in np.eye(len(theta))])
    np.testing.assert_allclose(np.concatenate([np.asarray(grad_w).ravel(),
                                               grad_b]),
                               numeric, rtol=0, atol=1e-8)

  @pytest.mark.parametrize('backend', sorted(BACKENDS))
  def test_objective_hessian_product_equals_the_explicit_hessian(self, backend):
    objective, x, _ = _objective(l2=1e-2, backend=backend)
    rng = np.random.default_rng(2)
    w, b = rng.normal(size=(6, 4)), rng.normal(size=4)
    dw, db = rng.normal(size=(6, 4)), rng.normal(size=4)
    # The Hessian in (W, b) written out: sum_i (diag(p_i) - p_i p_i^T) (x)
    # [x_i, 1] [x_i, 1]^T / n, plus l2 on the W block.
    p = np.asarray(objective.value(w, b)[1])
    xb = np.concatenate([x, np.ones((len(x), 1))], axis=1)  # [N, D + 1]
    hessian = sum(np.kron(np.outer(xi, xi), np.diag(pi) - np.outer(pi, pi))
                  for xi, pi in zip(xb, p)) / len(x)
    hessian[:24, :24] += 1e-2 * np.eye(24)  # (d, c) row-major, like W.ravel()
    v = np.concatenate([dw.ravel(), db])
    # hessp multiplies by x in float32, summing N rows and D + 1 columns,
    # relative to the same products of absolute values.
    bound = rounding_tol(len(x), x.shape[1] + 1) * (np.abs(hessian)
                                                    @ np.abs(v))
    hw, hb = objective.hessp(np.float32(p.T), dw, db)
    error = np.abs(np.concatenate([np.asarray(hw).ravel(), hb])
                   - hessian @ v)
    assert np.all(error <= bound), np.max(error / bound)

  @pytest.mark.parametrize('backend', sorted(BACKENDS))
  def test_the_preconditioner_inverts_the_class_blocks(self, backend):
    # With two classes the ones-complement has one direction, whose block is
    # the whole Hessian there: the preconditioned gradient is the exact Newton
    # direction, up to float32 blocks (D + 1 + N roundings) and the bias floor.
    error, scale = _preconditioned_newton_error(2, backend=backend)
    assert error <= 1e-5 * scale

  @pytest.mark.parametrize('backend', sorted(BACKENDS))
  def test_the_coupled_preconditioner_inverts_the_whole_hessian(self, backend):
    # Four classes: the coupled preconditioner is the whole Hessian in the
    # ones-complement, so the preconditioned gradient is the Newton direction
    # there, up to float32 blocks and the bias floor (as above). The class
    # blocks alone miss the coupling by orders more than that tolerance.
    coupled, scale = _preconditioned_newton_error(4, True, backend)
    blocks, _ = _preconditioned_newton_error(4, backend=backend)
    assert coupled <= 1e-5 * scale < blocks


class TestProtocol:
  """The whole protocol: references, fits, selection and contracts."""

  @pytest.mark.parametrize('backend', sorted(BACKENDS))
  @pytest.mark.parametrize('name', sorted(FEATURE_SETS))
  def test_the_probe_equals_a_converged_reference(self, name, backend):
    (train_x, train_y), (test_x, test_y), num_classes = FEATURE_SETS[name]
    fit_with = lambda backend: probe.linear_probe(
        train_x, train_y, test_x, test_y, num_classes, backend=backend,
        return_probe=True)
    ours, fitted = fit_with(backend)
    l2, top1 = _reference(name)
    assert ours['weight_decay'] == l2
    # Within one test image.
    assert abs(ours['top1'] - top1) <= 100.0 / len(test_y) + 1e-9
    assert all(fit['converged'] for fit in ours['fits'])
    assert ours['converged'] is True
    assert len(ours['fits']) == len(probe.L2_GRID) + 1
    if backend == 'jax':
      numpy_row, numpy_fitted = fit_with('numpy')
      assert ours['weight_decay'] == numpy_row['weight_decay']
      assert ours['top1'] == numpy_row['top1']
      # Both refits are within GRAD_TOL of the gradient's zero, and the loss
      # is lambda-strongly convex in W: each W lies within GRAD_TOL / lambda
      # of the optimum (the basis is orthogonal), the two within twice that.
      np.testing.assert_allclose(fitted.w, numpy_fitted.w, rtol=0,
                                 atol=2 * probe.GRAD_TOL / l2)

  def test_the_probe_with_coupled_steps_equals_the_reference(self, monkeypatch):
    # CIFAR-10-sized fits switch to the coupled preconditioner; these small
    # sets never need it, so force it at every Newton step.
    monkeypatch.setattr(probe, 'COUPLE_AFTER', 1)
    self.test_the_probe_equals_a_converged_reference(
        'nearly_separable_blobs', 'numpy')

  def test_a_fit_from_a_far_start_reaches_the_optimum_from_zero(
      self, monkeypatch):
    # The refit starts from weights fitted to other rows; a start far out on
    # overlapping blobs makes the Newton step backtrack, so the damped steps
    # run, and its classes' mean is not zero, so it is projected out. The
    # loss is l2-strongly convex: |w - w*| <= |g| / l2 <= 1e-5.
    x, y = _blobs(5, 80, 32, seed=3, spread=6.0)
    x = (x - x.mean(0)) / x.std(0)
    evaluations = []
    value = probe._Objective.value
    monkeypatch.setattr(probe._Objective, 'value',
                        lambda self, w, b: evaluations.append(1)
                        or value(self, w, b))
    start = np.random.default_rng(0).normal(size=(32, 5))
    objective = probe._Objective(x, y, 1e-3, 5)
    near = probe._solve(objective, np.zeros((32, 5)), np.zeros(5), 500)
    del evaluations[:]
    far = probe._solve(objective, 30.0 * start, np.zeros(5), 500)
    assert near.converged and far.converged
    assert len(evaluations) > far.steps + 1  # some step backtracked
    np.testing.assert_allclose(far.w, near.w, rtol=0, atol=2e-5)
    np.testing.assert_allclose(far.b, near.b, rtol=0, atol=2e-5)

  def test_every_fit_is_recorded_and_converged_means_a_small_gradient(self):
    (train_x, train_y), (test_x, test_y) = _digits_features()
    ours, fitted = probe.linear_probe(train_x, train_y, test_x, test_y, 10,
                                      return_probe=True)
    assert [f['lambda'] for f in ours['fits'][:-1]] == list(probe.L2_GRID)
    refit = ours['fits'][-1]
    assert refit['refit'] and refit['lambda'] == ours['weight_decay']
    for fit in ours['fits']:
      assert fit['converged'] and fit['grad_norm'] <= probe.GRAD_TOL
      assert 0 < fit['steps'] < probe.DEFAULT_PROBE_STEPS
    # The refit's gradient in the original coordinates, recomputed here.
    x = (train_x.astype(np.float64) - fitted.mean) / fitted.std
    logits = x @ fitted.w + fitted.b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(p)), train_y] -= 1.0
    grad = np.concatenate([
        (x.T @ p / len(p) + fitted.weight_decay * fitted.w).ravel(),
        p.sum(0) / len(p)])
    # The solver's gradient and this one differ by float64 rounding of sums
    # over 1,000 rows (~1e-13), far below the tolerance.
    assert np.linalg.norm(grad) <= 2 * probe.GRAD_TOL

  def test_a_fit_cut_short_is_flagged(self, caplog):
    (train_x, train_y), (test_x, test_y) = _digits_features()
    # Two Newton steps from zero cannot reach the optimum.
    short = probe.linear_probe(train_x, train_y, test_x, test_y, 10,
                               max_steps=2)
    assert not any(fit['converged'] for fit in short['fits'])
    # The reported number says so too (results.json's row, the summary).
    assert short['converged'] is False
    assert all(fit['steps'] == 2 and fit['grad_norm'] > probe.GRAD_TOL
               for fit in short['fits'])
    assert 'did not converge' in caplog.text
    # Each fit says where the probe is: fit i of the grid and the refit.
    count = len(probe.L2_GRID) + 1
    for i in range(1, count):
      assert f'probe fit {i}/{count}, lambda=' in caplog.text
    assert 'ETA >= ' in caplog.text

  def test_a_fit_that_did_not_converge_ranks_below_converged_ones(self):
    def record(converged, val_top1, val_ce):
      return {'converged': converged, 'val_top1': val_top1, 'val_ce': val_ce}
    assert probe.select([record(False, 99.0, 0.1), record(True, 90.0, 0.5),
                         record(True, 90.0, 0.4)]) == 2
    assert probe.select([record(True, 90.0, 0.4), record(True, 90.0, 0.4)]) == 0
    assert probe.select([record(False, 80.0, 0.4),
                         record(False, 85.0, 0.9)]) == 1

  def test_the_probe_leaves_the_shared_features_unchanged(self):
    # kNN and the probe read the same cached feature arrays.
    (train_x, train_y), (test_x, test_y) = _digits_features()
    copies = [a.copy() for a in (train_x, train_y, test_x, test_y)]
    probe.linear_probe(train_x, train_y, test_x, test_y, 10, l2_grid=(1e-2,))
    for array, copy in zip((train_x, train_y, test_x, test_y), copies):
      np.testing.assert_array_equal(array, copy)

  def test_regularisation_choice_never_reads_test(self):
    # Overlapping blobs with few examples per dimension: test accuracy depends
    # on lambda, and a selection that peeked at the test labels would pick a
    # different lambda once they are shuffled.
    train_x, train_y = _blobs(4, 30, 64, seed=2, spread=10.0)
    test_x, test_y = _blobs(4, 25, 64, seed=2, spread=10.0, noise_seed=3)
    first = probe.linear_probe(train_x, train_y, test_x, test_y, 4)
    shuffled = probe.linear_probe(
        train_x, train_y, test_x, np.random.default_rng(0).permutation(test_y),
        4)
    garbage = probe.linear_probe(train_x, train_y,
                                 np.full_like(test_x, 1e3), test_y, 4)
    for other in (shuffled, garbage):
      assert other['weight_decay'] == first['weight_decay']
      assert other['val_top1'] == first['val_top1']

  def test_stratified_holdout(self):
    labels = np.repeat([0, 1, 2, 3], [30, 11, 2, 1])
    held = probe.stratified_holdout(labels, 0.1, seed=0)
    np.testing.assert_array_equal(
        [held[labels == c].sum() for c in range(4)], [3, 1, 1, 0])
    np.testing.assert_array_equal(held, probe.stratified_holdout(labels))
    assert not np.array_equal(held, probe.stratified_holdout(labels, seed=1))
    with pytest.raises(ValueError, match='fraction'):
      probe.stratified_holdout(labels, 1.0)

  def test_probe_rejects_bad_labels_and_grids(self):
    x, y = _blobs(3, 5, 4, seed=0)
    with pytest.raises(ValueError, match='labels'):
      probe.linear_probe(x, y, x, np.full_like(y, -1), 3)
    with pytest.raises(ValueError, match='l2_grid'):
      probe.linear_probe(x, y, x, y, 3, l2_grid=(0.0, 1e-3))
    # No test rows: no accuracy to report (not a NaN).
    with pytest.raises(ValueError, match='one train and one test row'):
      probe.linear_probe(x, y, x[:0], y[:0], 3)

  def test_the_saved_probe_reproduces_the_reported_top1(self, tmp_path):
    (train_x, train_y), (test_x, test_y) = _digits_features()
    row, fitted = probe.linear_probe(train_x, train_y, test_x, test_y, 10,
                                     return_probe=True)
    path = str(tmp_path / 'probe.npz')
    probe.save_probe(path, fitted, dataset='digits', step=3, top1=row['top1'])
    logits = probe.load_probe(path).logits(test_x)
    assert 100.0 * np.mean(logits.argmax(1) == test_y) == row['top1']

  def test_a_collapsed_encoders_tied_logits_score_chance_top5(self):
    # Constant features: every logit is tied. Top-5 returns five classes, as
    # torch's topk(5) and sklearn's top_k_accuracy_score do (50% of 10).
    from sklearn import metrics
    classes = 10
    train_y, test_y = np.repeat(np.arange(classes), 50), np.repeat(
        np.arange(classes), 20)
    row, fitted = probe.linear_probe(
        np.zeros((len(train_y), 8), np.float32), train_y,
        np.zeros((len(test_y), 8), np.float32), test_y, classes,
        return_probe=True)
    logits = fitted.logits(np.zeros((len(test_y), 8), np.float32))
    assert np.all(logits == logits[:, :1])
    reference = 100 * metrics.top_k_accuracy_score(test_y, logits, k=5,
                                                   labels=np.arange(classes))
    assert (row['top1'], row['top5']) == (10.0, reference) == (10.0, 50.0)

  def test_classes_without_train_rows_are_fitted_not_crashed_on(self):
    # Classes 5-9 have no train rows: their bias has no finite optimum, and
    # the preconditioner becomes singular on the way (it divided by zero).
    (train_x, train_y), (test_x, test_y) = (
        _blobs(5, 40, 8, seed=0, spread=3.0),
        _blobs(5, 10, 8, seed=0, spread=3.0, noise_seed=1))
    row, fitted = probe.linear_probe(train_x, train_y, test_x, test_y, 10,
                                     max_steps=30, return_probe=True)
    assert fitted.logits(test_x).argmax(1).max() < 5
    for fit in row['fits']:
      assert fit['converged'] == (fit['grad_norm'] <= probe.GRAD_TOL)

  def test_no_held_out_rows_is_an_error(self):
    x = np.random.default_rng(0).normal(size=(10, 5)).astype(np.float32)
    with pytest.raises(ValueError, match='held-out rows'):
      probe.linear_probe(x, np.arange(10), x, np.arange(10), 10)

  def test_float64_features_keep_their_precision(self):
    # A class signal below float32's resolution at the features' offset: the
    # probe is affine-invariant, so the shifted features score as the centred.
    rng = np.random.default_rng(0)
    y, test_y = np.repeat(np.arange(2), 100), np.repeat(np.arange(2), 50)
    x = 1e5 + 1e-3 * (y[:, None] + 0.3 * rng.normal(size=(200, 4)))
    test_x = 1e5 + 1e-3 * (test_y[:, None] + 0.3 * rng.normal(size=(100, 4)))
    shifted = probe.linear_probe(x, y, test_x, test_y, 2)
    centred = probe.linear_probe((x - 1e5) * 1e3, y, (test_x - 1e5) * 1e3,
                                 test_y, 2)
    assert shifted['top1'] == centred['top1'] == 100.0

  @pytest.mark.parametrize('num_classes, couples', [(10, True), (100, False)])
  def test_the_coupled_square_is_built_only_within_the_memory_bound(
      self, monkeypatch, num_classes, couples):
    # CIFAR-10's and CIFAR-100's class counts at small N and D, under a bound
    # that holds the coupled square of 10 classes but not 100 at D + 1 = 9.
    # Every Newton step asks for the coupling (CIFAR-10-sized fits do after
    # COUPLE_AFTER CG steps); above the bound the class blocks still converge.
    train_x, train_y = _blobs(num_classes, 12, 8, seed=5, spread=2.0)
    test_x, test_y = _blobs(num_classes, 4, 8, seed=5, spread=2.0,
                            noise_seed=6)
    monkeypatch.setattr(probe, 'COUPLE_AFTER', 1)
    monkeypatch.setattr(probe, 'COUPLED_BYTES', 8 * (9 * 9)**2)
    built = []
    invert = probe.NUMPY.invert_coupled
    monkeypatch.setattr(probe, 'NUMPY', probe.NUMPY._replace(
        invert_coupled=lambda own, *args: built.append(own.shape) or invert(
            own, *args)))
    row = probe.linear_probe(train_x, train_y, test_x, test_y, num_classes,
                             backend='numpy')
    assert row['converged'] and all(fit['converged'] for fit in row['fits'])
    # The squares built, as the hook saw their blocks.
    assert bool(built) == couples
    assert all(8 * (k * d1)**2 <= probe.COUPLED_BYTES for k, d1, _ in built)

  def test_the_coupled_square_fits_the_bound_for_cifar10_only(self):
    assert probe._couples(9, 513)  # CIFAR-10 at D = 512: 170 MB
    assert 8 * (9 * 513)**2 <= probe.COUPLED_BYTES
    assert not probe._couples(99, 513)  # CIFAR-100 / Food-101: 21 GB
