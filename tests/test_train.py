"""End-to-end tests of pretraining on a tiny digits config (CPU)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

from otclr_jax import checkpoint
from otclr_jax import input_pipeline
from otclr_jax import losses
from otclr_jax import train
from tests.tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('data'))


def _params(state):
  return jax.tree_util.tree_leaves(jax.device_get(state.params))


def test_end_to_end_writes_logs_and_checkpoints(tmp_path, data_dir):
  workdir = str(tmp_path)
  state = train.train_and_evaluate(tiny_config(data_dir), workdir)
  assert int(state.step) == 4
  records = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  assert [r['step'] for r in records] == [2, 4]
  for key in ('loss', 'nce', 'sinkhorn', 'top1', 'lr', 'images_per_sec'):
    assert np.isfinite(records[-1][key]), key
  assert 0.0 <= records[-1]['top1'] <= 1.0
  assert checkpoint.Checkpointer(workdir).all_steps() == [2, 4]
  assert os.listdir(os.path.join(workdir, 'tensorboard'))


def test_resume_matches_uninterrupted_run(tmp_path, data_dir):
  config = tiny_config(data_dir)
  straight = train.train_and_evaluate(config, str(tmp_path / 'a'))
  first = train.train_and_evaluate(config, str(tmp_path / 'b'),
                                   stop_after_steps=2)
  assert int(first.step) == 2
  resumed = train.train_and_evaluate(config, str(tmp_path / 'b'))
  assert int(resumed.step) == 4
  for a, b in zip(_params(straight), _params(resumed)):
    np.testing.assert_array_equal(a, b)
  steps = [json.loads(l)['step'] for l in open(tmp_path / 'b' / 'metrics.jsonl')]
  assert steps == [2, 4]


def test_sigterm_saves_and_stops(tmp_path, data_dir, monkeypatch):
  real = input_pipeline.train_batches

  def batches_then_sigterm(*args, **kwargs):
    for i, batch in enumerate(real(*args, **kwargs)):
      if i == 1:
        os.kill(os.getpid(), signal.SIGTERM)
      yield batch

  monkeypatch.setattr(input_pipeline, 'train_batches', batches_then_sigterm)
  config = tiny_config(data_dir, checkpoint_every_steps=100)
  state = train.train_and_evaluate(config, str(tmp_path))
  assert int(state.step) == 2
  assert checkpoint.Checkpointer(str(tmp_path)).latest_step() == 2


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(
    tmp_path, data_dir, monkeypatch):
  config = tiny_config(data_dir, method='simclr')
  train.train_and_evaluate(config, str(tmp_path), stop_after_steps=2)
  real = losses.nt_xent
  monkeypatch.setattr(
      losses, 'nt_xent',
      lambda z1, z2, t: jax.tree_util.tree_map(lambda x: x * jnp.nan,
                                               real(z1, z2, t)))
  with pytest.raises(FloatingPointError, match='at step 3'):
    train.train_and_evaluate(config, str(tmp_path))
  assert checkpoint.Checkpointer(str(tmp_path)).latest_step() == 2


def test_train_step_compiles_once(data_dir):
  config = tiny_config(data_dir, method='simclr')
  model = train.create_model(config)
  schedule = train.learning_rate_schedule(config, 10, 4)
  tx = train.create_optimizer(config, schedule)
  mesh = train.make_mesh()
  # Placed as train_and_evaluate places it, so the donated output matches.
  state = jax.device_put(train.init_state(config, model, tx, jax.random.key(0)),
                         NamedSharding(mesh, P()))
  step = train.jit_train_step(config, model, tx, schedule, mesh)
  batch = np.zeros((16, 8, 8, 3), np.uint8)
  for _ in range(3):
    state, _ = step(state, train.global_batch(batch, mesh), jax.random.key(1))
  assert step._cache_size() == 1


def test_learning_rate_schedule(data_dir):
  config = tiny_config(data_dir, batch_size=512)
  config.optim.warmup_epochs = 2
  schedule = train.learning_rate_schedule(config, steps_per_epoch=10,
                                          total_steps=100)
  peak = config.optim.base_lr * 2
  assert float(schedule(0)) == 0.0
  assert float(schedule(10)) == pytest.approx(peak / 2)
  assert float(schedule(20)) == pytest.approx(peak)
  assert float(schedule(60)) == pytest.approx(peak / 2, rel=1e-5)
  assert float(schedule(100)) == pytest.approx(0.0, abs=1e-7)


def test_weight_decay_only_on_kernels(data_dir):
  config = tiny_config(data_dir, **{'ot.learn_alpha': True})
  params = {'net': {'conv': {'kernel': jnp.ones((3, 3, 1, 1)),
                             'bias': jnp.ones((1,))}},
            'alpha_logit': jnp.zeros(())}
  tx = train.create_optimizer(config, optax.constant_schedule(0.0))
  updates, _ = tx.update(jax.tree_util.tree_map(jnp.zeros_like, params),
                         tx.init(params), params)
  # With lr = 0 nothing moves; with lr = 1 only the decayed kernel would.
  tx1 = train.create_optimizer(config, optax.constant_schedule(1.0))
  updates, _ = tx1.update(jax.tree_util.tree_map(jnp.zeros_like, params),
                          tx1.init(params), params)
  assert float(jnp.abs(updates['net']['conv']['kernel']).sum()) > 0
  assert float(jnp.abs(updates['net']['conv']['bias']).sum()) == 0
  assert float(updates['alpha_logit']) == 0


def test_learned_alpha_moves(tmp_path, data_dir):
  config = tiny_config(data_dir, total_steps=2,
                       **{'ot.learn_alpha': True, 'ot.beta': 1.0})
  state = train.train_and_evaluate(config, str(tmp_path))
  assert float(state.params['alpha_logit']) != 0.0


@pytest.mark.parametrize('bad, match', [
    ({'method': 'byol'}, 'method'),
    ({'dtype': 'float16'}, 'dtype'),
    ({'ot.grid_size': 16}, 'grid_size'),
    ({'ot.alpha': 1.5}, 'alpha'),
    ({'optim.name': 'adam'}, 'optim'),
])
def test_bad_config_is_rejected(data_dir, bad, match):
  with pytest.raises(ValueError, match=match):
    train.validate_config(tiny_config(data_dir, **bad))


def test_four_devices_match_one(tmp_path, data_dir):
  script = textwrap.dedent(f"""
      import jax, numpy as np
      from tests.tiny import tiny_config
      from otclr_jax import input_pipeline, train
      assert jax.device_count() == 4
      config = tiny_config({data_dir!r})
      batch = input_pipeline.load_split('digits', 'train', 8, {data_dir!r}).images[:16]
      model = train.create_model(config)
      schedule = train.learning_rate_schedule(config, 10, 4)
      tx = train.create_optimizer(config, schedule)
      out = []
      for devices in (jax.devices()[:1], jax.devices()):
        mesh = train.make_mesh(devices)
        state = train.init_state(config, model, tx, jax.random.key(0))
        step = train.jit_train_step(config, model, tx, schedule, mesh)
        state, metrics = step(state, train.global_batch(batch, mesh),
                              jax.random.key(1))
        out.append((float(metrics['loss']),
                    jax.tree_util.tree_leaves(jax.device_get(state.params))))
      (loss1, params1), (loss4, params4) = out
      np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
      for a, b in zip(params1, params4):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
      print('OK', loss1, loss4)
      """)
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4',
             JAX_PLATFORMS='cpu')
  result = subprocess.run([sys.executable, '-c', script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'OK' in result.stdout


def test_bfloat16_trains(tmp_path, data_dir):
  config = tiny_config(data_dir, dtype='bfloat16', total_steps=16,
                       log_every_steps=1, checkpoint_every_steps=100,
                       **{'optim.base_lr': 2.0, 'optim.warmup_epochs': 0.0})
  state = train.train_and_evaluate(config, str(tmp_path))
  # Parameters and optimiser state stay float32; only activations are bf16.
  assert all(x.dtype == jnp.float32 for x in _params(state))
  losses_ = [json.loads(l)['loss'] for l in open(tmp_path / 'metrics.jsonl')]
  assert len(losses_) == 16 and all(np.isfinite(losses_))
  assert np.mean(losses_[-4:]) < np.mean(losses_[:4]) - 0.1
