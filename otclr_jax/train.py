"""Pretraining loop; data and keys follow `(seed, step)`: resumes are exact."""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import math
import os
import threading
import time
from typing import Any, Iterator, NamedTuple

from absl import logging
import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np

from otclr_jax import checkpoint
from otclr_jax import cli
from otclr_jax import data
from otclr_jax import experiment
from otclr_jax import export
from otclr_jax import fileio
from otclr_jax import optim
from otclr_jax import rundir
from otclr_jax import step as step_lib

# The step's bool [4] output: is each of `step.STATE_PARTS` finite after it.
_FINITE = 'state_finite'
# Logged by the kNN monitor (otclr_jax/evaluation/monitor.py) on its steps.
MONITOR_METRIC = 'monitor_knn_top1'


class DivergedError(FloatingPointError, cli.DivergedRunError):
  """The loss, a gradient or the training state became non-finite."""


# (metric, its label) on the console's progress line, in this order.
_CONSOLE_METRICS = (('loss', 'loss'), ('top1', 'top1'),
                    (MONITOR_METRIC, 'kNN'), ('lr', 'lr'))


class MetricLogger:
  """Console progress line, TensorBoard events and `metrics.jsonl`."""

  def __init__(self, workdir: str, total_steps: int, start_step: int,
               steps_per_epoch: int, batch_size: int):
    self.total_steps = total_steps
    self.steps_per_epoch = steps_per_epoch
    self.batch_size = batch_size
    self.path = os.path.join(workdir, rundir.METRICS_FILE)
    if os.path.exists(self.path):
      # Steps past the restored one are about to be redone.
      kept = [r for r in rundir.read_metrics(workdir)
              if r['step'] <= start_step]
      fileio.write_text(self.path,
                        ''.join(json.dumps(r) + '\n' for r in kept))
    # pylint: disable-next=g-import-not-at-top
    from tensorboardX import SummaryWriter
    # TensorBoard drops the events past the restored step, as above.
    self._tb = SummaryWriter(os.path.join(workdir, rundir.TENSORBOARD_DIR),
                             purge_step=start_step + 1)
    self._t0 = time.perf_counter()
    self._last_time, self._last_step = self._t0, start_step
    self._start_step = start_step

  def write(self, step: int, metrics: dict[str, float], steps: int) -> None:
    """Logs the means of `metrics` over the last `steps` steps.

    `steps` is recorded: after a resume or at a stop it is shorter than
    `log_every_steps`, so such a mean is not an uninterrupted run's.
    """
    now = time.perf_counter()
    rate = (step - self._last_step) * self.batch_size / max(
        now - self._last_time, 1e-9)
    self._last_time, self._last_step = now, step
    done = (step - self._start_step) / max(now - self._t0, 1e-9)
    eta = (self.total_steps - step) / done if done > 0 else float('nan')
    record = {'step': step, 'epoch': step / self.steps_per_epoch,
              **metrics, 'images_per_sec': rate, 'steps_averaged': steps}
    with open(self.path, 'a') as f:
      f.write(json.dumps(record) + '\n')
    for name, value in record.items():
      if name not in ('step', 'steps_averaged'):
        self._tb.add_scalar(f'train/{name}', value, step)
    self._tb.flush()
    # The console shows what tells a run's health at a glance; every metric
    # is in metrics.jsonl and TensorBoard.
    parts = ' '.join(f'{label} {metrics[name]:.3g}'
                     for name, label in _CONSOLE_METRICS if name in metrics)
    eta_text = (f'{int(eta) // 3600}:{int(eta) // 60 % 60:02d}:'
                f'{int(eta) % 60:02d}' if math.isfinite(eta) else '?')
    logging.info('step %d/%d %.0f%% %s %.0f img/s ETA %s', step,
                 self.total_steps, 100 * step / self.total_steps, parts, rate,
                 eta_text)

  def close(self) -> None:
    self._tb.close()


def _any_process(flag: bool) -> bool:
  """Whether `flag` is set on any process; every process must call it."""
  flags_ = multihost_utils.process_allgather(np.asarray([flag], np.int32))
  return bool(np.max(flags_))


def _share_text(text: str, size: int = 1024) -> str:
  """Process 0's `text` (its first `size` bytes) on every process."""
  buffer = np.zeros(size, np.uint8)
  encoded = text.encode()[:size]
  buffer[:len(encoded)] = np.frombuffer(encoded, np.uint8)
  shared = np.asarray(multihost_utils.broadcast_one_to_all(buffer), np.uint8)
  return shared.tobytes().rstrip(b'\0').decode(errors='replace')


@contextlib.contextmanager
def _workdir_lock(workdir: str) -> Iterator[None]:
  """The run's lock on `workdir`, taken by process 0 for all processes; each
  raises cli.WorkdirLockedError if process 0 could not take it."""
  with contextlib.ExitStack() as stack:
    error = None
    if jax.process_index() == 0:
      try:
        stack.enter_context(rundir.lock(workdir))
      except Exception as e:  # pylint: disable=broad-except
        error = e
    message = _share_text('' if error is None else
                          str(error) or type(error).__name__)
    if error is not None:
      raise error
    if message:
      raise cli.WorkdirLockedError(f'Process 0: {message}')
    yield


def _non_finite(finite) -> str | None:
  """'non-finite <parts>' for the false entries of `step.state_finite`."""
  bad = [part for part, ok in zip(step_lib.STATE_PARTS, finite) if not ok]
  return f'non-finite {", ".join(bad)}' if bad else None


def _state_problem(state: step_lib.TrainState) -> str | None:
  """Why a restored state cannot be resumed from (None if it can)."""
  return _non_finite(jax.device_get(jax.jit(step_lib.state_finite)(state)))


def _check_finite(records, ckpt: checkpoint.Checkpointer,
                  config: ml_collections.ConfigDict) -> None:
  """Raises DivergedError at the first non-finite `(step, metrics, finite)`."""
  for step, metrics, finite in records:
    bad_state = _non_finite(finite)
    if (math.isfinite(metrics['loss']) and math.isfinite(metrics['grad_norm'])
        and not bad_state):
      continue
    ckpt.wait()  # an in-flight save of an earlier, finite step counts
    latest = ckpt.latest_step()
    newest = ('No checkpoint was saved yet (the first is due at step '
              f'{config.checkpoint_every_steps}, '
              'config.checkpoint_every_steps).' if latest is None else
              f'The newest checkpoint, step {latest} in {ckpt.directory}, '
              'is finite (no non-finite state is ever saved).')
    what = (f'{bad_state} after the update' if bad_state
            else 'non-finite loss or gradient')
    raise DivergedError(
        f'Diverged at step {step}: {what} (loss {metrics["loss"]:.4g}, '
        f'grad_norm {metrics["grad_norm"]:.4g}); stopping. {newest} Lower '
        'config.optim.base_lr or lengthen config.optim.warmup_epochs.')


def _stored_config(config: ml_collections.ConfigDict,
                   workdir: str) -> dict[str, Any] | None:
  """The stored config a resume must match, or None: the run starts afresh.

  Raises:
    ConfigError: a result-changing setting differs from the stored run's
      (each named, stored -> new), or checkpoints whose config is unknown.
    rundir.CorruptFileError: config.json is not a JSON object.
  """
  if rundir.latest_checkpoint_step(workdir) is None:
    if rundir.read_config(workdir) is not None:
      # E.g. it diverged before its first checkpoint.
      logging.info('%s has no checkpoint: starting afresh; this config '
                   'replaces its %s.', workdir, rundir.CONFIG_FILE)
    return None
  stored = experiment.run_config(workdir)[0]
  new = config.to_dict()
  names = rundir.result_changing_diff(stored, new)
  if names:
    raise experiment.ConfigError(
        f'{workdir} holds a run trained with other settings; resuming it '
        f'would mix two runs. Differences (stored -> '
        f'new): {rundir.describe_diff(stored, new, names)}. Use another '
        '--workdir, or rerun with the stored values.')
  return stored


def _check_total(stored: dict[str, Any], total: int, steps_per_epoch: int,
                 workdir: str) -> None:
  """Refuses a resume of another length: another length is another run.

  A stretched or cut schedule would be neither run, while config.json and
  the checkpoints would record the new length only.
  """
  if not {'total_steps', 'num_epochs'} <= stored.keys():
    return
  old = optim.run_steps(stored['total_steps'], stored['num_epochs'],
                        steps_per_epoch)
  if total != old:
    raise experiment.ConfigError(
        f'{os.path.join(workdir, rundir.CONFIG_FILE)} holds a {old}-step run '
        f'(config.total_steps/num_epochs); this config asks for {total}. '
        'Another length is another run (the learning-rate schedule spans the '
        'total); use another --workdir.')


def _check_data(workdir: str, now: dict[str, Any]) -> None:
  """Refuses to resume on other data than the run began on (data.json)."""
  path = os.path.join(workdir, rundir.DATA_FILE)
  stored = rundir.read_json_file(path)
  if stored is None:
    logging.warning('%s has no %s (a run started before it was written): '
                    'its data cannot be compared; recording this data.',
                    workdir, rundir.DATA_FILE)
    return
  now = json.loads(json.dumps(now))
  changes = [f'{stored.get(k)} -> {now[k]} {k}' for k in ('images', 'classes')
             if stored.get(k) != now[k]]
  if stored.get('dataset') != now['dataset']:
    changes.insert(0, f'dataset {stored.get("dataset")!r} -> '
                   f'{now["dataset"]!r}')
  if stored.get('source') != now['source']:
    changes.append('the source files changed (digest of '
                   f'{(stored.get("source") or {}).get("kind", "source")} '
                   'differs)')
  if changes:
    raise experiment.ConfigError(
        f'{workdir} was trained on other data than it would resume on: '
        f'{", ".join(changes)} (stored in {path}). Restore the data it was '
        'trained on, or start the run in another --workdir.')


class RunResult(NamedTuple):
  """What `train` returns: the final TrainState, and its status: 'finished',
  or 'stopped' (a signal or stop_after_steps)."""
  state: step_lib.TrainState
  status: str


def train(config: ml_collections.ConfigDict, workdir: str, *,
          stop_after_steps: int | None = None,
          make_monitor=None) -> RunResult:
  """Pretrains, resuming from the newest finite checkpoint in `workdir`.

  Args:
    config: the run's config (configs/default.py documents the fields),
      checked by `evaluate.validate` (`main.run` does, once per command).
    workdir: the run directory (docs/operations.md, "A run directory").
    stop_after_steps: stop, checkpointed, after this many steps of this
      invocation; None runs to the end.
    make_monitor: `(config, model, train_split) -> callable(state) -> float`,
      the kNN monitor (handed in: training does not import evaluation).

  Raises:
    ConfigError: a bad config field, or one that conflicts with the run.
    cli.WorkdirLockedError: another process is training in `workdir`.
    DivergedError: non-finite loss, gradient or state (status 'diverged').
  """
  if config.monitor.every_steps > 0 and make_monitor is None:
    logging.warning(
        'config.monitor.every_steps=%d but no make_monitor was given: no kNN '
        'monitor in this run (`python -m otclr_jax.main` passes '
        '`main.make_monitor`).', config.monitor.every_steps)
  mesh = experiment.make_mesh()
  if config.batch_size % mesh.size:
    raise experiment.ConfigError(
        f'config.batch_size {config.batch_size} must be divisible by the '
        f'{mesh.size} devices.')
  # Only process 0 writes the workdir's own files; all save checkpoints.
  main = jax.process_index() == 0
  # Refuses an unreadable data source before the workdir exists.
  data.describe_source(config.dataset, 'train')
  # Outside the step loop (which checkpoints first) a signal raises, so that
  # the files being written are removed and status.json says 'stopped'.
  signals = (cli.stop_on_signals()
             if threading.current_thread() is threading.main_thread()
             else contextlib.nullcontext())
  with _workdir_lock(workdir), signals:
    stored = _stored_config(config, workdir)
    progress = {'step': 0, 'total': 0, 'started': False}
    try:
      result = _train(config, workdir, stored, progress, stop_after_steps,
                      mesh, make_monitor)
      if main and result.status == 'finished':
        try:
          _export_encoder(config, workdir, result.state)
        except cli.StopRequested as e:
          logging.error('Stopped by %s while writing the trained encoder '
                        '(no file half-written); the run is checkpointed at '
                        'its last step: rerun the same command to write it.',
                        e.name)
          result = RunResult(result.state, 'stopped')
    except BaseException as e:
      if main and progress['started']:
        state = ('diverged' if isinstance(e, DivergedError) else
                 'stopped' if isinstance(e, cli.StopRequested) else
                 'failed')
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
  return result


def _export_encoder(config: ml_collections.ConfigDict, workdir: str,
                    state: step_lib.TrainState) -> None:
  """Writes the encoder to workdir/encoder/encoder.msgpack."""
  path = export.encoder_path(workdir)
  # A killed export's leftovers: only the run's lock holder writes here.
  for stale in glob.glob(f'{glob.escape(path)}.*.tmp'):
    os.remove(stale)
  export.export_encoder(
      path, {'params': state.params['net'], 'batch_stats': state.batch_stats},
      config, step=int(state.step))
  logging.info('Encoder exported to %s', path)


def _train(config, workdir, stored, progress, stop_after_steps, mesh,
           make_monitor) -> RunResult:
  """The body of `train`, with the workdir locked and the config checked."""
  main = jax.process_index() == 0
  train_data = data.load_split(config.dataset, 'train', config.image_size,
                               config.data_dir or None)
  spe = data.steps_per_epoch(len(train_data.images), config.batch_size,
                             f'{config.dataset}/train')
  total = optim.run_steps(config.total_steps, config.num_epochs, spe)
  trained_on = {'dataset': config.dataset,
                'images': int(len(train_data.images)),
                'classes': int(train_data.num_classes),
                'source': data.describe_source(config.dataset, 'train')}
  if stored is not None:
    _check_total(stored, total, spe, workdir)
    _check_data(workdir, trained_on)
  if main:
    # Read before config.json and status.json are written: a damaged line
    # refuses the run and leaves the directory as it was.
    rundir.read_metrics(workdir)

  run, state, step_fn = step_lib.build(config, spe, mesh)
  # Jitted onto the mesh, so that every process holds the same replicated key.
  train_key = jax.jit(functools.partial(experiment.train_key, config),
                      out_shardings=NamedSharding(mesh, P()))()

  run_config = config.to_dict()
  ckpt = checkpoint.Checkpointer(workdir, config.keep_checkpoints)
  batches = logger = knn_monitor = None
  pending: list[tuple[int, dict[str, jax.Array]]] = []
  window: list[dict[str, float]] = []

  def flush() -> None:
    records = [(s, {k: float(v) for k, v in m.items() if k != _FINITE},
                m[_FINITE]) for s, m in jax.device_get(pending)]
    pending.clear()
    _check_finite(records, ckpt, config)
    window.extend(m for _, m, _ in records)

  def log(step: int) -> None:
    flush()
    if window:
      # Diagnostics evaluated on logging steps only are NaN on the others.
      kept = {k: [m[k] for m in window if not math.isnan(m[k])]
              for k in window[0]}
      means = {k: float(np.mean(v)) for k, v in kept.items() if v}
      if knn_monitor is not None and step % config.monitor.every_steps == 0:
        # After flush(): the state it reads is known to be finite.
        means[MONITOR_METRIC] = knn_monitor(state)
      if logger is not None:  # process 0 only
        logger.write(step, means, len(window))
      window.clear()

  def save(step: int) -> None:
    flush()  # raises before a non-finite state reaches the disk
    ckpt.save(step, state, run_config)
    if main:
      rundir.write_status(workdir, 'running', step, total)

  # Processes may see a signal at different steps: they agree when logging.
  several = jax.process_count() > 1
  agreed_stop = False
  try:
    state, restored = ckpt.restore_newest(state, _state_problem)
    if restored is not None:
      logging.info('Resumed from step %d in %s', restored, workdir)
    step = start = int(state.step)
    if main:
      rundir.write_config(workdir, run_config)
      rundir.write_json(os.path.join(workdir, rundir.DATA_FILE), trained_on)
      rundir.write_status(workdir, 'running', start, total)
    progress.update(step=start, total=total, started=True)
    logging.info(
        '%s (method %s, views %s) on %s: %d images, %d steps/epoch, %d steps, '
        'batch %d over %d device(s); %.2fM pretraining parameters (network '
        'and its targets).', run.recipe.title, run.method.name,
        run.recipe.views, config.dataset, len(train_data.images), spe, total,
        config.batch_size, mesh.size, step_lib.pretraining_params(state) / 1e6)
    batches = data.train_batches(train_data.images, config.batch_size,
                                 config.seed, start_step=start)
    if config.monitor.every_steps > 0 and make_monitor is not None:
      knn_monitor = make_monitor(config, run.model, train_data)
    if main:
      logger = MetricLogger(workdir, total, start, spe, config.batch_size)
    with cli.StopFlag() as stop:
      while step < total:
        stopping = agreed_stop if several else stop.signal is not None
        if stopping or (
            stop_after_steps is not None and step - start >= stop_after_steps):
          break
        state, metrics = step_fn(
            state, experiment.global_batch(next(batches), mesh), train_key)
        step += 1
        progress['step'] = step
        pending.append((step, metrics))
        if step % config.log_every_steps == 0 or step == total:
          log(step)
          if several:
            agreed_stop = _any_process(stop.signal is not None)
        if step % config.checkpoint_every_steps == 0:
          save(step)
      log(step)
      save(step)
      ckpt.wait()
      if step < total:
        logging.info('Stopped at step %d of %d; rerun the same command to '
                     'resume.', step, total)
  except BaseException:
    _close(ckpt, logger, batches)
    raise
  _close(ckpt, logger, batches, quiet=False)
  return RunResult(state, 'finished' if step >= total else 'stopped')


def _close(*closables, quiet: bool = True) -> None:
  """Closes the non-None `closables`; `quiet` logs their errors (not to bury
  the first)."""
  for closable in (c for c in closables if c is not None):
    try:
      closable.close()
    except Exception as e:  # pylint: disable=broad-except
      if not quiet:
        raise
      logging.warning('While closing after an error: %s',
                      checkpoint.describe_error(e))
