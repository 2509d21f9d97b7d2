"""Every tool against bad inputs: the documented status, one line, nothing made.

The statuses are docs/operations.md's table (otclr_jax/cli.py maps the
exceptions): 2 a usage error, 65 diverged, 73 locked or unwritable, 75
stopped, 1 anything else. A traceback would mean a bug in the project.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from launch import slurm as slurm_lib
from launch import sweep as sweep_lib
from otclr_jax import cli
from otclr_jax import export
from otclr_jax import rundir
from otclr_jax.figures import __main__ as figures_cli
from tests import helpers
from tests.folder_trees import random_tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = ['--config=configs/digits.py', '--config.total_steps=2',
          '--config.image_size=8', '--config.ot.grid_size=4']


def _snapshot(root):
  return sorted(os.path.relpath(os.path.join(d, n), root)
                for d, dirs, files in os.walk(root) for n in dirs + files)


def _check_one_line(err, status, expected, match):
  assert status == expected, err
  assert 'Traceback' not in err, err
  errors = [line for line in err.splitlines()
            if line.startswith(('E', 'F', 'error', 'Sweep', 'launch.slurm',
                                'Usage', '--aggregate_only'))]
  assert len(errors) == 1, err
  assert match in errors[0], errors[0]
  return errors[0]


# ----------------------------------------------------------------------------
# python -m otclr_jax.main and python -m otclr_jax.bench: one process each,
# six started together (each start imports JAX).


def _main_cases(root, data_dir):
  """(name, argv, status, text of the error line, paths that must not exist)."""
  afile = root / 'a_file'
  afile.write_text('not a directory\n')
  diverged = root / 'diverged'
  diverged.mkdir()
  (diverged / rundir.STATUS_FILE).write_text(json.dumps(
      {'state': 'diverged', 'step': 3, 'total_steps': 10}))
  tree = root / 'tree'
  random_tree(str(tree), {'train': {'a': 3, 'b': 3}}, size=8)
  os.symlink(str(root / 'gone.png'), str(tree / 'train' / 'a' / 'x.png'))
  (root / 'locked').mkdir()
  main = [sys.executable, '-m', 'otclr_jax.main', *DIGITS,
          f'--config.data_dir={data_dir}']
  bench = [sys.executable, '-m', 'otclr_jax.bench']
  return [
      ('negative seed', main + ['--config.seed=-1', f'--workdir={root}/w1'],
       2, 'config.seed', [root / 'w1']),
      ('seed past int64', main + [f'--config.seed={2**63}',
                                  f'--workdir={root}/w2'],
       2, 'config.seed', [root / 'w2']),
      ('workdir is a file', main + [f'--workdir={afile}/run'], 2,
       'not a directory', []),
      ('data_dir is a file', main + [f'--config.data_dir={afile}',
                                     f'--workdir={root}/w3'],
       2, 'data_dir', [root / 'w3']),
      ('moco queue below the batch', main + [
          '--config.method=moco', '--config.moco.queue_size=8',
          f'--workdir={root}/w4'], 2, 'moco.queue_size', [root / 'w4']),
      ('dangling symlink in a folder tree', main + [
          f'--config.dataset=folder:{tree}', '--config.eval.at_end=False',
          f'--workdir={root}/w5'], 2, 'x.png', [root / 'w5']),
      ('evaluating a run that diverged before a checkpoint', main + [
          '--config.mode=eval', f'--workdir={diverged}'], 65,
       'diverged at step 3', [diverged / 'eval']),
      ('evaluating an empty workdir', main + [
          '--config.mode=eval', f'--workdir={root}/w6'], 2,
       'pretrain first', [root / 'w6' / 'eval']),
      # Checked at the entry even when this command only trains: the
      # evaluation that follows would refuse it after the training.
      ('unknown evaluator', main + [
          "--config.eval.evaluators=('probe', 'nope')",
          '--config.eval.at_end=False', f'--workdir={root}/w7'], 2,
       'eval.evaluators', [root / 'w7']),
      ('a typo in an override', main + [
          '--config.ot.epsilo=0.1', f'--workdir={root}/w8'], 2,
       'Did you mean "epsilon"', [root / 'w8']),
      ('an epsilon too small', main + [
          '--config.ot.epsilon=1e-5', f'--workdir={root}/w9'], 2,
       'below 0.01145', [root / 'w9']),
      ('a missing config file', main + [
          '--config=configs/nope.py', f'--workdir={root}/w10'], 2,
       'cannot load --config=configs/nope.py', [root / 'w10']),
      ('a batch larger than the data', main + [
          '--config.batch_size=4096', f'--workdir={root}/w11'], 2,
       'batch_size=4096 is larger than digits/train', []),
      ('half the distributed settings', main + [
          '--num_processes=2', f'--workdir={root}/w12'], 2,
       '--coordinator_address', [root / 'w12']),
      ('evaluating a workdir another evaluation holds', main + [
          '--config.mode=eval', f'--workdir={root}/locked'], cli.EXIT_LOCKED,
       f'{root}/locked is in use by process {os.getpid()}',
       [root / 'locked' / 'eval']),
      ('bench without a subcommand', bench, 2, 'subcommand', []),
      ('bench flags out of range', bench + ['ot', '--repeats=0'], 2,
       'error: --repeats must be >= 1, got 0.', []),
      ('bench config typo', bench + [
          'train', '--config=configs/digits.py', '--config.optim.baselr=1'],
       2, "error: unknown config field 'baselr'", []),
  ]


def test_the_command_lines_refuse_bad_inputs_in_one_line(tmp_path, data_dir):
  cases = _main_cases(tmp_path, data_dir)
  # Not the user's: JAX's cluster variables, were they set here.
  env = {k: v for k, v in os.environ.items() if k not in (
      'JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID')}
  failures = []
  with rundir.lock(str(tmp_path / 'locked'), rundir.EVAL_LOCK_FILE):
    for start in range(0, len(cases), 6):
      batch = cases[start:start + 6]
      procs = [subprocess.Popen(argv, cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
               for _, argv, *_ in batch]
      for (name, argv, status, match, absent), proc in zip(batch, procs):
        _, err = proc.communicate(timeout=600)
        try:
          line = _check_one_line(err, proc.returncode, status, match)
          lines = err.strip().splitlines()
          # The error is what the user sees first (bench's flags) or last,
          # not buried above a traceback; no usage text, no JAX probe.
          assert line in (lines[:1] if 'bench' in argv[2] else lines[-2:])
          assert 'flags:' not in err and "backend 'tpu'" not in err, err
          for path in absent:
            assert not os.path.exists(path), f'{path} was created'
        except AssertionError as e:
          failures.append(f'{name}: {e}')
  assert not failures, '\n\n'.join(failures)


def _catches(pid, signum):
  with open(f'/proc/{pid}/status') as f:
    for line in f:
      if line.startswith('SigCgt:'):
        return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
  return False


@pytest.mark.skipif(not os.path.exists('/proc/self/status'),
                    reason='reads the signal mask from /proc')
def test_a_stop_during_start_up_exits_75(tmp_path):
  # SIGTERM while the tool still imports JAX: a preempted SLURM job must see
  # 75 (requeue), not 143.
  proc = subprocess.Popen(
      [sys.executable, '-m', 'otclr_jax.main', *DIGITS,
       f'--workdir={tmp_path}/run'], cwd=REPO, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  # Once the handler is in (SigCgt of /proc), the process is still importing
  # JAX: its first lines run before any heavy import.
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline and not _catches(proc.pid,
                                                     signal.SIGTERM):
    time.sleep(0.01)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 75, err
  assert 'Traceback' not in err and 'SIGTERM' in err
  assert not os.path.exists(tmp_path / 'run')


# ----------------------------------------------------------------------------
# The other tools, in this process, through the same runner.


def _sweep_file(path, body):
  path.write_text('from configs import digits\n\n\ndef get_config():\n'
                  '  return digits.get_config()\n\n\n'
                  f'def get_hyper(hyper):\n  return {body}\n')
  return str(path)


def _in_process_cases(root, data_dir):
  afile = root / 'a_file'
  afile.write_text('x')
  empty = _sweep_file(root / 'empty.py', 'hyper.zipit([])')
  one = _sweep_file(root / 'one.py',
                    "hyper.sweep('config.seed', [0])")
  torn = root / 'torn'
  torn.mkdir()
  (torn / 'runs.json').write_text('{"runs": [{"name": "a"')
  run = root / 'run'
  run.mkdir()
  rundir.write_config(str(run), helpers.tiny_config(data_dir).to_dict())
  outdir = root / 'outdir'
  outdir.mkdir()
  bad_png = root / 'bad.png'
  bad_png.write_bytes(b'\x89PNG\r\n\x1a\n' + b'\0' * 20)
  slurm = ['slurm', '--config=configs/digits.py']
  sweep_file = helpers.write_sweep(root / 's.py', helpers.tiny_grid())
  sweep = ['sweep', f'--config={sweep_file}',
           f'--workdir={root}/out']
  metrics = root / 'metrics_run'
  metrics.mkdir()
  (metrics / rundir.METRICS_FILE).write_text(
      '{"step": 1, "loss": 1}\n{"step": 2, "lo\n{"step": 3, "loss": 1}\n')
  return [
      ('sweep with an empty grid', sweep_lib.main,
       ['sweep', f'--config={empty}', f'--workdir={root}/s1'], 2,
       'no runs', [root / 's1']),
      ('sweep into a file', sweep_lib.main,
       ['sweep', f'--config={one}', f'--workdir={afile}'], 2,
       'not a directory', []),
      ('sweep summary of a torn runs.json', sweep_lib.main,
       ['sweep', f'--workdir={torn}', '--aggregate_only'], 2, 'runs.json',
       [torn / 'summary.md', torn / 'summary.json']),
      ('export into a directory', export.main,
       ['export', f'--workdir={run}', f'--out={outdir}'], 2,
       'is a directory', []),
      ('export a workdir that is a file', export.main,
       ['export', f'--workdir={afile}'], 2, 'not a directory', []),
      ('export a workdir without checkpoints', export.main,
       ['export', f'--workdir={run}'], 2, 'pretrain first', []),
      ('interpolation of a truncated image', figures_cli.main,
       ['figures', 'interpolation', f'--image={bad_png}',
        f'--out={root}/i.png', '--size=16'], 2, 'bad.png', [root / 'i.png']),
      ('curves of a metrics.jsonl with a corrupt middle line',
       figures_cli.main, ['figures', 'curves', f'--workdir={metrics}',
                          f'--out={root}/c.png'], 2, 'line 2',
       [root / 'c.png']),
      ('slurm into a file', slurm_lib.main,
       ['slurm', '--config=configs/digits.py', f'--workdir={afile}/x',
        '--nodes=2', '--gpus_per_node=1'], 2, 'not a directory', []),
      ('slurm of a bad config', slurm_lib.main, slurm + [
          f'--workdir={root}/j1', '--nodes=2', '--config.batch_size=1'], 2,
       'batch_size', [root / 'j1']),
      ('slurm on no nodes', slurm_lib.main, slurm + [
          f'--workdir={root}/j2', '--nodes=0'], 2, '>= 1 node',
       [root / 'j2']),
      # absl's other spellings pass the check but a job would drop or misread
      # them (--noconfig.x vanished; --config.x v took the next flag as v).
      *(('slurm with another override spelling', slurm_lib.main, slurm + [
          f'--workdir={root}/j3', '--nodes=2', *flags], 2,
         'give config overrides as --config.a.b=v', [root / 'j3'])
        for flags in (['--noconfig.optim.clip_lr'],
                      ['--config.data_dir', '/data'])),
      ('sweep with an override typo', sweep_lib.main, sweep + [
          '--config.ot.epsilonn=0.1'], 2, 'Did you mean "epsilon"', []),
      *(('sweep with another override spelling', sweep_lib.main,
         sweep + [flag], 2, '', []) for flag in (
             '--override=ot.epsilon=0.1', '--config.ot.epsilon')),
      # A swept key set on the command line too would be ambiguous.
      ('sweep setting a swept key', sweep_lib.main,
       sweep + ['--config.seed=3'], 2, 'sweeps config.seed', []),
      # One array task's index means nothing to a job or a summary of them.
      *(('one index of a sweep job or summary', sweep_lib.main,
         sweep + ['--only_index=0', mode], 2, 'Usage', [])
        for mode in ('--slurm', '--aggregate_only')),
      ('summary of no directory', sweep_lib.main, [
          'sweep', f'--workdir={root}/typo', '--aggregate_only'], 2,
       f'{root}/typo does not exist', [root / 'typo']),
      ('interpolation into a JPEG', figures_cli.main, [
          'figures', 'interpolation', f'--out={root}/fig.jpg', '--size=16'],
       2, '.png', []),
      # Not "0 figure(s)" with status 0.
      ('report of nothing', figures_cli.main, [
          'figures', 'report', f'--workdir={outdir}'], 2, 'no figure drawn',
       []),
      *(('report of no run', figures_cli.main, [
          'figures', 'report', *flags, f'{flag}={root}/no'], 2,
         f'{flag}={root}/no is not a run directory', [])
        for flag, flags in (('--workdir', []),
                            ('--compare', [f'--workdir={outdir}']))),
      # One parser with main: a typo fails with a suggestion instead of
      # adding a field and leaving epsilon unchanged.
      ('figures with an override typo', figures_cli.main, [
          'figures', 'tsne', f'--workdir={run}', '--config=configs/digits.py',
          '--config.ot.epsilonn=0.1'], 2, 'Did you mean "epsilon"', []),
      ('figures of no kind', figures_cli.main, [
          'figures', 'nosuch', f'--workdir={run}'], 2, '', []),
      ('figures of no run', figures_cli.main, ['figures', 'tsne'], 2, '', []),
  ]


def test_every_tool_refuses_bad_inputs_in_one_line(tmp_path, data_dir,
                                                   capsys):
  cases = _in_process_cases(tmp_path, data_dir)
  failures = []
  for name, main, argv, status, match, absent in cases:
    capsys.readouterr()
    before = _snapshot(tmp_path)
    code = cli.call(main, argv, usage_errors=())
    err = capsys.readouterr().err
    try:
      _check_one_line(err, code, status, match)
      for path in absent:
        assert not os.path.exists(path), f'{path} was created'
      assert _snapshot(tmp_path) == before, 'files were created'
    except AssertionError as e:
      failures.append(f'{name}: {e}')
  assert not failures, '\n\n'.join(failures)


@pytest.mark.parametrize('error, status', [
    (rundir.CorruptFileError('x.json is corrupt'), 2),
    (cli.WorkdirLockedError('in use'), 73),
    (cli.StopRequested(signal.SIGTERM), 75),
    (OSError(28, 'No space left on device', '/full/x'), 1),
    (PermissionError(13, 'Permission denied', '/ro/x'), 73),
    (NotADirectoryError(20, 'Not a directory', '/f/x'), 2),
    (FileNotFoundError('No checkpoints in /w'), 2),
])
def test_the_status_table(error, status, capsys):
  assert cli.report(error) == status
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and 'Traceback' not in err


def test_a_bug_keeps_its_traceback(capsys):
  try:
    {}['oops']
  except KeyError as e:
    assert cli.report(e) == 1
  assert 'Traceback' in capsys.readouterr().err


def test_disk_full_path_from_a_tensorstore_error():
  # The text Orbax raised on a 20 MB tmpfs (abridged).
  error = ValueError(
      'RESOURCE_EXHAUSTED: Error writing "params.net.head.out.kernel/0.0" in '
      'OCDBT database at local file "/w/checkpoints/2.tmp/": Failed writing: '
      '"/w/checkpoints/2.tmp/d/4457ef": Failed to write 14004224 bytes to '
      "file 18: No space left on device [os_error_code='28']")
  try:
    raise RuntimeError('save failed') from error
  except RuntimeError as e:
    assert cli.disk_full_path(e, '/w') == '/w/checkpoints/2.tmp/d/4457ef'
  assert cli.disk_full_path(ValueError('other'), '/w') is None


# Each tool in a child whose work is replaced by a signal to itself; the
# sweep's training child signals the sweep, which waits for it.
_SIGNALLED = textwrap.dedent("""
    import os, sys, time
    tool, signum = sys.argv[1], int(sys.argv[2])
    def stop(*_):
      os.kill(os.getpid(), signum)
      time.sleep(30)
    if tool == 'export':
      from otclr_jax import export as module
      module.export_checkpoint = stop
    elif tool == 'figures':
      from otclr_jax.figures import __main__ as module, curves
      curves.curves_for_runs = stop
    else:
      from launch import sweep as module
      module.command = lambda *_: [sys.executable, '-c', 'import os, time; '
                                   f'os.kill(os.getppid(), {signum}); '
                                   'time.sleep(60)']
    sys.exit(module.main([tool, *sys.argv[3:]]))
""")


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize('tool, argv, line', [
    ('export', ['--workdir=/nonexistent'], 'Export stopped by {}; nothing '
     'was written.'),
    ('figures', ['curves', '--workdir=/nonexistent'], 'Figures stopped by {};'
     ' rerun to draw them.'),
    ('sweep', ['--config={tmp}/s.py', '--workdir={tmp}/out'], 'Sweep s '
     'stopped by {}; rerun the same command to resume.'),
])
def test_a_signal_ends_a_tool_with_75_and_one_line(tmp_path, tool, argv, line,
                                                   signum):
  helpers.write_sweep(tmp_path / 's.py', helpers.tiny_grid())
  done = subprocess.run(
      [sys.executable, '-c', _SIGNALLED, tool, str(signum),
       *(a.format(tmp=tmp_path) for a in argv)], cwd=REPO,
      capture_output=True, text=True, timeout=300)
  assert done.returncode == cli.EXIT_STOPPED, done.stderr
  assert done.stderr.strip().splitlines() == [
      line.format(signal.Signals(signum).name)]
  assert 'FAILED' not in done.stdout


# ----------------------------------------------------------------------------
# Signals: a stop raised where it lands, or a flag between steps.


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_stop_on_signals_raises_and_restores_the_handlers(signum):
  before = signal.getsignal(signum)
  with pytest.raises(cli.StopRequested) as stopped:
    with cli.stop_on_signals():
      os.kill(os.getpid(), signum)
      time.sleep(5)  # The handler raises before this ends.
  assert stopped.value.signum == signum
  assert stopped.value.name == signal.Signals(signum).name
  assert signal.getsignal(signum) is before
  # Not an Exception: `except Exception` blocks do not swallow a stop.
  assert not isinstance(stopped.value, Exception)


def test_a_stop_raised_in_a_finaliser_is_not_lost(capfd):
  ran_on = []
  with pytest.raises(cli.StopRequested) as stopped:
    with cli.stop_on_signals():
      helpers.SignalsInAFinaliser(signal.SIGTERM)  # dropped at once
      ran_on.append('after the finaliser')
      cli.check_stop()
      ran_on.append('after check_stop')
  assert ran_on == ['after the finaliser']
  assert stopped.value.signum == signal.SIGTERM
  assert 'Exception ignored' not in capfd.readouterr().err
  cli.check_stop()  # nothing pending once the block has ended


def test_work_that_ends_before_a_check_has_ended():
  with cli.stop_on_signals():
    helpers.SignalsInAFinaliser(signal.SIGINT)
  cli.check_stop()  # the next block starts with nothing pending
  with cli.stop_on_signals():
    cli.check_stop()


def test_other_dropped_exceptions_are_still_reported():
  seen = []

  class Fails:

    def __del__(self):
      raise ValueError('from a finaliser')

  hook = sys.unraisablehook
  sys.unraisablehook = seen.append
  try:
    with cli.stop_on_signals():
      Fails()
  finally:
    sys.unraisablehook = hook
  assert [type(info.exc_value) for info in seen] == [ValueError]


def test_helpconfig_lists_every_field_with_its_value_and_comment():
  from otclr_jax import config_files  # pylint: disable=g-import-not-at-top
  result = subprocess.run(
      [sys.executable, '-m', 'otclr_jax.main', '--config=configs/digits.py',
       '--config.ot.epsilon=0.1', '--helpconfig'], cwd=REPO,
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  config = config_files.load(os.path.join(REPO, 'configs', 'digits.py'))
  for name in config_files.flatten(config.to_dict()):
    assert f'--config.{name}=' in result.stdout, name
  assert '--config.ot.epsilon=0.1\n' in result.stdout
  assert '--config.dataset=digits\n      see otclr_jax/data/' in result.stdout
  assert '--config.moco.temperature=0.2\n      MoCo v2.' in result.stdout
  # The module's --help names it.
  helped = subprocess.run(
      [sys.executable, '-m', 'otclr_jax.main', '--help'], cwd=REPO,
      capture_output=True, text=True, timeout=120)
  assert '--helpconfig' in helped.stdout


def test_orbax_warnings_about_deliberate_choices_are_dropped():
  import logging  # pylint: disable=g-import-not-at-top
  from otclr_jax import checkpoint  # pylint: disable=g-import-not-at-top
  keep = checkpoint._DropOrbaxInfo().filter
  orbax = os.path.join('site-packages', 'orbax', 'checkpoint', 'x.py')

  def record(level, msg, path=orbax):
    return logging.LogRecord('absl', level, path, 1, msg, (), None)

  for msg in ('Given directory is read only=%s',
              'CheckpointManagerOptions.read_only=True, setting create=False.',
              'Metadata file does not exist: %s'):
    assert not keep(record(logging.WARNING, msg))
  assert not keep(record(logging.INFO, 'Saving checkpoint'))
  assert keep(record(logging.WARNING, 'Something else went wrong'))
  assert keep(record(logging.INFO, 'ours', path='otclr_jax/train.py'))

