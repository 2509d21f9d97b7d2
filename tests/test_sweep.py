"""Tests of the sweep (launch/sweep.py): runs, commands, resuming, results
that cannot be silently wrong, one-line errors."""

import glob
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import ml_collections
import numpy as np
import pytest

from launch import launcher as launcher_lib
from launch import sweep as sweep_lib
from otclr_jax import cli
from otclr_jax import experiment
from tests import helpers
from tests.helpers import FakeLauncher
from tests.helpers import flags_of
from tests.helpers import sweep_file
from tests.helpers import tiny_grid
from tests.helpers import write_sweep


def overrides(run):
  return dict(run.overrides)


def _run(sweep, workdir, launcher=None, **kwargs):
  """`run_sweep` with `launcher` (a new FakeLauncher), not aggregating."""
  return sweep_lib.run_sweep(sweep, workdir, **{
      'aggregate': False, 'launcher': launcher or FakeLauncher(), **kwargs})


def _main(path, workdir, *flags):
  return sweep_lib.main(['sweep', f'--config={path}', f'--workdir={workdir}',
                         *flags])


# ----------------------------------------------------------------------------
# Runs and commands.


def test_paper_sweep_expands_to_named_runs_and_commands(tmp_path, capsys):
  sweep = sweep_lib.load_sweep(sweep_file('cifar10_paper'))
  runs = sweep.runs(str(tmp_path))
  assert [r.name for r in runs] == [
      f'seed={s},batch_size={b},method={m}' for s in (0, 1, 2)
      for b in (256, 512) for m in ('simclr', 'otclr')]
  assert [r.index for r in runs] == list(range(12))
  assert sweep_lib.run_sweep(sweep, str(tmp_path), dry_run=True) == 0
  lines = [l.strip() for l in capsys.readouterr().out.splitlines()]
  commands = [shlex.split(l) for l in lines if 'otclr_jax.main' in l]
  assert len(commands) == 2 * 12
  for run, train, evaluate in zip(runs, commands[::2], commands[1::2]):
    assert train[:3] == [sys.executable, '-m', 'otclr_jax.main']
    flags = flags_of(train)
    values = overrides(run)
    assert flags == {
        'config': sweep_file('cifar10_paper'),
        'workdir': os.path.join(str(tmp_path), run.name),
        'config.method': values['method'],
        'config.batch_size': str(values['batch_size']),
        'config.seed': str(values['seed']),
        # The sweep's runs share their random-init floors.
        'config.eval.floor_dir': os.path.join(str(tmp_path), 'floors')}
    assert flags_of(evaluate) == {**flags, 'config.mode': 'eval'}
    # The command's config is the run's: what training will store.
    config = sweep.run_config(run)
    assert (config.dataset, config.method, config.batch_size, config.seed) == (
        'cifar10', values['method'], values['batch_size'], values['seed'])
  assert os.listdir(tmp_path) == []  # a dry run leaves no trace


def test_any_config_key_can_be_swept(tmp_path):
  path = write_sweep(tmp_path / 's.py', {'ot.epsilon': [0.05, 0.1],
                                         'model.proj_dim': [16, 32]})
  sweep = sweep_lib.load_sweep(path)
  runs = sweep.runs(str(tmp_path / 'out'))
  assert [r.name for r in runs] == [
      'ot.epsilon=0.05,model.proj_dim=16', 'ot.epsilon=0.05,model.proj_dim=32',
      'ot.epsilon=0.1,model.proj_dim=16', 'ot.epsilon=0.1,model.proj_dim=32']
  assert sweep.run_config(runs[3]).ot.epsilon == 0.1
  assert sweep.run_config(runs[3]).model.proj_dim == 32


def test_overrides_reach_the_command_line_with_config_flag_syntax(tmp_path):
  path = write_sweep(tmp_path / 's.py', tiny_grid(), {
      'data_dir': '/d', 'ot.learn_alpha': True,
      'eval.datasets': ('digits', 'cifar10')})
  sweep = sweep_lib.load_sweep(path, ['--config.ot.epsilon=0.1'])
  (run,) = sweep.runs(str(tmp_path / 'out'))
  assert run.name == 'seed=0,method=otclr'
  flags = flags_of(sweep_lib.command(sweep, run, 'train'))
  assert flags['config.data_dir'] == '/d'
  assert flags['config.ot.learn_alpha'] == 'true'
  assert flags['config.eval.datasets'] == "('digits', 'cifar10')"
  assert flags['config.ot.epsilon'] == '0.1'
  assert sweep.run_config(run).ot.epsilon == 0.1


_DIGITS_SWEEP = ('from configs import digits\n'
                 'def get_config():\n  return digits.get_config()\n'
                 'def get_hyper(hyper):\n  return {}\n')


@pytest.mark.parametrize('sweep, message', [
    (({**tiny_grid(), 'seed': []}, None), 'non-empty list'),
    ((tiny_grid(), {'ot.no_such_field': 1}),
     r's\.py \(run .*\): Bad config override .*no_such_field'),
    ((tiny_grid(), {'total_steps': 'many'}),
     r'total_steps=many: invalid literal for int'),
    ((tiny_grid(), {'total_steps': 1.5}), r'total_steps=1\.5: invalid literal'),
    ((tiny_grid(), {'seed': 3}), 'set by two parts'),
    (({**tiny_grid(), 'seed': [0, 0]}, None), 'duplicate run names'),
    (({'method': ['simclr', 'nosuch']}, None),
     r'run method=nosuch\): config\.method must be one of'),
    ((tiny_grid(), {'ot': {'epsilon': 0.1}}),
     r'config\.ot is a block of fields; .*config\.ot\.epsilon'),
    # A typo must not add a key and leave the real field at its default.
    ((tiny_grid(), {'ot.epsilonn': 0.1}), 'Did you mean "epsilon"'),
    ('def get_config(:\n', 'SyntaxError'),
    (_DIGITS_SWEEP.format('hyper.sweep("config.seed", 3)'), 'TypeError'),
    (_DIGITS_SWEEP.format('hyper.sweep("seed", [0, 1])'), 'config.<field>'),
])
def test_bad_sweep_files_are_refused_in_one_line_before_anything_runs(
    tmp_path, capsys, sweep, message):
  path = tmp_path / 's.py'
  if isinstance(sweep, str):
    path.write_text(sweep)
  else:
    write_sweep(path, *sweep)
  with pytest.raises(ValueError, match=message):
    sweep_lib.load_sweep(str(path))
  assert _main(path, tmp_path / 'out') == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and 'Traceback' not in err
  assert re.search(message, err), err
  assert not os.path.exists(tmp_path / 'out')


def test_overrides_take_mains_spelling(tmp_path):
  # Other spellings are refused: tests/test_cli.py.
  sweep = sweep_lib.load_sweep(write_sweep(tmp_path / 's.py', tiny_grid()),
                               ['--config.ot.epsilon=0.2'])
  (run,) = sweep.runs(str(tmp_path / 'out'))
  assert flags_of(sweep_lib.command(sweep, run, 'train'))[
      'config.ot.epsilon'] == '0.2'


def test_folder_datasets_get_a_single_path_component():
  hypers = sweep_lib.HYPER.product([
      sweep_lib.HYPER.sweep('config.dataset', ['folder:/data/my pets']),
      sweep_lib.HYPER.sweep('config.seed', [1]),
      sweep_lib.HYPER.fixed('config.batch_size', 64)])
  config = ml_collections.ConfigDict({'eval': {'floor_dir': ''}})
  (run,) = sweep_lib.Sweep('/s.py', config, (), tuple(hypers)).runs('/w')
  assert run.name == 'dataset=folder-data-my-pets,seed=1'
  assert run.workdir == '/w/dataset=folder-data-my-pets,seed=1'


def test_tilde_in_workdir_is_the_home_directory(tmp_path, monkeypatch):
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  monkeypatch.chdir(tmp_path)
  assert _main(write_sweep(tmp_path / 's.py', tiny_grid()), '~/sw',
               '--slurm') == 0
  assert (tmp_path / 'home' / 'sw' / 'sweep.sbatch').exists()
  assert not (tmp_path / '~').exists()


# ----------------------------------------------------------------------------
# SLURM array tasks.


def test_array_task_refuses_a_sweep_file_that_changed(tmp_path):
  path = write_sweep(tmp_path / 's.py', tiny_grid(seeds=(0, 1)),
                     base={'ot.epsilon': 0.05})
  workdir = str(tmp_path / 'out')
  sweep_lib.write_slurm(sweep_lib.load_sweep(path), workdir, job_name='t')
  launcher = FakeLauncher()
  assert _run(sweep_lib.load_sweep(path), workdir, launcher,
              only_index=1) == 0
  assert launcher.calls
  # The same run names, another value of a fixed setting: the tasks still to
  # run would train otherwise than the ones that ran.
  write_sweep(tmp_path / 's.py', tiny_grid(seeds=(0, 1)),
              base={'ot.epsilon': 0.5})
  with pytest.raises(ValueError,
                     match=r'run seed=0.*ot\.epsilon: 0\.05 -> 0\.5'):
    _run(sweep_lib.load_sweep(path), workdir, only_index=1)
  write_sweep(tmp_path / 's.py', tiny_grid(seeds=(1, 2)),
              base={'ot.epsilon': 0.05})
  with pytest.raises(ValueError, match='sweep file changed'):
    _run(sweep_lib.load_sweep(path), workdir, only_index=0)


# ----------------------------------------------------------------------------
# Local runs with a fake launcher.


def test_resuming_skips_finished_runs_and_relaunches_the_rest(four_runs,
                                                              capsys):
  sweep, workdir, names = four_runs
  runs = sweep.runs(workdir)
  # Run 0 finished; run 1 evaluated at an intermediate step (not finished);
  # run 2 trained but not evaluated; run 3 untouched.
  for run, kwargs in zip(runs, ({}, {'state': 'stopped', 'step': 1},
                                {'evaluated': False})):
    helpers.write_run_files(run.workdir, sweep.run_config(run), **kwargs)
  launcher = FakeLauncher()
  assert _run(sweep, workdir, launcher) == 0
  assert launcher.calls == [(names[1], 'train'), (names[1], 'eval'),
                            (names[2], 'eval'),
                            (names[3], 'train'), (names[3], 'eval')]
  # Progress with an estimate from the runs worked on, not the skipped one.
  out = capsys.readouterr().out
  assert 'runs through' not in out.split(names[1])[0]
  assert re.search(r'2 of 4 runs through, about \d\d:\d\d:\d\d left', out)
  assert '4 of 4 runs through' not in out
  # Everything finished now: a second pass launches nothing.
  again = FakeLauncher()
  assert _run(sweep, workdir, again) == 0
  assert again.calls == []
  assert len(json.load(open(os.path.join(workdir, 'runs.json')))['runs']) == 4


def test_a_failed_run_is_reported_and_the_sweep_goes_on(four_runs, capsys):
  sweep, workdir, names = four_runs
  launcher = FakeLauncher(fail={(names[1], 'train')})
  assert _run(sweep, workdir, launcher) == 1
  assert [n for n, mode in launcher.calls if mode == 'eval'] == [
      names[0], names[2], names[3]]
  assert f'FAILED {names[1]}' in capsys.readouterr().out
  stopping = FakeLauncher(fail={(names[0], 'eval')})
  assert _run(sweep, workdir + '2', stopping, stop_on_error=True) == 1
  assert stopping.calls == [(names[0], 'train'), (names[0], 'eval')]


@pytest.mark.parametrize('stop', ['signal', 'evaluation', 'preempted'])
def test_a_stopped_run_stops_the_sweep_with_75(four_runs, capsys, stop):
  # A stopped evaluation is no failure (going on, then exiting 1): it stops
  # the sweep.
  sweep, workdir, names = four_runs
  launcher = FakeLauncher(**{
      'signal': {'stop_during': names[1], 'stop_at_step': 1},
      'evaluation': {'fail': {(names[0], 'eval'): 75}},
      'preempted': {'exit_stopped': {names[1]}}}[stop])
  assert _run(sweep, workdir, launcher) == 75
  # A signal during training stops without evaluating.
  assert launcher.calls == [(names[0], 'train'), (names[0], 'eval')] + (
      [] if stop == 'evaluation' else [(names[1], 'train')])
  if stop == 'preempted':  # the child leaves its run unfinished
    out = capsys.readouterr().out
    assert f'{names[1]}: stopped' in out and 'rerun' in out
    resumed = FakeLauncher()
    assert _run(sweep, workdir, resumed) == 0
    assert resumed.calls[:2] == [(names[1], 'train'), (names[1], 'eval')]


def test_only_index_runs_one_run(four_runs):
  sweep, workdir, names = four_runs
  launcher = FakeLauncher()
  assert _run(sweep, workdir, launcher, only_index=2, aggregate=True) == 0
  assert launcher.calls == [(names[2], 'train'), (names[2], 'eval')]
  with pytest.raises(ValueError, match='only_index'):
    _run(sweep, workdir, launcher, only_index=4, aggregate=True)


# ----------------------------------------------------------------------------
# The real thing, twice: same seed, same numbers.


def _without_timing(path):
  records = [json.loads(l) for l in open(path)]
  for record in records:
    record.pop('images_per_sec')
  return records


@pytest.mark.slow  # two sweeps of train + eval subprocesses (~1 min)
def test_same_seed_gives_the_same_numbers_on_the_cpu(tmp_path):
  base = {'data_dir': str(tmp_path / 'data'), 'eval.probe_steps': 50,
          'eval.num_view_images': 16}
  sweep = sweep_lib.load_sweep(write_sweep(tmp_path / 's.py', tiny_grid(),
                                           base=base))
  runs = [str(tmp_path / w / 'seed=0,method=otclr') for w in ('a', 'b')]
  for run in runs:
    code = _run(sweep, os.path.dirname(run),
                launcher_lib.SubprocessLauncher(helpers.REPO))
    assert code == 0, open(os.path.join(run, 'train.log')).read()[-3000:]
  first, second = (_without_timing(os.path.join(r, 'metrics.jsonl'))
                   for r in runs)
  assert [r['step'] for r in first] == [1, 2]
  assert all(np.isfinite(r['loss']) for r in first)
  assert first == second
  a, b = (json.load(open(os.path.join(r, 'eval', 'results.json')))
          for r in runs)
  assert a['step'] == 2
  for section in ('linear', 'random_init', 'clusters', 'views'):
    assert a[section] == b[section], section
  for probe in ('linear', 'random_init'):
    assert 0.0 <= a[probe]['digits']['top1'] <= 100.0


# ----------------------------------------------------------------------------
# Results that cannot be silently wrong.


@pytest.mark.parametrize('base, flag, change', [
    ({'ot.epsilon': 0.5}, '--config.ot.epsilon=0.1',
     r'ot\.epsilon: 0\.5 -> 0\.1'),
    # In a sweep another length is a conflict too, not a lengthening.
    (None, '--config.total_steps=4', r'total_steps: 2 -> 4'),
])
def test_a_rerun_that_changes_the_result_is_refused_and_runs_json_kept(
    tmp_path, capsys, base, flag, change):
  path = write_sweep(tmp_path / 's.py', tiny_grid(), base=base)
  workdir = str(tmp_path / 'out')
  assert _run(sweep_lib.load_sweep(path), workdir) == 0
  runs_json = open(os.path.join(workdir, 'runs.json')).read()
  launcher = FakeLauncher()
  with pytest.raises(sweep_lib.RunConflictError,
                     match=r'seed=0,method=otclr: .*' + change):
    _run(sweep_lib.load_sweep(path, [flag]), workdir, launcher)
  assert launcher.calls == []
  capsys.readouterr()
  # A SLURM job (array or multi-node) is refused alike, before any file.
  for job in ([], ['--slurm'], ['--slurm', '--nodes=2']):
    assert _main(path, workdir, flag, *job) == 2
    err = capsys.readouterr().err
    assert 'refused' in err and re.search(change, err), err
    assert len(err.strip().splitlines()) == 1, err
  assert open(os.path.join(workdir, 'runs.json')).read() == runs_json
  assert not glob.glob(os.path.join(workdir, '*.sbatch'))
  # Settings that do not change the result are no conflict.
  again = FakeLauncher()
  assert _run(sweep_lib.load_sweep(path, ['--config.log_every_steps=2']),
              workdir, again) == 0
  assert again.calls == []


def test_results_without_a_stored_config_are_refused(four_runs):
  sweep, workdir, names = four_runs
  helpers.fake_results(os.path.join(workdir, names[2]), 2)
  with pytest.raises(sweep_lib.RunConflictError,
                     match=f'{names[2]}: .*no config.json'):
    _run(sweep, workdir)


def test_other_evaluation_settings_are_evaluated_again(tmp_path, capsys):
  path = write_sweep(tmp_path / 's.py', tiny_grid(seeds=(0, 1)))
  workdir = str(tmp_path / 'out')
  _run(sweep_lib.load_sweep(path), workdir)
  names = ['seed=0,method=otclr', 'seed=1,method=otclr']
  # Seed 1's evaluation fails, so its results are still the old embedding's
  # and stay out of the means.
  launcher = FakeLauncher(fail={(names[1], 'eval')})
  capsys.readouterr()
  assert _run(sweep_lib.load_sweep(path, ['--config.eval.probe_steps=7',
                                          '--config.eval.embedding=h']),
              workdir, launcher, aggregate=True) == 1
  assert launcher.calls == [(n, 'eval') for n in names]
  out = capsys.readouterr().out
  assert 'eval.probe_steps: 500 -> 7' in out
  assert "eval.embedding: 'z' -> 'h'" in out
  summary = json.load(open(os.path.join(workdir, 'summary.json')))
  (excluded,) = summary['not_averaged']
  assert excluded['run'] == names[1]
  assert "eval.embedding: 'z' -> 'h'" in excluded['why']


def test_damaged_run_files_are_reevaluated_not_crashed_on(four_runs, capsys):
  sweep, workdir, names = four_runs
  assert _run(sweep, workdir) == 0
  broken = os.path.join(workdir, names[0], 'eval', 'results.json')
  with open(broken, 'w') as f:
    f.write('{"step": 2, "lin')
  launcher = FakeLauncher()
  assert _run(sweep, workdir, launcher) == 0
  assert launcher.calls == [(names[0], 'eval')]
  assert broken in capsys.readouterr().out


def test_views_sweep_runs_every_method_with_both_view_generators_and_seeds(
    tmp_path):
  # The fake launcher writes its files at config.total_steps (0: epochs).
  sweep = sweep_lib.load_sweep(sweep_file('digits_methods'),
                               ['--config.total_steps=20'])
  workdir = str(tmp_path / 'out')
  runs = sweep.runs(workdir)
  settings = [tuple(overrides(r)[k] for k in ('method', 'views', 'seed'))
              for r in runs]
  assert settings == [(m, v, s) for m in ('simclr', 'moco', 'byol', 'dino')
                      for v in ('augment', 'ot') for s in (0, 1, 2)]
  assert runs[9].name == 'method=moco,views=ot,seed=0'
  launcher = FakeLauncher()
  assert _run(sweep, workdir, launcher) == 0
  assert launcher.calls == [(r.name, mode) for r in runs
                            for mode in ('train', 'eval')]
  # Each run's command asks for its views; the run's stored config has them.
  for run, setting in zip(runs, settings):
    stored = json.load(open(os.path.join(run.workdir, 'config.json')))
    assert (stored['method'], stored['views'], stored['seed']) == setting
  # A sweep file without the axis runs the config's views ('').
  smoke = sweep_lib.load_sweep(sweep_file('digits_smoke'))
  assert all('views' not in r.name and smoke.run_config(r).views == ''
             for r in smoke.runs(workdir))


@pytest.mark.parametrize('name', sorted(
    os.path.basename(p)[:-3] for p in glob.glob(
        os.path.join(helpers.REPO, 'launch', 'sweeps', '[!_]*.py'))))
def test_shipped_sweeps_give_valid_run_configs(name, tmp_path):
  # Every run a shipped sweep would launch passes training's whole-config
  # check, so a typo or an impossible combination fails here, not hours in.
  sweep = sweep_lib.load_sweep(sweep_file(name))
  for run in sweep.runs(str(tmp_path)):
    experiment.validate_config(sweep.run_config(run))


# ----------------------------------------------------------------------------
# One line and the documented status, never a traceback.


_HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from otclr_jax import rundir
    with rundir.lock(sys.argv[1], rundir.SWEEP_LOCK_FILE):
      print('locked', flush=True)
      time.sleep(60)
""")


def test_a_second_sweep_on_one_directory_is_refused_with_73(tmp_path, capsys):
  path = write_sweep(tmp_path / 's.py', tiny_grid(seeds=(0, 1)))
  workdir = str(tmp_path / 'out')
  holder = subprocess.Popen([sys.executable, '-c', _HOLD_LOCK, workdir],
                            cwd=helpers.REPO, stdout=subprocess.PIPE,
                            text=True)
  try:
    assert holder.stdout.readline().strip() == 'locked'
    assert _main(path, workdir) == cli.EXIT_LOCKED
  finally:
    holder.kill()
    holder.wait()
  captured = capsys.readouterr()
  assert captured.err.count('\n') == 1 and 'in use by process' in captured.err
  assert 'FAILED' not in captured.out + captured.err
  assert not os.path.exists(os.path.join(workdir, 'runs.json'))


def test_the_readmes_tiny_sweep_fits_its_schedule_in_its_steps(caplog):
  from otclr_jax import data  # pylint: disable=g-import-not-at-top
  from otclr_jax import optim  # pylint: disable=g-import-not-at-top
  with open(os.path.join(helpers.REPO, 'README.md')) as f:
    assert 'launch/sweeps/digits_smoke.py' in f.read()
  sweep = sweep_lib.load_sweep(sweep_file('digits_smoke'))
  for run in sweep.runs('/w'):
    config = sweep.run_config(run)
    spe = data.steps_per_epoch(1438, config.batch_size, 'digits/train')
    with caplog.at_level('WARNING'):
      optim.learning_rate_schedule(config, spe, config.total_steps)
    assert 'never decays' not in caplog.text
    assert 0 < config.monitor.every_steps <= config.total_steps


def test_the_view_factorial_sweeps_each_option_against_both_baselines():
  sweep = sweep_lib.load_sweep(sweep_file('cifar10_views'))
  runs = sweep.runs('/w')
  assert len(runs) == 15
  arms = [(c.method, c.ot.source, c.ot.detail, c.ot.colour)
          for c in map(sweep.run_config, runs[:5])]
  assert arms == [('simclr', 'image', 'none', 'before'),
                  ('otclr', 'image', 'none', 'before'),
                  ('otclr', 'strong', 'none', 'before'),
                  ('otclr', 'image', 'residual', 'before'),
                  ('otclr', 'image', 'none', 'after')]
  # Seed and batch first in the names: gpu_check.sh picks a seed's runs so.
  assert all(r.name.startswith(f'seed={i // 5},batch_size=256,')
             for i, r in enumerate(runs))
  config = sweep.run_config(runs[0])
  assert (config.batch_size, config.eval.recompute_bn) == (256, True)
