"""The interface every pretraining objective implements, and shared pieces.

Per step, `otclr_jax.step` differentiates ``loss`` (``extra``, e.g. a target
network or queue, is constant), updates, then calls ``post_update``. Every
model maps images [B, H, W, 3] to a tuple starting ``(h [B, 512], z [B, D])``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from otclr_jax import models

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


class Progress(NamedTuple):
  """Where training stands, for schedules inside a method.

  Attributes:
    step: optimiser updates done before this one (traced int32 scalar).
    total_steps: length of the run in updates (static Python int).
    steps_per_epoch: updates per epoch (static Python int).
  """
  step: jax.Array
  total_steps: int
  steps_per_epoch: int


@dataclasses.dataclass(frozen=True)
class Method:
  """One self-supervised objective (protocol in the module docstring).

  Attributes:
    name: the `config.method` value.
    title: the name tables print (the paper's spelling), e.g. ``'MoCo'``.
    create_model: ``config -> flax Module`` (the online network).
    loss: ``(config, model, params, batch_stats, extra, v1, v2, progress) ->
      (loss, metrics, batch_stats, extra)``; ``v1, v2`` [B, H, W, 3] float32,
      ``metrics`` a dict of scalars (the step adds ``'loss'``).
    network: the class of the online network `create_model` builds.
    embed: ``(model, variables, h [N, 512]) -> z [N, D]``, BatchNorm frozen.
    init_extra: ``(config, variables, key) -> extra`` from initial variables;
      by default no extra state.
    post_update: ``(config, extra, params, batch_stats, progress) -> extra``;
      by default `extra` unchanged.
    default_config: ``() -> ConfigDict`` for ``config.<name>``, or None (the
      default); an ``optim`` sub-block replaces ``config.optim``
      (`optim.optim_settings`).
  """
  name: str
  title: str
  create_model: Callable[[ml_collections.ConfigDict], nn.Module]
  loss: Callable[..., tuple[jax.Array, dict[str, jax.Array], Any, Any]]
  network: type
  embed: Callable[..., jax.Array]
  init_extra: Callable[..., Any] = lambda config, variables, key: {}
  post_update: Callable[..., Any] = (
      lambda config, extra, params, batch_stats, progress: extra)
  default_config: Callable[[], Optional[ml_collections.ConfigDict]] = (
      lambda: None)


def copy_targets(variables, select: Callable[[Any], Any] = lambda t: t):
  """``target_params`` and ``target_batch_stats``: copies of `select` of the
  online variables (the step donates the state; no shared buffers)."""
  return {f'target_{k}': jax.tree_util.tree_map(jnp.copy, select(variables[k]))
          for k in ('params', 'batch_stats')}


def apply_per_view(model: nn.Module, params, batch_stats, v1: jax.Array,
                   v2: jax.Array):
  """Runs `model` in training mode on each view batch (own BN statistics).

  Args:
    model: a network returning a tuple of [B, ...] arrays.
    v1, v2: the two view batches [B, H, W, 3].

  Returns:
    `(outputs, batch_stats)`: outputs [view 1; view 2] ([2B, ...] each) and
    the statistics after both passes.
  """
  out1, updates = model.apply({'params': params, 'batch_stats': batch_stats},
                              v1, train=True, mutable=['batch_stats'])
  out2, updates = model.apply(
      {'params': params, 'batch_stats': updates['batch_stats']}, v2,
      train=True, mutable=['batch_stats'])
  outputs = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]),
                                   out1, out2)
  return outputs, updates['batch_stats']


def ema(target, online, tau: jax.Array | float):
  """``tau * target + (1 - tau) * online`` per leaf; tau = 1 keeps `target`."""
  return jax.tree_util.tree_map(
      lambda t, o: tau * t + (1.0 - tau) * o, target, online)


def cosine_momentum(step: jax.Array | int, total_steps: int, base: float,
                    final: float) -> jax.Array:
  """EMA momentum rising from `base` to `final` on a half cosine.

  ``tau(k) = final - (final - base) * (cos(pi k / K) + 1) / 2`` (BYOL
  section 3.2; solo-learn ``solo/utils/momentum.py``).

  Args:
    step: updates done k (int, may be traced).
    total_steps: K > 0.

  Returns:
    float32 scalar.
  """
  frac = jnp.asarray(step, jnp.float32) / max(total_steps, 1)
  return jnp.float32(final) - jnp.float32(final - base) * (
      jnp.cos(jnp.float32(math.pi) * frac) + 1.0) / 2.0


# `report_horizon` warns above this share of initialisation left in a target.
WARN_INIT_SHARE = 0.1


def init_share(base: float, final: float, total_steps: int) -> float:
  """``prod_{k<K} tau(k)`` (float64): the share of a target's initial value
  left after K = `total_steps` EMA updates of `cosine_momentum`."""
  k = np.arange(total_steps, dtype=np.float64)
  tau = final - (final - base) * (np.cos(np.pi * k / max(total_steps, 1))
                                  + 1.0) / 2.0
  with np.errstate(divide='ignore'):
    return float(np.exp(np.sum(np.log(tau))))


def horizon_base_tau(base: float, final: float, total_steps: int,
                     max_init_share: float) -> float:
  """The largest start momentum <= `base` leaving <= `max_init_share` (BYOL).

  `base` itself when it meets the share; `max_init_share` lies in (0, 1].
  """
  if init_share(base, final, total_steps) <= max_init_share:
    return float(base)
  # init_share grows with the starting momentum; it is 0 at base 0.
  lo, hi = 0.0, float(base)
  for _ in range(60):
    mid = (lo + hi) / 2
    if init_share(mid, final, total_steps) <= max_init_share:
      lo = mid
    else:
      hi = mid
  return lo


def schedule_base_tau(settings: ml_collections.ConfigDict,
                      total_steps: int) -> float:
  """`horizon_base_tau` of a block's base_tau, final_tau, max_init_share."""
  return horizon_base_tau(settings.base_tau, settings.final_tau, total_steps,
                          settings.max_init_share)


def report_horizon(name: str, settings: ml_collections.ConfigDict,
                   total_steps: int) -> float:
  """Logs the target's momentum schedule; warns when it is too slow.

  Args:
    name: the config block, e.g. ``'byol'``.
    settings: that block (``base_tau``, ``final_tau``, ``max_init_share``).
    total_steps: length of the run in updates.

  Returns:
    The share of the target's initialisation left at the end.
  """
  start = schedule_base_tau(settings, total_steps)
  share = init_share(start, settings.final_tau, total_steps)
  logging.info('%s target: momentum %.5f -> %.5f over %d steps (config '
               'base_tau %.5f); %.3g of its initialisation is left at the '
               'end.', name, start, settings.final_tau, total_steps,
               settings.base_tau, share)
  if share > WARN_INIT_SHARE:
    logging.warning(
        '%s target still holds %.0f%% of its random initialisation at the end '
        'of this %d-step run: raise the run length, lower config.%s.base_tau, '
        'or lower config.%s.max_init_share.', name, 100 * share, total_steps,
        name, name)
  return share


def ema_targets(block: str, online: Callable[[Any], Any] = lambda p: p):
  """A `post_update` moving `extra['target_params']` to the online ones by EMA.

  Momentum: `cosine_momentum` from `schedule_base_tau` to ``final_tau``.

  Args:
    block: the method's config block, e.g. 'moco'.
    online: maps online params to the target's tree (BYOL drops a predictor).
  """
  def post_update(config, extra, params, batch_stats, progress):
    del batch_stats
    settings = config[block]
    tau = cosine_momentum(progress.step, progress.total_steps,
                          schedule_base_tau(settings, progress.total_steps),
                          settings.final_tau)
    return dict(extra, target_params=ema(extra['target_params'],
                                         online(params), tau))
  return post_update


def lars(base_lr: float, weight_decay: float,
         clip_grad: float) -> ml_collections.ConfigDict:
  """An ``optim`` sub-block: LARS as solo-learn's CIFAR recipes set it
  (momentum 0.9, eta 0.02, clipped adaptive rates)."""
  return ml_collections.ConfigDict(dict(
      name='lars', base_lr=base_lr, momentum=0.9, weight_decay=weight_decay,
      eta=0.02, clip_lr=True, clip_grad=clip_grad))


# The rules of the method blocks' fields (config.<method>.<name>), by name;
# `experiment.validate_config` applies them to the run's block.
BLOCK_RULES = (
    (('temperature', 'student_temp', 'teacher_temp', 'warmup_teacher_temp'),
     'must be > 0', lambda v: v > 0),
    (('proj_hidden_dim', 'proj_dim', 'pred_hidden_dim', 'hidden_dim',
      'bottleneck_dim', 'num_prototypes'),
     'must be an integer >= 1', lambda v: isinstance(v, int) and v >= 1),
    (('base_tau', 'final_tau', 'centre_momentum'), 'must lie in [0, 1]',
     lambda v: 0 <= v <= 1),
    (('max_init_share',), 'must lie in (0, 1]', lambda v: 0 < v <= 1),
    (('warmup_teacher_temp_epochs', 'freeze_last_layer'), 'must be >= 0',
     lambda v: v >= 0),
)


def encoder(config: ml_collections.ConfigDict) -> models.ResNet:
  """The run's ResNet (`config.model`), computing in `config.dtype`."""
  if config.dtype not in DTYPES:
    raise ValueError(f'config.dtype must be one of {tuple(DTYPES)}, got '
                     f'{config.dtype!r}.')
  return models.ResNet(
      stage_sizes=config.model.stage_sizes, stem=config.model.stem,
      dtype=DTYPES[config.dtype], conv_impl=config.model.conv_impl)
