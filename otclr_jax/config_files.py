"""Config files outside absl flags: for tools (bench, figures) and tests.

`python -m otclr_jax.main` reads configs through `config_flags`; tools that
take several runs or their own flags load the same `get_config()` files here
and apply the same dotted `key=value` overrides.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from typing import Any, Sequence

import ml_collections


def load(path: str) -> ml_collections.ConfigDict:
  """A config from a `configs/X.py` file (`get_config()`) or a JSON dump."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'No config file {path}.')
  if not path.endswith('.py'):
    with open(path) as f:
      return ml_collections.ConfigDict(json.load(f))
  spec = importlib.util.spec_from_file_location('_otclr_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def parse_override(text: str) -> tuple[str, Any]:
  """`'ot.epsilon=0.1'` -> `('ot.epsilon', 0.1)`; bare words stay strings."""
  key, sep, value = text.partition('=')
  if not sep or not key:
    raise ValueError(f'An override is key=value (e.g. ot.epsilon=0.1), got '
                     f'{text!r}.')
  try:
    return key, ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return key, value


def set_field(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
  """Sets a dotted field, e.g. `set_field(config, 'ot.beta', 1.0)`."""
  node = config
  *parents, leaf = key.split('.')
  for parent in parents:
    node = node[parent]
  if isinstance(node.get(leaf), bool) and isinstance(value, str):
    # Shell habits: --override ot.learn_alpha=true.
    value = value.lower() in ('1', 'true', 'yes')
  node[leaf] = value


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: Sequence[str]) -> ml_collections.ConfigDict:
  for text in overrides:
    set_field(config, *parse_override(text))
  return config
