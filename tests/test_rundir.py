"""Tests of otclr_jax.rundir: stored files, config diffs, the workdir lock."""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import ml_collections
import pytest

from otclr_jax import methods
from otclr_jax import rundir
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_status_and_config_round_trip(tmp_path):
  assert rundir.read_status(str(tmp_path)) is None
  assert rundir.read_config(str(tmp_path)) is None
  rundir.write_status(str(tmp_path), 'stopped', 3, 10)
  status = rundir.read_status(str(tmp_path))
  assert (status['state'], status['step'], status['total_steps']) == (
      'stopped', 3, 10)
  rundir.write_config(str(tmp_path), {'seed': 0, 'eval': {'d': ('a',)}})
  assert rundir.read_config(str(tmp_path)) == {'seed': 0, 'eval': {'d': ['a']}}


@pytest.mark.parametrize('name, reader', [
    (rundir.STATUS_FILE, rundir.read_status),
    (rundir.CONFIG_FILE, rundir.read_config)])
def test_corrupt_file_names_itself(tmp_path, name, reader):
  (tmp_path / name).write_text('{"state": "runn')
  with pytest.raises(ValueError, match=name):
    reader(str(tmp_path))


def test_result_changing_diff():
  stored = {'seed': 0, 'method': 'otclr', 'mode': 'train', 'data_dir': '/a',
            'log_every_steps': 5, 'total_steps': 4, 'num_epochs': 1,
            'ot': {'epsilon': 0.05, 'grid_size': 4},
            'eval': {'datasets': ['digits'], 'batch_size': 8},
            'monitor': {'every_steps': 500, 'num_train': 1000}}
  # A run stored before compilation_cache_dir existed still resumes; the
  # kNN monitor only reads the state.
  new = {'seed': 1, 'method': 'otclr', 'mode': 'eval', 'data_dir': '/b',
         'compilation_cache_dir': '/c',
         'log_every_steps': 7, 'total_steps': 8, 'num_epochs': 3,
         'ot': {'epsilon': 0.1, 'grid_size': 4, 'extra': 1},
         'eval': {'datasets': ('cifar10',), 'batch_size': 9},
         'monitor': {'every_steps': 0, 'num_train': 10, 'num_test': 5}}
  names = rundir.result_changing_diff(stored, new)
  assert names == ['ot.epsilon', 'ot.extra', 'seed']
  text = rundir.describe_diff(stored, new, names)
  assert "ot.epsilon: 0.05 -> 0.1" in text and 'ot.extra: (absent) -> 1' in text
  assert rundir.result_changing_diff(stored, stored) == []
  # A config stored before the monitor existed (no `monitor` at all).
  del stored['monitor']
  assert rundir.result_changing_diff(stored, new) == names


def test_a_run_stored_before_a_view_option_existed_is_the_same_run():
  # Its absence meant today's default: the run resumes and its results
  # stay current; another value is another run.
  stored = {'seed': 0, 'ot': {'epsilon': 0.05}}
  new = {'seed': 0, 'ot': {'epsilon': 0.05, **{
      k.split('.')[1]: v for k, v in rundir.ADDED_FIELDS.items()}}}
  assert rundir.result_changing_diff(stored, new) == []
  assert rundir.identity(stored) == rundir.identity(new)
  new['ot']['source'] = 'strong'
  assert rundir.result_changing_diff(stored, new) == ['ot.source']


def test_other_methods_settings_never_change_a_result():
  # A block of another method is never read: a field added to it later (or
  # changed) does not stop the run resuming; its own method's block does.
  stored = {'method': 'otclr', 'seed': 0, 'dino': {'base_tau': 0.9995},
            'moco': {'queue_size': 1024}}
  new = {'method': 'otclr', 'seed': 0,
         'dino': {'base_tau': 0.99, 'use_bn_in_head': False},
         'moco': {'queue_size': 4096}}
  assert rundir.result_changing_diff(stored, new) == []
  stored['method'] = new['method'] = 'dino'
  assert rundir.result_changing_diff(stored, new) == [
      'dino.base_tau', 'dino.use_bn_in_head']
  # A config naming another method (e.g. the config file's default when a
  # run is evaluated) still compares the run's own block.
  new['method'] = 'moco'
  assert rundir.result_changing_diff(stored, new) == [
      'dino.base_tau', 'dino.use_bn_in_head', 'method', 'moco.queue_size']
  stored['method'], new['method'] = 'moco', 'otclr'
  assert rundir.result_changing_diff(stored, new) == ['method',
                                                      'moco.queue_size']


def test_method_blocks_are_the_registered_methods_blocks():
  config = methods.add_defaults(ml_collections.ConfigDict())
  blocks = {name for name in methods.NAMES
            if isinstance(config.get(name, None), ml_collections.ConfigDict)}
  assert blocks == set(rundir.METHOD_BLOCKS)


def test_lock_refuses_a_second_process_and_is_released(tmp_path):
  workdir = str(tmp_path / 'run')
  script = textwrap.dedent(f"""
      from otclr_jax import cli, rundir
      try:
        with rundir.lock({workdir!r}):
          pass
      except cli.WorkdirLockedError as e:
        print('LOCKED', e)
      else:
        print('FREE')
      """)
  other = lambda: subprocess.run([sys.executable, '-c', script], cwd=REPO,
                                 capture_output=True, text=True, timeout=60)
  assert not helpers.is_locked(workdir) and not os.path.exists(workdir)
  with rundir.lock(workdir):
    with rundir.lock(workdir):  # re-entrant in one process
      pass
    assert helpers.is_locked(workdir)
    result = other()
    assert 'LOCKED' in result.stdout, result.stderr
    assert f'process {os.getpid()}' in result.stdout
    assert workdir in result.stdout
  assert 'FREE' in other().stdout
  assert not helpers.is_locked(workdir)


# ----------------------------------------------------------------------------
# An evaluation's outputs read as one unit; one torn-line rule for metrics.


def _evaluation(name, step):
  return ({'step': step, 'top1': float(step), 'config': {'name': name}},
          {'tables.md': f'| {name} |\n', 'tables.tex': f'% {name}\n',
           'config.json': f'{{"name": "{name}"}}\n',
           f'results_step{step}.json': f'{{"name": "{name}"}}\n'})


@pytest.mark.parametrize('fail_at', range(5))
def test_an_interrupted_evaluation_is_never_read_as_finished(
    tmp_path, monkeypatch, fail_at):
  workdir = str(tmp_path)
  old = rundir.write_evaluation(workdir, *_evaluation('old', 2))
  assert rundir.read_results(workdir) == old
  writes = []
  real = rundir.fileio.write_text

  def failing(path, text):
    if len(writes) == fail_at:
      raise OSError(28, 'No space left on device', path)
    writes.append(path)
    real(path, text)

  monkeypatch.setattr(rundir.fileio, 'write_text', failing)
  with pytest.raises(OSError):
    rundir.write_evaluation(workdir, *_evaluation('new', 4))
  monkeypatch.setattr(rundir.fileio, 'write_text', real)
  if fail_at == 0:
    assert rundir.read_results(workdir) == old  # nothing was replaced
  else:
    # Some files are the new evaluation's: the old results do not bind them.
    with pytest.raises(rundir.IncompleteEvaluationError,
                       match='evaluate again'):
      rundir.read_results(workdir)
  new = rundir.write_evaluation(workdir, *_evaluation('new', 4))
  assert rundir.read_results(workdir) == new


def test_metrics_have_one_torn_line_rule(tmp_path, caplog):
  path = tmp_path / rundir.METRICS_FILE
  assert rundir.read_metrics(str(tmp_path)) == []
  path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
                  '{"step": 3, "lo')
  assert [r['step'] for r in rundir.read_metrics(str(tmp_path))] == [1, 2]
  assert 'torn last line 3' in caplog.text
  path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
  with pytest.raises(rundir.CorruptFileError,
                     match=r'metrics.jsonl line 2 is not a metrics record'):
    rundir.read_metrics(str(tmp_path))


_RUN_FILE_NAMES = (rundir.CONFIG_FILE, rundir.STATUS_FILE, rundir.METRICS_FILE,
                   rundir.DATA_FILE, rundir.CHECKPOINTS_DIR,
                   rundir.SKIPPED_CHECKPOINTS_DIR, rundir.TENSORBOARD_DIR,
                   rundir.RUNS_FILE, rundir.TRAIN_LOG, rundir.EVAL_LOG,
                   rundir.LOCK_FILE, rundir.EVAL_LOCK_FILE,
                   rundir.SWEEP_LOCK_FILE, 'results.json',
                   *rundir.SUMMARY_FILES)


def _docstrings(tree):
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        yield first.value


def test_only_rundir_spells_the_run_directory_file_names():
  # Every other module reaches a run directory's files through rundir's
  # names, so that one place knows the layout. Docstrings may name files.
  root = pathlib.Path(__file__).resolve().parents[1]
  found = []
  for path in sorted([*root.glob('otclr_jax/**/*.py'),
                      *root.glob('launch/**/*.py')]):
    if path.name == 'rundir.py':
      continue
    tree = ast.parse(path.read_text())
    skip = {id(node) for node in _docstrings(tree)}
    for node in ast.walk(tree):
      if (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in skip):
        for name in _RUN_FILE_NAMES:
          text = node.value
          if (text == name or text.endswith('/' + name)
              or text.startswith(name + '/')):
            found.append(f'{path.relative_to(root)}:{node.lineno} {text!r}')
  assert not found, found
