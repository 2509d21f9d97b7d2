"""Tests of the objectives in otclr_jax/methods against NumPy and closed forms."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from otclr_jax import methods
from otclr_jax import models
from otclr_jax.methods import base
from otclr_jax.methods import byol
from otclr_jax.methods import dino
from otclr_jax.methods import moco


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _logsumexp(x, axis):
  m = np.max(x, axis=axis, keepdims=True)
  return np.squeeze(m, axis) + np.log(np.sum(np.exp(x - m), axis=axis))


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_registry_names_and_errors():
  assert methods.NAMES == ('simclr', 'moco', 'byol', 'dino')
  for name in methods.NAMES:
    assert methods.get(name).name == name
  with pytest.raises(ValueError, match='config.method'):
    methods.get('swav')


def test_moco_infonce_matches_numpy():
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, 6, 5))
  queue = _unit(rng.normal(size=(11, 5)))
  loss, top1 = moco.infonce(jnp.asarray(q), jnp.asarray(k),
                            jnp.asarray(queue), 0.2)
  qn, kn = _unit(q), _unit(k)
  # MoCo eq. 1: -log exp(q.k+/t) / (exp(q.k+/t) + sum_j exp(q.k_j/t)).
  pos = np.sum(qn * kn, -1) / 0.2
  neg = qn @ queue.T / 0.2
  expected = np.mean(-pos + np.log(np.exp(pos) + np.exp(neg).sum(-1)))
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
  assert float(top1) == np.mean(pos > neg.max(-1))


def test_moco_queue_is_fifo_and_wraps():
  queue = jnp.zeros((5, 1))
  ptr = jnp.int32(0)
  seen = []
  for i in range(4):
    keys = jnp.asarray([[10. * i + 1], [10. * i + 2]])
    seen += [10 * i + 1, 10 * i + 2]
    queue, ptr = moco.enqueue(queue, ptr, keys)
    assert int(ptr) == (2 * (i + 1)) % 5
  # 8 keys through a 5-slot queue: slots hold the last 5, the pointer at the
  # oldest (slot 3 holds key 4 of 8, ...).
  np.testing.assert_array_equal(np.asarray(queue[:, 0]),
                                [seen[5], seen[6], seen[7], seen[3], seen[4]])
  oldest_first = np.roll(np.asarray(queue[:, 0]), -int(ptr))
  np.testing.assert_array_equal(oldest_first, seen[-5:])
  with pytest.raises(ValueError, match='queue_size'):
    moco.enqueue(jnp.zeros((2, 1)), ptr, jnp.zeros((3, 1)))


def test_byol_regression_loss_matches_numpy():
  rng = np.random.default_rng(1)
  p, z = rng.normal(size=(2, 7, 4))
  # BYOL eq. 2: || p/|p| - z/|z| ||^2, batch mean.
  expected = np.mean(np.sum((_unit(p) - _unit(z)) ** 2, -1))
  np.testing.assert_allclose(
      float(byol.regression_loss(jnp.asarray(p), jnp.asarray(z))), expected,
      rtol=1e-5)


def test_dino_loss_and_centre_match_numpy():
  rng = np.random.default_rng(2)
  student, teacher = rng.normal(size=(2, 8, 6))
  centre = rng.normal(size=6) * 0.1
  value = dino.dino_loss(jnp.asarray(student), jnp.asarray(teacher),
                         jnp.asarray(centre), 0.1, 0.05)
  # DINO Algorithm 1: H(t, s) = -sum softmax((t - c) / tt) log softmax(s / ts)
  # for the pairs (teacher view 2, student view 1) and (1, 2), halved.
  p_t = _softmax((teacher - centre) / 0.05)
  log_p_s = np.log(_softmax(student / 0.1))
  h = lambda t, s: np.mean(-np.sum(t * s, -1))
  expected = (h(p_t[4:], log_p_s[:4]) + h(p_t[:4], log_p_s[4:])) / 2
  np.testing.assert_allclose(float(value), expected, rtol=1e-5)
  np.testing.assert_allclose(
      np.asarray(dino.update_centre(jnp.asarray(centre), jnp.asarray(teacher),
                                    0.9)),
      0.9 * centre + 0.1 * teacher.mean(0), rtol=1e-6)


def test_dino_teacher_temperature_warms_up_linearly():
  config = ml_collections.ConfigDict({'dino': dino.default_config()})
  config.dino.warmup_teacher_temp_epochs = 2.0
  for step, expected in ((0, 0.04), (5, 0.04 + 0.03 * 5 / 20), (20, 0.07),
                         (100, 0.07)):
    temp = dino.teacher_temperature(
        config, base.Progress(jnp.int32(step), 200, 10))
    np.testing.assert_allclose(float(temp), expected, rtol=1e-6)
  config.dino.warmup_teacher_temp_epochs = 0.0
  assert float(dino.teacher_temperature(
      config, base.Progress(jnp.int32(0), 200, 10))) == pytest.approx(0.07)


def test_cosine_momentum_closed_form():
  for k in (0, 1, 37, 50, 99, 100):
    expected = 1.0 - (1.0 - 0.99) * (math.cos(math.pi * k / 100) + 1) / 2
    np.testing.assert_allclose(
        float(base.cosine_momentum(k, 100, 0.99, 1.0)), expected, rtol=1e-6)
  assert float(base.cosine_momentum(0, 100, 0.99, 0.999)) == pytest.approx(
      0.99)
  assert float(base.cosine_momentum(100, 100, 0.99, 0.999)) == pytest.approx(
      0.999)


def test_ema_closed_form():
  target = {'w': jnp.asarray([1.0, -2.0])}
  online = {'w': jnp.asarray([3.0, 5.0])}
  for _ in range(7):
    target = base.ema(target, online, 0.9)
  # Constant online weights: t_n = tau^n t_0 + (1 - tau^n) o.
  expected = 0.9 ** 7 * np.array([1.0, -2.0]) + (1 - 0.9 ** 7) * np.array(
      [3.0, 5.0])
  np.testing.assert_allclose(np.asarray(target['w']), expected, rtol=1e-6)


def _shapes(method, config):
  model = method.create_model(config)

  def init():
    variables = model.init({'params': jax.random.key(0)},
                           jnp.zeros((1, 32, 32, 3)), train=False)
    return variables, method.init_extra(config, variables, jax.random.key(1))

  # Shapes only: a full-size init would cost seconds for nothing.
  return jax.eval_shape(init)


def _count(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


def test_moco_parameter_count_is_the_papers():
  config = methods.add_defaults(default.get_config())
  config.method = 'moco'
  variables, extra = _shapes(methods.get('moco'), config)
  online, target = _count(variables['params']), _count(extra['target_params'])
  # The paper's complexity table: 23.01M pretraining, 11.18M at evaluation.
  assert online + target == 23_010_688
  assert _count(variables['params']['encoder']) == 11_176_512
  assert extra['queue'].shape == (2, 32768, 128)


def test_byol_and_dino_targets_mirror_the_online_networks():
  config = methods.add_defaults(default.get_config())
  variables, extra = _shapes(methods.get('byol'), config)
  assert set(variables['params']) == {'encoder', 'head', 'predictor'}
  assert (jax.tree_util.tree_structure(extra['target_params'])
          == jax.tree_util.tree_structure(
              {k: variables['params'][k] for k in ('encoder', 'head')}))
  # Predictor 128 -> 512 (no bias) + BatchNorm 2 x 512 + 512 -> 128 + bias.
  assert _count(variables['params']['predictor']) == (
      128 * 512 + 2 * 512 + 512 * 128 + 128)
  variables, extra = _shapes(methods.get('dino'), config)
  assert _count(extra['target_params']) == _count(variables['params'])
  # DINO head 512-2048-2048-256 with biases, then 256 x 4096 prototypes.
  assert _count(variables['params']['head']) == (
      512 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 256 + 256 + 256 * 4096)
  assert extra['centre'].shape == (4096,)


def test_dino_head_normalises_prototypes():
  head = models.DINOHead(hidden_dim=8, bottleneck_dim=4, num_prototypes=5)
  h = jax.random.normal(jax.random.key(0), (3, 6))
  variables = head.init(jax.random.key(1), h)
  scaled = jax.tree_util.tree_map(lambda x: x, variables)
  scaled['params']['prototypes'] = 7.0 * variables['params']['prototypes']
  _, logits = head.apply(variables, h)
  _, logits_scaled = head.apply(scaled, h)
  # Weight-normalised with the norm fixed to 1: scores are cosines, invariant
  # to the scale of the prototype vectors.
  np.testing.assert_allclose(np.asarray(logits_scaled), np.asarray(logits),
                             rtol=1e-5, atol=1e-6)
  assert float(jnp.max(jnp.abs(logits))) <= 1.0 + 1e-6


@pytest.mark.parametrize('field, value, match', [
    ('moco.queue_size', 8, 'queue_size'),
    ('byol.base_tau', 1.5, 'base_tau'),
])
def test_bad_method_settings_are_rejected(field, value, match):
  config = methods.add_defaults(default.get_config())
  block, name = field.split('.')
  config[block][name] = value
  method = methods.get(block)
  variables = {'params': {'encoder': {}, 'head': {}, 'predictor': {}},
               'batch_stats': {'encoder': {}, 'head': {}, 'predictor': {}}}
  with pytest.raises(ValueError, match=match):
    method.init_extra(config, variables, jax.random.key(0))


def test_titles_name_rows_like_the_paper():
  assert methods.title('simclr', 'augment') == 'SimCLR'
  assert methods.title('simclr', 'ot') == 'OTCLR'
  assert methods.title('otclr', '') == 'OTCLR'
  assert methods.title('moco', 'augment') == 'MoCo'
  assert methods.title('moco', 'ot') == 'MoCo + OT views'
  assert methods.title('dino', 'ot') == 'DINO + OT views'
