"""Tests of `evaluation.floor`: the random-init floor fitted once, shared."""

import json
import os
import threading
import time

import pytest

from otclr_jax import rundir
from otclr_jax.evaluation import evaluate
from otclr_jax.evaluation import floor
from otclr_jax.evaluation import probe
from tests import helpers

ROWS = [(('random_init', 'd', 'top1'), 12.5),
        (('random_init', 'd', 'knn_top1'), 1 / 3)]


def test_the_floor_is_fitted_once_and_read_back_exactly(tmp_path):
  calls = []

  def fit():
    calls.append(1)
    return ROWS

  identity = {'weights': 'abc', 'seed': 0}
  first = floor.load_or_fit(str(tmp_path), identity, fit, 'run_a')
  second = floor.load_or_fit(str(tmp_path), identity, fit, 'run_b')
  assert calls == [1]
  assert first == (ROWS, floor.floor_file(str(tmp_path), identity), True)
  assert second == (ROWS, first[1], False)
  # Another identity is another floor.
  assert floor.load_or_fit(str(tmp_path), {**identity, 'seed': 1}, fit,
                           'run_c')[2]
  assert len(calls) == 2
  with open(first[1]) as f:
    assert json.load(f)['fitted_by'] == os.path.abspath('run_a')


def test_a_second_run_waits_for_the_floor_another_is_fitting(tmp_path):
  started, order = threading.Event(), []

  def slow_fit():
    started.set()
    time.sleep(0.5)
    order.append('fitted')
    return ROWS

  def never():
    raise AssertionError('the waiting run fitted the floor again')

  first = threading.Thread(target=floor.load_or_fit,
                           args=(str(tmp_path), {'a': 1}, slow_fit, 'a'))
  first.start()
  assert started.wait(10)
  rows, _, fitted = floor.load_or_fit(str(tmp_path), {'a': 1}, never, 'b')
  first.join()
  assert (rows, fitted, order) == (ROWS, False, ['fitted'])


def test_a_floor_file_of_another_identity_is_refused(tmp_path):
  path = floor.floor_file(str(tmp_path), {'a': 1})
  rundir.write_json(path, {'identity': {'a': 2}, 'rows': []})
  with pytest.raises(rundir.CorruptFileError, match='another identity'):
    floor.load_or_fit(str(tmp_path), {'a': 1}, lambda: ROWS, 'w')


def test_runs_of_one_seed_share_one_floor_equal_to_their_own(
    finished_run, tmp_path, monkeypatch):
  base, trained, _ = finished_run
  helpers.small_digits(monkeypatch)
  fits = []
  original = probe.linear_probe
  monkeypatch.setattr(probe, 'linear_probe',
                      lambda *a, **k: fits.append(1) or original(*a, **k))
  evaluators = {'eval.evaluators': ('probe', 'knn')}
  alone = evaluate.evaluate_run(
      helpers.eval_config(base.data_dir, **evaluators),
      helpers.copy_run(trained, tmp_path / 'alone'), None).results
  assert len(fits) == 2  # the trained encoder and the floor
  shared = helpers.eval_config(base.data_dir, **evaluators,
                               **{'eval.floor_dir': str(tmp_path / 'floors')})
  first = evaluate.evaluate_run(
      shared, helpers.copy_run(trained, tmp_path / 'first'), None).results
  assert len(fits) == 4
  # Another run of the same seed and network (here: another method's
  # objective changes nothing the untrained encoder computes) reads it.
  second = evaluate.evaluate_run(
      shared, helpers.copy_run(trained, tmp_path / 'second'), None).results
  assert len(fits) == 5
  assert first['random_init'] == second['random_init'] == alone['random_init']
  assert first['linear'] == alone['linear']
  assert first['protocol']['floor']['fitted_here']
  assert not second['protocol']['floor']['fitted_here']
  assert second['protocol']['floor']['file'] == first['protocol']['floor'][
      'file']
  name = os.path.basename(first['protocol']['floor']['file'])
  assert sorted(os.listdir(tmp_path / 'floors')) == [name, name + '.lock']
  # No init features were extracted in the runs that share the floor.
  assert not os.path.exists(
      os.path.join(tmp_path / 'second' / 'run', 'eval', 'features', 'init'))
  # Another seed's untrained encoder has its own floor.
  reseeded = shared.copy_and_resolve_references()
  reseeded.seed = 1
  other = evaluate.evaluate_run(
      reseeded, helpers.copy_run(trained, tmp_path / 'other'), None).results
  assert other['protocol']['floor']['fitted_here']
  assert other['protocol']['floor']['file'] != first['protocol']['floor'][
      'file']
