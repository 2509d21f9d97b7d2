"""Tests of `otclr_jax.main.run`: which config a command uses, and its
statuses."""

import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from otclr_jax import cli
from otclr_jax import experiment
from otclr_jax import main
from otclr_jax import rundir
from otclr_jax import train
from otclr_jax.evaluation import features
from tests import folder_trees
from tests import helpers


# `simclr_run`'s settings.
RUN = {'method': 'simclr', 'seed': 1, 'loss.temperature': 0.2}


def _config(data_dir, **overrides):
  config = helpers.eval_config(data_dir, **overrides)
  config.eval.figures = False
  return config


@pytest.fixture
def workdir(simclr_run, tmp_path):
  """A copy of `simclr_run` without its evaluation."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(simclr_run[1], workdir, ignore=shutil.ignore_patterns(
      'eval'))
  return workdir


def test_evaluation_uses_the_runs_own_settings(workdir, data_dir,
                                               monkeypatch):
  helpers.small_digits(monkeypatch)
  # The config file's defaults (OTCLR, seed 0) differ from the run's.
  config = _config(data_dir, mode='eval')
  assert main.run(config, workdir) == 0
  with open(os.path.join(workdir, 'eval', 'results.json')) as f:
    results = json.load(f)
  assert (results['method'], results['title'], results['seed']) == (
      'simclr', 'SimCLR', 1)
  with open(os.path.join(workdir, 'eval', 'config.json')) as f:
    stored = json.load(f)
  assert (stored['method'], stored['seed'], stored['loss']['temperature']) == (
      'simclr', 1, 0.2)
  with open(os.path.join(workdir, 'eval', 'tables.md')) as f:
    assert '| SimCLR' in f.read()


def test_evaluation_refuses_a_flag_that_contradicts_the_run(workdir,
                                                            data_dir, caplog):
  config = _config(data_dir, mode='eval', method='moco')
  helpers.assert_usage_error(
      caplog, r"--config.method contradicts the run in .*checkpoints.4 "
      r"\(method: 'simclr' -> 'moco'",
      lambda: main.run(config, workdir, overridden=['mode', 'method']))
  assert not os.path.exists(os.path.join(workdir, 'eval'))
  # A flag that agrees with the run, and eval.* settings, are fine.
  config = _config(data_dir, mode='eval', method='simclr')
  experiment.adopt_run_config(config, workdir, ['method', 'eval.batch_size'])
  assert config.seed == 1


def test_deleted_config_json_still_guards_the_resume(workdir, data_dir):
  os.remove(os.path.join(workdir, rundir.CONFIG_FILE))
  other = _config(data_dir, **{**RUN, 'seed': 4, 'ot.epsilon': 0.1})
  with pytest.raises(experiment.ConfigError,
                     match=r'ot.epsilon: 0.05 -> 0.1; seed: 1 -> 4'):
    train.train(other, workdir)
  assert not os.path.exists(os.path.join(workdir, rundir.CONFIG_FILE))
  # Evaluation recovers the run's settings from the checkpoint as well.
  config = _config(data_dir, mode='eval')
  experiment.adopt_run_config(config, workdir)
  assert (config.method, config.seed) == ('simclr', 1)
  same = _config(data_dir, **RUN)
  assert train.train(same, workdir).status == 'finished'
  assert rundir.read_config(workdir)['seed'] == 1


def test_checkpoints_without_any_config_are_not_resumed_or_evaluated(
    workdir, data_dir, caplog):
  os.remove(os.path.join(workdir, rundir.CONFIG_FILE))
  checkpoints = os.path.join(workdir, 'checkpoints')
  for step in os.listdir(checkpoints):
    shutil.rmtree(os.path.join(checkpoints, step, 'config'))
  config = _config(data_dir, **RUN)
  with pytest.raises(experiment.ConfigError, match='no checkpoint holds its '
                     'config'):
    train.train(config, workdir)
  # Evaluating it with this command's settings would report another run.
  config = _config(data_dir, mode='eval', method='moco', seed=7)
  helpers.assert_usage_error(caplog, 'no checkpoint holds its config',
                             lambda: main.run(config, workdir))
  assert not os.path.exists(os.path.join(workdir, rundir.RESULTS_FILE))


@pytest.mark.parametrize('edit, shown', [
    (lambda c: c['model'].update(stage_sizes=[2, 2, 2, 2]),
     "model.stage_sizes: [1, 1, 1, 1] -> [2, 2, 2, 2]"),
    (lambda c: c.update(seed=2), 'seed: 1 -> 2'),
    (lambda c: c.update(batch_size='16'), "batch_size: 16 -> '16'"),
    (lambda c: c.update(ot=None), 'ot: (absent) -> None'),
    (lambda c: c.clear(), 'and '),
])
def test_a_config_json_that_disagrees_with_the_checkpoint_is_refused(
    workdir, data_dir, caplog, capsys, edit, shown):
  from otclr_jax import export  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, rundir.CONFIG_FILE)
  stored = rundir.read_config(workdir)
  edit(stored)
  rundir.write_json(path, stored)
  message = 'disagrees with the config stored in checkpoint'
  config = _config(data_dir, mode='eval')
  helpers.assert_usage_error(
      caplog, re.escape(message) + '.*' + re.escape(shown),
                     lambda: main.run(config, workdir))
  assert not os.path.exists(os.path.join(workdir, 'eval'))
  same = _config(data_dir, **RUN)
  with pytest.raises(experiment.ConfigError, match=message):
    train.train(same, workdir)
  assert export.main(['export', f'--workdir={workdir}']) == 2
  err = capsys.readouterr().err
  assert message in err and err.count('\n') == 1, err


def test_a_train_and_evaluate_command_validates_its_config_once(
    tmp_path, data_dir, monkeypatch):
  # Into ~/run: the home directory's.
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  monkeypatch.chdir(tmp_path)
  helpers.small_digits(monkeypatch)
  calls = []
  real = experiment.validate_config
  monkeypatch.setattr(experiment, 'validate_config',
                      lambda config: calls.append(1) or real(config))
  config = _config(data_dir, **{'eval.at_end': True,
                                'eval.evaluators': ('knn',)})
  assert main.run(config, '~/run') == 0
  workdir = tmp_path / 'home' / 'run'
  assert os.path.exists(workdir / rundir.RESULTS_FILE)
  assert rundir.read_status(str(workdir))['state'] == 'finished'
  assert not os.path.exists(tmp_path / '~')
  assert len(calls) == 1


def test_corrupt_config_json_is_a_usage_error(workdir, data_dir, caplog):
  with open(os.path.join(workdir, rundir.CONFIG_FILE), 'w') as f:
    f.write('{"seed": 3,')
  for mode in ('train', 'eval'):
    config = _config(data_dir, mode=mode, **RUN)
    helpers.assert_usage_error(caplog, 'config.json is corrupt',
                               lambda: main.run(config, workdir))


def test_unwritable_workdir_ends_in_one_line(tmp_path, data_dir, monkeypatch,
                                             caplog):
  workdir = str(tmp_path / 'locked' / 'run')
  os.makedirs(os.path.dirname(workdir))
  if os.geteuid() == 0:  # root writes through any mode bits
    def refuse(path, *args, **kwargs):
      raise PermissionError(errno.EACCES, 'Permission denied', path)
    monkeypatch.setattr(rundir.os, 'makedirs', refuse)
  else:
    os.chmod(os.path.dirname(workdir), 0o555)
  with caplog.at_level(logging.ERROR):
    assert main.run(_config(data_dir), workdir) == cli.EXIT_CANT_CREATE
  assert re.search('Cannot write .*Permission denied', caplog.text)


def _one_class_tree(root):
  folder_trees.random_tree(root, {'train': {'only': 3}, 'test': {'only': 3}},
                           size=8)


def _one_image_per_class_tree(root):
  layout = {'a': 1, 'b': 1, 'c': 1}
  folder_trees.random_tree(root, {'train': layout, 'test': layout}, size=8)


@pytest.mark.parametrize('name, message', [
    ('folder:{tmp}/absent', 'absent'),
    ('folder:{tmp}/one_class', 'class'),
    ('folder:{tmp}/one_each', 'at most one train image per class'),
    ('cifar11', 'cifar11'),
])
def test_evaluation_datasets_are_checked_before_training(tmp_path, data_dir,
                                                         name, message,
                                                         caplog):
  _one_class_tree(str(tmp_path / 'one_class'))
  _one_image_per_class_tree(str(tmp_path / 'one_each'))
  workdir = str(tmp_path / 'run')
  config = _config(data_dir, **{'eval.at_end': True})
  config.eval.datasets = ('digits', name.format(tmp=tmp_path))
  helpers.assert_usage_error(caplog, message,
                             lambda: main.run(config, workdir))
  assert not os.path.exists(workdir)  # nothing was trained


def test_a_dataset_the_probe_cannot_use_is_refused_before_evaluating(
    workdir, tmp_path, data_dir, caplog):
  _one_image_per_class_tree(str(tmp_path / 'one_each'))
  config = _config(data_dir, mode='eval')
  config.eval.datasets = (f'folder:{tmp_path}/one_each',)
  helpers.assert_usage_error(caplog, 'at most one train image per class',
                             lambda: main.run(config, workdir))
  assert not os.path.exists(os.path.join(workdir, rundir.RESULTS_FILE))


def test_data_errors_are_usage_errors(tmp_path, data_dir, caplog):
  helpers.assert_usage_error(
      caplog, r'batch_size=2048 is larger than digits/train',
                     lambda: main.run(_config(data_dir, batch_size=2048),
                                      str(tmp_path / 'a')))
  _one_class_tree(str(tmp_path / 'tree'))
  shutil.rmtree(tmp_path / 'tree' / 'train')
  config = _config(data_dir, dataset=f'folder:{tmp_path}/tree')
  helpers.assert_usage_error(caplog, 'train',
                             lambda: main.run(config, str(tmp_path / 'b')))


@pytest.mark.parametrize('signal_name, dropped', [
    ('SIGTERM', False), ('SIGINT', False),
    # Its raise dropped, as when it lands in JAX's garbage-collection
    # callback.
    ('SIGTERM', True)])
def test_a_signal_during_evaluation_stops_with_75(workdir, data_dir,
                                                  monkeypatch, caplog,
                                                  signal_name, dropped):
  real = features.extract_features

  def interrupted(*args, **kwargs):
    if dropped:
      helpers.SignalsInAFinaliser(signal.Signals[signal_name])
    else:
      os.kill(os.getpid(), signal.Signals[signal_name])
    return real(*args, **kwargs)

  monkeypatch.setattr(features, 'extract_features', interrupted)
  with caplog.at_level(logging.ERROR):
    assert main.run(_config(data_dir, mode='eval'), workdir) == (
        cli.EXIT_STOPPED)
  assert f'{signal_name} during evaluation' in caplog.text
  assert not os.path.exists(os.path.join(workdir, 'eval', 'results.json'))


def test_a_signal_while_the_encoder_is_written_stops_cleanly(
    tmp_path, data_dir, monkeypatch, caplog):
  from otclr_jax import export  # pylint: disable=g-import-not-at-top
  from otclr_jax import fileio  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / 'run')
  real = fileio.atomic_write

  def interrupted(path, write):
    def write_then_stop(f):
      write(f)
      os.kill(os.getpid(), signal.SIGTERM)
    encoder = path.endswith(rundir.ENCODER_FILE)
    return real(path, write_then_stop if encoder else write)

  monkeypatch.setattr(fileio, 'atomic_write', interrupted)
  with caplog.at_level(logging.ERROR):
    assert main.run(_config(data_dir), workdir) == cli.EXIT_STOPPED
  assert 'while writing the trained encoder' in caplog.text
  assert 'while starting' not in caplog.text
  encoder_dir = os.path.join(workdir, rundir.ENCODER_DIR)
  assert not os.path.isdir(encoder_dir) or os.listdir(encoder_dir) == []
  assert rundir.read_status(workdir)['state'] == 'stopped'
  # The rerun writes it, from the final checkpoint.
  monkeypatch.setattr(fileio, 'atomic_write', real)
  assert main.run(_config(data_dir), workdir) == 0
  assert os.listdir(encoder_dir) == [rundir.ENCODER_FILE]
  assert rundir.read_status(workdir)['state'] == 'finished'
  assert export.load_encoder_config(export.encoder_path(workdir))['step'] == 4


def test_evaluation_settings_are_checked_before_training(tmp_path, data_dir,
                                                         caplog):
  workdir = str(tmp_path / 'run')
  config = _config(data_dir, **{'eval.at_end': True})
  config.eval.evaluators = ('probe', 'knnn')
  helpers.assert_usage_error(caplog, 'evaluators',
                             lambda: main.run(config, workdir))
  assert not os.path.exists(workdir)


def test_the_command_line_stops_evaluation_with_75(workdir, data_dir):
  # SIGTERM alone: both signals take one path, checked in process above; this
  # checks the process's own exit.
  proc = subprocess.Popen(
      [sys.executable, '-m', 'otclr_jax.main', '--config=configs/digits.py',
       f'--config.data_dir={data_dir}', '--config.mode=eval',
       '--config.eval.figures=False', f'--workdir={workdir}'],
      stderr=subprocess.PIPE, text=True,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    lines = []
    for line in proc.stderr:
      lines.append(line)
      if 'Evaluating ' in line:
        break
    # Into the probe's jitted solver: the interpreter's shutdown must not
    # tear down a computation still running (a segfault, exit 139).
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=300)
  finally:
    proc.kill()
  stderr = ''.join(lines) + rest
  assert proc.returncode == cli.EXIT_STOPPED, stderr
  assert 'Traceback' not in stderr and 'Fatal Python error' not in stderr
  assert 'SIGTERM during evaluation' in stderr


def test_compilation_cache_goes_to_a_directory_per_cpu(tmp_path):
  cache = tmp_path / 'xla'
  out = folder_trees.run_python(f"""
      import jax
      from configs import default
      from otclr_jax import main
      config = default.get_config()
      config.compilation_cache_dir = {str(cache)!r}
      print(main.use_compilation_cache(config))
      jax.jit(lambda x: x * 2.0 + 1.0)(3.0).block_until_ready()
      """, cwd=tmp_path, env={
          # Without the test session's own cache variable, which would take
          # over.
          'JAX_COMPILATION_CACHE_DIR': None,
          'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'})
  assert out.returncode == 0, out.stderr
  used = out.stdout.strip().splitlines()[-1]
  assert os.path.dirname(used) == str(cache)
  assert re.fullmatch(r'cpu-[0-9a-f]{12}', os.path.basename(used))
  assert os.listdir(used)  # the program was written there


def test_compilation_cache_leaves_jax_alone_when_told(monkeypatch):
  config = helpers.tiny_config('unused')
  config.compilation_cache_dir = '/never/used'
  monkeypatch.setenv('JAX_COMPILATION_CACHE_DIR', '/set/by/the/user')
  assert main.use_compilation_cache(config) is None
  monkeypatch.delenv('JAX_COMPILATION_CACHE_DIR')
  config.compilation_cache_dir = ''
  assert main.use_compilation_cache(config) is None


def test_training_that_finished_is_0_while_another_evaluation_runs(
    tmp_path, data_dir, caplog):
  import fcntl  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / 'run'
  workdir.mkdir()
  # A manual evaluation of this workdir, in another process, holds eval/.
  held = open(workdir / rundir.EVAL_LOCK_FILE, 'w')
  fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
  try:
    with caplog.at_level(logging.INFO):
      status = main.run(_config(data_dir, **{'eval.at_end': True}),
                        str(workdir))
  finally:
    held.close()
  assert status == 0
  assert rundir.read_status(str(workdir))['state'] == 'finished'
  lines = [r.getMessage() for r in caplog.records
           if 'evaluat' in r.getMessage() and 'in use' in r.getMessage()]
  assert len(lines) == 1, lines
  assert 'may hold an earlier step' in lines[0], lines
  assert not (workdir / 'eval' / 'results.json').exists()
