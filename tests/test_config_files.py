"""Tests of otclr_jax.config_files."""

import json

import pytest

from otclr_jax import config_files


def test_load_py_and_json_agree(tmp_path):
  config = config_files.load('configs/digits.py')
  assert config.dataset == 'digits' and config.ot.epsilon == 0.05
  path = tmp_path / 'config.json'
  path.write_text(json.dumps(config.to_dict()))
  again = config_files.load(str(path))
  assert again.to_dict() == json.loads(json.dumps(config.to_dict()))


@pytest.mark.parametrize('text, key, value', [
    ('ot.epsilon=0.1', 'ot.epsilon', 0.1),
    ('batch_size=512', 'batch_size', 512),
    ('method=simclr', 'method', 'simclr'),
    ("eval.datasets=('cifar10','digits')", 'eval.datasets',
     ('cifar10', 'digits')),
])
def test_parse_override(text, key, value):
  assert config_files.parse_override(text) == (key, value)


def test_apply_overrides_parses_booleans_from_the_shell():
  config = config_files.apply_overrides(
      config_files.load('configs/default.py'),
      ['ot.learn_alpha=true', 'eval.at_end=False', 'ot.beta=1.0'])
  assert config.ot.learn_alpha is True
  assert config.eval.at_end is False
  assert config.ot.beta == 1.0


@pytest.mark.parametrize('bad', ['ot.epsilon', '=3'])
def test_bad_override(bad):
  with pytest.raises(ValueError, match='key=value'):
    config_files.parse_override(bad)


def test_missing_file():
  with pytest.raises(FileNotFoundError):
    config_files.load('configs/nope.py')
