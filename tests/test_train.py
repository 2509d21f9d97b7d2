"""End-to-end tests of pretraining on a tiny digits config (CPU)."""

import errno
import functools
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from otclr_jax import checkpoint
from otclr_jax import cli
from otclr_jax import config_files
from otclr_jax import data
from otclr_jax import experiment
from otclr_jax import optim
from otclr_jax import losses
from otclr_jax import main
from otclr_jax import rundir
from otclr_jax import step as step_lib
from otclr_jax import train
from otclr_jax.evaluation import evaluate
from tests import folder_trees
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_end_to_end_writes_logs_and_checkpoints(finished_run):
  _, workdir, state = finished_run
  assert int(state.step) == 4
  records = rundir.read_metrics(workdir)
  assert [r['step'] for r in records] == [2, 4]
  for key in ('loss', 'nce', 'sinkhorn', 'top1', 'lr', 'images_per_sec'):
    assert np.isfinite(records[-1][key]), key
  assert 0.0 <= records[-1]['top1'] <= 1.0
  assert checkpoint.Checkpointer(workdir).all_steps() == [2, 4]
  assert os.listdir(os.path.join(workdir, 'tensorboard'))


def test_resume_matches_uninterrupted_run(finished_run, stopped_run,
                                          tmp_path):
  _, _, straight = finished_run
  config, stopped = stopped_run
  workdir = helpers.copy_run(stopped, tmp_path)
  assert checkpoint.Checkpointer(workdir).all_steps() == [2]
  # TensorBoard names its event files by the second: a resume within the
  # second of the run before it would write into that run's file.
  time.sleep(1.1)
  # Stopped again after step 3, then resumed to the end: steps 3 and 4 are
  # logged alone, and say so (their means are not an uninterrupted run's).
  assert train.train(config, workdir, stop_after_steps=1).status == 'stopped'
  time.sleep(1.1)
  resumed = train.train(config, workdir).state
  assert int(resumed.step) == 4
  helpers.assert_trees_equal(straight.params, resumed.params)
  records = rundir.read_metrics(workdir)
  assert [(r['step'], r['steps_averaged']) for r in records] == [
      (2, 2), (3, 1), (4, 1)]
  # TensorBoard hides an abandoned run's events past the resumed step.
  events = _tensorboard_events(os.path.join(workdir, 'tensorboard'))
  starts = [e.step for e in events if e.session_log.status == 1]  # START
  assert starts == [1, 3, 4]


def _tensorboard_events(logdir):
  """Every event of the TFRecord files in `logdir`, oldest file first."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  events = []
  for name in sorted(os.listdir(logdir)):
    data = pathlib.Path(logdir, name).read_bytes()
    start = 0
    while start < len(data):  # length (8 bytes), its CRC, record, its CRC
      size = int.from_bytes(data[start:start + 8], 'little')
      events.append(
          event_pb2.Event.FromString(data[start + 12:start + 12 + size]))
      start += size + 16
  return events


@pytest.mark.slow  # ~30 s per method on 2 cores
@pytest.mark.parametrize('method', ['moco', 'byol', 'dino'])
def test_checkpointed_resume_keeps_every_method_state(tmp_path, data_dir,
                                                      method):
  # Through Orbax, not a serialised round trip (tests/test_step.py): the key
  # encoder, queues and pointer, targets and DINO's centre come back bit for
  # bit, so the resumed run ends where the straight one does.
  config = helpers.tiny_config(data_dir, method=method, views='ot', **{
      'moco.queue_size': 32, 'byol.pred_hidden_dim': 16,
      'dino.hidden_dim': 16, 'dino.bottleneck_dim': 8,
      'dino.num_prototypes': 32})
  straight = train.train(config, str(tmp_path / 'a')).state
  first = train.train(config, str(tmp_path / 'b'), stop_after_steps=2).state
  assert int(first.step) == 2
  resumed = train.train(config, str(tmp_path / 'b')).state
  assert straight.extra
  helpers.assert_trees_equal(straight, resumed)


def _sigterm_after_two_batches(monkeypatch):
  """Makes the input pipeline send SIGTERM while yielding batch 2."""
  real = data.train_batches

  def batches_then_sigterm(*args, **kwargs):
    for i, batch in enumerate(real(*args, **kwargs)):
      if i == 1:
        os.kill(os.getpid(), signal.SIGTERM)
      yield batch

  monkeypatch.setattr(data, 'train_batches', batches_then_sigterm)


@pytest.mark.usefixtures('fresh_steps')
def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(
    stopped_run, tmp_path, monkeypatch):
  config, stopped = stopped_run
  workdir = helpers.copy_run(stopped, tmp_path)
  real = losses.nt_xent
  monkeypatch.setattr(
      losses, 'nt_xent',
      lambda z1, z2, t: jax.tree_util.tree_map(lambda x: x * jnp.nan,
                                               real(z1, z2, t)))
  with pytest.raises(FloatingPointError, match='at step 3'):
    train.train(config, workdir)
  assert checkpoint.Checkpointer(workdir).latest_step() == 2


def _steps_per_epoch(config):
  """Updates per epoch of `config`'s run, as `train.train` counts them."""
  images = data.load_split(config.dataset, 'train', config.image_size,
                           config.data_dir).images
  return data.steps_per_epoch(len(images), config.batch_size)


@pytest.mark.usefixtures('fresh_steps')
def test_train_step_compiles_once(data_dir):
  # The tiny run's own step: its program is in the persistent cache already.
  config = helpers.tiny_config(data_dir)
  mesh = experiment.make_mesh()
  # Built as training builds it, so the donated output matches.
  _, state, step = step_lib.build(config, _steps_per_epoch(config), mesh)
  batch = np.zeros((16, 8, 8, 3), np.uint8)
  with helpers.traces() as traced:
    for _ in range(3):
      state, _ = step(state, experiment.global_batch(batch, mesh),
                      jax.random.key(1))
  assert traced.count('step') == 1, traced


@pytest.mark.usefixtures('fresh_steps')
def test_builds_of_one_config_share_one_jitted_step(data_dir):
  mesh = experiment.make_mesh()
  config = helpers.tiny_config(data_dir)
  step = step_lib.build(config, 10, mesh)[2]
  assert step_lib.build(helpers.tiny_config(data_dir), 10, mesh)[2] is step
  # Settings of the other stages of a run are not the step's.
  assert step_lib.build(helpers.tiny_config(data_dir, seed=5, **{
      'eval.batch_size': 7, 'checkpoint_every_steps': 1,
      'monitor.every_steps': 1}), 10, mesh)[2] is step
  # Read inside the step (the logged steps' Sinkhorn cost).
  assert step_lib.build(helpers.tiny_config(data_dir, log_every_steps=1), 10,
                        mesh)[2] is not step
  assert step_lib.build(config, 20, mesh)[2] is not step


def test_initial_state_is_the_floor_and_compiles_the_init_once(data_dir):
  # BYOL: its targets copy the network.
  config = helpers.tiny_config(data_dir, method='byol')
  run = step_lib.setup(config, steps_per_epoch=10)
  state = step_lib.initial_state(config, run)
  # The state drawn inside one jit, as before the init was shared.
  reference = jax.jit(functools.partial(
      step_lib.init_state, config, run.method, run.model, run.tx))(
          experiment.init_key(config))
  helpers.assert_trees_equal(state, reference)
  # No two leaves share a buffer (a train step donates the state).
  pointers = [x.unsafe_buffer_pointer()
              for x in jax.tree_util.tree_leaves(state)]
  assert len(set(pointers)) == len(pointers)
  with helpers.traces() as traced:
    floor = experiment.initial_variables(config)
  # The floor reuses the init training compiled.
  assert 'init' not in traced, traced
  helpers.assert_trees_equal(floor, {'params': state.params['net'],
                                     'batch_stats': state.batch_stats})


def test_learning_rate_schedule(data_dir):
  config = helpers.tiny_config(data_dir, batch_size=512)
  config.optim.warmup_epochs = 2
  schedule = jax.jit(optim.learning_rate_schedule(
      config, steps_per_epoch=10, total_steps=100))
  peak = config.optim.base_lr * 2
  assert float(schedule(0)) == 0.0
  # optax in float32. The warm-up: the peak (1), the fraction 10 / 20 and
  # its product (3).
  assert float(schedule(10)) == pytest.approx(peak / 2,
                                              rel=helpers.rounding_tol(4))
  # The cosine decay: the peak (1), count / decay steps (2), pi and its
  # product (2, absolute at the argument's scale pi / 2 to pi: k = 3.2 on
  # them), cos (12), the sum, product and halving (3).
  rtol = helpers.rounding_tol(2, k=3.2) + helpers.rounding_tol(1 + 2 + 12 + 3)
  assert float(schedule(20)) == pytest.approx(peak, rel=rtol)
  assert float(schedule(60)) == pytest.approx(peak / 2, rel=rtol)
  # At the end 1 + cos(pi) cancels: the same errors, absolute, on peak / 2.
  assert float(schedule(100)) == pytest.approx(0.0, abs=rtol * peak / 2)


def test_weight_decay_only_on_kernels(data_dir):
  config = helpers.tiny_config(data_dir, **{'ot.learn_alpha': True})
  params = {'net': {'conv': {'kernel': np.ones((3, 3, 1, 1), np.float32),
                             'bias': np.ones((1,), np.float32)}},
            'alpha_logit': np.zeros((), np.float32)}
  tx = optim.create_optimizer(config, optax.constant_schedule(1.0))
  # With lr = 1 and zero gradients only the decayed kernel moves.
  updates = jax.jit(lambda p: tx.update(
      jax.tree_util.tree_map(jnp.zeros_like, p), tx.init(p), p)[0])(params)
  assert float(jnp.abs(updates['net']['conv']['kernel']).sum()) > 0
  assert float(jnp.abs(updates['net']['conv']['bias']).sum()) == 0
  assert float(updates['alpha_logit']) == 0


def test_knn_monitor_is_logged_and_leaves_training_unchanged(
    finished_run, tmp_path, data_dir, caplog):
  monitored = helpers.tiny_config(data_dir, **{
      'monitor.every_steps': 2, 'monitor.num_train': 40,
      'monitor.num_test': 20})
  caplog.set_level('INFO')
  with_monitor = train.train(monitored, str(tmp_path / 'a'),
                             make_monitor=main.make_monitor).state
  lines = [r.getMessage() for r in caplog.records]
  _, plain_workdir, without = finished_run  # no make_monitor: no monitor
  helpers.assert_trees_equal(
      (with_monitor.params, with_monitor.batch_stats),
      (without.params, without.batch_stats))
  records = rundir.read_metrics(str(tmp_path / 'a'))
  assert [r['step'] for r in records] == [2, 4]
  for record in records:
    assert 0.0 <= record[train.MONITOR_METRIC] <= 100.0
  assert all(train.MONITOR_METRIC not in r
             for r in rundir.read_metrics(plain_workdir))
  progress = [l for l in lines if l.startswith('step 4/4')]
  assert len(progress) == 1 and ' kNN ' in progress[0]
  # The line fits a terminal with absl's prefix (main's, ~25 characters).
  assert len(progress[0]) <= 95, progress[0]


def test_bfloat16_trains_and_alpha_is_learned(tmp_path, data_dir):
  config = helpers.tiny_config(
      data_dir, dtype='bfloat16', total_steps=16, log_every_steps=1,
      checkpoint_every_steps=100, **{
          'optim.base_lr': 2.0, 'optim.warmup_epochs': 0.0,
          'ot.learn_alpha': True, 'ot.beta': 1.0})
  state = train.train(config, str(tmp_path)).state
  assert float(state.params['alpha_logit']) != 0.0
  # Parameters and optimiser state stay float32; only activations are bf16.
  assert all(x.dtype == jnp.float32
             for x in jax.tree_util.tree_leaves(state.params))
  losses_ = [r['loss'] for r in rundir.read_metrics(str(tmp_path))]
  assert len(losses_) == 16 and all(np.isfinite(losses_))
  assert np.mean(losses_[-4:]) < np.mean(losses_[:4]) - 0.1


# ----------------------------------------------------------------------------
# Results that cannot be wrong silently (see also tests/test_rundir.py).


def _poison_batch_stats_at(monkeypatch, bad_step):
  """Makes the update that produces step `bad_step` leave inf BatchNorm stats.

  The loss and gradient of that step are still finite (they are computed
  before the update), as when a huge learning rate first blows up the
  running variances.
  """
  real = step_lib.train_step

  def poisoned(state, batch, key, **kwargs):
    new, metrics = real(state, batch, key, **kwargs)
    stats = jax.tree_util.tree_map(
        lambda v: jnp.where(new.step == bad_step, jnp.inf, v), new.batch_stats)
    return new.replace(batch_stats=stats), metrics

  monkeypatch.setattr(step_lib, 'train_step', poisoned)


@pytest.mark.usefixtures('fresh_steps')
def test_non_finite_state_is_never_checkpointed(tmp_path, data_dir,
                                                monkeypatch):
  _poison_batch_stats_at(monkeypatch, 4)
  config = helpers.tiny_config(data_dir, method='simclr')
  workdir = str(tmp_path / 'a')
  with pytest.raises(train.DivergedError,
                     match=r'step 4: non-finite batch_stats.*step 2 in'):
    train.train(config, workdir)
  assert checkpoint.Checkpointer(workdir).all_steps() == [2]
  assert rundir.read_status(workdir)['state'] == 'diverged'
  # A divergence before any checkpoint says so.
  config.checkpoint_every_steps = 100
  workdir = str(tmp_path / 'b')
  with pytest.raises(train.DivergedError,
                     match='step 4: .*No checkpoint was saved yet'):
    train.train(config, workdir)
  assert main.run(config, workdir) == cli.EXIT_DIVERGED
  # Nothing to resume: a retry with other settings starts afresh, with the
  # real step again.
  monkeypatch.undo()
  step_lib.clear_compiled_steps()
  retry = helpers.tiny_config(data_dir, seed=1)
  assert train.train(retry, workdir, stop_after_steps=1).status == 'stopped'
  assert rundir.read_config(workdir)['seed'] == 1


def test_resume_skips_a_non_finite_checkpoint(finished_run, stopped_run,
                                              tmp_path):
  # A poisoned workdir: its newest checkpoint holds inf (a state of the same
  # run's structure, the finished one's, at step 3).
  _, _, state = finished_run
  config, stopped = stopped_run
  workdir = helpers.copy_run(stopped, tmp_path)
  bad = state.replace(step=3, batch_stats=jax.tree_util.tree_map(
      lambda v: np.asarray(v) * np.inf, state.batch_stats))
  ckpt = checkpoint.Checkpointer(workdir)
  ckpt.save(3, bad)
  ckpt.close()
  state = train.train(config, workdir).state
  assert int(state.step) == 4
  assert os.path.isdir(os.path.join(workdir, 'checkpoints_skipped', '3'))


def test_second_trainer_in_a_workdir_is_refused(tmp_path, data_dir):
  workdir = str(tmp_path / 'run')
  holder = subprocess.Popen(
      [sys.executable, '-c', textwrap.dedent(f"""
          import sys, time
          from otclr_jax import rundir
          with rundir.lock({workdir!r}):
            print('held', flush=True)
            time.sleep(120)
          """)], cwd=REPO, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'held'
    config = helpers.tiny_config(data_dir)
    with pytest.raises(cli.WorkdirLockedError,
                       match=f'in use by process {holder.pid}'):
      train.train(config, workdir)
    assert main.run(config, workdir) == cli.EXIT_LOCKED
  finally:
    holder.kill()
    holder.wait()
  assert rundir.read_status(workdir) is None  # the refused run wrote nothing


def test_resume_with_other_settings_is_refused(stopped_run, tmp_path,
                                               data_dir):
  _, stopped = stopped_run
  workdir = helpers.copy_run(stopped, tmp_path)
  assert rundir.read_config(workdir)['method'] == 'otclr'
  assert rundir.read_status(workdir)['state'] == 'stopped'
  other = helpers.tiny_config(data_dir, method='simclr', seed=3)
  with pytest.raises(experiment.ConfigError,
                     match=r"method: 'otclr' -> 'simclr'; seed: 0 -> 3"):
    train.train(other, workdir)
  # Another length too: a lengthened run's files had recorded only the new
  # length, so it passed for a run trained on one schedule.
  for total in (3, 6):
    with pytest.raises(experiment.ConfigError,
                       match=f'4-step run.*asks for {total}'):
      train.train(helpers.tiny_config(data_dir, total_steps=total), workdir)
  # Settings that do not change the result are allowed.
  same = helpers.tiny_config(data_dir, **{'monitor.every_steps': 0,
                                          'eval.batch_size': 7})
  result = train.train(same, workdir, stop_after_steps=1)
  assert int(result.state.step) == 3
  assert rundir.read_config(workdir)['eval']['batch_size'] == 7


def test_truncated_checkpoint_and_torn_metrics_line(finished_run, tmp_path,
                                                    data_dir, caplog):
  config = helpers.tiny_config(data_dir)
  _, straight_workdir, straight = finished_run
  workdir = pathlib.Path(helpers.copy_run(straight_workdir, tmp_path))
  # What a crash mid-write leaves: a checkpoint's data cut short, and a
  # half-written metrics line.
  truncated = helpers.truncate_checkpoint(workdir, 4)
  assert truncated
  with open(workdir / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 5, "lo')
  caplog.set_level('INFO')
  resumed = train.train(config, str(workdir)).state
  messages = [r.getMessage() for r in caplog.records]
  # Which truncated file TensorStore reads first, and so its error's wording,
  # varies between runs: the test checks what the run does about it.
  skipped = [m for m in messages if m.startswith('Skipping checkpoint')]
  assert len(skipped) == 1 and os.path.join('checkpoints', '4') in skipped[0]
  # Checkpoint 4 is set aside with its truncated files, ...
  aside = workdir / 'checkpoints_skipped' / '4'
  assert sorted(os.listdir(workdir / 'checkpoints_skipped')) == ['4']
  aside_data = aside / 'default' / 'ocdbt.process_0' / 'd'
  assert sorted(path.name for path in aside_data.iterdir()) == truncated
  assert all((aside_data / name).stat().st_size == 10 for name in truncated)
  # ... the run resumes from checkpoint 2 and trains on to step 4, where it
  # saves a complete checkpoint 4 and ends where the straight run does.
  assert any(m.startswith('Resumed from step 2 in ') for m in messages)
  assert not any(m.startswith('Resumed from step 4') for m in messages)
  assert any('torn last line 3 of' in m and 'metrics.jsonl' in m
             for m in messages)
  assert int(resumed.step) == 4
  helpers.assert_trees_equal(straight.params, resumed.params)
  steps = [r['step'] for r in rundir.read_metrics(str(workdir))]
  assert steps == [2, 4]
  assert checkpoint.Checkpointer(str(workdir)).all_steps() == [2, 4]
  reader = checkpoint.Checkpointer(str(workdir), read_only=True)
  try:
    restored, step = reader.restore_newest(resumed)
  finally:
    reader.close()
  assert step == 4
  helpers.assert_trees_equal(straight.params, restored.params)


def test_no_checkpoint_that_restores_ends_with_one_line(stopped_run, tmp_path,
                                                        caplog):
  config, stopped = stopped_run
  workdir = pathlib.Path(helpers.copy_run(stopped, tmp_path))
  helpers.truncate_checkpoint(workdir, 2)
  for mode in ('train', 'eval'):
    caplog.clear()
    run_config = config.copy_and_resolve_references()
    run_config.mode = mode
    assert main.run(run_config, str(workdir)) == cli.EXIT_FAILED
    errors = [r.getMessage() for r in caplog.records if r.levelname == 'ERROR']
    assert len(errors) == 1 and '\n' not in errors[0], errors
    assert errors[0].startswith('No checkpoint in ') and 'step 2' in errors[0]
  # Nothing is set aside when no checkpoint restores.
  assert checkpoint.Checkpointer(str(workdir)).all_steps() == [2]
  assert not (workdir / 'checkpoints_skipped').exists()


def test_a_damaged_metrics_file_refuses_the_resume_before_any_write(
    finished_run, tmp_path, data_dir):
  _, straight_workdir, _ = finished_run
  workdir = pathlib.Path(helpers.copy_run(straight_workdir, tmp_path))
  lines = (workdir / 'metrics.jsonl').read_text().splitlines(keepends=True)
  (workdir / 'metrics.jsonl').write_text('{"lo\n' + ''.join(lines[1:]))
  before = {name: (workdir / name).read_bytes()
            for name in ('config.json', 'status.json', 'data.json')}
  assert main.run(helpers.tiny_config(data_dir), str(workdir)) == cli.EXIT_USAGE
  assert {name: (workdir / name).read_bytes() for name in before} == before


@pytest.mark.parametrize('full', ['checkpoint', 'metrics'])
def test_a_full_disk_ends_with_one_line_naming_the_path(
    tmp_path, data_dir, monkeypatch, caplog, full):
  workdir = str(tmp_path / 'run')
  if full == 'checkpoint':  # found before Orbax writes
    usage = checkpoint.shutil.disk_usage
    monkeypatch.setattr(checkpoint.shutil, 'disk_usage',
                        lambda path: usage(path)._replace(free=1000))
    path = f'{workdir}/checkpoints/2'
  else:
    path = os.path.join(workdir, 'metrics.jsonl')

    def write(*_):
      raise OSError(errno.ENOSPC, 'No space left on device', path)

    monkeypatch.setattr(train.MetricLogger, 'write', write)
  caplog.set_level('INFO')
  assert main.run(helpers.tiny_config(data_dir), workdir) == 1
  errors = [r.getMessage() for r in caplog.records if r.levelname == 'ERROR']
  assert len(errors) == 1 and caplog.records[-1].levelname == 'ERROR', errors
  assert errors[0].startswith(
      f'Disk full: could not write {path} (No space left'), errors
  if full == 'checkpoint':
    assert not os.listdir(os.path.join(workdir, 'checkpoints'))
  assert rundir.read_status(workdir)['state'] == 'failed'


def test_sigterm_saves_stops_and_exits_with_the_stopped_status(
    tmp_path, data_dir, monkeypatch):
  _sigterm_after_two_batches(monkeypatch)
  config = helpers.tiny_config(data_dir, checkpoint_every_steps=100)
  assert main.run(config, str(tmp_path)) == cli.EXIT_STOPPED == 75
  assert checkpoint.Checkpointer(str(tmp_path)).latest_step() == 2
  status = rundir.read_status(str(tmp_path))
  assert (status['state'], status['step'], status['total_steps']) == (
      'stopped', 2, 4)


@pytest.mark.parametrize('bad, match', [
    ({'method': 'swav'}, 'method'),
    ({'views': 'mixup'}, 'views'),
    ({'method': 'otclr', 'views': 'augment'}, 'otclr'),
    ({'dtype': 'float16'}, 'dtype'),
    ({'ot.grid_size': 16}, 'grid_size'),
    ({'ot.alpha': 1.5}, 'alpha'),
    ({'optim.name': 'adam'}, 'optim'),
    ({'monitor.every_steps': -1}, 'monitor.every_steps'),
    ({'monitor.every_steps': 3}, 'multiple of config.log_every_steps'),
    ({'monitor.num_train': 0}, 'monitor.num_train'),
    ({'monitor.num_test': 0}, 'monitor.num_test'),
    # The run's method block and the convolution: negative temperatures had
    # trained to exit 0, the rest failed as tracebacks after the lock.
    ({'method': 'moco', 'moco.temperature': -0.2}, 'moco.temperature'),
    ({'method': 'dino', 'dino.student_temp': -0.1}, 'dino.student_temp'),
    ({'method': 'dino', 'dino.num_prototypes': 0}, 'dino.num_prototypes'),
    ({'method': 'byol', 'byol.base_tau': 1.5}, r'byol.base_tau must lie in'),
    ({'method': 'byol', 'byol.max_init_share': 0.0}, 'byol.max_init_share'),
    ({'model.conv_impl': 'bogus'}, 'model.conv_impl'),
    ({'ot.epsilon': 0.0}, 'ot.epsilon must be > 0'),
    ({'ot.epsilon': 1e-5}, r'ot.epsilon=1e-05 is below 0.01145'),
    ({'ot.num_iters': 0}, 'ot.num_iters'),
    ({'ot.grid_size': 1}, 'ot.grid_size'),
    ({'loss.temperature': 0.0}, 'loss.temperature'),
    ({'optim.base_lr': -0.1}, 'optim.base_lr'),
    ({'optim.warmup_epochs': -1.0}, 'optim.warmup_epochs'),
    ({'optim.momentum': 1.0}, 'optim.momentum'),
    ({'optim.weight_decay': -1e-4}, 'optim.weight_decay'),
    ({'eval.batch_size': 0}, 'eval.batch_size'),
    ({'eval.datasets': ()}, 'eval.datasets'),
    ({'batch_size': 1}, 'batch_size'),
    ({'mode': 'evaluate'}, 'mode'),
    ({'model.stage_sizes': (2, 2, 2)}, 'model.stage_sizes must be 4'),
    ({'model.stage_sizes': (1, 0, 1, 1)}, 'model.stage_sizes must be 4'),
    ({'augment.saturation': float('inf')},
     'config.augment.saturation must be finite, got inf'),
    ({'augment.crop_scale': (0.5, float('nan'))},
     r'config.augment.crop_scale must be finite, got \[0.5, nan\]'),
    ({'dino.optim.base_lr': float('nan')}, 'dino.optim.base_lr must be finite'),
])
def test_whole_config_is_checked_before_anything_is_created(
    tmp_path, bad, match, caplog):
  workdir = str(tmp_path / 'run')
  config = helpers.tiny_config(str(tmp_path / 'data'), **bad)
  with pytest.raises(experiment.ConfigError, match=match):
    experiment.validate_config(config)
  with pytest.raises(experiment.ConfigError, match=match):
    evaluate.validate(config)
  helpers.assert_usage_error(caplog, match,
                             lambda: main.run(config, workdir))
  assert not os.path.exists(workdir)
  assert not os.path.exists(tmp_path / 'data')


@pytest.mark.parametrize('name', ['default', 'digits', 'cifar10',
                                  'imagenet300'])
def test_shipped_configs_pass_validation(name):
  experiment.validate_config(config_files.load(os.path.join(REPO, 'configs',
                                                            f'{name}.py')))


def test_a_resume_on_other_data_is_refused(tmp_path, data_dir):
  rng = np.random.default_rng(0)
  root = tmp_path / 'tree'

  def add_class(name, count):
    for i in range(count):
      folder_trees.save_image(str(root), 'train', name, f'{i}.png',
                              rng.integers(0, 256, (8, 8, 3), np.uint8))

  # As many full batches per epoch as the digits of `tiny_config`: the same
  # schedule, so the same compiled step as the tiny run's.
  per_class = -(-16 * _steps_per_epoch(helpers.tiny_config(data_dir)) // 3)
  for name in ('a', 'b', 'c'):
    add_class(name, per_class)
  config = helpers.tiny_config(str(tmp_path / 'data'), dataset=f'folder:{root}',
                               total_steps=4)
  workdir = str(tmp_path / 'run')
  train.train(config, workdir, stop_after_steps=2)
  status = rundir.read_status(workdir)
  add_class('d', per_class)  # the tree grew between a preemption and the resume
  with pytest.raises(experiment.ConfigError,
                     match=rf'other data.*{3 * per_class} -> {4 * per_class} '
                     r'images.*3 -> 4 classes'):
    train.train(config, workdir)
  assert rundir.read_status(workdir) == status
  # Back to the data it was trained on, it resumes.
  shutil.rmtree(root / 'train' / 'd')
  assert train.train(config, workdir).status == 'finished'
