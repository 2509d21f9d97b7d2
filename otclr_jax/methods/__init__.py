"""Self-supervised objectives behind one interface (`base.Method`).

`get(name)` returns the method `config.method` names; `add_defaults(config)`
adds every method's settings block (``config.moco`` ...) and ``config.views``
where a config lacks them. Adding a method: one module defining ``METHOD``,
its line in `_MODULES`, and its tests (docs/methods.md).
`for_model(model)` gives the method of a network (evaluation embeds with it).
"""

from __future__ import annotations

import ml_collections

from otclr_jax.methods import base
from otclr_jax.methods import byol
from otclr_jax.methods import dino
from otclr_jax.methods import moco
from otclr_jax.methods import simclr

Method = base.Method
Progress = base.Progress

_MODULES = (simclr, moco, byol, dino)
_REGISTRY = {module.METHOD.name: module.METHOD for module in _MODULES}
NAMES = tuple(_REGISTRY)


def get(name: str) -> base.Method:
  """The method called `name` (a `config.method` value, not the alias 'otclr')."""
  if name not in _REGISTRY:
    raise ValueError(f'config.method must be one of {NAMES} (or the alias '
                     f"'otclr' = simclr with views='ot'), got {name!r}.")
  return _REGISTRY[name]


def for_model(model) -> base.Method:
  """The first registered method whose online network `model` is an instance of.

  Methods that share a network (SimCLR and MoCo) share its embedding too.
  """
  for method in _REGISTRY.values():
    if isinstance(model, method.network):
      return method
  raise ValueError(f'No method builds a {type(model).__name__}.')


def add_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Adds the missing method blocks and ``config.views`` (in place).

  ``config.views = ''`` means the method's default views: ``'ot'`` for the
  alias ``'otclr'``, ``'augment'`` otherwise (`views.resolve`).

  Args:
    config: an unlocked ConfigDict.

  Returns:
    The same config.
  """
  if 'views' not in config:
    config.views = ''
  for method in _REGISTRY.values():
    block = method.default_config()
    if block is not None and method.name not in config:
      config[method.name] = block
  return config


def title(method: str, views: str) -> str:
  """A run's row name as the paper writes it: 'MoCo', 'MoCo + OT views', 'OTCLR'.

  Args:
    method: a `config.method` value, or the alias 'otclr'.
    views: 'augment' or 'ot' (ignored for the alias).

  Returns:
    The display name; SimCLR with OT views is the paper's OTCLR.
  """
  if method == 'otclr' or (method == 'simclr' and views == 'ot'):
    return 'OTCLR'
  name = get(method).title
  return f'{name} + OT views' if views == 'ot' else name
