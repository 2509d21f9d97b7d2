"""The optimisers of otclr_jax/optim.py against NumPy re-implementations."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from otclr_jax import experiment
from otclr_jax import optim
from tests.helpers import chain
from tests.helpers import rounding_tol


def _solo_learn_lars(params, grads_per_step, lrs, momentum, weight_decay, eta,
                     clip_lr, eps=1e-8):
  """solo-learn's LARS step (solo/utils/lars.py, exclude_bias_n_norm=True).

  Written from its update equations, one parameter at a time, in float64.

  Returns:
    The parameters after the steps, and per parameter the largest magnitude
    a parameter or a step lr * buf took (the scale of the update's terms).
  """
  params = {k: np.asarray(v, np.float64) for k, v in params.items()}
  scales = {k: float(np.max(np.abs(v))) for k, v in params.items()}
  bufs = {}
  for grads, lr in zip(grads_per_step, lrs):
    for name, p in params.items():
      d_p = np.asarray(grads[name], np.float64)
      p_norm, g_norm = np.linalg.norm(p), np.linalg.norm(d_p)
      if p.ndim != 1:
        if p_norm != 0 and g_norm != 0:
          lars_lr = eta * p_norm / (g_norm + p_norm * weight_decay + eps)
          if clip_lr:
            lars_lr = min(lars_lr / lr, 1.0) if lr > 0 else 1.0
          d_p = (d_p + weight_decay * p) * lars_lr
      # The first step's buffer is a copy of d_p; then mu * buf + d_p.
      bufs[name] = d_p.copy() if name not in bufs else (
          momentum * bufs[name] + d_p)
      params[name] = p - lr * bufs[name]
      scales[name] = max(scales[name], float(np.max(np.abs(params[name]))),
                         float(np.max(np.abs(lr * bufs[name]))))
  return params, scales


class TestLARS:
  """LARS and per-parameter clipping against NumPy re-implementations."""

  @pytest.mark.parametrize('clip_lr', [True, False])
  def test_lars_matches_solo_learn_update(self, clip_lr):
    rng = np.random.default_rng(0)
    # A kernel, a bias, a BatchNorm scale and a kernel with no gradient
    # (frozen prototypes).
    params = {'kernel': rng.normal(size=(4, 3)),
              'conv': rng.normal(size=(3, 3, 2, 4)),
              'bias': rng.normal(size=(3,)),
              'scale': 1.0 + 0.1 * rng.normal(size=(3,)),
              'frozen': rng.normal(size=(3, 2))}
    steps = 5
    grads = []
    for k in range(steps):
      g = {name: rng.normal(size=np.shape(p)) * 10.0 ** (k - 2)
           for name, p in params.items()}
      g['frozen'] = np.zeros((3, 2))
      grads.append(g)
    # Warm-up from 0 (the first step divides by lr = 0 under clip_lr), then a
    # cosine: large and small rates both appear.
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1.5, 2, steps + 1)
    lrs = [float(schedule(k)) for k in range(steps)]
    momentum, weight_decay, eta = 0.9, 1e-2, 0.02
    expected, scales = _solo_learn_lars(params, grads, lrs, momentum,
                                        weight_decay, eta, clip_lr)

    tx = optim.lars(schedule, momentum=momentum, weight_decay=weight_decay,
                         eta=eta, clip_lr=clip_lr)
    p = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    state = tx.init(p)
    for g in grads:
      updates, state = tx.update(
          {k: jnp.asarray(v, jnp.float32) for k, v in g.items()}, state, p)
      p = optax.apply_updates(p, updates)
    # float32 against float64 from the unrounded values. Per step: rounding
    # the gradient, the two norms over at most `size` entries and their
    # square roots, the ratio (the constants, products, sums, a division) and
    # its clip, the direction, the momentum buffer, the step and update; five
    # steps and rounding the parameters, on terms of the largest parameter or
    # step (the update subtracts them).
    size = max(np.size(p) for p in params.values())
    n = chain(*[chain(size, size, stages=17)] * steps, stages=1)
    for name in params:
      np.testing.assert_allclose(np.asarray(p[name]), expected[name], rtol=0,
                                 atol=rounding_tol(n) * scales[name],
                                 err_msg=name)
    # A zero gradient leaves the parameter as it was: no decay, no step. Only
    # its rounding to float32 remains.
    np.testing.assert_allclose(np.asarray(p['frozen']), params['frozen'],
                               rtol=rounding_tol(stages=1))

  def test_lars_treats_a_scalar_as_a_bias(self):
    # solo-learn has no scalar parameters; the OT interpolation logit is one,
    # and like biases it is neither adapted nor decayed: plain momentum SGD.
    tx = optim.lars(optax.constant_schedule(0.1), momentum=0.9,
                         weight_decay=0.5, eta=0.02, clip_lr=True)
    p = {'alpha_logit': jnp.float32(0.7)}
    state = tx.init(p)
    for g, expected in ((2.0, -0.1 * 2.0), (1.0, -0.1 * (0.9 * 2.0 + 1.0))):
      updates, state = tx.update({'alpha_logit': jnp.float32(g)}, state, p)
      # The rate and momentum constants, then per update the buffer's product
      # and sum and the step's product.
      assert float(updates['alpha_logit']) == pytest.approx(
          expected, rel=rounding_tol(stages=2 + 2 * 3))

  def test_lars_clip_lr_caps_the_adapted_rate_at_the_global_one(self):
    # |p| = 1, |g| = 1e-4: eta |p| / |g| = 200 >> 1, so with clip_lr the step is
    # lr * g, without it lr * 200 * g.
    p = {'w': jnp.asarray([[1.0, 0.0]])}
    g = {'w': jnp.asarray([[1e-4, 0.0]])}
    for clip_lr, factor in ((True, 1.0), (False, 0.02 / (1e-4 + 1e-8))):
      tx = optim.lars(optax.constant_schedule(0.5), momentum=0.9,
                           weight_decay=0.0, eta=0.02, clip_lr=clip_lr)
      updates, _ = tx.update(g, tx.init(p), p)
      # The ratio: |g| (the squares' sum of 2 and sqrt; |p| = 1 exactly),
      # + eps and its constant, eta, the product and the division, then the
      # direction's product (clipped, the ratio is exactly 1).
      np.testing.assert_allclose(np.asarray(updates['w']),
                                 -0.5 * factor * np.asarray(g['w']),
                                 rtol=rounding_tol(2, stages=8))

  def test_per_parameter_clipping_is_dinos(self):
    rng = np.random.default_rng(1)
    grads = {'a': rng.normal(size=(5, 4)) * 3, 'b': rng.normal(size=(3,)) * 0.1}
    tx = optim.clip_per_parameter(1.5)
    out, _ = tx.update({k: jnp.asarray(v, jnp.float32)
                        for k, v in grads.items()},
                       tx.init(grads))
    for name, g in grads.items():
      # DINO utils.clip_gradients: each tensor on its own.
      coef = 1.5 / (np.linalg.norm(g) + 1e-6)
      expected = g * coef if coef < 1 else g
      # Rounding g, its norm (a sum and sqrt), + 1e-6 and its constant, the
      # division, the product.
      np.testing.assert_allclose(np.asarray(out[name]), expected,
                                 rtol=rounding_tol(g.size, stages=6))
    # The clipped norm is 1.5 |g| / (|g| + 1e-6); NumPy's float32 norm of the
    # result adds its sum and sqrt.
    g_norm = np.linalg.norm(grads['a'])
    assert np.linalg.norm(np.asarray(out['a'])) == pytest.approx(
        1.5 * g_norm / (g_norm + 1e-6), rel=rounding_tol(20, 20, stages=7))


class TestRecipes:
  """Each method's optimiser settings and schedule."""

  def test_each_method_trains_with_its_recipe(self):
    config = default.get_config()
    expected = {'simclr': ('sgd', 0.3, 1e-4, 0.0),
                'moco': ('sgd', 0.3, 1e-4, 0.0),
                'byol': ('lars', 1.0, 1e-5, 0.0),
                'dino': ('lars', 0.3, 1e-6, 3.0)}
    for method, (name, lr, wd, clip) in expected.items():
      config.method = method
      opt = optim.optim_settings(config)
      assert (opt.name, opt.base_lr, opt.weight_decay, opt.clip_grad) == (
          name, lr, wd, clip), method
      if name == 'lars':
        assert (opt.eta, opt.clip_lr, opt.momentum) == (0.02, True, 0.9)
    config.method = 'byol'
    config.byol.optim.base_lr = 0.5
    schedule = optim.learning_rate_schedule(config, 10, 100)
    # Peak base_lr * B / 256 at the end of the shared warm-up: optax's float32
    # peak times its cosine factor at the decay's first step (cos and the
    # sums, products and division around it).
    assert float(schedule(int(config.optim.warmup_epochs * 10))) == (
        pytest.approx(0.5 * config.batch_size / 256,
                      rel=rounding_tol(stages=6, funcs=1)))

  def test_epochs_become_whole_steps_without_float_truncation(self):
    # 0.57 * 100 is 56.999... in float64: int() made a 57-step warm-up 56.
    assert optim.epoch_steps(0.57, 100) == 57
    assert optim.epoch_steps(0.3, 195) == 58
    assert optim.run_steps(0, 0.29, 100) == 29
    assert optim.run_steps(7, 3, 100) == 7
    config = default.get_config()
    config.optim.warmup_epochs = 0.57
    lrs = [float(optim.learning_rate_schedule(config, 100, 1000)(k))
           for k in (56, 57)]
    assert lrs[0] < lrs[1]  # still rising at step 56

  def test_a_run_within_its_warmup_says_it_never_decays(self, caplog):
    config = default.get_config()  # warm-up 2 epochs
    with caplog.at_level('WARNING'):
      schedule = optim.learning_rate_schedule(config, 10, 20)
    assert 'never decays' in caplog.text
    assert float(schedule(19)) == pytest.approx(
        config.optim.base_lr * config.batch_size / 256, rel=1e-6)
    caplog.clear()
    optim.learning_rate_schedule(config, 10, 21)
    assert 'never decays' not in caplog.text

  @pytest.mark.parametrize('field, value', [
      ('byol.optim.name', 'adam'), ('dino.optim.eta', 0.0),
      ('dino.optim.clip_grad', -1.0), ('optim.eta', -1.0)])
  def test_bad_optimiser_settings_are_rejected(self, field, value):
    config = default.get_config()
    config.method = field.split('.')[0] if field[0] != 'o' else 'simclr'
    node = config
    *path, name = field.split('.')
    for part in path:
      node = node[part]
    node[name] = value
    with pytest.raises(experiment.ConfigError, match=field):
      experiment.validate_config(config)

  def test_lars_state_trains_a_quadratic_down(self):
    # End to end through create_optimizer: a DINO recipe on a toy loss.
    config = default.get_config()
    config.method = 'dino'
    schedule = optim.learning_rate_schedule(config, 5, 50)
    tx = optim.create_optimizer(config, schedule)
    params = {'w': jnp.ones((3, 3)), 'b': jnp.ones((3,))}
    loss = lambda p: jnp.sum(jnp.square(p['w'] - 2.0)) + jnp.sum(
        jnp.square(p['b']))
    state = tx.init(params)
    start = float(loss(params))
    for _ in range(50):
      updates, state = tx.update(jax.grad(loss)(params), state, params)
      params = optax.apply_updates(params, updates)
    assert float(loss(params)) < 0.5 * start
