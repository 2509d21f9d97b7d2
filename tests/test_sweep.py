"""Tests of the sweep launcher: runs, commands, SLURM, resuming, tables."""

import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from launch import launcher as launcher_lib
from launch import run_state
from launch import slurm
from launch import sweep as sweep_lib
from otclr_jax import config_files
from otclr_jax import experiment
from otclr_jax import rundir
from otclr_jax.evaluation import probe
from tests.helpers import mean_std_rtol

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = {
    'image_size': 8,
    'total_steps': 2,
    'log_every_steps': 1,
    'checkpoint_every_steps': 2,
    'model.proj_hidden_dim': 32,
    'model.proj_dim': 16,
    'ot.grid_size': 4,
    'batch_size': 16,
}


def write_sweep(path, axes, fixed=None, base=None, config='digits'):
  """A sweep file: `base` set in get_config, `axes` x `fixed` in get_hyper."""
  body = [f'  config.{k} = {v!r}' for k, v in {**TINY, **(base or {})}.items()]
  parts = [f'      hyper.sweep({"config." + k!r}, {v!r}),'
           for k, v in axes.items()]
  parts += [f'      hyper.fixed({"config." + k!r}, {v!r}),'
            for k, v in (fixed or {}).items()]
  path.write_text('\n'.join([
      f'from configs import {config}', '', '', 'def get_config():',
      f'  config = {config}.get_config()', *body, '  return config', '', '',
      'def get_hyper(hyper):', '  return hyper.product([', *parts, '  ])',
      '']))
  return str(path)


def tiny_grid(methods=('otclr',), seeds=(0,)):
  return {'seed': list(seeds), 'method': list(methods)}


def flags_of(argv):
  return dict(a[2:].split('=', 1) for a in argv if a.startswith('--'))


def aggregate_only(workdir):
  return sweep_lib.main(['sweep', f'--workdir={workdir}', '--aggregate_only'])


def sweep_file(name):
  return os.path.join(REPO, 'launch', 'sweeps', f'{name}.py')


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
        'config.seed': str(values['seed'])}
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
  (run,) = sweep_lib.Sweep('/s.py', None, (), tuple(hypers)).runs('/w')
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
# SLURM.


def test_slurm_script_has_one_task_per_run(tmp_path):
  workdir = str(tmp_path / 'sweep')
  code = sweep_lib.main(['sweep', f'--config={sweep_file("cifar10_paper")}',
                         f'--workdir={workdir}', '--slurm', '--partition=gpu',
                         '--time=02:00:00', '--config.data_dir=/tfds'])
  assert code == 0
  script = open(os.path.join(workdir, 'sweep.sbatch')).read()
  header = [l for l in script.splitlines() if l.startswith('#SBATCH')]
  for line in ('#SBATCH --array=0-11', '#SBATCH --requeue',
               '#SBATCH --partition=gpu', '#SBATCH --time=02:00:00',
               '#SBATCH --gres=gpu:1'):
    assert line in header
  assert any(l.startswith('#SBATCH --signal=B:TERM@') for l in header)
  assert 'trap requeue TERM' in script
  assert 'scontrol requeue' in script
  (task,) = [l for l in script.splitlines()
             if 'launch.sweep' in l and not l.startswith('#')]
  argv = shlex.split(task.rstrip(' &'))
  assert argv[:4] == [sys.executable, '-m', 'launch.sweep',
                      f'--config={sweep_file("cifar10_paper")}']
  assert f'--workdir={workdir}' in argv
  assert '--config.data_dir=/tfds' in argv
  assert '--only_index=$SLURM_ARRAY_TASK_ID' in argv
  subprocess.run(['bash', '-n', os.path.join(workdir, 'sweep.sbatch')],
                 check=True)

  listed = json.load(open(os.path.join(workdir, 'runs.json')))['runs']
  runs = sweep_lib.load_sweep(sweep_file('cifar10_paper')).runs(workdir)
  assert [e['name'] for e in listed] == [r.name for r in runs]
  assert [e['index'] for e in listed] == list(range(12))
  assert '--config.data_dir=/tfds' in listed[5]['train']
  assert listed[5]['eval'].endswith('--config.mode=eval')


# A stand-in for training: reports progress in its workdir's metrics.jsonl
# and status.json (argv[3], if given), and on SIGTERM saves (here: writes a
# file) and exits 0.
_CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    def stop(*_):
      open(sys.argv[1], 'w').write('stopped')
      sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    if len(sys.argv) > 3:
      with open(os.path.join(sys.argv[3], 'status.json'), 'w') as f:
        json.dump({'state': 'running', 'step': 1, 'total_steps': 2}, f)
      with open(os.path.join(sys.argv[3], 'metrics.jsonl'), 'w') as f:
        f.write(json.dumps({'step': 1, 'loss': 2.5}) + '\\n')
    print('a log line that is not progress', flush=True)
    open(sys.argv[2], 'w').write('ready')
    time.sleep(60)
    sys.exit(3)
""")


def _when_ready(path, action, timeout=30):
  def wait():
    deadline = time.time() + timeout
    while not os.path.exists(path) and time.time() < deadline:
      time.sleep(0.05)
    action()
  thread = threading.Thread(target=wait)
  thread.start()
  return thread


def test_slurm_task_passes_sigterm_on_and_requeues_itself(tmp_path):
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'scontrol').write_text(
      f'#!/bin/sh\necho "$@" > {tmp_path}/scontrol.txt\n')
  (bin_dir / 'scontrol').chmod(0o755)
  (tmp_path / 'child.py').write_text(_CHILD)
  stopped, ready = tmp_path / 'stopped', tmp_path / 'ready'
  script = slurm.slurm_script(['python', '-m', 'launch.sweep'], REPO,
                             str(tmp_path), ['a', 'b'], job_name='t')
  fake = shlex.join([sys.executable, str(tmp_path / 'child.py'), str(stopped),
                     str(ready)])
  script = '\n'.join(fake + ' &' if line.endswith(' &') else line
                     for line in script.splitlines())
  (tmp_path / 'job.sh').write_text(script)
  env = {**os.environ, 'PATH': f'{bin_dir}:{os.environ["PATH"]}',
         'SLURM_ARRAY_JOB_ID': '7', 'SLURM_ARRAY_TASK_ID': '1'}
  job = subprocess.Popen(['bash', str(tmp_path / 'job.sh')], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  _when_ready(str(ready), lambda: job.send_signal(signal.SIGTERM)).join()
  out = job.communicate(timeout=30)[0].decode()
  assert job.returncode == 0, out
  assert stopped.read_text() == 'stopped'
  assert (tmp_path / 'scontrol.txt').read_text().split() == ['requeue', '7_1']


def test_launcher_passes_a_stop_signal_on_and_shows_progress(tmp_path,
                                                             capsys):
  (tmp_path / 'child.py').write_text(_CHILD)
  stopped, ready = tmp_path / 'stopped', tmp_path / 'ready'
  launcher = launcher_lib.SubprocessLauncher(REPO, poll_seconds=0.05)
  launcher.prefix = '[1/1] run: '
  thread = _when_ready(str(ready),
                       lambda: launcher._handle(signal.SIGTERM, None))
  (tmp_path / 'run').mkdir()
  code = launcher([sys.executable, str(tmp_path / 'child.py'), str(stopped),
                   str(ready), str(tmp_path / 'run')],
                  str(tmp_path / 'run' / 'train.log'))
  thread.join()
  assert code == 0
  assert stopped.read_text() == 'stopped'
  assert launcher.stop_signal == signal.SIGTERM
  assert 'not progress' in open(tmp_path / 'run' / 'train.log').read()
  # Progress comes from metrics.jsonl and status.json, not the log text.
  assert '[1/1] run: step 1/2, loss 2.5000' in capsys.readouterr().out


def test_array_task_refuses_a_changed_sweep_file(tmp_path):
  path = write_sweep(tmp_path / 's.py', tiny_grid(seeds=(0, 1)))
  workdir = str(tmp_path / 'out')
  sweep_lib.write_slurm(sweep_lib.load_sweep(path), workdir, job_name='t')
  write_sweep(tmp_path / 's.py', tiny_grid(seeds=(1, 2)))
  with pytest.raises(ValueError, match='sweep file changed'):
    sweep_lib.run_sweep(sweep_lib.load_sweep(path), workdir, only_index=0,
                        launcher=FakeLauncher())


# ----------------------------------------------------------------------------
# Local runs with a fake launcher.


def resolved_config(argv):
  """The ConfigDict a `python -m otclr_jax.main` argv would run."""
  return config_files.apply_overrides(
      config_files.load(flags_of(argv)['config']),
      [a for a in argv if a.startswith('--config.')])


def write_run_files(workdir, config, *, state='finished', step=None,
                    evaluated=True, results_step=None):
  """What training (config.json, status.json, a checkpoint) and evaluation
  (eval/results.json, eval/config.json) leave in a run directory."""
  total = config.total_steps
  step = total if step is None else step
  os.makedirs(os.path.join(workdir, 'checkpoints', str(step)), exist_ok=True)
  train_config = config.to_dict()
  train_config['mode'] = 'train'
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(train_config, f)
  with open(os.path.join(workdir, 'status.json'), 'w') as f:
    json.dump({'state': state, 'step': step, 'total_steps': total,
               'updated': '2026-11-21T00:00:00+00:00'}, f)
  if evaluated:
    fake_results(workdir, step if results_step is None else results_step)
    with open(os.path.join(workdir, 'eval', 'config.json'), 'w') as f:
      json.dump({**train_config, 'mode': 'eval'}, f)


class FakeLauncher:
  """Pretends to train/evaluate: writes what train.py and evaluate.py would."""

  def __init__(self, fail=(), stop_during=None, stop_at_step=None,
               exit_stopped=()):
    self.calls = []
    self.fail = set(fail)
    self.stop_during = stop_during
    self.stop_at_step = stop_at_step
    self.exit_stopped = set(exit_stopped)  # runs whose training exits 75
    self.stop_signal = None

  def __call__(self, argv, log_path):
    flags = flags_of(argv)
    workdir = flags['workdir']
    name = os.path.basename(workdir)
    mode = flags.get('config.mode', 'train')
    self.calls.append((name, mode))
    assert os.path.dirname(log_path) == workdir
    if (name, mode) in self.fail:
      return 1
    config = resolved_config(argv)
    total = config.total_steps
    if mode == 'train':
      if self.stop_during == name or name in self.exit_stopped:
        if self.stop_during == name:
          self.stop_signal = signal.SIGTERM
        step = self.stop_at_step or 1
        write_run_files(workdir, config, state='stopped', step=step,
                        evaluated=False)
        return 75 if name in self.exit_stopped else 0
      write_run_files(workdir, config, evaluated=False)
    else:
      status = json.load(open(os.path.join(workdir, 'status.json')))
      fake_results(workdir, status['step'])
      with open(os.path.join(workdir, 'eval', 'config.json'), 'w') as f:
        json.dump(config.to_dict(), f)
    return 0


def fake_results(workdir, step):
  os.makedirs(os.path.join(workdir, 'eval'), exist_ok=True)
  with open(os.path.join(workdir, 'eval', 'results.json'), 'w') as f:
    json.dump({'step': step}, f)


@pytest.fixture
def four_runs(tmp_path):
  path = write_sweep(tmp_path / 's.py', tiny_grid(('simclr', 'otclr'), (0, 1)))
  sweep = sweep_lib.load_sweep(path)
  workdir = str(tmp_path / 'out')
  return sweep, workdir, [r.name for r in sweep.runs(workdir)]


def _config_of(sweep, run):
  return sweep.run_config(run)


def test_resuming_skips_finished_runs_and_relaunches_the_rest(four_runs):
  sweep, workdir, names = four_runs
  runs = sweep.runs(workdir)
  # Run 0 finished; run 1 evaluated at an intermediate step (not finished);
  # run 2 trained but not evaluated; run 3 untouched.
  write_run_files(runs[0].workdir, _config_of(sweep, runs[0]))
  write_run_files(runs[1].workdir, _config_of(sweep, runs[1]),
                  state='stopped', step=1)
  write_run_files(runs[2].workdir, _config_of(sweep, runs[2]),
                  evaluated=False)
  launcher = FakeLauncher()
  code = sweep_lib.run_sweep(sweep, workdir, launcher=launcher,
                             aggregate=False)
  assert code == 0
  assert launcher.calls == [(names[1], 'train'), (names[1], 'eval'),
                            (names[2], 'eval'),
                            (names[3], 'train'), (names[3], 'eval')]
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


def test_final_step_of_an_epoch_based_run_comes_from_metrics(tmp_path):
  config = config_files.apply_overrides(
      config_files.load(sweep_file('cifar10_paper')), [('num_epochs', 3)])
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
  fake_results(str(tmp_path), 100)
  os.replace(tmp_path / 'eval_config.json', tmp_path / 'eval' / 'config.json')
  assert not run_state.is_finished(config, str(tmp_path))
  fake_results(str(tmp_path), 585)
  assert run_state.is_finished(config, str(tmp_path))


# ----------------------------------------------------------------------------
# Aggregation.


def test_aggregation_gives_mean_and_std_over_seeds(tmp_path, capsys):
  top1 = {('otclr', 256): [50.0, 52.0, 57.0], ('simclr', 256): [40.0, 44.0],
          ('otclr', 512): [61.5]}
  for (method, batch), values in top1.items():
    for seed, value in enumerate(values):
      name = f'method={method},batch_size={batch},seed={seed}'
      fake = {'step': 10, 'method': method, 'seed': seed, 'batch_size': batch,
              'pretrain_dataset': 'cifar10',
              'linear': {'cifar10': {'top1': value, 'top5': 90.0 + seed}},
              'random_init': {'cifar10': {'top1': 20.0 + seed,
                                          'top5': 50.0}}}
      os.makedirs(tmp_path / name / 'eval')
      (tmp_path / name / 'eval' / 'results.json').write_text(json.dumps(fake))
      (tmp_path / name / 'status.json').write_text(json.dumps(
          {'state': 'finished', 'step': 10, 'total_steps': 10}))
  # Not a run: no eval/results.json.
  os.makedirs(tmp_path / 'slurm')
  assert aggregate_only(tmp_path) == 0

  rows = json.load(open(tmp_path / 'summary.json'))['rows']
  by_key = {(r['method'], r['batch_size']): r for r in rows}
  assert set(by_key) == set(top1)
  for key, values in top1.items():
    got = by_key[key]['linear']['cifar10']['top1']
    assert got['n'] == len(values)
    rtol_mean, rtol_std = mean_std_rtol(values)
    np.testing.assert_allclose(got['mean'], np.mean(values), rtol=rtol_mean)
    if len(values) > 1:
      np.testing.assert_allclose(got['std'], np.std(values, ddof=1),
                                 rtol=rtol_std)
  markdown = open(tmp_path / 'summary.md').read()
  assert '53.00 ± 3.61' in markdown
  assert '42.00 ± 2.83 (n=2)' in markdown
  assert r'\pm' in open(tmp_path / 'summary.tex').read()
  assert markdown in capsys.readouterr().out


def test_aggregation_of_an_empty_sweep_writes_nothing(tmp_path):
  assert aggregate_only(tmp_path) == 0
  assert os.listdir(tmp_path) == []


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


def _results_run(root, name, top1, status):
  os.makedirs(root / name / 'eval')
  (root / name / 'eval' / 'results.json').write_text(json.dumps({
      'step': status['step'], 'method': 'otclr', 'seed': 0, 'batch_size': 16,
      'pretrain_dataset': 'digits',
      'linear': {'digits': {'top1': top1, 'top5': 99.0}}}))
  (root / name / 'status.json').write_text(json.dumps(status))


def test_diverged_and_unfinished_runs_are_never_averaged(tmp_path, capsys):
  _results_run(tmp_path, 'digits_otclr_b16_s0', 84.7,
               {'state': 'finished', 'step': 100, 'total_steps': 100})
  _results_run(tmp_path, 'digits_otclr_b16_s1', 10.0,
               {'state': 'diverged', 'step': 6, 'total_steps': 100})
  _results_run(tmp_path, 'digits_otclr_b16_s2', 30.0,
               {'state': 'stopped', 'step': 50, 'total_steps': 100})
  assert aggregate_only(tmp_path) == 0
  (row,) = json.load(open(tmp_path / 'summary.json'))['rows']
  assert row['linear']['digits']['top1']['n'] == 1
  assert row['linear']['digits']['top1']['mean'] == 84.7
  markdown = open(tmp_path / 'summary.md').read()
  assert '## Not averaged' in markdown
  assert 'digits_otclr_b16_s1`: training diverged at step 6 of 100' in markdown
  assert 'digits_otclr_b16_s2`: training stopped at step 50 of 100' in markdown
  assert '47.35' not in markdown and '±' not in markdown.split('## Not')[0]
  assert 'Not averaged' in open(tmp_path / 'summary.tex').read()


def test_only_the_sweeps_own_runs_are_averaged(tmp_path):
  for name, top1 in (('seed=0,method=otclr', 84.7), ('old_name_s0', 10.0)):
    _results_run(tmp_path, name, top1,
                 {'state': 'finished', 'step': 100, 'total_steps': 100})
  (tmp_path / 'runs.json').write_text(json.dumps(
      {'runs': [{'name': 'seed=0,method=otclr'}]}))
  assert aggregate_only(tmp_path) == 0
  (row,) = json.load(open(tmp_path / 'summary.json'))['rows']
  assert row['linear']['digits']['top1']['n'] == 1
  assert row['linear']['digits']['top1']['mean'] == 84.7
  assert 'old_name_s0`: not a run of this sweep' in open(
      tmp_path / 'summary.md').read()


def test_aggregate_only_refuses_a_missing_directory(tmp_path, capsys):
  missing = str(tmp_path / 'typo')
  assert aggregate_only(missing) == 2
  assert f'{missing} does not exist' in capsys.readouterr().err
  assert not os.path.exists(missing)


def test_a_broken_results_file_is_named_and_left_out(tmp_path, capsys):
  _results_run(tmp_path, 'digits_otclr_b16_s0', 84.7,
               {'state': 'finished', 'step': 100, 'total_steps': 100})
  _results_run(tmp_path, 'digits_otclr_b16_s1', 80.0,
               {'state': 'finished', 'step': 100, 'total_steps': 100})
  broken = tmp_path / 'digits_otclr_b16_s1' / 'eval' / 'results.json'
  broken.write_text(broken.read_text()[:40])
  assert aggregate_only(tmp_path) == 1
  err = capsys.readouterr().err
  assert str(broken) in err
  (row,) = json.load(open(tmp_path / 'summary.json'))['rows']
  assert row['linear']['digits']['top1']['n'] == 1
  assert str(broken) in open(tmp_path / 'summary.md').read()


_SLEEPER = textwrap.dedent("""
    import os, sys, time
    open(sys.argv[1], 'w').write(str(os.getpid()))
    time.sleep(120)
""")

_SWEEP_PROCESS = textwrap.dedent("""
    import sys
    import os
    from launch import launcher
    launcher.SubprocessLauncher(os.getcwd(), poll_seconds=0.1)(
        [sys.executable, sys.argv[1], sys.argv[2]], sys.argv[3])
""")


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie (exited, not yet reaped by init) counts as dead.
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().split(') ')[-1][0] != 'Z'
  except FileNotFoundError:
    return False


@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason='PR_SET_PDEATHSIG is Linux-only')
def test_children_die_with_a_killed_sweep(tmp_path):
  (tmp_path / 'sleeper.py').write_text(_SLEEPER)
  pid_file = tmp_path / 'child.pid'
  parent = subprocess.Popen(
      [sys.executable, '-c', _SWEEP_PROCESS, str(tmp_path / 'sleeper.py'),
       str(pid_file),
       str(tmp_path / 'run' / 'train.log')], cwd=REPO)
  deadline = time.time() + 60
  while not (pid_file.exists() and pid_file.read_text()):
    assert time.time() < deadline and parent.poll() is None
    time.sleep(0.05)
  child = int(pid_file.read_text())
  assert _alive(child)
  parent.send_signal(signal.SIGKILL)
  parent.wait()
  deadline = time.time() + 10
  while _alive(child) and time.time() < deadline:
    time.sleep(0.05)
  alive = _alive(child)
  if alive:
    os.kill(child, signal.SIGKILL)
  assert not alive, 'the child outlived the SIGKILLed sweep'


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
                           f'--workdir={workdir}']) == rundir.EXIT_LOCKED
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
  _when_ready(str(ready), lambda: sweep.send_signal(signum), 300).join()
  out, err = sweep.communicate(timeout=60)
  assert sweep.returncode == rundir.EXIT_STOPPED, (out, err)
  assert ready.exists() and 'Traceback' not in err
  assert err.strip().splitlines() == [
      f'Sweep s stopped by {signal.Signals(signum).name}; rerun the same '
      'command to resume.']
  assert 'FAILED' not in out


def test_results_of_another_probe_protocol_are_not_finished(four_runs):
  # The L2 grid, tolerance and solver are code: results fitted before they
  # changed must be evaluated again, not averaged beside new ones.
  sweep, workdir, names = four_runs
  run = sweep.runs(workdir)[0]
  config = _config_of(sweep, run)
  write_run_files(run.workdir, config)
  path = os.path.join(run.workdir, 'eval', 'results.json')
  protocol = {'probe': probe.SOLVER, 'l2_grid': list(probe.L2_GRID),
              'probe_tolerance': probe.GRAD_TOL}

  def write(protocol):
    with open(path, 'w') as f:
      json.dump({'step': config.total_steps, 'protocol': protocol}, f)

  write(protocol)
  assert run_state.is_finished(config, run.workdir)
  for key, old in (('l2_grid', [0.0] + list(probe.L2_GRID)),
                   ('probe_tolerance', 1e-6),
                   ('probe', 'full-batch L-BFGS (optax.lbfgs)')):
    write({**protocol, key: old})
    assert not run_state.is_finished(config, run.workdir)
    assert key in run_state.stale_results_reason(config, run.workdir)
  launcher = FakeLauncher()
  assert sweep_lib.run_sweep(sweep, workdir, launcher=launcher,
                             aggregate=False) == 0
  assert (names[0], 'eval') in launcher.calls
  assert (names[0], 'train') not in launcher.calls


def test_a_sweep_over_a_setting_tabulates_one_row_per_value(tmp_path):
  # The example of launch/sweep.py's docstring: seeds x ot.epsilon. Results
  # written before they carried their config are identified by
  # eval/config.json.
  path = write_sweep(tmp_path / 's.py', {'ot.epsilon': [0.05, 0.5]})
  sweep = sweep_lib.load_sweep(path)
  workdir = tmp_path / 'out'
  for run, top1 in zip(sweep.runs(str(workdir)), (94.7, 97.5)):
    config = sweep.run_config(run)
    _results_run(workdir, run.name, top1, {'state': 'finished', 'step': 2,
                                          'total_steps': 2})
    (workdir / run.name / 'eval' / 'config.json').write_text(
        json.dumps({**config.to_dict(), 'mode': 'eval'}))
  assert aggregate_only(workdir) == 0
  rows = json.load(open(workdir / 'summary.json'))['rows']
  assert [r['n'] for r in rows] == [1, 1]
  assert [r['label'] for r in rows] == ['ot.epsilon=0.05', 'ot.epsilon=0.5']
  markdown = open(workdir / 'summary.md').read()
  assert '(n=2)' not in markdown and 'ot.epsilon=0.5' in markdown


def test_every_run_of_the_sweep_that_is_not_averaged_is_listed(tmp_path):
  names = ['seed=0', 'seed=1', 'seed=2', 'seed=3']
  (tmp_path / 'runs.json').write_text(json.dumps(
      {'runs': [{'name': n} for n in names]}))
  _results_run(tmp_path, names[0], 84.7,
               {'state': 'finished', 'step': 100, 'total_steps': 100})
  # Diverged before any evaluation; failed at start; never started.
  os.makedirs(tmp_path / names[1])
  (tmp_path / names[1] / 'status.json').write_text(json.dumps(
      {'state': 'diverged', 'step': 6, 'total_steps': 100}))
  os.makedirs(tmp_path / names[2])
  (tmp_path / names[2] / 'status.json').write_text(json.dumps(
      {'state': 'failed', 'step': 0, 'total_steps': 100}))
  assert aggregate_only(tmp_path) == 0
  summary = json.load(open(tmp_path / 'summary.json'))
  assert [r['n'] for r in summary['rows']] == [1]
  why = {e['run']: e['why'] for e in summary['not_averaged']}
  assert set(why) == set(names[1:])
  assert 'diverged at step 6 of 100' in why[names[1]]
  assert 'failed at step 0 of 100' in why[names[2]]
  assert 'not started' in why[names[3]]
  for ext in ('md', 'tex'):
    text = open(tmp_path / f'summary.{ext}').read()
    assert all(n in text for n in names[1:]), ext


def test_an_evaluation_cut_between_its_writes_is_never_finished(
    tmp_path, monkeypatch):
  from otclr_jax import fileio  # pylint: disable=g-import-not-at-top
  from otclr_jax.evaluation import evaluate  # pylint: disable=g-import-not-at-top
  path = write_sweep(tmp_path / 's.py', tiny_grid())
  sweep = sweep_lib.load_sweep(path)
  (run,) = sweep.runs(str(tmp_path / 'out'))
  old, new = sweep.run_config(run), sweep_lib.load_sweep(
      path, ['--config.eval.probe_steps=7']).run_config(run)
  write_run_files(run.workdir, old, evaluated=False)

  def results_of(config):
    return {'step': 2, 'method': 'otclr', 'seed': 0, 'batch_size': 16,
            'pretrain_dataset': 'digits', 'config': config.to_dict(),
            'linear': {'digits': {'top1': 90.0, 'top5': 99.0}}}

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
