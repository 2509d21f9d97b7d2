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
reads) and the embedding [B, D] the cluster and view metrics read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

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
      (``config.<name>``), or None when it has none.
  """
  name: str
  title: str
  create_model: Callable[[ml_collections.ConfigDict], nn.Module]
  init_extra: Callable[..., Any]
  loss: Callable[..., tuple[jax.Array, dict[str, jax.Array], Any, Any]]
  post_update: Callable[..., Any]
  default_config: Callable[[], Optional[ml_collections.ConfigDict]]


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


def l2_normalise(z: jax.Array) -> jax.Array:
  """Rows of `z` [..., D] scaled to unit norm (an all-zero row stays zero)."""
  sq_norm = jnp.sum(jnp.square(z), axis=-1, keepdims=True)
  return z * jax.lax.rsqrt(jnp.maximum(sq_norm, 1e-24))


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


def ema_targets(block: str, online: Callable[[Any], Any] = lambda p: p):
  """A `post_update` that moves `extra['target_params']` towards the online
  parameters by EMA, with `cosine_momentum` from `config.<block>.base_tau` to
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
                          settings.base_tau, settings.final_tau)
    return dict(extra, target_params=ema(extra['target_params'],
                                         online(params), tau))
  return post_update


def check_momentum(config_field: str, base: float, final: float) -> None:
  for name, value in (('base_tau', base), ('final_tau', final)):
    if not 0.0 <= value <= 1.0:
      raise ValueError(f'config.{config_field}.{name} must lie in [0, 1], got '
                       f'{value}.')


def dtype_of(config: ml_collections.ConfigDict):
  if config.dtype not in DTYPES:
    raise ValueError(f'config.dtype must be one of {tuple(DTYPES)}, got '
                     f'{config.dtype!r}.')
  return DTYPES[config.dtype]
