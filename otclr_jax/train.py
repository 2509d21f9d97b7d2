"""OTCLR / SimCLR pretraining: one jitted, donated train step over a device mesh.

The step takes uint8 images, draws two SimCLR strong views on the device, and
for `method='otclr'` turns them into OT displacement views before NT-Xent
(docs/method.md sections 1 and 4-6). Everything needed to resume lives in
`TrainState`; data order and augmentation keys are functions of
`(config.seed, step)`, so a resumed run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from otclr_jax import export
from otclr_jax import fileio
from otclr_jax import input_pipeline
from otclr_jax import losses
from otclr_jax import models
from otclr_jax import ot
from otclr_jax import rundir

METHODS = ('simclr', 'otclr')
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}

# The smallest safe `ot.epsilon`. Kernel-mode Sinkhorn (otclr_jax/ot.py) builds
# K = exp(-C / epsilon) with the cost C normalised to [0, 1], in float32. Its
# smallest entry exp(-1 / epsilon) stays a normal float32 (>= 2**-126 =
# 1.18e-38 = exp(-87.34)) only for epsilon >= 1 / (126 ln 2) = 0.01145; below
# that entries flush to 0, the scalings a / (K v) overflow and the views and
# the loss turn NaN at the first step.
MIN_EPSILON = 1.0 / (126 * math.log(2))

# Key of the train step's output holding [3] booleans: whether params,
# batch_stats and opt_state are all finite *after* the update. Popped before
# logging; a checkpoint is only written when every step up to it was finite.
_FINITE = 'state_finite'
_STATE_PARTS = ('params', 'batch_stats', 'opt_state')
# Logged by the kNN monitor (otclr_jax/monitor.py) on its steps.
MONITOR_METRIC = 'monitor_knn_top1'


class ConfigError(ValueError):
  """A config field is invalid, or conflicts with the run stored in the workdir."""


class DivergedError(FloatingPointError):
  """The loss, a gradient or the training state became non-finite."""


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


def _require(ok: bool, field: str, rule: str, value: Any) -> None:
  if not ok:
    raise ConfigError(f'config.{field} {rule}, got {value!r}.')


def _is_number(value: Any) -> bool:
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value))


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Checks every field before anything is created (workdir, data caches).

  Raises:
    ConfigError: (a ValueError) naming the field, its value and the rule.
  """
  c = config
  _require(c.mode in ('train', 'eval'), 'mode', "must be 'train' or 'eval'",
           c.mode)
  _require(c.method in METHODS, 'method', f'must be one of {METHODS}',
           c.method)
  _require(c.dtype in DTYPES, 'dtype', f'must be one of {tuple(DTYPES)}',
           c.dtype)
  _require(_is_int(c.seed), 'seed', 'must be an integer', c.seed)
  _require(isinstance(c.dataset, str) and c.dataset, 'dataset',
           'must name a dataset', c.dataset)
  _require(_is_int(c.image_size)
           and c.image_size >= input_pipeline.MIN_IMAGE_SIZE, 'image_size',
           f'must be an integer >= {input_pipeline.MIN_IMAGE_SIZE}',
           c.image_size)
  _require(_is_int(c.batch_size) and c.batch_size >= 2, 'batch_size',
           'must be an integer >= 2 (NT-Xent needs negatives)', c.batch_size)
  for field in ('log_every_steps', 'checkpoint_every_steps',
                'keep_checkpoints'):
    _require(_is_int(c[field]) and c[field] >= 1, field,
             'must be an integer >= 1', c[field])
  _require(_is_int(c.total_steps) and c.total_steps >= 0, 'total_steps',
           'must be an integer >= 0 (0: use num_epochs)', c.total_steps)
  _require(_is_number(c.num_epochs) and c.num_epochs >= 0, 'num_epochs',
           'must be >= 0', c.num_epochs)
  if c.total_steps <= 0 and c.num_epochs <= 0:
    raise ConfigError('Set config.num_epochs > 0 or config.total_steps > 0.')
  _require(c.model.stem in models.STEMS, 'model.stem',
           f'must be one of {models.STEMS}', c.model.stem)
  for field in ('proj_hidden_dim', 'proj_dim'):
    _require(_is_int(c.model[field]) and c.model[field] >= 1,
             f'model.{field}', 'must be an integer >= 1', c.model[field])
  _require(_is_number(c.loss.temperature) and c.loss.temperature > 0,
           'loss.temperature', 'must be > 0', c.loss.temperature)
  _require(c.optim.name in ('sgd', 'lars'), 'optim.name',
           "must be 'sgd' or 'lars'", c.optim.name)
  _require(_is_number(c.optim.base_lr) and c.optim.base_lr >= 0,
           'optim.base_lr', 'must be >= 0', c.optim.base_lr)
  _require(_is_number(c.optim.momentum) and 0 <= c.optim.momentum < 1,
           'optim.momentum', 'must lie in [0, 1)', c.optim.momentum)
  _require(_is_number(c.optim.weight_decay) and c.optim.weight_decay >= 0,
           'optim.weight_decay', 'must be >= 0', c.optim.weight_decay)
  _require(_is_number(c.optim.warmup_epochs) and c.optim.warmup_epochs >= 0,
           'optim.warmup_epochs', 'must be >= 0', c.optim.warmup_epochs)
  _require(_is_int(c.ot.grid_size) and c.ot.grid_size >= 2, 'ot.grid_size',
           'must be an integer >= 2', c.ot.grid_size)
  if c.ot.grid_size > c.image_size:
    raise ConfigError(f'config.ot.grid_size ({c.ot.grid_size}) must not '
                      f'exceed config.image_size ({c.image_size}).')
  _require(_is_number(c.ot.epsilon) and c.ot.epsilon > 0, 'ot.epsilon',
           'must be > 0', c.ot.epsilon)
  if c.ot.epsilon < MIN_EPSILON:
    raise ConfigError(
        f'config.ot.epsilon={c.ot.epsilon} is below {MIN_EPSILON:.5f}, the '
        'smallest safe value: the Sinkhorn kernel exp(-C / epsilon) on the '
        'max-1 cost C in [0, 1] underflows float32 (smallest normal 1.18e-38 '
        f'= exp(-87.3)) for epsilon < 1/87.3, which gives NaN views and loss.')
  _require(_is_int(c.ot.num_iters) and c.ot.num_iters >= 1, 'ot.num_iters',
           'must be an integer >= 1', c.ot.num_iters)
  _require(_is_number(c.ot.alpha) and 0.0 <= c.ot.alpha <= 1.0, 'ot.alpha',
           'must lie in [0, 1]', c.ot.alpha)
  if c.ot.learn_alpha and not 0.0 < c.ot.alpha < 1.0:
    raise ConfigError('config.ot.learn_alpha starts from sigmoid(logit) = '
                      f'config.ot.alpha, which must lie in (0, 1); got '
                      f'{c.ot.alpha}.')
  _require(_is_number(c.ot.beta) and c.ot.beta >= 0, 'ot.beta', 'must be >= 0',
           c.ot.beta)
  _require(isinstance(c.ot.learn_alpha, bool), 'ot.learn_alpha',
           'must be True or False', c.ot.learn_alpha)
  datasets = c.eval.datasets
  _require(isinstance(datasets, (tuple, list)) and len(datasets) >= 1
           and all(isinstance(d, str) and d for d in datasets),
           'eval.datasets', 'must be a non-empty tuple of dataset names',
           datasets)
  _require(isinstance(c.eval.views_dataset, str), 'eval.views_dataset',
           "must be a dataset name or ''", c.eval.views_dataset)
  for field in ('batch_size', 'probe_steps', 'num_view_images'):
    _require(_is_int(c.eval[field]) and c.eval[field] >= 1, f'eval.{field}',
             'must be an integer >= 1', c.eval[field])
  for field in ('at_end', 'figures'):
    _require(isinstance(c.eval[field], bool), f'eval.{field}',
             'must be True or False', c.eval[field])
  if 'monitor' in c:  # configs stored by older versions have none
    _require(_is_int(c.monitor.every_steps) and c.monitor.every_steps >= 0
             and c.monitor.every_steps % c.log_every_steps == 0,
             'monitor.every_steps', '(the kNN monitor) must be 0 (off) or a '
             'multiple of config.log_every_steps (it is logged with that '
             "step's line)", c.monitor.every_steps)
    for field in ('num_train', 'num_test'):
      _require(_is_int(c.monitor[field]) and c.monitor[field] >= 1,
               f'monitor.{field}', 'must be an integer >= 1',
               c.monitor[field])
  try:
    augment_params(c)
  except ValueError as e:
    raise ConfigError(str(e)) from e
  _require(c.ot.core in ot.CORES, 'ot.core', f'must be one of {ot.CORES}',
           c.ot.core)


def monitor_enabled(config: ml_collections.ConfigDict) -> bool:
  """Whether the kNN monitor runs (otclr_jax/monitor.py; `config.monitor`)."""
  return 'monitor' in config and config.monitor.every_steps > 0


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
  inserts the cross-device reductions. The metrics also hold
  `metrics['state_finite']`, `state_finite(new_state)`.
  """
  replicated = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P('data'))

  def step(state, batch, key):
    new_state, metrics = train_step(state, batch, key, model=model, tx=tx,
                                    schedule=schedule, config=config)
    metrics[_FINITE] = state_finite(new_state)
    return new_state, metrics

  return jax.jit(step, in_shardings=(replicated, data, replicated),
                 out_shardings=(replicated, replicated), donate_argnums=0)


def state_finite(state: TrainState) -> jax.Array:
  """Bool [3]: whether params, batch_stats and opt_state hold only finite values.

  One fused reduction on the device; the loss and gradient are computed
  *before* the update, so only this sees an update that overflowed the state
  (e.g. BatchNorm running variances after a huge step).
  """
  def finite(tree):
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)
  return jnp.stack([finite(getattr(state, part)) for part in _STATE_PARTS])


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
      lines = f.readlines()
    kept = []
    for number, line in enumerate(lines, 1):
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        if number == len(lines):
          # What a crash or a full disk leaves: a line cut short.
          logging.warning('Dropping the torn last line %d of %s (%s): %r',
                          number, self.path, e, line[:80])
          continue
        raise ValueError(f'{self.path} line {number} is not JSON ({e}); '
                         'fix or delete that line and rerun.') from e
      if record['step'] <= step:
        kept.append(line)
    fileio.write_text(self.path, ''.join(kept))

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


def _newest_checkpoint_text(ckpt: checkpoint.Checkpointer,
                            config: ml_collections.ConfigDict) -> str:
  ckpt.wait()  # an in-flight save of an earlier, finite step counts
  latest = ckpt.latest_step()
  if latest is None:
    return ('No checkpoint was saved yet (the first is due at step '
            f'{config.checkpoint_every_steps}, config.checkpoint_every_steps).')
  return (f'The newest checkpoint, step {latest} in {ckpt.directory}, is '
          'finite (no non-finite state is ever saved).')


def _check_finite(records, ckpt: checkpoint.Checkpointer,
                  config: ml_collections.ConfigDict) -> None:
  """Raises DivergedError at the first step with a non-finite loss or state.

  Args:
    records: `(step, metrics, finite)` triples, `finite` the step's
      `state_finite` flags.
    ckpt: the run's checkpointer, to name the newest (finite) checkpoint.
    config: the run's config.
  """
  for step, metrics, finite in records:
    bad_state = [part for part, ok in zip(_STATE_PARTS, finite) if not ok]
    if (math.isfinite(metrics['loss']) and math.isfinite(metrics['grad_norm'])
        and not bad_state):
      continue
    what = (f'non-finite {", ".join(bad_state)} after the update'
            if bad_state else 'non-finite loss or gradient')
    raise DivergedError(
        f'Diverged at step {step}: {what} (loss {metrics["loss"]:.4g}, '
        f'grad_norm {metrics["grad_norm"]:.4g}); stopping. '
        f'{_newest_checkpoint_text(ckpt, config)} Lower '
        'config.optim.base_lr or lengthen config.optim.warmup_epochs.')


def _state_problem(state: TrainState) -> str | None:
  """Why a restored state cannot be resumed from (None if it can)."""
  finite = np.asarray(jax.device_get(jax.jit(state_finite)(state)))
  bad = [part for part, ok in zip(_STATE_PARTS, finite) if not ok]
  return f'non-finite {", ".join(bad)}' if bad else None


def _stored_total(stored: dict[str, Any], steps_per_epoch: int) -> int | None:
  if 'total_steps' not in stored or 'num_epochs' not in stored:
    return None
  if stored['total_steps'] > 0:
    return int(stored['total_steps'])
  return int(stored['num_epochs'] * steps_per_epoch)


def check_resume(stored: dict[str, Any] | None,
                 config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses a config whose result-changing settings differ from config.json.

  Raises:
    ConfigError: naming each differing field with its stored and new value.
  """
  if stored is None:
    return
  new = config.to_dict()
  names = rundir.result_changing_diff(stored, new)
  if names:
    raise ConfigError(
        f'{os.path.join(workdir, rundir.CONFIG_FILE)} holds a run with other '
        f'settings; resuming it would mix two runs. Differences (stored -> '
        f'new): {rundir.describe_diff(stored, new, names)}. Use another '
        '--workdir, or rerun with the stored values.')


def check_total(stored: dict[str, Any] | None, total: int,
                steps_per_epoch: int, workdir: str) -> None:
  """Allows a resumed run the stored length or a longer one, never a shorter.

  The learning-rate schedule (warmup, then cosine to 0 over the total) depends
  on the total: a longer run continues on the new, stretched schedule from the
  resumed step (a warning says so); a shorter one would have taken other
  steps from the start, so it is refused.

  Raises:
    ConfigError: the resolved total is below the stored one.
  """
  old = None if stored is None else _stored_total(stored, steps_per_epoch)
  if old is None or total == old:
    return
  if total < old:
    raise ConfigError(
        f'{os.path.join(workdir, rundir.CONFIG_FILE)} holds a {old}-step run '
        f'(config.total_steps/num_epochs); this config asks for {total}. A '
        'run may be lengthened but not shortened (the learning-rate schedule '
        'spans the total); use another --workdir.')
  logging.warning('Lengthening the run in %s from %d to %d steps: the '
                  'learning-rate schedule now spans %d steps from the resumed '
                  'step on.', workdir, old, total, total)


@dataclasses.dataclass
class RunResult:
  """What `train` returns.

  Attributes:
    state: the final TrainState.
    status: 'finished' (reached total_steps) or 'stopped' (SIGTERM/SIGINT or
      stop_after_steps; rerunning resumes).
  """
  state: TrainState
  status: str


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       stop_after_steps: int | None = None,
                       mesh: Mesh | None = None) -> TrainState:
  """`train(...)`'s final TrainState (see `train`)."""
  return train(config, workdir, stop_after_steps=stop_after_steps,
               mesh=mesh).state


def train(config: ml_collections.ConfigDict, workdir: str, *,
          stop_after_steps: int | None = None,
          mesh: Mesh | None = None) -> RunResult:
  """Pretrains (resuming from `workdir` if it holds a checkpoint).

  The whole config is validated before anything is created. The workdir is
  locked for the run (otclr_jax/rundir.py); its config is stored in
  config.json on first start and a resume from its checkpoints must match it
  (`check_resume`, `check_total`); status.json follows the run. A checkpoint is only saved
  when every step up to it left a finite state; a resume starts from the
  newest checkpoint that restores and is finite.

  Args:
    config: the run's config (configs/default.py documents the fields).
    workdir: output directory: checkpoints/, tensorboard/, metrics.jsonl,
      config.json, status.json, and once finished encoder/encoder.msgpack
      (`export_encoder`).
    stop_after_steps: leave after this many steps of *this* invocation,
      checkpointing as on a preemption (for time-sliced cluster jobs and the
      resumption test). None runs to the end.
    mesh: device mesh with a 'data' axis; default all devices.

  Returns:
    A RunResult. When training completes and `config.eval.at_end` is set,
    the run's checkpoint is then evaluated (otclr_jax.evaluate).

  Raises:
    ConfigError: a bad config field, or one that conflicts with config.json.
    rundir.WorkdirLockedError: another process is training in `workdir`.
    DivergedError: non-finite loss, gradient or state (status 'diverged').
  """
  validate_config(config)
  mesh = make_mesh() if mesh is None else mesh
  if config.batch_size % mesh.size:
    raise ConfigError(f'config.batch_size {config.batch_size} must be '
                      f'divisible by the {mesh.size} devices.')
  # Only process 0 writes the workdir's own files; on several hosts the
  # others share its filesystem and must not lock themselves out.
  main = jax.process_index() == 0
  with rundir.lock(workdir) if main else contextlib.nullcontext():
    stored = rundir.read_config(workdir)
    if stored is not None and not checkpoint.has_checkpoint(workdir):
      # Nothing to resume (e.g. it diverged before its first checkpoint):
      # this run starts afresh and replaces the stored config.
      logging.info('%s has no checkpoint: starting afresh; this config '
                   'replaces its %s.', workdir, rundir.CONFIG_FILE)
      stored = None
    check_resume(stored, config, workdir)
    progress = {'step': 0, 'total': 0, 'started': False}
    try:
      result = _train(config, workdir, stored, progress, stop_after_steps,
                      mesh)
      if main and result.status == 'finished':
        export_encoder(config, workdir, result.state)
    except BaseException as e:
      if main and progress['started']:
        state = 'diverged' if isinstance(e, DivergedError) else 'failed'
        try:
          rundir.write_status(workdir, state, progress['step'],
                              progress['total'])
        except OSError as write_error:  # e.g. the disk that failed is full
          logging.warning('Could not record %r in %s: %s', state,
                          rundir.STATUS_FILE, write_error)
      raise
    if main:
      rundir.write_status(workdir, result.status, progress['step'],
                          progress['total'])
    if result.status == 'finished' and config.eval.at_end:
      from otclr_jax import evaluate  # pylint: disable=g-import-not-at-top
      with rundir.lock(workdir, rundir.EVAL_LOCK_FILE):
        evaluate.evaluate(config, workdir)
  return result


def export_encoder(config: ml_collections.ConfigDict, workdir: str,
                   state: TrainState) -> str:
  """Writes the finished run's encoder to `workdir/encoder/encoder.msgpack`.

  The backbone alone (params, BatchNorm statistics, model settings) for
  `otclr_jax.export.load_encoder`; returns the path.
  """
  path = export.encoder_path(workdir)
  export.export_encoder(
      path, {'params': state.params['net'], 'batch_stats': state.batch_stats},
      config, step=int(state.step))
  logging.info('Encoder exported to %s', path)
  return path


def _train(config, workdir, stored, progress, stop_after_steps,
           mesh) -> RunResult:
  """The body of `train`, with the workdir locked and the config checked."""
  main = jax.process_index() == 0
  data = input_pipeline.load_split(config.dataset, 'train', config.image_size,
                                   config.data_dir or None)
  spe = input_pipeline.steps_per_epoch(len(data.images), config.batch_size)
  total = total_steps_for(config, spe)
  check_total(stored, total, spe, workdir)

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
  try:
    state, restored = ckpt.restore_newest(state, _state_problem)
  except BaseException:
    ckpt.close()
    raise
  if restored is not None:
    logging.info('Resumed from step %d in %s', restored, workdir)
  start = int(state.step)
  if main:
    if stored is None and restored is not None:
      logging.warning('%s has checkpoints but no %s (written by older '
                      'versions); storing this config without checking it.',
                      workdir, rundir.CONFIG_FILE)
    rundir.write_config(workdir, config.to_dict())
    rundir.write_status(workdir, 'running', start, total)
  progress.update(step=start, total=total, started=True)
  logging.info(
      'method %s on %s: %d images, %d steps/epoch, %d steps, batch %d over %d '
      'device(s); %.2fM encoder + head parameters.', config.method,
      config.dataset, len(data.images), spe, total, config.batch_size,
      mesh.size, count_params(state.params['net']) / 1e6)

  step_fn = jit_train_step(config, model, tx, schedule, mesh)
  batches: Iterator[np.ndarray] = input_pipeline.train_batches(
      data.images, config.batch_size, config.seed, start_step=start)
  logger = None
  pending: list[tuple[int, dict[str, jax.Array]]] = []
  window: list[dict[str, float]] = []

  def flush() -> None:
    records = []
    for s, m in jax.device_get(pending):
      finite = np.asarray(m.pop(_FINITE))
      records.append((s, {k: float(v) for k, v in m.items()}, finite))
    pending.clear()
    _check_finite(records, ckpt, config)
    window.extend(m for _, m, _ in records)

  def log(step: int) -> None:
    flush()
    if window:
      means = {}
      for key in window[0]:
        values = [m[key] for m in window if not math.isnan(m[key])]
        if values:  # diagnostics evaluated on logging steps only
          means[key] = float(np.mean(values))
      if knn_monitor is not None and step % config.monitor.every_steps == 0:
        # After flush(): the state it reads is known to be finite.
        means[MONITOR_METRIC] = knn_monitor(state)
      logger.write(step, means)
      window.clear()

  def save(step: int) -> None:
    flush()  # raises before a non-finite state reaches the disk
    ckpt.save(step, state)
    if main:
      rundir.write_status(workdir, 'running', step, total)

  step = start
  knn_monitor = None
  try:
    if monitor_enabled(config):
      from otclr_jax import monitor  # pylint: disable=g-import-not-at-top
      knn_monitor = monitor.KnnMonitor(config, model, data)
    logger = MetricLogger(workdir, total, start, spe, config.batch_size)
    with _StopRequest() as stop:
      while step < total:
        if stop.signal is not None or (
            stop_after_steps is not None and step - start >= stop_after_steps):
          break
        state, metrics = step_fn(state, global_batch(next(batches), mesh),
                                 train_key)
        step += 1
        progress['step'] = step
        pending.append((step, metrics))
        if step % config.log_every_steps == 0 or step == total:
          log(step)
        if step % config.checkpoint_every_steps == 0:
          save(step)
      log(step)
      save(step)
      ckpt.wait()
      if step < total:
        logging.info('Stopped at step %d of %d; rerun the same command to '
                     'resume.', step, total)
  except BaseException:
    _close_quietly(ckpt, logger, batches)
    raise
  _close_quietly(ckpt, logger, batches, quiet=False)
  return RunResult(state, 'finished' if step >= total else 'stopped')


def _close_quietly(ckpt, logger, batches, quiet: bool = True) -> None:
  """Closes the run's writers; with `quiet`, an error here is logged in one line.

  After a failure (e.g. a full disk) closing the checkpointer or the event
  writer often fails the same way; their tracebacks would bury the first one.
  """
  close = getattr(batches, 'close', None)
  for closer in (ckpt.close, logger.close if logger else None, close):
    if closer is None:
      continue
    try:
      closer()
    except Exception as e:  # pylint: disable=broad-except
      if not quiet:
        raise
      logging.warning('While closing after an error: %s',
                      checkpoint.describe_error(e))
