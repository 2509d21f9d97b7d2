"""The optimisers: SGD with masked weight decay, LARS, and their schedule.

LARS follows solo-learn, per-parameter clipping DINO (docs/methods.md).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import optax

from otclr_jax import views as views_lib

OPTIMIZERS = ('sgd', 'lars')


def optim_settings(config: ml_collections.ConfigDict
                   ) -> ml_collections.ConfigDict:
  """The run's optimiser: a method block's ``optim``, else `config.optim`."""
  block = config.get(views_lib.recipe(config).method.name) or {}
  return block.get('optim', config.optim)


def run_steps(total_steps: int, num_epochs: float, steps_per_epoch: int
              ) -> int:
  """The run length: `total_steps` if > 0, else `num_epochs` in steps."""
  return (int(total_steps) if total_steps > 0
          else epoch_steps(num_epochs, steps_per_epoch))


def epoch_steps(epochs: float, steps_per_epoch: int) -> int:
  """Whole steps in `epochs` epochs (0.57 x 100 is 57, not float's 56.99...)."""
  return math.floor(epochs * steps_per_epoch + 1e-6)


def learning_rate_schedule(config: ml_collections.ConfigDict,
                           steps_per_epoch: int,
                           total_steps: int) -> optax.Schedule:
  """Linear warmup to `base_lr * batch_size / 256`, then cosine decay to 0.

  A run no longer than the warmup ends at the peak (a warning says so).
  """
  peak = optim_settings(config).base_lr * config.batch_size / 256.0
  warmup = epoch_steps(config.optim.warmup_epochs, steps_per_epoch)
  if warmup >= total_steps > 0:
    logging.warning(
        'The %d-step run is not longer than its %d-step warmup: the learning '
        'rate rises to its peak and never decays (lower '
        'config.optim.warmup_epochs).', total_steps, warmup)
  warmup = min(warmup, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=0.0)


class LarsState(NamedTuple):
  count: jax.Array
  momentum: Any


def lars(schedule: optax.Schedule, momentum: float, weight_decay: float,
         eta: float, clip_lr: bool, eps: float = 1e-8
         ) -> optax.GradientTransformation:
  """LARS as solo-learn's ``solo/utils/lars.py`` (with ``exclude_bias_n_norm``).

  For a kernel p (ndim > 1) with gradient g and ``|p|, |g| > 0``:
  ``r = eta |p| / (|g| + weight_decay |p| + eps)``, with ``clip_lr``
  ``r = min(r / lr, 1)``, and ``d = r (g + weight_decay p)``; otherwise
  ``d = g``. Then ``v <- momentum v + d`` (no dampening), ``p <- p - lr v``.

  Args:
    schedule: learning rate per step.
    momentum: mu in [0, 1).
    weight_decay: beta >= 0.
    eta: trust coefficient.
    clip_lr: clip the adapted rate at the global one.
    eps: denominator guard.

  Returns:
    An optax transformation needing ``params`` in ``update``.
  """
  def init_fn(params):
    return LarsState(count=jnp.zeros((), jnp.int32),
                     momentum=jax.tree_util.tree_map(jnp.zeros_like, params))

  def update_fn(updates, state, params):
    lr = schedule(state.count)

    def direction(g, p):
      p_norm = jnp.linalg.norm(p)
      g_norm = jnp.linalg.norm(g)
      ratio = eta * p_norm / (g_norm + p_norm * weight_decay + eps)
      if clip_lr:
        # lr = 0 (the warm-up's first step) gives inf: the ratio is 1.
        ratio = jnp.minimum(ratio / lr, 1.0)
      adapt = (p.ndim > 1) & (p_norm > 0) & (g_norm > 0)
      return jnp.where(adapt, ratio * (g + weight_decay * p), g)

    d = jax.tree_util.tree_map(direction, updates, params)
    buf = jax.tree_util.tree_map(lambda v, x: momentum * v + x,
                                 state.momentum, d)
    return (jax.tree_util.tree_map(lambda v: -lr * v, buf),
            LarsState(count=state.count + 1, momentum=buf))

  return optax.GradientTransformation(init_fn, update_fn)


def clip_per_parameter(max_norm: float) -> optax.GradientTransformation:
  """Clips each gradient tensor to norm <= `max_norm` (DINO clip_gradients)."""
  def update_fn(updates, state, params=None):
    del params
    def clip(g):
      coef = max_norm / (jnp.linalg.norm(g) + 1e-6)
      return jnp.where(coef < 1, g * coef, g)
    return jax.tree_util.tree_map(clip, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                      update_fn)


def create_optimizer(config: ml_collections.ConfigDict,
                     schedule: optax.Schedule) -> optax.GradientTransformation:
  """The run's optimiser (`optim_settings`), gradient clipping first if any."""
  opt = optim_settings(config)
  if opt.name == 'lars':
    tx = lars(schedule, momentum=opt.momentum, weight_decay=opt.weight_decay,
              eta=opt.eta, clip_lr=opt.clip_lr)
  else:
    tx = optax.chain(
        # Kernels only: not BatchNorm scales, biases or the interpolation logit.
        optax.add_decayed_weights(opt.weight_decay, mask=lambda params: (
            jax.tree_util.tree_map(lambda p: p.ndim > 1, params))),
        optax.sgd(schedule, momentum=opt.momentum))
  if opt.clip_grad > 0:
    tx = optax.chain(clip_per_parameter(opt.clip_grad), tx)
  return tx
