"""Tests of the objectives in otclr_jax/methods: NumPy and closed forms."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from configs import digits
from otclr_jax import experiment
from otclr_jax import optim
from otclr_jax import methods
from otclr_jax import models
from otclr_jax import step as step_lib
from otclr_jax.methods import base
from otclr_jax.methods import byol
from otclr_jax.methods import dino
from otclr_jax.methods import moco
from tests.helpers import EPS64
from tests.helpers import chain
from tests.helpers import network_chain
from tests.helpers import rounding_tol


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


# cosine_momentum's float32 chain: the constants, k / K, the product with pi,
# cos, + 1, the product and the difference from final, which stays near 1.
_TAU = chain(stages=8, funcs=1)


def _shapes(method, config):
  """Shapes only of the variables and extra state: a full-size init would
  cost seconds for nothing."""
  model = method.create_model(config)

  def init():
    variables = model.init({'params': jax.random.key(0)},
                           jnp.zeros((1, 32, 32, 3)), train=False)
    return variables, method.init_extra(config, variables, jax.random.key(1))

  return jax.eval_shape(init)


def _count(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


# Bisection's 60 halvings of [0, 0.99] end within one float64 ulp of the
# starting momentum, which moves log init_share by d log(share) / d base =
# sum_k (cos(pi k / K) + 1) / 2 / tau(k) <= 132 / 0.5 ulps: 264 EPS64. On
# top, init_share's own float64 rounding (as above), relative to
# |log 0.01| = 4.6 (k = 5).
_FITTED_SHARE_RTOL = 264 * EPS64 + rounding_tol(_TAU, 132, funcs=2, k=5,
                                                eps=EPS64)


def _small_config(method):
  config = methods.add_defaults(default.get_config())
  config.method = method
  config.image_size = 8
  config.batch_size = 4
  config.model.stem = 'cifar'
  config.model.stage_sizes = (1, 1, 1, 1)
  config.model.proj_hidden_dim, config.model.proj_dim = 16, 8
  config.byol.proj_hidden_dim, config.byol.proj_dim = 16, 8
  config.byol.pred_hidden_dim = 16
  config.dino.hidden_dim, config.dino.bottleneck_dim = 16, 8
  config.dino.num_prototypes = 12
  config.moco.queue_size = 8
  return config


def _init(config):
  method = methods.get(config.method)
  model = method.create_model(config)
  # Jitted: eagerly, every layer's operations would compile one by one.
  variables = jax.jit(functools.partial(model.init, train=False))(
      {'params': jax.random.key(0)}, jnp.zeros((1, 8, 8, 3)))
  extra = method.init_extra(config, variables, jax.random.key(1))
  if 'target_params' in extra:
    # Targets that differ from the online networks, as after some training.
    extra['target_params'] = jax.jit(functools.partial(
        jax.tree_util.tree_map, lambda x: x * 1.1))(extra['target_params'])
  return method, model, variables, extra


def _views(seed=0):
  v1, v2 = jax.random.uniform(jax.random.key(seed), (2, 4, 8, 8, 3))
  return v1, v2


class TestObjectives:
  """The losses, schedules and updates against NumPy and closed forms."""

  def test_registry_names_and_errors(self):
    assert methods.NAMES == ('simclr', 'moco', 'byol', 'dino')
    for name in methods.NAMES:
      assert methods.get(name).name == name
    with pytest.raises(ValueError, match='config.method'):
      methods.get('swav')

  def test_moco_infonce_matches_numpy(self):
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
    # float32 against float64: normalising, dot products of 5, the sum over
    # 1 + 11 logits, the mean over 6. The loss is 1-Lipschitz in each of the
    # positive logit and the logsumexp, whose arguments reach 1 / t = 5: an
    # absolute scale of 2 x 5.
    np.testing.assert_allclose(
        float(loss), expected, rtol=0,
        atol=rounding_tol(5, 5, 12, 6, stages=6, funcs=2) * 2 / 0.2)
    assert float(top1) == np.mean(pos > neg.max(-1))

  def test_moco_queue_is_fifo_and_wraps(self):
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

  def test_byol_regression_loss_matches_numpy(self):
    rng = np.random.default_rng(1)
    p, z = rng.normal(size=(2, 7, 4))
    # BYOL eq. 2: || p/|p| - z/|z| ||^2, batch mean.
    expected = np.mean(np.sum((_unit(p) - _unit(z)) ** 2, -1))
    # float32 against float64. Each squared distance of unit vectors is at
    # most 4, and squaring doubles a relative error (k = 2).
    np.testing.assert_allclose(
        float(byol.regression_loss(jnp.asarray(p), jnp.asarray(z))), expected,
        rtol=0, atol=rounding_tol(4, 4, 7, stages=6, k=2) * 4)

  def test_dino_loss_and_centre_match_numpy(self):
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
    # float32 against float64. Each score a = (t - c) / tt or s / ts takes 5
    # stages before its exp, absolute errors of up to |a| u: the teacher's
    # probabilities carry twice that as a relative error, the student's
    # log-probabilities as an absolute one. The rest rounds relative to the
    # loss: softmax and log over 6, the cross-entropy's sum, the mean over 4.
    a_t = np.max(np.abs(teacher - centre)) / 0.05
    a_s = np.max(np.abs(student)) / 0.1
    np.testing.assert_allclose(
        float(value), expected,
        rtol=rounding_tol(stages=5, k=2 * a_t)
        + rounding_tol(6, 6, 4, stages=3, funcs=2),
        atol=rounding_tol(stages=5, k=2 * a_s))
    # 0.9 c + 0.1 mean(t), relative to the terms' magnitudes (they may
    # cancel).
    np.testing.assert_allclose(
        np.asarray(dino.update_centre(jnp.asarray(centre), jnp.asarray(teacher),
                                      0.9)),
        0.9 * centre + 0.1 * teacher.mean(0), rtol=0,
        atol=rounding_tol(8, stages=5) * np.max(0.9 * np.abs(centre)
                                       + 0.1 * np.abs(teacher).mean(0)))

  def test_dino_teacher_temperature_warms_up_linearly(self):
    config = ml_collections.ConfigDict({'dino': dino.default_config()})
    config.dino.teacher_temp = 0.07
    config.dino.warmup_teacher_temp_epochs = 2.0
    for step, expected in ((0, 0.04), (5, 0.04 + 0.03 * 5 / 20), (20, 0.07),
                           (100, 0.07)):
      temp = dino.teacher_temperature(
          config, base.Progress(jnp.int32(step), 200, 10))
      np.testing.assert_allclose(float(temp), expected,
                                 rtol=rounding_tol(stages=5))
    config.dino.warmup_teacher_temp_epochs = 0.0
    assert float(dino.teacher_temperature(
        config, base.Progress(jnp.int32(0), 200, 10))) == pytest.approx(
            0.07, rel=rounding_tol(stages=1))  # float32(0.07)

  def test_cosine_momentum_closed_form(self):
    rtol = rounding_tol(_TAU)
    for k in (0, 1, 37, 50, 99, 100):
      expected = 1.0 - (1.0 - 0.99) * (math.cos(math.pi * k / 100) + 1) / 2
      np.testing.assert_allclose(
          float(base.cosine_momentum(k, 100, 0.99, 1.0)), expected, rtol=rtol)
    assert float(base.cosine_momentum(0, 100, 0.99, 0.999)) == pytest.approx(
        0.99, rel=rtol)
    assert float(base.cosine_momentum(100, 100, 0.99, 0.999)) == pytest.approx(
        0.999, rel=rtol)

  def test_ema_closed_form(self):
    target = {'w': jnp.asarray([1.0, -2.0])}
    online = {'w': jnp.asarray([3.0, 5.0])}
    for _ in range(7):
      target = base.ema(target, online, 0.9)
    # Constant online weights: t_n = tau^n t_0 + (1 - tau^n) o.
    expected = 0.9 ** 7 * np.array([1.0, -2.0]) + (1 - 0.9 ** 7) * np.array(
        [3.0, 5.0])
    # float32: tau and 1 - tau, then per update a product and a sum, on terms
    # of at most |online| = 5 (the target crosses 0 from -2 to 5).
    np.testing.assert_allclose(np.asarray(target['w']), expected, rtol=0,
                               atol=rounding_tol(stages=2 + 2 * 7) * 5)


class TestNetworks:
  """Parameter counts, settings and titles."""

  def test_moco_parameter_count_is_the_papers(self):
    config = methods.add_defaults(default.get_config())
    config.method = 'moco'
    variables, extra = _shapes(methods.get('moco'), config)
    online, target = _count(variables['params']), _count(extra['target_params'])
    # The paper's complexity table: 23.01M pretraining, 11.18M at evaluation.
    assert online + target == 23_010_688
    assert _count(variables['params']['encoder']) == 11_176_512
    assert extra['queue'].shape == (2, 32768, 128)

  def test_byol_and_dino_targets_mirror_the_online_networks(self):
    config = methods.add_defaults(default.get_config())
    variables, extra = _shapes(methods.get('byol'), config)
    # BYOL's own widths by default: 512 -> 4096 (no bias) + BN -> 256, then the
    # predictor 256 -> 4096 + BN -> 256.
    assert _count(variables['params']['head']) == (
        512 * 4096 + 2 * 4096 + 4096 * 256 + 256)
    assert _count(variables['params']['predictor']) == (
        256 * 4096 + 2 * 4096 + 4096 * 256 + 256)
    config.byol.proj_hidden_dim, config.byol.proj_dim = 512, 128
    config.byol.pred_hidden_dim = 512
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

  def test_dino_head_normalises_prototypes(self):
    head = dino.DINOHead(hidden_dim=8, bottleneck_dim=4, num_prototypes=5)
    h = jax.random.normal(jax.random.key(0), (3, 6))
    variables = head.init(jax.random.key(1), h)
    scaled = jax.tree_util.tree_map(lambda x: x, variables)
    scaled['params']['prototypes'] = 7.0 * variables['params']['prototypes']
    _, logits = head.apply(variables, h)
    _, logits_scaled = head.apply(scaled, h)
    # Weight-normalised with the norm fixed to 1: scores are cosines, invariant
    # to the scale of the prototypes. One program on two inputs: the unit
    # prototypes differ by the rounding of 7 v and their normalising, the
    # cosines by a dot product of 4, in units of 1.
    cosine_tol = rounding_tol(4, 4, stages=3, funcs=1)
    np.testing.assert_allclose(np.asarray(logits_scaled), np.asarray(logits),
                               rtol=0, atol=cosine_tol)
    assert float(jnp.max(jnp.abs(logits))) <= 1.0 + cosine_tol

  @pytest.mark.parametrize('field, value, match', [
      ('moco.queue_size', 8, 'queue_size'),
      ('byol.base_tau', 1.5, 'base_tau'),
      ('dino.max_init_share', 0.0, 'max_init_share'),
  ])
  def test_bad_method_settings_are_rejected(self, field, value, match):
    # Checked with the config, before anything is created (not at init).
    config = default.get_config()
    block, name = field.split('.')
    config.method = block
    config[block][name] = value
    with pytest.raises(experiment.ConfigError, match=match):
      experiment.validate_config(config)

  def test_titles_name_rows_like_the_paper(self):
    assert methods.title('simclr', 'augment') == 'SimCLR'
    assert methods.title('simclr', 'ot') == 'OTCLR'
    assert methods.title('otclr', '') == 'OTCLR'
    assert methods.title('moco', 'augment') == 'MoCo'
    assert methods.title('moco', 'ot') == 'MoCo + OT views'
    assert methods.title('dino', 'ot') == 'DINO + OT views'


class TestHorizons:
  """Target horizons: how much of its initialisation a target keeps."""

  def test_init_share_is_the_product_of_the_momenta(self):
    # Constant momentum: tau^K. float64: each tau's chain, its log, their sum
    # over 132 and exp, relative to 132 |log 0.99| = 1.33 (k = 2).
    assert base.init_share(0.99, 0.99, 132) == pytest.approx(
        0.99 ** 132, rel=rounding_tol(_TAU, 132, funcs=2, k=2, eps=EPS64))
    taus = [float(base.cosine_momentum(k, 50, 0.9, 1.0)) for k in range(50)]
    # The product of 50 float32 taus, each with its chain.
    assert base.init_share(0.9, 1.0, 50) == pytest.approx(
        np.prod(taus), rel=rounding_tol(50 * _TAU))

  def test_horizon_lowers_the_momentum_of_short_runs_only(self):
    # 132 steps (digits, 12 epochs at batch 128): BYOL's 0.99 leaves half the
    # initialisation; the fitted start leaves exactly the allowed share.
    assert base.init_share(0.99, 1.0, 132) > 0.5
    start = base.horizon_base_tau(0.99, 1.0, 132, 0.01)
    assert start < 0.99
    assert base.init_share(start, 1.0, 132) == pytest.approx(
        0.01, rel=_FITTED_SHARE_RTOL)
    # The paper's 20 epochs of ImageNet-300 at batch 256 keep the configured
    # momenta: 0.99 for MoCo, DINO's 0.9995.
    steps = 20 * 300_000 // 256
    assert base.horizon_base_tau(0.99, 0.999, steps, 0.01) == 0.99
    assert base.horizon_base_tau(0.9995, 1.0, steps, 0.01) == 0.9995
    # max_init_share = 1 keeps any momentum.
    assert base.horizon_base_tau(0.99, 1.0, 132, 1.0) == 0.99

  def test_digits_byol_and_dino_keep_their_momentum(self):
    # configs/digits.py: BYOL's and DINO's targets keep 0.99 over the 132
    # steps, both train at base_lr 0.1, DINO's teacher is sharpened at 0.02
    # and centred on the last batch alone (docs/methods.md, "BYOL and DINO on
    # digits"); MoCo's momentum stays fitted to the run.
    config = digits.get_config()
    assert base.schedule_base_tau(config.byol, 132) == 0.99
    assert base.schedule_base_tau(config.moco, 132) < 0.94
    assert base.schedule_base_tau(config.dino, 132) == 0.99
    assert (config.dino.teacher_temp,
            config.dino.centre_momentum) == (0.02, 0.0)
    config.method = 'dino'
    progress = base.Progress(jnp.int32(0), 132, 11)
    assert float(dino.teacher_temperature(config, progress)) == pytest.approx(
        0.02, rel=rounding_tol(stages=5))
    for method, base_lr in (('byol', 0.1), ('dino', 0.1), ('moco', 0.3)):
      config.method = method
      assert optim.optim_settings(config).base_lr == base_lr
    assert optim.optim_settings(config) is config.optim

  def test_post_update_follows_the_fitted_schedule(self):
    config = methods.add_defaults(default.get_config())
    target = {'w': jnp.zeros(())}
    online = {'w': jnp.ones(())}
    extra = {'target_params': target}
    for k in range(20):
      extra = base.ema_targets('byol')(
          config, extra, online, {}, base.Progress(jnp.int32(k), 20, 5))
    # Target 0, online 1: the target holds 1 - (share of its init).
    np.testing.assert_allclose(float(extra['target_params']['w']), 1 - 0.01,
                               rtol=1e-4)

  def test_a_target_that_keeps_its_initialisation_is_warned_about(
      self, monkeypatch):
    config = methods.add_defaults(default.get_config())
    warnings = []
    monkeypatch.setattr(base.logging, 'warning',
                        lambda *args: warnings.append(args[0] % args[1:]))
    assert base.report_horizon('byol', config.byol, 132) == pytest.approx(
        0.01, rel=_FITTED_SHARE_RTOL)
    assert not warnings
    config.byol.max_init_share = 1.0
    share = base.report_horizon('byol', config.byol, 132)
    # max_init_share 1 keeps base_tau 0.99: the same float64 computation.
    assert share == base.init_share(0.99, 1.0, 132)
    assert len(warnings) == 1 and '51%' in warnings[0]
    assert 'config.byol.max_init_share' in warnings[0]
    # A long run at the same momenta: nothing to warn about.
    warnings.clear()
    base.report_horizon('byol', config.byol, 100_000)
    assert not warnings


class TestSteps:
  """BatchNorm batches, frozen prototypes and embeddings in a step."""

  def test_byol_normalises_each_view_on_its_own(self):
    config = _small_config('byol')
    method, model, variables, extra = _init(config)
    v1, v2 = _views()
    progress = base.Progress(jnp.int32(0), 10, 5)
    value = jax.jit(lambda params: method.loss(
        config, model, params, variables['batch_stats'], extra, v1, v2,
        progress)[0])(variables['params'])
    # Reference: every network run on one view batch at a time.
    online, target = (jax.jit(functools.partial(
        net.apply, train=True, mutable=['batch_stats']))
                       for net in (model, byol.target_model(config)))
    run = lambda apply, params, stats, v: apply(
        {'params': params, 'batch_stats': stats}, v)[0]
    p = [run(online, variables['params'], variables['batch_stats'], v)[2]
         for v in (v1, v2)]
    z = [run(target, extra['target_params'], extra['target_batch_stats'], v)[1]
         for v in (v1, v2)]
    pairs = [(_unit(np.asarray(a)), _unit(np.asarray(b)))
             for a, b in ((p[0], z[1]), (p[1], z[0]))]
    expected = sum(np.mean(np.sum((a - b) ** 2, -1)) for a, b in pairs)
    # Two programs (both views in one jitted loss against one network run per
    # view) of one float32 computation: the network at batch 4, normalising 8
    # entries, the squared difference's sum, the batch mean. Growth: squaring
    # doubles a relative error, and the difference of two unit vectors
    # amplifies their errors by 2 / |p - z|.
    n = chain(network_chain(model, v1.shape, train=True), 8, 8, 4, stages=6)
    k = 2 * 2 / min(np.min(np.linalg.norm(a - b, axis=-1)) for a, b in pairs)
    rtol = rounding_tol(n, k=k)
    np.testing.assert_allclose(float(value), expected, rtol=rtol)
    # One BatchNorm batch for both views would give another value.
    both = jnp.concatenate([v1, v2])
    pj = np.asarray(run(online, variables['params'], variables['batch_stats'],
                        both)[2])
    zj = np.asarray(run(target, extra['target_params'],
                        extra['target_batch_stats'], both)[1])
    joint = sum(np.mean(np.sum((_unit(a) - _unit(b)) ** 2, -1))
                for a, b in ((pj[:4], zj[4:]), (pj[4:], zj[:4])))
    assert abs(joint - expected) > 10 * rtol * abs(expected), (joint, expected)

  def test_moco_key_encoder_statistics_never_see_the_query_batch(self):
    config = _small_config('moco')
    method, model, variables, extra = _init(config)
    v1, v2 = _views()
    progress = base.Progress(jnp.int32(0), 10, 5)

    # The network's state is an argument, not a constant baked into the program.
    @jax.jit
    def run(variables, extra, v1, v2):
      _, _, _, new_extra = method.loss(config, model, variables['params'],
                                       variables['batch_stats'], extra, v1, v2,
                                       progress)
      # Enqueued this step at slots 0-3: k1 in queue 0, k2 in queue 1.
      return new_extra['queue'][0, :4], new_extra['queue'][1, :4]

    keys = lambda v1, v2: run(variables, extra, v1, v2)
    k1, k2 = map(np.asarray, keys(v1, v2))
    other = jax.random.uniform(jax.random.key(5), v1.shape)
    # k2 is the positive of q1 = query(v1): another view-1 batch must leave it
    # unchanged, BatchNorm statistics included (and k1 likewise for v2).
    k1_new, k2_same = map(np.asarray, keys(other, v2))
    np.testing.assert_array_equal(k2_same, k2)
    assert np.max(np.abs(k1_new - k1)) > 1e-3
    k1_same, k2_new = map(np.asarray, keys(v1, other))
    np.testing.assert_array_equal(k1_same, k1)
    assert np.max(np.abs(k2_new - k2)) > 1e-3

  def test_dino_freezes_the_prototypes_for_the_first_epoch(self):
    config = _small_config('dino')
    assert config.dino.freeze_last_layer == 1.0
    method, model, variables, extra = _init(config)
    v1, v2 = _views()

    def loss(params, step):
      return method.loss(config, model, params, variables['batch_stats'], extra,
                         v1, v2, base.Progress(step, 20, 5))[0]

    # Jitted with the step traced, as in training (and one compilation instead
    # of four eager backward passes).
    grads = jax.jit(jax.grad(loss))
    for step, frozen in ((0, True), (4, True), (5, False), (12, False)):
      g = grads(variables['params'], jnp.int32(step))
      norm = float(jnp.linalg.norm(g['head']['prototypes']))
      assert (norm == 0.0) == frozen, (step, norm)
      assert float(jnp.linalg.norm(g['head']['hidden1']['kernel'])) > 0
    # The loss itself does not change while the prototypes are frozen.
    values = [jax.jit(loss)(variables['params'], jnp.int32(s)) for s in (0, 5)]
    assert float(values[0]) == float(values[1])

  @pytest.mark.parametrize('name, head_bn', [
      ('simclr', False), ('moco', False), ('byol', False), ('dino', False),
      ('dino', True)])
  def test_each_method_embeds_features_as_its_network(self, name, head_bn):
    config = _small_config(name)
    config.dino.use_bn_in_head = head_bn
    method, model, variables, _ = _init(config)
    assert methods.for_model(model).embed is method.embed
    x = jax.random.uniform(jax.random.key(3), (5, 8, 8, 3))
    if head_bn:
      assert set(variables['batch_stats']['head']) == {'hidden1_bn',
                                                       'hidden2_bn'}
      # Running averages that differ from the initial ones, so that an
      # embedding read without them would differ.
      _, updates = model.apply(variables, x, train=True,
                               mutable=['batch_stats'])
      variables = dict(variables, batch_stats=updates['batch_stats'])
    h, z = model.apply(variables, x, train=False)[:2]
    # Both run the head's modules eagerly, primitive by primitive, on the same
    # h and parameters: the same computation, bit for bit.
    np.testing.assert_array_equal(
        np.asarray(method.embed(model, variables, h)), np.asarray(z))

  def test_dino_head_batchnorm_keeps_a_common_offset_out_of_the_scores(self):
    # Features far from 0 along one shared direction (as a trained ResNet's
    # non-negative pooled features can be): without BatchNorm the bottleneck
    # points the same way for every input and the scores barely depend on it;
    # BatchNorm in the head removes the offset.
    key1, key2 = jax.random.split(jax.random.key(0))
    h = 100.0 + jax.random.normal(key1, (64, 32))
    spread = {}
    for use_bn in (False, True):
      head = dino.DINOHead(hidden_dim=64, bottleneck_dim=16, num_prototypes=32,
                           use_bn=use_bn)
      variables = head.init(key2, h)
      (y, logits), _ = head.apply(variables, h, train=True,
                                  mutable=['batch_stats'])
      u = np.asarray(y) / np.linalg.norm(np.asarray(y), axis=1, keepdims=True)
      spread[use_bn] = (float(np.mean(u @ u.T)),
                        float(np.mean(np.std(np.asarray(logits), axis=0))))
    assert spread[False][0] > 0.99, spread
    assert spread[True][0] < 0.5, spread
    assert spread[True][1] > 10 * spread[False][1], spread

  def test_for_model_names_the_method_of_a_network(self):
    assert methods.for_model(models.SimCLRNet()).name == 'simclr'
    assert methods.for_model(byol.BYOLNet()).name == 'byol'
    assert methods.for_model(dino.DINONet()).name == 'dino'
    with pytest.raises(ValueError, match='No method'):
      methods.for_model(models.ResNet())

  def test_setup_logs_the_horizon_of_ema_methods(self, monkeypatch):
    reports = []
    monkeypatch.setattr(
        base, 'report_horizon',
        lambda name, block, steps: reports.append((name, steps)))
    for name in ('simclr', 'byol'):
      config = _small_config(name)
      step_lib.setup(config, 11)
    assert reports == [('byol', 11 * config.num_epochs)]
