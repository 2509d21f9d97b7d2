"""OTCLR / SimCLR pretraining: one jitted, donated train step over a device mesh.

The step takes uint8 images, draws two SimCLR strong views on the device, and
for `method='otclr'` turns them into OT displacement views before NT-Xent
(docs/method.md sections 1 and 4-6). Everything needed to resume lives in
`TrainState`; data order and augmentation keys are functions of
`(config.seed, step)`, so a resumed run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import threading
import time
from typing import Any, Iterator

from absl import logging
import flax.struct
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from otclr_jax import augment
from otclr_jax import checkpoint
from otclr_jax import input_pipeline
from otclr_jax import losses
from otclr_jax import models
from otclr_jax import ot

METHODS = ('simclr', 'otclr')
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


class TrainState(flax.struct.PyTreeNode):
  """Everything a resumed run needs.

  Attributes:
    step: number of optimiser updates done.
    params: {'net': network params, 'alpha_logit': [] when ot.learn_alpha}.
    batch_stats: BatchNorm running statistics.
    opt_state: optax state.
  """
  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any


# ----------------------------------------------------------------------------
# Set-up.


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Rejects settings that would fail late or train something else silently."""
  if config.method not in METHODS:
    raise ValueError(f'config.method must be one of {METHODS}, got '
                     f'{config.method!r}.')
  if config.dtype not in DTYPES:
    raise ValueError(f'config.dtype must be one of {tuple(DTYPES)}, got '
                     f'{config.dtype!r}.')
  if config.optim.name not in ('sgd', 'lars'):
    raise ValueError(f"config.optim.name must be 'sgd' or 'lars', got "
                     f'{config.optim.name!r}.')
  for field in ('batch_size', 'log_every_steps', 'checkpoint_every_steps',
                'keep_checkpoints'):
    if config[field] < 1:
      raise ValueError(f'config.{field} must be >= 1, got {config[field]}.')
  if config.total_steps <= 0 and config.num_epochs <= 0:
    raise ValueError('Set config.num_epochs > 0 or config.total_steps > 0.')
  if config.ot.learn_alpha and not 0.0 < config.ot.alpha < 1.0:
    raise ValueError('config.ot.learn_alpha starts from sigmoid(logit) = '
                     f'config.ot.alpha, which must lie in (0, 1); got '
                     f'{config.ot.alpha}.')
  if not 0.0 <= config.ot.alpha <= 1.0:
    raise ValueError(f'config.ot.alpha must lie in [0, 1], got '
                     f'{config.ot.alpha}.')
  augment_params(config)
  if config.ot.grid_size > config.image_size:
    raise ValueError(f'config.ot.grid_size ({config.ot.grid_size}) must not '
                     f'exceed config.image_size ({config.image_size}).')


def create_model(config: ml_collections.ConfigDict) -> models.SimCLRNet:
  return models.SimCLRNet(
      stem=config.model.stem,
      proj_hidden_dim=config.model.proj_hidden_dim,
      proj_dim=config.model.proj_dim,
      dtype=DTYPES[config.dtype])


def total_steps_for(config: ml_collections.ConfigDict,
                    steps_per_epoch: int) -> int:
  if config.total_steps > 0:
    return int(config.total_steps)
  return int(config.num_epochs * steps_per_epoch)


def learning_rate_schedule(config: ml_collections.ConfigDict,
                           steps_per_epoch: int,
                           total_steps: int) -> optax.Schedule:
  """Linear warmup to `base_lr * batch_size / 256`, then cosine decay to 0."""
  peak = config.optim.base_lr * config.batch_size / 256.0
  warmup = min(int(config.optim.warmup_epochs * steps_per_epoch),
               max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=0.0)


def _decay_mask(params):
  # Convolution and dense kernels only: decaying BatchNorm scales, biases or
  # the interpolation logit would pull them towards 0 for no benefit.
  return jax.tree_util.tree_map(lambda p: p.ndim > 1, params)


def create_optimizer(config: ml_collections.ConfigDict,
                     schedule: optax.Schedule) -> optax.GradientTransformation:
  opt = config.optim
  if opt.name == 'lars':
    return optax.lars(schedule, weight_decay=opt.weight_decay,
                      weight_decay_mask=_decay_mask,
                      trust_ratio_mask=_decay_mask, momentum=opt.momentum)
  return optax.chain(
      optax.add_decayed_weights(opt.weight_decay, mask=_decay_mask),
      optax.sgd(schedule, momentum=opt.momentum))


def init_state(config: ml_collections.ConfigDict, model: models.SimCLRNet,
               tx: optax.GradientTransformation, key: jax.Array) -> TrainState:
  dummy = jnp.zeros((1, config.image_size, config.image_size, 3), jnp.float32)
  variables = model.init({'params': key}, dummy, train=False)
  params = {'net': variables['params']}
  if config.ot.learn_alpha:
    params['alpha_logit'] = jnp.asarray(
        losses.alpha_to_logit(config.ot.alpha), jnp.float32)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    batch_stats=variables['batch_stats'],
                    opt_state=tx.init(params))


def count_params(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


# ----------------------------------------------------------------------------
# The step.


def regulariser_in_loss(config: ml_collections.ConfigDict) -> bool:
  """Whether `beta * L_Sinkhorn` is part of the loss (then every step needs it).

  With beta = 0 it is only a logged diagnostic. (With beta != 0 but a fixed
  alpha it enters the loss value yet has no gradient, docs/method.md section 6.)
  """
  return config.ot.beta != 0


def current_alpha(config: ml_collections.ConfigDict, params) -> jax.Array:
  if config.ot.learn_alpha:
    return losses.alpha_from_logit(params['alpha_logit'])
  return jnp.asarray(config.ot.alpha, jnp.float32)


def augment_params(config: ml_collections.ConfigDict) -> augment.AugmentParams:
  """The strong augmentation's settings from `config.augment` (checked)."""
  fields = dict(config.augment) if 'augment' in config else {}
  for name in ('crop_scale',):
    if name in fields:
      fields[name] = tuple(float(v) for v in fields[name])
  try:
    return augment.AugmentParams(**fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f'config.augment: {e}') from e


def make_views(config: ml_collections.ConfigDict, params, images: jax.Array,
               key: jax.Array):
  """Both positive views of a batch, as the training step sees them.

  Args:
    config: the run's config.
    params: TrainState.params (for a learnt alpha).
    images: source images float32 [B, H, W, 3] in [0, 1].
    key: PRNG key for the two strong augmentations.

  Returns:
    `(v1, v2, strong1, strong2)`, each [B, H, W, 3]: the views fed to the
    encoder, and the strong augmentations they came from (equal to the views
    for SimCLR).
  """
  k1, k2 = jax.random.split(key)
  params_aug = augment_params(config)
  xs1 = augment.simclr_augment(k1, images, params_aug)
  xs2 = augment.simclr_augment(k2, images, params_aug)
  if config.method == 'simclr':
    return xs1, xs2, xs1, xs2
  views = functools.partial(
      ot.ot_views, alpha=current_alpha(config, params),
      grid_size=config.ot.grid_size, epsilon=config.ot.epsilon,
      num_iters=config.ot.num_iters, core=config.ot.core)
  return views(images, xs1), views(images, xs2), xs1, xs2


def train_step(state: TrainState, batch: jax.Array, key: jax.Array, *,
               model: models.SimCLRNet, tx: optax.GradientTransformation,
               schedule: optax.Schedule, config: ml_collections.ConfigDict):
  """One optimiser update.

  Args:
    state: current state (donated).
    batch: uint8 images [B, H, W, 3], B the global batch.
    key: the run's training key; folded with the step here.
    model: the network.
    tx: the optimiser.
    schedule: learning-rate schedule, for logging.
    config: the run's config (static).

  Returns:
    `(new_state, metrics)`, metrics a dict of scalars for this step.
  """
  images = batch.astype(jnp.float32) / 255.0
  step_key = jax.random.fold_in(key, state.step)
  otclr = config.method == 'otclr'

  def loss_fn(params):
    v1, v2, xs1, xs2 = make_views(config, params, images, step_key)
    (_, z), updates = model.apply(
        {'params': params['net'], 'batch_stats': state.batch_stats},
        jnp.concatenate([v1, v2]), train=True, mutable=['batch_stats'])
    z1, z2 = jnp.split(z, 2)
    if not otclr:
      loss, metrics = losses.pretrain_loss(
          z1, z2, temperature=config.loss.temperature)
      return loss, (metrics, updates['batch_stats'])
    regulariser = functools.partial(
        losses.sinkhorn_regulariser, images, xs1, xs2, v1, v2,
        grid_size=config.ot.grid_size, epsilon=config.ot.epsilon,
        num_iters=config.ot.num_iters)
    if regulariser_in_loss(config):
      reg = regulariser()
      loss, metrics = losses.pretrain_loss(
          z1, z2, reg, temperature=config.loss.temperature,
          beta=config.ot.beta)
    else:
      # A diagnostic only: evaluated exactly on the steps that are logged,
      # NaN (skipped by the logger) on the others, which saves ~1% of a step.
      loss, metrics = losses.pretrain_loss(
          z1, z2, temperature=config.loss.temperature)
      metrics['sinkhorn'] = jax.lax.cond(
          (state.step + 1) % config.log_every_steps == 0, regulariser,
          lambda: jnp.float32(jnp.nan))
    metrics['alpha'] = current_alpha(config, params)
    return loss, (metrics, updates['batch_stats'])

  grads, (metrics, batch_stats) = jax.grad(loss_fn, has_aux=True)(
      state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics['grad_norm'] = optax.tree.norm(grads)
  metrics['lr'] = schedule(state.step)
  new_state = state.replace(step=state.step + 1, params=params,
                            batch_stats=batch_stats, opt_state=opt_state)
  return new_state, metrics


def make_mesh(devices=None) -> Mesh:
  devices = np.asarray(jax.devices() if devices is None else devices)
  return Mesh(devices, ('data',))


def jit_train_step(config, model, tx, schedule, mesh: Mesh):
  """The train step jitted over `mesh`: batch sharded on 'data', state replicated.

  NT-Xent and BatchNorm see the global batch: the arrays are global and XLA
  inserts the cross-device reductions.
  """
  replicated = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P('data'))
  step = functools.partial(train_step, model=model, tx=tx, schedule=schedule,
                           config=config)
  return jax.jit(step, in_shardings=(replicated, data, replicated),
                 out_shardings=(replicated, replicated), donate_argnums=0)


def global_batch(batch: np.ndarray, mesh: Mesh) -> jax.Array:
  """This process's rows of the global host batch, as one global device array."""
  n = jax.process_count()
  if batch.shape[0] % n or (batch.shape[0] // n) % (mesh.size // n or 1):
    raise ValueError(f'Global batch {batch.shape[0]} must split evenly over '
                     f'{n} processes and {mesh.size} devices.')
  local = batch.shape[0] // n
  rows = batch[jax.process_index() * local:(jax.process_index() + 1) * local]
  return jax.make_array_from_process_local_data(
      NamedSharding(mesh, P('data')), rows, batch.shape)


# ----------------------------------------------------------------------------
# Logging.


class MetricLogger:
  """Console progress line, TensorBoard events and `metrics.jsonl` (process 0)."""

  def __init__(self, workdir: str, total_steps: int, start_step: int,
               steps_per_epoch: int, batch_size: int):
    self.total_steps = total_steps
    self.steps_per_epoch = steps_per_epoch
    self.batch_size = batch_size
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self._tb = None
    if self.enabled:
      self._truncate_after(start_step)
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))
    self._t0 = time.perf_counter()
    self._last_time, self._last_step = self._t0, start_step
    self._start_step = start_step

  def _truncate_after(self, step: int) -> None:
    # Lines past the restored step describe updates that are about to be
    # redone; keeping them would duplicate steps in the curves.
    if not os.path.exists(self.path):
      return
    with open(self.path) as f:
      kept = [line for line in f if json.loads(line)['step'] <= step]
    with open(self.path, 'w') as f:
      f.writelines(kept)

  def write(self, step: int, metrics: dict[str, float]) -> None:
    now = time.perf_counter()
    rate = (step - self._last_step) * self.batch_size / max(
        now - self._last_time, 1e-9)
    self._last_time, self._last_step = now, step
    done = (step - self._start_step) / max(now - self._t0, 1e-9)
    eta = (self.total_steps - step) / done if done > 0 else float('nan')
    record = {'step': step, 'epoch': step / self.steps_per_epoch,
              **metrics, 'images_per_sec': rate}
    if not self.enabled:
      return
    with open(self.path, 'a') as f:
      f.write(json.dumps(record) + '\n')
    for name, value in record.items():
      if name != 'step':
        self._tb.add_scalar(f'train/{name}', value, step)
    self._tb.flush()
    frac = step / self.total_steps
    bar = '#' * int(20 * frac) + '-' * (20 - int(20 * frac))
    parts = ' '.join(f'{k} {v:.4g}' for k, v in metrics.items())
    eta_text = (time.strftime('%H:%M:%S', time.gmtime(eta))
                if math.isfinite(eta) else '?')
    logging.info('step %d/%d [%s] %3.0f%% | %s | %.0f img/s | ETA %s', step,
                 self.total_steps, bar, 100 * frac, parts, rate, eta_text)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


class _StopRequest:
  """Turns SIGTERM/SIGINT into a flag checked between steps."""

  def __init__(self):
    self.signal = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, _):
    logging.warning('Received %s: saving a checkpoint and stopping.',
                    signal.Signals(signum).name)
    self.signal = signum

  def __exit__(self, *_):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


# ----------------------------------------------------------------------------
# The loop.


def _check_finite(records: list[tuple[int, dict[str, float]]],
                  ckpt: checkpoint.Checkpointer) -> None:
  for step, metrics in records:
    if not (math.isfinite(metrics['loss'])
            and math.isfinite(metrics['grad_norm'])):
      raise FloatingPointError(
          f'Non-finite loss or gradient at step {step} (loss '
          f'{metrics["loss"]}, grad_norm {metrics["grad_norm"]}); stopping. '
          f'The last good checkpoint is step {ckpt.latest_step()} in '
          f'{ckpt.directory}.')


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       stop_after_steps: int | None = None,
                       mesh: Mesh | None = None) -> TrainState:
  """Pretrains (resuming from `workdir` if it holds a checkpoint).

  Args:
    config: the run's config (configs/default.py documents the fields).
    workdir: output directory: checkpoints/, tensorboard/, metrics.jsonl.
    stop_after_steps: leave after this many steps of *this* invocation,
      checkpointing as on a preemption (for time-sliced cluster jobs and the
      resumption test). None runs to the end.
    mesh: device mesh with a 'data' axis; default all devices.

  Returns:
    The final TrainState. When training completes and `config.eval.at_end` is
    set, the run's checkpoint is then evaluated (otclr_jax.evaluate).
  """
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  mesh = make_mesh() if mesh is None else mesh
  if config.batch_size % mesh.size:
    raise ValueError(f'batch_size {config.batch_size} must be divisible by '
                     f'the {mesh.size} devices.')

  data = input_pipeline.load_split(config.dataset, 'train', config.image_size,
                                   config.data_dir or None)
  spe = input_pipeline.steps_per_epoch(len(data.images), config.batch_size)
  total = total_steps_for(config, spe)

  root = jax.random.key(config.seed)
  init_key, train_key = jax.random.split(root)
  model = create_model(config)
  schedule = learning_rate_schedule(config, spe, total)
  tx = create_optimizer(config, schedule)
  replicated = NamedSharding(mesh, P())
  state = jax.jit(functools.partial(init_state, config, model, tx),
                  out_shardings=replicated)(init_key)
  train_key = jax.device_put(train_key, replicated)

  ckpt = checkpoint.Checkpointer(workdir, config.keep_checkpoints)
  if ckpt.latest_step() is not None:
    state = ckpt.restore(state)
    logging.info('Resumed from step %d in %s', int(state.step), workdir)
  start = int(state.step)
  logging.info(
      'method %s on %s: %d images, %d steps/epoch, %d steps, batch %d over %d '
      'device(s); %.2fM encoder + head parameters.', config.method,
      config.dataset, len(data.images), spe, total, config.batch_size,
      mesh.size, count_params(state.params['net']) / 1e6)

  step_fn = jit_train_step(config, model, tx, schedule, mesh)
  batches: Iterator[np.ndarray] = input_pipeline.train_batches(
      data.images, config.batch_size, config.seed, start_step=start)
  logger = MetricLogger(workdir, total, start, spe, config.batch_size)
  pending: list[tuple[int, dict[str, jax.Array]]] = []
  window: list[dict[str, float]] = []

  def flush() -> None:
    records = [(s, {k: float(v) for k, v in m.items()})
               for s, m in jax.device_get(pending)]
    pending.clear()
    _check_finite(records, ckpt)
    window.extend(m for _, m in records)

  def log(step: int) -> None:
    flush()
    if window:
      means = {}
      for key in window[0]:
        values = [m[key] for m in window if not math.isnan(m[key])]
        if values:  # diagnostics evaluated on logging steps only
          means[key] = float(np.mean(values))
      logger.write(step, means)
      window.clear()

  step = start
  try:
    with _StopRequest() as stop:
      while step < total:
        if stop.signal is not None or (
            stop_after_steps is not None and step - start >= stop_after_steps):
          break
        state, metrics = step_fn(state, global_batch(next(batches), mesh),
                                 train_key)
        step += 1
        pending.append((step, metrics))
        if step % config.log_every_steps == 0 or step == total:
          log(step)
        if step % config.checkpoint_every_steps == 0:
          flush()
          ckpt.save(step, state)
      log(step)
      ckpt.save(step, state)
      if step < total:
        logging.info('Stopped at step %d of %d; rerun the same command to '
                     'resume.', step, total)
  finally:
    ckpt.close()
    logger.close()
    close = getattr(batches, 'close', None)
    if close is not None:
      close()
  if step >= total and config.eval.at_end:
    from otclr_jax import evaluate  # pylint: disable=g-import-not-at-top
    evaluate.evaluate(config, workdir)
  return state
