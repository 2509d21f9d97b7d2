"""Whether a run of a sweep is finished (launch/run_state.py): its final
step, its evaluation's protocol and files."""

import json
import os

import pytest

from launch import run_state
from launch import sweep as sweep_lib
from otclr_jax import config_files
from otclr_jax import rundir
from otclr_jax.evaluation import knn
from otclr_jax.evaluation import probe
from tests import helpers


def test_final_step_of_an_epoch_based_run_comes_from_metrics(tmp_path):
  config = config_files.apply_overrides(
      config_files.load(helpers.sweep_file('cifar10_paper')),
      [('num_epochs', 3)])
  assert run_state.final_step(config, str(tmp_path)) is None
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    for step in (50, 100):
      f.write(json.dumps({'step': step, 'epoch': step / 195}) + '\n')
    f.write('{"step": 150, "ep')  # torn by a crash
  assert run_state.final_step(config, str(tmp_path)) == 3 * 195
  with open(tmp_path / 'status.json', 'w') as f:
    json.dump({'state': 'finished', 'step': 585, 'total_steps': 585}, f)
  with open(tmp_path / 'eval_config.json', 'w') as f:
    json.dump(config.to_dict(), f)
  helpers.fake_results(str(tmp_path), 100)
  os.replace(tmp_path / 'eval_config.json', tmp_path / 'eval' / 'config.json')
  assert not run_state.is_finished(config, str(tmp_path))
  helpers.fake_results(str(tmp_path), 585)
  assert run_state.is_finished(config, str(tmp_path))


def test_the_identifying_protocol_is_what_the_evaluators_record():
  # Rows (aggregate) and staleness (run_state) read the same fields.
  assert sorted({**probe.PROTOCOL, **knn.PROTOCOL}) == sorted(
      rundir.PROTOCOL_FIELDS)


def test_results_of_another_probe_protocol_are_not_finished(four_runs):
  # The L2 grid, tolerance and solver are code: results fitted before they
  # changed must be evaluated again, not averaged beside new ones.
  sweep, workdir, names = four_runs
  run = sweep.runs(workdir)[0]
  config = sweep.run_config(run)
  helpers.write_run_files(run.workdir, config)
  path = os.path.join(run.workdir, 'eval', 'results.json')
  protocol = {'probe': probe.SOLVER, 'l2_grid': list(probe.L2_GRID),
              'probe_tolerance': probe.GRAD_TOL,
              'holdout_fraction': probe.HOLDOUT_FRACTION,
              'holdout_seed': probe.HOLDOUT_SEED}

  def write(protocol):
    with open(path, 'w') as f:
      json.dump({'step': config.total_steps, 'protocol': protocol}, f)

  write(protocol)
  assert run_state.is_finished(config, run.workdir)
  for key, old in (('l2_grid', [0.0] + list(probe.L2_GRID)),
                   ('probe_tolerance', 1e-6), ('holdout_seed', 1),
                   ('probe', 'full-batch L-BFGS (optax.lbfgs)')):
    write({**protocol, key: old})
    assert not run_state.is_finished(config, run.workdir)
    assert key in run_state.stale_results_reason(config, run.workdir)
  # Probe rows that record no protocol were fitted some unknown way.
  with open(path, 'w') as f:
    json.dump({'step': config.total_steps,
               'linear': {'digits': {'top1': 90.0}}}, f)
  assert 'probe None' in run_state.stale_results_reason(config, run.workdir)
  launcher = helpers.FakeLauncher()
  assert sweep_lib.run_sweep(sweep, workdir, launcher=launcher,
                             aggregate=False) == 0
  assert (names[0], 'eval') in launcher.calls
  assert (names[0], 'train') not in launcher.calls


def test_an_evaluation_cut_between_its_writes_is_never_finished(
    tmp_path, monkeypatch):
  from otclr_jax import fileio  # pylint: disable=g-import-not-at-top
  from otclr_jax.evaluation import evaluate  # pylint: disable=g-import-not-at-top
  path = helpers.write_sweep(tmp_path / 's.py', helpers.tiny_grid())
  sweep = sweep_lib.load_sweep(path)
  (run,) = sweep.runs(str(tmp_path / 'out'))
  old, new = sweep.run_config(run), sweep_lib.load_sweep(
      path, ['--config.eval.probe_steps=7']).run_config(run)
  helpers.write_run_files(run.workdir, old, evaluated=False)

  def results_of(config):
    return {'step': 2, 'method': 'otclr', 'seed': 0, 'batch_size': 16,
            'pretrain_dataset': 'digits', 'config': config.to_dict(),
            'linear': {'digits': {'top1': 90.0, 'top5': 99.0}},
            'protocol': {'probe': probe.SOLVER,
                         'l2_grid': list(probe.L2_GRID),
                         'probe_tolerance': probe.GRAD_TOL,
                         'holdout_fraction': probe.HOLDOUT_FRACTION,
                         'holdout_seed': probe.HOLDOUT_SEED}}

  evaluate.write_results(results_of(old), run.workdir, old)
  assert run_state.is_finished(old, run.workdir)
  real = fileio.write_text

  def full_disk_at_the_config(path, text):
    if path.endswith(os.path.join('eval', 'config.json')):
      raise OSError(28, 'No space left on device', path)
    real(path, text)

  monkeypatch.setattr(fileio, 'write_text', full_disk_at_the_config)
  with pytest.raises(OSError):
    evaluate.write_results(results_of(new), run.workdir, new)
  monkeypatch.setattr(fileio, 'write_text', real)
  # Neither evaluation's settings may find it finished: evaluate again.
  assert not run_state.is_finished(old, run.workdir)
  assert not run_state.is_finished(new, run.workdir)
  assert 'interrupted' in run_state.stale_results_reason(old, run.workdir)
  evaluate.write_results(results_of(new), run.workdir, new)
  assert run_state.is_finished(new, run.workdir)
  assert not run_state.is_finished(old, run.workdir)
