"""Self-supervised objectives behind one interface (`base.Method`).

Adding a method: one module defining ``METHOD``, its line in `_MODULES`, and
its tests (docs/methods.md).
"""

from __future__ import annotations

import ml_collections

from otclr_jax.methods import base
from otclr_jax.methods import byol
from otclr_jax.methods import dino
from otclr_jax.methods import moco
from otclr_jax.methods import simclr

_MODULES = (simclr, moco, byol, dino)
_REGISTRY = {module.METHOD.name: module.METHOD for module in _MODULES}
NAMES = tuple(_REGISTRY)


def get(name: str) -> base.Method:
  """The method called `name` (a `config.method`, not the alias 'otclr')."""
  if name not in _REGISTRY:
    raise ValueError(f'config.method must be one of {NAMES} (or the alias '
                     f"'otclr' = simclr with views='ot'), got {name!r}.")
  return _REGISTRY[name]


def for_model(model) -> base.Method:
  """The first registered method whose online network's class is `model`'s."""
  for method in _REGISTRY.values():
    if type(model) is method.network:  # pylint: disable=unidiomatic-typecheck
      return method
  raise ValueError(f'No method builds a {type(model).__name__}.')


def add_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Adds the missing method blocks and ``config.views = ''`` to the unlocked
  `config`, in place; returns it."""
  if 'views' not in config:
    config.views = ''
  for method in _REGISTRY.values():
    block = method.default_config()
    if block is not None and method.name not in config:
      config[method.name] = block
  return config


def title(method: str, views: str) -> str:
  """A run's row name as the paper writes it, e.g. 'MoCo + OT views', 'OTCLR'.

  Args:
    method: a `config.method` value, or the alias 'otclr'.
    views: 'augment' or 'ot' (ignored for the alias).
  """
  if method == 'otclr' or (method == 'simclr' and views == 'ot'):
    return 'OTCLR'
  name = get(method).title
  return f'{name} + OT views' if views == 'ot' else name
