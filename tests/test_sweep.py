"""Tests of the sweep (launch/sweep.py): runs, commands, resuming, results
that cannot be silently wrong, one-line errors."""

import glob
import json
import os
import re
import shlex
import signal
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
from tests.helpers import FakeLauncher
from tests.helpers import REPO
from tests.helpers import fake_results
from tests.helpers import flags_of
from tests.helpers import sweep_file
from tests.helpers import tiny_grid
from tests.helpers import when_ready
from tests.helpers import write_run_files
from tests.helpers import write_sweep


def overrides(run):
  return dict(run.overrides)


# ----------------------------------------------------------------------------
# Runs and commands.


def test_paper_sweep_expands_to_named_runs_and_commands(tmp_path, capsys):
  sweep = sweep_lib.load_sweep(sweep_file('cifar10_paper'))
  runs = sweep.runs(str(tmp_path))
  expected = [f'seed={s},batch_size={b},method={m}' for s in (0, 1, 2)
              for b in (256, 512) for m in ('simclr', 'otclr')]
  assert [r.name for r in runs] == expected
  assert [r.index for r in runs] == list(range(12))

  code = sweep_lib.run_sweep(sweep, str(tmp_path), dry_run=True)
  assert code == 0
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
  # A dry run leaves no trace.
  assert os.listdir(tmp_path) == []


def test_any_config_key_can_be_swept(tmp_path):
  path = write_sweep(tmp_path / 's.py', {'ot.epsilon': [0.05, 0.1],
                                         'model.proj_dim': [16, 32]})
  runs = sweep_lib.load_sweep(path).runs(str(tmp_path / 'out'))
  assert [r.name for r in runs] == [
      'ot.epsilon=0.05,model.proj_dim=16', 'ot.epsilon=0.05,model.proj_dim=32',
      'ot.epsilon=0.1,model.proj_dim=16', 'ot.epsilon=0.1,model.proj_dim=32']
  sweep = sweep_lib.load_sweep(path)
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


@pytest.mark.parametrize('axes, fixed, message', [
    ({**tiny_grid(), 'seed': []}, None, 'non-empty list'),
    (tiny_grid(), {'ot.no_such_field': 1},
     r's\.py \(run .*\): Bad config override .*no_such_field'),
    (tiny_grid(), {'total_steps': 'many'},
     r'total_steps=many: invalid literal for int'),
    (tiny_grid(), {'total_steps': 1.5}, r'total_steps=1\.5: invalid literal'),
    (tiny_grid(), {'seed': 3}, 'set by two parts'),
    ({**tiny_grid(), 'seed': [0, 0]}, None, 'duplicate run names'),
    ({'method': ['simclr', 'nosuch']}, None,
     r'run method=nosuch\): config\.method must be one of'),
    (tiny_grid(), {'ot': {'epsilon': 0.1}},
     r'config\.ot is a block of fields; .*config\.ot\.epsilon'),
])
def test_bad_sweep_files_are_rejected(tmp_path, axes, fixed, message):
  path = write_sweep(tmp_path / 's.py', axes, fixed)
  with pytest.raises(ValueError, match=message):
    sweep_lib.load_sweep(path)


def test_keys_need_the_config_prefix(tmp_path):
  path = tmp_path / 's.py'
  path.write_text('from configs import digits\n'
                  'def get_config():\n  return digits.get_config()\n'
                  'def get_hyper(hyper):\n'
                  '  return hyper.sweep("seed", [0, 1])\n')
  with pytest.raises(ValueError, match='config.<field>'):
    sweep_lib.load_sweep(str(path))


def test_an_invalid_run_config_is_refused_in_one_line_before_anything_runs(
    tmp_path, capsys):
  path = write_sweep(tmp_path / 's.py', {'method': ['simclr', 'nosuch']})
  out = str(tmp_path / 'out')
  assert sweep_lib.main(['sweep', f'--config={path}', f'--workdir={out}']) == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and 'nosuch' in err and 'Traceback' not in err
  assert not os.path.exists(out)


@pytest.mark.parametrize('text', [
    'def get_config(:\n',  # not Python
    'from configs import digits\n'
    'def get_config():\n  return digits.get_config()\n'
    'def get_hyper(hyper):\n  return hyper.sweep("config.seed", 3)\n',
])
def test_a_broken_sweep_file_is_refused_in_one_line(tmp_path, capsys, text):
  (tmp_path / 's.py').write_text(text)
  assert sweep_lib.main(['sweep', f'--config={tmp_path / "s.py"}',
                         f'--workdir={tmp_path / "out"}']) == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and 'Traceback' not in err
  assert not os.path.exists(tmp_path / 'out')


def test_override_typos_fail_with_a_suggestion_before_anything_runs(
    tmp_path, capsys):
  # A typo must not add a key and leave the real field at its default.
  path = write_sweep(tmp_path / 's.py', tiny_grid(), {'ot.epsilonn': 0.1})
  with pytest.raises(ValueError, match='Did you mean "epsilon"'):
    sweep_lib.load_sweep(path)
  out = str(tmp_path / 'out')
  assert sweep_lib.main(['sweep', f'--config={path}', f'--workdir={out}']) == 2
  assert 'Did you mean "epsilon"' in capsys.readouterr().err
  good = write_sweep(tmp_path / 'good.py', tiny_grid())
  assert sweep_lib.main(['sweep', f'--config={good}', f'--workdir={out}',
                         '--config.ot.epsilonn=0.1']) == 2
  assert 'Did you mean "epsilon"' in capsys.readouterr().err
  for other in ('--override=ot.epsilon=0.1', '--config.ot.epsilon'):
    assert sweep_lib.main(['sweep', f'--config={good}', f'--workdir={out}',
                           other]) == 2
    assert 'Traceback' not in capsys.readouterr().err
  # A swept key set on the command line too would be ambiguous.
  assert sweep_lib.main(['sweep', f'--config={good}', f'--workdir={out}',
                         '--config.seed=3']) == 2
  assert 'sweeps config.seed' in capsys.readouterr().err
  # One array task's index means nothing to a job or a summary of them all.
  for mode in ('--slurm', '--aggregate_only'):
    assert sweep_lib.main(['sweep', f'--config={good}', f'--workdir={out}',
                           '--only_index=0', mode]) == 2
    assert 'Usage' in capsys.readouterr().err
  assert not os.path.exists(out)
  # main's spelling is accepted and reaches the command line.
  sweep = sweep_lib.load_sweep(good, ['--config.ot.epsilon=0.2'])
  (run,) = sweep.runs(out)
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
  path = write_sweep(tmp_path / 's.py', tiny_grid())
  assert sweep_lib.main(['sweep', f'--config={path}', '--workdir=~/sw',
                         '--slurm']) == 0
  assert (tmp_path / 'home' / 'sw' / 'sweep.sbatch').exists()
  assert not (tmp_path / '~').exists()


# ----------------------------------------------------------------------------
# SLURM array tasks.


def test_array_task_refuses_a_changed_sweep_file(tmp_path):
  path = write_sweep(tmp_path / 's.py', tiny_grid(seeds=(0, 1)))
  workdir = str(tmp_path / 'out')
  sweep_lib.write_slurm(sweep_lib.load_sweep(path), workdir, job_name='t')
  write_sweep(tmp_path / 's.py', tiny_grid(seeds=(1, 2)))
  with pytest.raises(ValueError, match='sweep file changed'):
    sweep_lib.run_sweep(sweep_lib.load_sweep(path), workdir, only_index=0,
                        launcher=FakeLauncher())


def test_array_task_refuses_a_sweep_file_that_changed_a_runs_settings(
    tmp_path):
  # The same run names, another value of a fixed setting: the tasks still to
  # run would train otherwise than the ones that ran.
  path = write_sweep(tmp_path / 's.py', tiny_grid(seeds=(0, 1)),
                     base={'ot.epsilon': 0.05})
  workdir = str(tmp_path / 'out')
  sweep_lib.write_slurm(sweep_lib.load_sweep(path), workdir, job_name='t')
  launcher = FakeLauncher()
  assert sweep_lib.run_sweep(sweep_lib.load_sweep(path), workdir,
                             only_index=1, launcher=launcher) == 0
  assert launcher.calls
  write_sweep(tmp_path / 's.py', tiny_grid(seeds=(0, 1)),
              base={'ot.epsilon': 0.5})
  with pytest.raises(ValueError,
                     match=r'run seed=0.*ot\.epsilon: 0\.05 -> 0\.5'):
    sweep_lib.run_sweep(sweep_lib.load_sweep(path), workdir, only_index=1,
                        launcher=FakeLauncher())


# ----------------------------------------------------------------------------
# Local runs with a fake launcher.


def test_resuming_skips_finished_runs_and_relaunches_the_rest(four_runs,
                                                              capsys):
  sweep, workdir, names = four_runs
  runs = sweep.runs(workdir)
  # Run 0 finished; run 1 evaluated at an intermediate step (not finished);
  # run 2 trained but not evaluated; run 3 untouched.
  write_run_files(runs[0].workdir, sweep.run_config(runs[0]))
  write_run_files(runs[1].workdir, sweep.run_config(runs[1]),
                  state='stopped', step=1)
  write_run_files(runs[2].workdir, sweep.run_config(runs[2]),
                  evaluated=False)
  launcher = FakeLauncher()
  code = sweep_lib.run_sweep(sweep, workdir, launcher=launcher,
                             aggregate=False)
  assert code == 0
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
  assert sweep_lib.run_sweep(sweep, workdir, launcher=again,
                             aggregate=False) == 0
  assert again.calls == []
  assert len(json.load(open(os.path.join(workdir, 'runs.json')))['runs']) == 4


def test_a_failed_run_is_reported_and_the_sweep_goes_on(four_runs, capsys):
  sweep, workdir, names = four_runs
  launcher = FakeLauncher(fail={(names[1], 'train')})
  code = sweep_lib.run_sweep(sweep, workdir, launcher=launcher,
                             aggregate=False)
  assert code == 1
  assert [n for n, mode in launcher.calls if mode == 'eval'] == [
      names[0], names[2], names[3]]
  assert f'FAILED {names[1]}' in capsys.readouterr().out

  stopping = FakeLauncher(fail={(names[0], 'eval')})
  code = sweep_lib.run_sweep(sweep, str(workdir) + '2', launcher=stopping,
                             stop_on_error=True, aggregate=False)
  assert code == 1
  assert stopping.calls == [(names[0], 'train'), (names[0], 'eval')]


def test_a_signal_during_training_stops_without_evaluating(four_runs):
  sweep, workdir, names = four_runs
  launcher = FakeLauncher(stop_during=names[1], stop_at_step=1)
  code = sweep_lib.run_sweep(sweep, workdir, launcher=launcher,
                             aggregate=False)
  assert code == 75
  assert launcher.calls == [(names[0], 'train'), (names[0], 'eval'),
                            (names[1], 'train')]


def test_only_index_runs_one_run(four_runs):
  sweep, workdir, names = four_runs
  launcher = FakeLauncher()
  assert sweep_lib.run_sweep(sweep, workdir, launcher=launcher,
                             only_index=2) == 0
  assert launcher.calls == [(names[2], 'train'), (names[2], 'eval')]
  with pytest.raises(ValueError, match='only_index'):
    sweep_lib.run_sweep(sweep, workdir, launcher=launcher, only_index=4)


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
  path = write_sweep(tmp_path / 's.py', tiny_grid(), base=base)
  sweep = sweep_lib.load_sweep(path)
  workdirs = [str(tmp_path / 'a'), str(tmp_path / 'b')]
  for workdir in workdirs:
    code = sweep_lib.run_sweep(sweep, workdir, aggregate=False,
                               launcher=launcher_lib.SubprocessLauncher(REPO))
    assert code == 0, open(os.path.join(
        workdir, 'seed=0,method=otclr', 'train.log')).read()[-3000:]
  runs = [os.path.join(w, 'seed=0,method=otclr') for w in workdirs]
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
  assert sweep_lib.run_sweep(sweep_lib.load_sweep(path), workdir,
                             launcher=FakeLauncher(), aggregate=False) == 0
  runs_json = open(os.path.join(workdir, 'runs.json')).read()
  launcher = FakeLauncher()
  changed = sweep_lib.load_sweep(path, [flag])
  with pytest.raises(sweep_lib.RunConflictError,
                     match=r'seed=0,method=otclr: .*' + change):
    sweep_lib.run_sweep(changed, workdir, launcher=launcher, aggregate=False)
  assert launcher.calls == []
  assert open(os.path.join(workdir, 'runs.json')).read() == runs_json
  capsys.readouterr()
  assert sweep_lib.main(['sweep', f'--config={path}', f'--workdir={workdir}',
                         flag]) == 2
  err = capsys.readouterr().err
  assert 'refused' in err and re.search(change, err), err
  assert len(err.strip().splitlines()) == 1, err
  # A SLURM job (array or multi-node) is refused alike, before any file.
  for job in (['--slurm'], ['--slurm', '--nodes=2']):
    assert sweep_lib.main(['sweep', f'--config={path}', f'--workdir={workdir}',
                           flag, *job]) == 2
    err = capsys.readouterr().err
    assert 'refused' in err and re.search(change, err), err
  assert open(os.path.join(workdir, 'runs.json')).read() == runs_json
  assert not glob.glob(os.path.join(workdir, '*.sbatch'))
  # Settings that do not change the result are no conflict.
  again = FakeLauncher()
  assert sweep_lib.run_sweep(sweep_lib.load_sweep(
      path, ['--config.log_every_steps=2']),
                             workdir, launcher=again, aggregate=False) == 0
  assert again.calls == []


def test_results_without_a_stored_config_are_refused(four_runs):
  sweep, workdir, names = four_runs
  fake_results(os.path.join(workdir, names[2]), 2)
  with pytest.raises(sweep_lib.RunConflictError,
                     match=f'{names[2]}: .*no config.json'):
    sweep_lib.run_sweep(sweep, workdir, launcher=FakeLauncher(),
                        aggregate=False)


def test_other_evaluation_settings_are_evaluated_again(tmp_path, capsys):
  path = write_sweep(tmp_path / 's.py', tiny_grid(seeds=(0, 1)))
  workdir = str(tmp_path / 'out')
  sweep_lib.run_sweep(sweep_lib.load_sweep(path), workdir,
                      launcher=FakeLauncher(), aggregate=False)
  launcher = FakeLauncher()
  capsys.readouterr()
  assert sweep_lib.run_sweep(
      sweep_lib.load_sweep(path, ['--config.eval.probe_steps=7']), workdir,
      launcher=launcher, aggregate=False) == 0
  names = ['seed=0,method=otclr', 'seed=1,method=otclr']
  assert launcher.calls == [(n, 'eval') for n in names]
  assert 'eval.probe_steps: 500 -> 7' in capsys.readouterr().out


def test_results_a_failed_evaluation_left_are_not_the_sweeps(tmp_path):
  # The sweep asks for another embedding; seed 1's evaluation fails, so its
  # results are still the old embedding's and stay out of the means.
  path = write_sweep(tmp_path / 's.py', tiny_grid(seeds=(0, 1)))
  workdir = str(tmp_path / 'out')
  sweep_lib.run_sweep(sweep_lib.load_sweep(path), workdir,
                      launcher=FakeLauncher(), aggregate=False)
  names = ['seed=0,method=otclr', 'seed=1,method=otclr']
  assert sweep_lib.run_sweep(
      sweep_lib.load_sweep(path, ['--config.eval.embedding=h']), workdir,
      launcher=FakeLauncher(fail={(names[1], 'eval')})) == 1
  summary = json.load(open(os.path.join(workdir, 'summary.json')))
  (excluded,) = summary['not_averaged']
  assert excluded['run'] == names[1]
  assert "eval.embedding: 'z' -> 'h'" in excluded['why']


def test_a_stopped_evaluation_stops_the_sweep_with_75(four_runs):
  # It had counted as a failure: the sweep went on, then exited 1.
  sweep, workdir, names = four_runs
  launcher = FakeLauncher(fail={(names[0], 'eval'): 75})
  assert sweep_lib.run_sweep(sweep, workdir, launcher=launcher,
                             aggregate=False) == 75
  assert launcher.calls == [(names[0], 'train'), (names[0], 'eval')]


def test_a_preempted_child_leaves_its_run_unfinished(four_runs, capsys):
  sweep, workdir, names = four_runs
  launcher = FakeLauncher(exit_stopped={names[1]})
  assert sweep_lib.run_sweep(sweep, workdir, launcher=launcher,
                             aggregate=False) == 75
  assert launcher.calls == [(names[0], 'train'), (names[0], 'eval'),
                            (names[1], 'train')]
  out = capsys.readouterr().out
  assert f'{names[1]}: stopped' in out and 'rerun' in out
  resumed = FakeLauncher()
  assert sweep_lib.run_sweep(sweep, workdir, launcher=resumed,
                             aggregate=False) == 0
  assert resumed.calls[:2] == [(names[1], 'train'), (names[1], 'eval')]


def test_damaged_run_files_are_reevaluated_not_crashed_on(four_runs, capsys):
  sweep, workdir, names = four_runs
  assert sweep_lib.run_sweep(sweep, workdir, launcher=FakeLauncher(),
                             aggregate=False) == 0
  broken = os.path.join(workdir, names[0], 'eval', 'results.json')
  with open(broken, 'w') as f:
    f.write('{"step": 2, "lin')
  launcher = FakeLauncher()
  assert sweep_lib.run_sweep(sweep, workdir, launcher=launcher,
                             aggregate=False) == 0
  assert launcher.calls == [(names[0], 'eval')]
  assert broken in capsys.readouterr().out


def test_views_sweep_runs_every_method_with_both_view_generators_and_seeds(
    tmp_path):
  # The fake launcher writes its files at config.total_steps (0: epochs).
  sweep = sweep_lib.load_sweep(sweep_file('digits_methods'),
                               ['--config.total_steps=20'])
  workdir = str(tmp_path / 'out')
  runs = sweep.runs(workdir)
  assert [(overrides(r)['method'], overrides(r)['views'], overrides(r)['seed'])
          for r in runs] == [
      (m, v, s) for m in ('simclr', 'moco', 'byol', 'dino')
      for v in ('augment', 'ot') for s in (0, 1, 2)]
  assert runs[9].name == 'method=moco,views=ot,seed=0'
  launcher = FakeLauncher()
  assert sweep_lib.run_sweep(sweep, workdir, launcher=launcher,
                             aggregate=False) == 0
  assert launcher.calls == [(r.name, mode) for r in runs
                            for mode in ('train', 'eval')]
  # Each run's command asks for its views; the run's stored config has them.
  for run in runs:
    stored = json.load(open(os.path.join(run.workdir, 'config.json')))
    assert (stored['method'], stored['views'], stored['seed']) == (
        overrides(run)['method'], overrides(run)['views'],
        overrides(run)['seed'])
  # A sweep file without the axis runs the config's views ('').
  smoke = sweep_lib.load_sweep(sweep_file('digits_smoke'))
  assert all('views' not in r.name and smoke.run_config(r).views == ''
             for r in smoke.runs(workdir))


@pytest.mark.parametrize('name', sorted(
    os.path.basename(p)[:-3] for p in glob.glob(
        os.path.join(REPO, 'launch', 'sweeps', '[!_]*.py'))))
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
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'locked'
    assert sweep_lib.main(['sweep', f'--config={path}',
                           f'--workdir={workdir}']) == cli.EXIT_LOCKED
  finally:
    holder.kill()
    holder.wait()
  captured = capsys.readouterr()
  assert captured.err.count('\n') == 1 and 'in use by process' in captured.err
  assert 'FAILED' not in captured.out + captured.err
  assert not os.path.exists(os.path.join(workdir, 'runs.json'))


# Runs a sweep whose "training" sleeps until signalled.
_SLEEPY_SWEEP = textwrap.dedent("""
    import sys
    from launch import sweep
    ready = sys.argv[3]
    sweep.command = lambda *_: [sys.executable, '-c',
        f'import time; open({ready!r}, "w").write("x"); time.sleep(60)']
    sys.exit(sweep.main(['sweep', f'--config={sys.argv[1]}',
                         f'--workdir={sys.argv[2]}']))
""")


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_sweep_with_75_and_one_line(tmp_path, signum):
  path = write_sweep(tmp_path / 's.py', tiny_grid())
  ready = tmp_path / 'ready'
  sweep = subprocess.Popen(
      [sys.executable, '-c', _SLEEPY_SWEEP, path, str(tmp_path / 'out'),
       str(ready)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)
  # Loading the sweep imports the model code: slow on a busy machine.
  when_ready(str(ready), lambda: sweep.send_signal(signum), 300).join()
  out, err = sweep.communicate(timeout=60)
  assert sweep.returncode == cli.EXIT_STOPPED, (out, err)
  assert ready.exists() and 'Traceback' not in err
  assert err.strip().splitlines() == [
      f'Sweep s stopped by {signal.Signals(signum).name}; rerun the same '
      'command to resume.']
  assert 'FAILED' not in out




def test_the_readmes_tiny_sweep_fits_its_schedule_in_its_steps(caplog):
  from otclr_jax import data  # pylint: disable=g-import-not-at-top
  from otclr_jax import optim  # pylint: disable=g-import-not-at-top
  with open(os.path.join(REPO, 'README.md')) as f:
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
