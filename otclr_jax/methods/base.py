"""The interface every pretraining objective implements, and shared pieces.

A method is a `Method`: a frozen bundle of pure functions that the generic
train step (`otclr_jax.step`) calls in this order, once per step:

1. ``loss(config, model, params, batch_stats, extra, v1, v2, progress)``
   inside the differentiated function: runs the network(s) on the two view
   batches and returns ``(loss, metrics, new_batch_stats, new_extra)``.
   Gradients flow to ``params`` only; anything of ``extra`` (target network,
   queue, centre) is constant for the step.
2. the optimiser update of ``params``;
3. ``post_update(config, extra, params, batch_stats, progress)`` -> extra,
   with the updated parameters (EMA targets).

``extra`` is any pytree of arrays (``{}`` for SimCLR). It lives in
``TrainState.extra`` so that checkpoints hold it and a resumed run repeats an
uninterrupted one bit for bit. Under ``jax.jit`` over a device mesh every
array is global, so a queue is filled with the keys of the global batch and
BatchNorm sees the global batch, without collectives written here.

Every method's model maps images [B, H, W, 3] to a tuple whose first two
entries are ``(h, z)``: encoder features [B, 512] (what the linear probe
reads) and the embedding [B, D] the cluster and view metrics read;
``Method.embed`` computes that z from h alone.

Methods with an EMA target (``base_tau`` / ``final_tau`` in their config
block) share `ema_targets`, whose momentum schedule fits the run's length
(`horizon_base_tau`).
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

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


class Progress(NamedTuple):
  """Where training stands, for schedules inside a method.

  Attributes:
    step: number of optimiser updates done before this one (int32 scalar,
      traced).
    total_steps: length of the run in updates (static Python int).
    steps_per_epoch: updates per epoch (static Python int).
  """
  step: jax.Array
  total_steps: int
  steps_per_epoch: int


@dataclasses.dataclass(frozen=True)
class Method:
  """One self-supervised objective (see the module docstring for the protocol).

  Attributes:
    name: the `config.method` value.
    title: the name tables print (the paper's spelling), e.g. ``'MoCo'``.
    create_model: ``config -> flax Module`` (the online network).
    init_extra: ``(config, variables, key) -> extra``, with ``variables`` the
      online network's ``{'params', 'batch_stats'}`` as initialised.
    loss: ``(config, model, params, batch_stats, extra, v1, v2, progress) ->
      (loss, metrics, batch_stats, extra)``; ``params`` are the network's
      parameters (``TrainState.params['net']``), ``v1, v2`` the view batches
      [B, H, W, 3] float32, ``metrics`` a dict of scalars (without
      ``'loss'``, which the step adds).
    post_update: ``(config, extra, params, batch_stats, progress) -> extra``,
      with the parameters after the optimiser update.
    default_config: ``() -> ConfigDict`` of the method's own settings
      (``config.<name>``), or None when it has none. A block may hold an
      ``optim`` sub-block: the method's optimiser recipe, used instead of
      ``config.optim`` (`optim.optim_settings`).
    network: the class of the online network `create_model` builds
      (`otclr_jax.methods.for_model` finds a model's method by it).
    embed: ``(model, variables, h) -> z``: the embedding [N, D] the cluster
      and view metrics read, from encoder features h [N, 512], with the
      network's ``{'params', 'batch_stats'}`` (BatchNorm in inference mode).
  """
  name: str
  title: str
  create_model: Callable[[ml_collections.ConfigDict], nn.Module]
  init_extra: Callable[..., Any]
  loss: Callable[..., tuple[jax.Array, dict[str, jax.Array], Any, Any]]
  post_update: Callable[..., Any]
  default_config: Callable[[], Optional[ml_collections.ConfigDict]]
  network: type
  embed: Callable[..., jax.Array]


def no_extra(config, variables, key):
  """`init_extra` of a method without extra state."""
  del config, variables, key
  return {}


def keep_extra(config, extra, params, batch_stats, progress):
  """`post_update` of a method whose extra state does not follow the params."""
  del config, params, batch_stats, progress
  return extra


def no_config() -> None:
  return None


def copy_tree(tree):
  """A copy of every array of `tree`.

  Targets start equal to the online network but must not share its buffers:
  the train step donates the whole state, and a buffer donated twice fails.
  """
  return jax.tree_util.tree_map(jnp.copy, tree)


def apply_per_view(model: nn.Module, params, batch_stats, v1: jax.Array,
                   v2: jax.Array):
  """Runs `model` in training mode on each view batch separately.

  Each view is normalised by BatchNorm with its own batch statistics, as
  solo-learn and BYOL forward one view at a time; the running averages are
  updated by the first pass and then by the second.

  Args:
    model: a network returning a tuple of [B, ...] arrays.
    params: its parameters.
    batch_stats: its BatchNorm statistics.
    v1: first views [B, H, W, 3].
    v2: second views [B, H, W, 3].

  Returns:
    `(outputs, batch_stats)`: the outputs of both passes concatenated as
    [view 1; view 2] along the batch ([2B, ...] each), and the statistics
    after both passes.
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
  """Exponential moving average ``tau * target + (1 - tau) * online``, leafwise.

  Args:
    target: pytree of float arrays (the slow copy).
    online: pytree of the same structure (the trained copy).
    tau: momentum in [0, 1]; 1 keeps the target.

  Returns:
    The updated target pytree.
  """
  return jax.tree_util.tree_map(
      lambda t, o: tau * t + (1.0 - tau) * o, target, online)


def cosine_momentum(step: jax.Array | int, total_steps: int, base: float,
                    final: float) -> jax.Array:
  """EMA momentum rising from `base` to `final` on a half cosine.

  ``tau(k) = final - (final - base) * (cos(pi k / K) + 1) / 2`` (BYOL, Grill
  et al. 2020, section 3.2; solo-learn ``solo/utils/momentum.py``): ``base``
  at step 0, ``final`` at step K = `total_steps`.

  Args:
    step: updates done (int, may be traced).
    total_steps: K > 0.
    base: momentum at step 0.
    final: momentum at step K.

  Returns:
    float32 scalar.
  """
  frac = jnp.asarray(step, jnp.float32) / max(total_steps, 1)
  return jnp.float32(final) - jnp.float32(final - base) * (
      jnp.cos(jnp.float32(math.pi) * frac) + 1.0) / 2.0


# `report_horizon` warns when more than this share of a target's random
# initialisation is still in it at the end of the run.
WARN_INIT_SHARE = 0.1


def init_share(base: float, final: float, total_steps: int) -> float:
  """Share of a target's initial value left after the run's EMA updates.

  After K updates ``t_K = prod_k tau(k) * t_0 + (...) * online``, so
  ``prod_{k<K} tau(k)`` (with `cosine_momentum`) is the weight the random
  initialisation still has in the target.

  Args:
    base: momentum at step 0.
    final: momentum at step K.
    total_steps: K.

  Returns:
    ``prod_{k=0}^{K-1} tau(k)`` in [0, 1], computed in float64.
  """
  k = np.arange(total_steps, dtype=np.float64)
  tau = final - (final - base) * (np.cos(np.pi * k / max(total_steps, 1))
                                  + 1.0) / 2.0
  with np.errstate(divide='ignore'):
    return float(np.exp(np.sum(np.log(tau))))


def horizon_base_tau(base: float, final: float, total_steps: int,
                     max_init_share: float) -> float:
  """The largest starting momentum <= `base` that fits the run's length.

  Short runs lower the starting momentum, as BYOL's presets do (0.97, 0.99
  and 0.996 for 40, 100-300 and 1000 epochs): the cosine schedule then runs
  from the returned value to `final`, leaving at most `max_init_share` of the
  initialisation in the target at the end (`init_share`). Long runs keep
  `base`.

  Args:
    base: the configured momentum at step 0.
    final: momentum at the last step.
    total_steps: K.
    max_init_share: in (0, 1]; 1 keeps `base`.

  Returns:
    float, `base` when it already meets the share.
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
  """`horizon_base_tau` of a method's ``base_tau, final_tau, max_init_share``."""
  return horizon_base_tau(settings.base_tau, settings.final_tau, total_steps,
                          settings.max_init_share)


def report_horizon(name: str, settings: ml_collections.ConfigDict,
                   total_steps: int) -> float:
  """Logs the target's momentum schedule over the run; warns when it is too slow.

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
  """A `post_update` that moves `extra['target_params']` towards the online
  parameters by EMA, with `cosine_momentum` from `schedule_base_tau` (the
  configured `config.<block>.base_tau`, lowered for short runs) to
  `config.<block>.final_tau` (MoCo's key encoder, BYOL's target, DINO's
  teacher).

  Args:
    block: the method's config block, e.g. 'moco'.
    online: maps the online params to the tree the target mirrors (BYOL drops
      its predictor).
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


def check_momentum(config_field: str,
                   settings: ml_collections.ConfigDict) -> None:
  """Checks a block's ``base_tau``, ``final_tau`` and ``max_init_share``."""
  for name in ('base_tau', 'final_tau'):
    if not 0.0 <= settings[name] <= 1.0:
      raise ValueError(f'config.{config_field}.{name} must lie in [0, 1], got '
                       f'{settings[name]}.')
  if not 0.0 < settings.max_init_share <= 1.0:
    raise ValueError(f'config.{config_field}.max_init_share must lie in '
                     f'(0, 1], got {settings.max_init_share}.')


def dtype_of(config: ml_collections.ConfigDict):
  if config.dtype not in DTYPES:
    raise ValueError(f'config.dtype must be one of {tuple(DTYPES)}, got '
                     f'{config.dtype!r}.')
  return DTYPES[config.dtype]
