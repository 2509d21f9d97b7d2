"""Tests of otclr_jax.config_files."""

import json

from absl import flags
from ml_collections import config_flags
import pytest

from otclr_jax import config_files


def test_load_py_and_json_agree(tmp_path):
  config = config_files.load('configs/digits.py')
  assert config.dataset == 'digits' and config.ot.epsilon == 0.05
  path = tmp_path / 'config.json'
  path.write_text(json.dumps(config.to_dict()))
  again = config_files.load(str(path))
  # JSON lists come back as the config's tuples, so overrides parse alike.
  assert again.to_dict() == config.to_dict()
  config = config_files.apply_overrides(
      again, ["--config.eval.datasets=('digits',)"])
  assert config.eval.datasets == ('digits',)
  with pytest.raises(ValueError, match='Did you mean'):
    config_files.apply_overrides(config_files.load(str(path)),
                                 ['--config.ot.epsilonn=0.1'])


def test_apply_overrides_parses_by_field_type():
  base = config_files.load('configs/default.py')
  config = config_files.apply_overrides(base, [
      '--config.ot.learn_alpha=true', '--config.eval.at_end=False',
      '--config.ot.beta=1', '--config.method=simclr',
      "--config.eval.datasets=('cifar10','digits')",
      ('batch_size', 512), ('ot.alpha', 0.25), ('eval.figures', False)])
  assert config.ot.learn_alpha is True
  assert config.eval.at_end is False
  assert config.ot.beta == 1.0 and isinstance(config.ot.beta, float)
  assert config.method == 'simclr'
  assert config.eval.datasets == ('cifar10', 'digits')
  assert config.batch_size == 512 and config.ot.alpha == 0.25
  assert config.eval.figures is False
  assert config.is_locked
  assert base.ot.epsilon == 0.05 and base.method == 'otclr'  # not mutated


@pytest.mark.parametrize('text, match', [
    ('--config.ot.epsilonn=0.1', 'Did you mean "epsilon"'),
    ('--config.ott.epsilon=0.1', 'Did you mean "ot"'),
    ('--config.batch_size=1.5', 'batch_size'),
    ('--config.ot.epsilon=abc', 'ot.epsilon'),
    ('--config.ot.learn_alpha=yes', 'learn_alpha'),
])
def test_typos_and_bad_types_fail(text, match):
  with pytest.raises(ValueError, match=match):
    config_files.apply_overrides(config_files.load('configs/default.py'),
                                 [text])


@pytest.mark.parametrize('bad', ['--config.ot.epsilon', '--config.=3',
                                 '--seed=3', 'ot.epsilon=0.1'])
def test_malformed_override(bad):
  with pytest.raises(ValueError, match='key=value'):
    config_files.override_flag(bad)


def test_override_flag_is_what_main_takes():
  assert config_files.override_flag(('ot.learn_alpha', True)) == (
      '--config.ot.learn_alpha=true')
  assert config_files.override_flag(('eval.datasets', ['a'])) == (
      "--config.eval.datasets=('a',)")
  assert config_files.override_flag('--config.ot.alpha=0.3') == (
      '--config.ot.alpha=0.3')


def test_missing_file():
  with pytest.raises(FileNotFoundError):
    config_files.load('configs/nope.py')


def _define(flag_values, argv):
  config_flags.DEFINE_config_file('config', None, 'config',
                                  flag_values=flag_values, lock_config=True,
                                  sys_argv=argv)
  flags.DEFINE_string('workdir', None, 'dir', flag_values=flag_values)


def test_parse_flags_reads_config_and_overrides_like_main():
  fv, rest = config_files.parse_flags(
      ['tool', '--config=configs/digits.py', '--config.ot.epsilon=0.2',
       '--workdir=w', 'extra'], _define)
  assert fv.config.ot.epsilon == 0.2 and fv.config.is_locked
  assert fv.workdir == 'w' and rest == ['extra']
  assert config_files.parse_flags(['tool', '--help'], _define) is None


def test_every_tool_takes_helpconfig_and_absl_logging_flags(capsys):
  assert config_files.parse_flags(
      ['tool', '--config=configs/digits.py', '--config.ot.epsilon=0.2',
       '--helpconfig'], _define) is None
  assert '  --config.ot.epsilon=0.2\n' in capsys.readouterr().out
  with pytest.raises(config_files.UsageError, match='give --config='):
    config_files.parse_flags(['tool', '--helpconfig'], _define)
  fv, _ = config_files.parse_flags(['tool', '-v=1'], _define)
  assert fv.verbosity == 1
  flags.FLAGS['verbosity'].unparse()


@pytest.mark.parametrize('argv, match', [
    (['--config=configs/digits.py', '--config.ot.epsilonn=0.1'],
     'Did you mean "epsilon"'),
    (['--config=configs/digits.py', '--config.batch_size=1.5'], 'batch_size'),
    (['--config=configs/nope.py'], 'cannot load --config=configs/nope.py'),
    (['--worktree=x'], 'worktree'),
])
def test_parse_flags_fails_in_one_line(argv, match):
  with pytest.raises(config_files.UsageError, match=match) as e:
    config_files.parse_flags(['tool', *argv], _define)
  assert '\n' not in str(e.value)


def test_a_misspelt_field_in_a_config_file_is_refused(tmp_path):
  # It had been added beside the real one, stored, and ignored.
  path = tmp_path / 'typo.py'
  path.write_text('from configs import digits\n\n\ndef get_config():\n'
                  '  config = digits.get_config()\n'
                  '  config.optim.baselr = 5.0\n  return config\n')
  with pytest.raises(config_files.UsageError,
                     match=r'cannot load --config=.*baselr.*'
                     r'Did you mean "base_lr"'):
    config_files.parse_flags(['tool', f'--config={path}'], _define)


def test_a_run_config_json_as_config_file_is_named(tmp_path):
  # --config runs Python: a config.json fails as a NameError on `true`.
  path = tmp_path / 'config.json'
  path.write_text(json.dumps(config_files.load('configs/digits.py').to_dict()))
  with pytest.raises(config_files.UsageError,
                     match=rf'cannot load --config={path} \(a Python '
                     r'config file\): NameError') as e:
    config_files.parse_flags(['tool', f'--config={path}'], _define)
  assert '\n' not in str(e.value)
