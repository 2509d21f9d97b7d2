"""The pretraining step (views -> model -> objective -> update), and what a
config builds for it: method, model, optimiser, step-0 state, jitted step."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from absl import logging
import flax.struct
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import ml_collections
import optax

from otclr_jax import experiment
from otclr_jax import losses
from otclr_jax import optim
from otclr_jax import rundir
from otclr_jax import views
from otclr_jax.methods import base


class TrainState(flax.struct.PyTreeNode):
  """Everything a resumed run needs.

  Attributes:
    step: number of optimiser updates done (int32 scalar).
    params: {'net': network params, 'alpha_logit': [] when ot.learn_alpha}.
    batch_stats: BatchNorm running statistics of the trained network.
    opt_state: optax state.
    extra: the method's state outside the optimiser (`base.Method`).
  """
  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any
  extra: Any


def init_state(config: ml_collections.ConfigDict, method: base.Method,
               model, tx: optax.GradientTransformation,
               key: jax.Array, variables: Any = None) -> TrainState:
  """The state at step 0; the method's extra state draws from fold_in(key, 1).

  Args:
    config: the run's config.
    method: the objective (`views.recipe`).
    model: `method.create_model(config)`.
    tx: the optimiser.
    key: the run's init key.
    variables: `{'params', 'batch_stats'}` drawn from `key`, or None.
  """
  if variables is None:
    dummy = jnp.zeros((1, config.image_size, config.image_size, 3),
                      jnp.float32)
    variables = model.init({'params': key}, dummy, train=False)
  params = {'net': variables['params']}
  if config.ot.learn_alpha:
    params['alpha_logit'] = jnp.asarray(
        losses.alpha_to_logit(config.ot.alpha), jnp.float32)
  extra = method.init_extra(config, variables, jax.random.fold_in(key, 1))
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    batch_stats=variables['batch_stats'],
                    opt_state=tx.init(params), extra=extra)


# The parts of a TrainState that `state_finite` checks, in its output's order.
STATE_PARTS = ('params', 'batch_stats', 'opt_state', 'extra')


def state_finite(state: TrainState) -> jax.Array:
  """Bool [4]: whether each of `STATE_PARTS` holds only finite values."""
  def finite(tree):
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)
  return jnp.stack([finite(getattr(state, part)) for part in STATE_PARTS])


def train_step(state: TrainState, batch: jax.Array, key: jax.Array, *,
               method: base.Method, config: ml_collections.ConfigDict, model,
               tx: optax.GradientTransformation, schedule: optax.Schedule,
               total_steps: int, steps_per_epoch: int):
  """One optimiser update.

  Args:
    state: current state (donated under `jit_train_step`).
    batch: uint8 images [B, H, W, 3], B the global batch.
    key: the run's training key; folded with the step (resumable).
    method: the objective (static).
    config: the run's config (static).
    model: `method.create_model(config)` (static).
    tx: the optimiser.
    schedule: learning-rate schedule, for logging.
    total_steps: length of the run (momentum schedules).
    steps_per_epoch: updates per epoch (schedules counted in epochs).

  Returns:
    `(new_state, metrics)`: scalars ``'loss'``, the method's terms,
    ``'sinkhorn'`` and ``'alpha'`` (OT views), ``'grad_norm'``, ``'lr'``.
  """
  images = batch.astype(jnp.float32) / 255.0
  step_key = jax.random.fold_in(key, state.step)
  progress = base.Progress(state.step, total_steps, steps_per_epoch)

  def loss_fn(params):
    alpha = views.current_alpha(config, params)
    v1, v2, xs1, xs2 = views.make_views(config, images, step_key, alpha)
    loss, metrics, batch_stats, extra = method.loss(
        config, model, params['net'], state.batch_stats, state.extra, v1, v2,
        progress)
    if views.recipe(config).views == 'ot':
      regulariser = functools.partial(
          losses.sinkhorn_regulariser, images, xs1, xs2, v1, v2,
          grid_size=config.ot.grid_size, epsilon=config.ot.epsilon,
          num_iters=config.ot.num_iters)
      if views.regulariser_in_loss(config):
        reg = regulariser()
        loss = loss + config.ot.beta * reg
        metrics['sinkhorn'] = reg
      else:
        # A diagnostic: computed only on logged steps, NaN (skipped) elsewhere.
        metrics['sinkhorn'] = jax.lax.cond(
            (state.step + 1) % config.log_every_steps == 0, regulariser,
            lambda: jnp.float32(jnp.nan))
      metrics['alpha'] = alpha
    metrics['loss'] = loss
    return loss, (metrics, batch_stats, extra)

  grads, (metrics, batch_stats, extra) = jax.grad(loss_fn, has_aux=True)(
      state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  extra = method.post_update(config, extra, params['net'], batch_stats,
                             progress)
  metrics['grad_norm'] = optax.tree.norm(grads)
  metrics['lr'] = schedule(state.step)
  return state.replace(step=state.step + 1, params=params,
                       batch_stats=batch_stats, opt_state=opt_state,
                       extra=extra), metrics


def jit_train_step(method: base.Method, config: ml_collections.ConfigDict,
                   model, tx: optax.GradientTransformation,
                   schedule: optax.Schedule, mesh: Mesh, *, total_steps: int,
                   steps_per_epoch: int):
  """Jitted `train_step`, batch sharded on 'data'; adds 'state_finite' [4]."""
  replicated = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P('data'))

  def step(state, batch, key):
    # `train_step` is looked up when traced, so a test can wrap it.
    new_state, metrics = train_step(
        state, batch, key, method=method, config=config, model=model, tx=tx,
        schedule=schedule, total_steps=total_steps,
        steps_per_epoch=steps_per_epoch)
    metrics['state_finite'] = state_finite(new_state)
    return new_state, metrics

  return jax.jit(step, in_shardings=(replicated, data, replicated),
                 out_shardings=(replicated, replicated), donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything a config builds for a run of known length.

  Attributes:
    recipe: the objective and the views (`views.recipe`).
    model: the trained network.
    schedule: the learning-rate schedule.
    tx: the optimiser.
    steps_per_epoch: updates per epoch.
    total_steps: length of the run in updates.
  """
  recipe: views.Recipe
  model: Any
  schedule: optax.Schedule
  tx: optax.GradientTransformation
  steps_per_epoch: int
  total_steps: int

  @property
  def method(self) -> base.Method:
    return self.recipe.method


def setup(config: ml_collections.ConfigDict, steps_per_epoch: int) -> Setup:
  """The run's method, model, schedule and optimiser.

  Args:
    config: a validated config.
    steps_per_epoch: updates per epoch (`data.steps_per_epoch`).
  """
  recipe = views.recipe(config)
  total = optim.run_steps(config.total_steps, config.num_epochs,
                          steps_per_epoch)
  schedule = optim.learning_rate_schedule(config, steps_per_epoch, total)
  opt = optim.optim_settings(config)
  logging.info('Optimiser: %s', ', '.join(
      f'{k}={v}' for k, v in sorted(opt.items())))
  block = config.get(recipe.method.name, None)
  if block is not None and 'base_tau' in block:
    base.report_horizon(recipe.method.name, block, total)
  return Setup(recipe=recipe, model=recipe.method.create_model(config),
               schedule=schedule,
               tx=optim.create_optimizer(config, schedule),
               steps_per_epoch=steps_per_epoch, total_steps=total)


def initial_state(config: ml_collections.ConfigDict, run: Setup,
                  mesh: Mesh | None = None) -> TrainState:
  """The state at step 0 from `experiment.initial_variables`, on `mesh`."""
  init = functools.partial(init_state, config, run.method, run.model,
                           run.tx)
  placed = {} if mesh is None else {'out_shardings': NamedSharding(mesh, P())}
  return jax.jit(init, **placed)(experiment.init_key(config),
                                 experiment.initial_variables(config))


# Jitted steps by config: tracing and lowering one costs seconds even when
# the persistent cache holds its executable, so runs of one config in one
# process (a resume, a notebook, the tests) trace it once. Oldest out first.
_STEPS: dict[tuple[Any, ...], Callable[..., Any]] = {}
_MAX_STEPS = 8


def clear_compiled_steps() -> None:
  """Drops the kept jitted steps; for after patching a function they trace."""
  _STEPS.clear()


def build(config: ml_collections.ConfigDict, steps_per_epoch: int,
          mesh: Mesh) -> tuple[Setup, TrainState, Callable[..., Any]]:
  """`setup`, step-0 state on `mesh`, donating `step_fn(state, batch, key)`."""
  run = setup(config, steps_per_epoch)
  state = initial_state(config, run, mesh)
  # All the step closes over; frozen, so a caller's later edit cannot reach it.
  frozen = ml_collections.FrozenConfigDict(
      {k: v for k, v in config.items() if k not in rundir.STEP_UNREAD_FIELDS})
  key = (frozen, run.steps_per_epoch, run.total_steps, mesh)
  if key not in _STEPS:
    if len(_STEPS) == _MAX_STEPS:
      del _STEPS[next(iter(_STEPS))]
    _STEPS[key] = jit_train_step(
        run.method, frozen, run.model, run.tx, run.schedule, mesh,
        total_steps=run.total_steps, steps_per_epoch=run.steps_per_epoch)
  return run, state, _STEPS[key]


def pretraining_params(state: TrainState) -> int:
  """Parameters of the network and its targets (not queues or statistics)."""
  extra = state.extra if isinstance(state.extra, dict) else {}
  targets = {k: v for k, v in extra.items() if k.endswith('params')}
  return (experiment.count_params(state.params['net'])
          + experiment.count_params(targets))
