"""Tests of the generic train step (otclr_jax/step.py) on tiny digits."""

import functools
import math
import os
import subprocess
import sys
import textwrap

import flax.serialization
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from otclr_jax import data
from otclr_jax import experiment
from otclr_jax import optim
from otclr_jax import methods
from otclr_jax import models
from otclr_jax import ot
from otclr_jax import step as step_lib
from tests.helpers import chain
from tests.helpers import network_chain
from tests.helpers import ot_chain
from tests.helpers import rounding_tol
from tests.helpers import tiny_config
from tests.helpers import traces

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMBINATIONS = [(m, v) for m in methods.NAMES for v in ('augment', 'ot')]


@pytest.fixture(scope='module')
def images(data_dir):
  return data.load_split('digits', 'train', 8, data_dir).images


def build(config, total_steps=4, steps_per_epoch=2, mesh=None):
  """(method, state, jitted step) for `config`, as training will build them."""
  method = step_lib.views.recipe(config).method
  model = method.create_model(config)
  schedule = optim.learning_rate_schedule(config, steps_per_epoch,
                                               total_steps)
  tx = optim.create_optimizer(config, schedule)
  mesh = experiment.make_mesh() if mesh is None else mesh
  # Jitted and placed as training places it: targets copied from the online
  # network must not alias its buffers, or donating the state fails.
  state = jax.jit(
      functools.partial(step_lib.init_state, config, method, model, tx),
      out_shardings=NamedSharding(mesh, P()))(jax.random.key(0))
  step = step_lib.jit_train_step(method, config, model, tx, schedule, mesh,
                                 total_steps=total_steps,
                                 steps_per_epoch=steps_per_epoch)
  return method, state, step, mesh


# Logged metrics (float.hex) of the first two steps of the SimCLR/OTCLR train
# step (train.train_step at commit 656364d, `tiny_config` digits with
# ResNet-18's stages (`_PINNED_MODEL`), batch images[:16], init key 0, train
# key 1, 4 total steps, 2 per epoch, lax.conv convolutions), computed by
# XLA:CPU on an AVX-512 machine; the 'ot' and 'ot_learn' rows by the
# matmul-form OT views (ot.resize_matrix, [m, N, m] Sinkhorn) on an AVX2
# machine. Other instruction sets and other programs of the same step
# (conv_impl) round differently: each metric is compared with the
# rounding_tol of its chain of float32 roundings (`pinned_rtol`).
_PINNED_MODEL = {'model.stage_sizes': models.RESNET18}
PINNED = {
    'augment': [
        {'grad_norm': '0x1.f63ffe0000000p+6', 'loss': '0x1.be3e680000000p+1'},
        {'grad_norm': '0x1.95d1800000000p+6', 'loss': '0x1.b9957c0000000p+1'},
    ],
    'ot': [
        {'alpha': '0x1.0000000000000p-1', 'grad_norm': '0x1.5ac9100000000p+7', 'loss': '0x1.c65d360000000p+1', 'sinkhorn': 'nan'},
        {'alpha': '0x1.0000000000000p-1', 'grad_norm': '0x1.493df00000000p+7', 'loss': '0x1.c75c480000000p+1', 'sinkhorn': '-0x1.aa7d420000000p-2'},
    ],
    'ot_learn': [
        {'alpha': '0x1.0000000000000p-1', 'grad_norm': '0x1.5ac9100000000p+7', 'loss': '0x1.9138140000000p+1', 'sinkhorn': '-0x1.a929140000000p-2'},
        {'alpha': '0x1.0000000000000p-1', 'grad_norm': '0x1.493ed40000000p+7', 'loss': '0x1.920ca00000000p+1', 'sinkhorn': '-0x1.aa7d420000000p-2'},
    ],
}


@functools.cache
def _chains():
  """`rounding_tol` chains of the pinned step: 16 images of 8 px, both views
  through one network (BatchNorm batches of 32), the imagenet stem.

  Returns:
    The views' (augmentations, OT views) and the loss's, the gradients' and
    the logged norm's chains, and the Sinkhorn regulariser's.
  """
  side, batch, grid = 8, 16, 4
  # The augmentations' pixel errors (tests/test_augment.py), stages
  # weighted by the scales they round at: the crop's 4 x 6 coordinate
  # stages at the side's; the colour jitter's blends at 2 (dot products of
  # 3, the mean over the image, 14 stages), hue's 13 stages at up to 11,
  # amplified by up to 6.5 in any order; grayscale. The OT views likewise.
  # Both doubled: relative to the first convolution's terms of mean 1/2.
  crop = chain(4, stages=1 + 4 * side * 6)
  jitter = 6.5 * (2 * chain(3, 3, side * side, stages=14)
                  + 11 * chain(stages=13))
  augment = 2 * (crop + math.ceil(jitter) + chain(3, stages=1))
  ot_views = 2 * ot_chain(grid, 20, (side, side), 'views')
  config = tiny_config(None, method='simclr', **_PINNED_MODEL)
  model = methods.get('simclr').create_model(config)
  network = network_chain(model, (2 * batch, side, side, 3), train=True)
  # NT-Xent on 16-dim projections (tests/test_losses.py).
  nt_xent = chain(16, 16, 2 * batch - 1, 2 * batch, stages=5, funcs=3)
  # The backward pass through the same reductions and the weight
  # gradients' sums over the stem's outputs; the norm: squares of the
  # largest parameter, the sum over all, sqrt.
  backward = chain(network, (2 * batch, 4, 4))
  params = jax.tree.leaves(jax.eval_shape(
      lambda: model.init(jax.random.key(0), np.zeros((1, side, side, 3)),
                         train=False))['params'])
  norm = chain(max(p.size for p in params), len(params), stages=2)
  # The regulariser: four image costs, their sum and the mean over the batch.
  sinkhorn = chain(ot_chain(grid, 20, (side, side), 'cost'), 4, batch,
                   stages=2)
  return augment, ot_views, network + nt_xent, backward, norm, sinkhorn


# The Sinkhorn regulariser's terms are bounded by eps (2 L + 1) per cost,
# with |log u|, |log v| <= L = 1 / eps + 2 |log(DELTA / m^2)| + log(m^2)
# (the scalings of a kernel in [exp(-1 / eps), 1] on histograms of at least
# DELTA / m^2); the regulariser halves a sum of four such costs.
_EPS = 0.05
_L = 1 / _EPS + 2 * abs(math.log(ot.DELTA / 16)) + math.log(16)
_SINKHORN_SCALE = 2 * _EPS * (2 * _L + 1)


def pinned_rtol(name, index, pinned):
  """Relative tolerances of step `index` (0 or 1) of `PINNED[name]`.

  Step 1's loss: the views, the network and NT-Xent, plus beta x the
  regulariser (beta = 1 with a learnt alpha) relative to the loss. Its
  gradient norm: the backward pass on top, and the norm's sum of squares.
  Step 2 starts from parameters that step 1's gradients moved: their error
  enters its chains (first order, for a step too small to amplify it: the
  learning rate times the curvature below 1). alpha is the sigmoid of a
  logit the warm-up's zero first learning rate left at 0: exactly 1/2.
  """
  augment, ot_views, forward, backward, norm, sinkhorn_chain = _chains()
  views = augment + (ot_views if name != 'augment' else 0)
  loss = views + forward
  grads = loss + backward
  carried = grads if index == 1 else 0
  rtol = {'loss': rounding_tol(carried, loss),
          'grad_norm': rounding_tol(carried, grads, norm),
          'alpha': 0.0}
  value = abs(float.fromhex(pinned.get('sinkhorn', 'nan')))
  if not math.isnan(value):
    # The regulariser's images do not depend on the network; with a learnt
    # alpha its views depend on step 1's gradients.
    carried_views = carried if name == 'ot_learn' else 0
    sinkhorn = rounding_tol(carried_views, views, sinkhorn_chain,
                            k=_SINKHORN_SCALE / value)
    rtol['sinkhorn'] = sinkhorn
    if name == 'ot_learn':
      rtol['loss'] += sinkhorn * value / abs(float.fromhex(pinned['loss']))
  elif 'sinkhorn' in pinned:
    rtol['sinkhorn'] = 0.0  # a NaN pin: the metric must be NaN too
  return rtol


def _progress_metric(method, metrics):
  """The part of the loss training lowers (DINO's: KL, without the
  teacher's entropy)."""
  if method == 'dino':
    return float(metrics['loss']) - float(metrics['teacher_entropy'])
  return float(metrics['loss'])


class TestStep:
  """The train step: pinned metrics, every method, EMA targets, devices."""

  # Every conv_impl sums the same convolutions in another order: another
  # program of the same chains.
  @pytest.mark.parametrize('name, views, overrides, conv_impl', [
      ('augment', 'augment', {}, 'xla'),
      ('ot', 'ot', {}, 'xla'),
      ('ot_learn', 'ot', {'ot.learn_alpha': True, 'ot.beta': 1.0}, 'xla'),
      ('ot', 'ot', {}, 'matmul'),
      ('ot', 'ot', {}, 'auto'),
  ])
  def test_simclr_reproduces_the_old_train_step(
      self, data_dir, images, name, views, overrides, conv_impl):
    config = tiny_config(data_dir, method='simclr', views=views, **overrides,
                         **{'model.conv_impl': conv_impl, **_PINNED_MODEL})
    _, state, step, mesh = build(config)
    batch = experiment.global_batch(images[:16], mesh)
    for index, pinned in enumerate(PINNED[name]):
      state, metrics = step(state, batch, jax.random.key(1))
      rtol = pinned_rtol(name, index, pinned)
      for k, value in pinned.items():
        np.testing.assert_allclose(float(np.asarray(metrics[k])),
                                   float.fromhex(value), rtol=rtol[k], atol=0,
                                   err_msg=k)
    assert np.all(np.asarray(metrics['state_finite']))
    assert state.extra == {}

  def test_otclr_alias_equals_simclr_with_ot_views(self, data_dir):
    alias = methods.add_defaults(tiny_config(data_dir, method='otclr'))
    assert step_lib.views.recipe(alias)[:2] == (methods.get('simclr'), 'ot')
    alias.views = 'augment'
    with pytest.raises(ValueError, match='otclr'):
      step_lib.views.recipe(alias)

  @pytest.mark.slow  # ~1 min per combination on the 2-core CPU
  @pytest.mark.parametrize('method, views', COMBINATIONS)
  def test_every_method_trains_and_resumes_exactly(
      self, data_dir, images, method, views):
    n = 8
    config = tiny_config(data_dir, method=method, views=views, **{
        'optim.base_lr': 2.0, 'optim.warmup_epochs': 0.0})
    # One batch of keys: from step 1 on, the negatives are the previous batch's
    # keys, not the random initial queue (whose loss is lower, by construction).
    config.moco.queue_size = 16
    # A fixed teacher temperature: its warm-up raises the loss by design.
    config.dino.warmup_teacher_temp_epochs = 0.0
    _, state, step, mesh = build(config, total_steps=2 * n)
    template = jax.device_get(state)
    batches = [experiment.global_batch(images[16 * i:16 * (i + 1)], mesh)
               for i in range(2 * n)]
    key = jax.random.key(1)
    with traces() as traced:
      progress = []
      for i, batch in enumerate(batches):
        if i == n:
          saved = flax.serialization.to_bytes(state)
        state, metrics = step(state, batch, key)
        assert np.isfinite(float(metrics['loss'])), (i, metrics)
        assert np.all(np.asarray(metrics['state_finite'])), i
        progress.append(_progress_metric(method, metrics))
      # Trains: the objective falls over 16 steps (means of 3: single tiny steps
      # are noisy; over 8 steps MoCo on OT views looked flat). MoCo starts at
      # step 1: at step 0 its negatives are the random initial queue, an easier
      # task by construction.
      start = 1 if method == 'moco' else 0
      assert np.mean(progress[-3:]) < np.mean(progress[start:start + 3]), (
          progress)
      # Resumes: N steps, a serialised round trip, N more == 2N straight,
      # bit for bit, extra state (targets, queue, centre) included.
      resumed = jax.device_put(flax.serialization.from_bytes(template, saved),
                               NamedSharding(mesh, P()))
      assert int(resumed.step) == n
      for batch in batches[n:]:
        resumed, _ = step(resumed, batch, key)
    # The extra state keeps its shapes and dtypes: one compilation, resume too.
    assert traced.count('step') == 1, traced
    straight, again = jax.device_get(state), jax.device_get(resumed)
    assert (jax.tree_util.tree_structure(straight)
            == jax.tree_util.tree_structure(again))
    for a, b in zip(jax.tree_util.tree_leaves(straight),
                    jax.tree_util.tree_leaves(again)):
      np.testing.assert_array_equal(b, a)

  def test_targets_follow_the_online_network_by_ema(self, data_dir, images):
    # No warm-up, so the first step moves the online network (at lr 0 every
    # tau gives the same target), and max_init_share 1 keeps base_tau.
    config = tiny_config(data_dir, method='byol', views='augment', **{
        'optim.warmup_epochs': 0.0, 'byol.max_init_share': 1.0})
    method, state, step, mesh = build(config, total_steps=4)
    before = jax.device_get(state)
    state, _ = step(state, experiment.global_batch(images[:16], mesh),
                    jax.random.key(1))
    after = jax.device_get(state)
    tau = 0.99  # cosine schedule at step 0 = base_tau.
    kernel = lambda tree: tree['encoder']['stem_conv']['kernel']
    online = kernel(after.params['net'])
    target = kernel(before.extra['target_params'])
    # The step's tau carries cosine_momentum's 8 stages and cos, an absolute
    # error that 1 - tau keeps; the products, 1 - tau and the sum, on terms of
    # at most |target| + |online|.
    atol = rounding_tol(stages=12, funcs=1) * float(
        np.max(np.abs(target) + np.abs(online)))
    # The EMA of the updated online weights, not of those before the step.
    np.testing.assert_allclose(kernel(after.extra['target_params']),
                               tau * target + (1 - tau) * online, rtol=0,
                               atol=atol)
    pre = tau * target + (1 - tau) * kernel(before.params['net'])
    assert np.abs(kernel(after.extra['target_params']) - pre).max() > 10 * atol
    assert method.name == 'byol'

  @pytest.mark.slow  # a subprocess compiling every method on 4 devices
  def test_four_devices_match_one_for_every_method(self, data_dir):
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from otclr_jax import data, experiment, methods
        from tests.helpers import tiny_config
        from tests.test_step import build, pinned_rtol
        assert jax.device_count() == 4
        images = data.load_split('digits', 'train', 8,
                                 {data_dir!r}).images[:16]
        for name in methods.NAMES:
          config = tiny_config({data_dir!r}, method=name, views='augment')
          out = []
          for devices in (jax.devices()[:1], jax.devices()):
            mesh = experiment.make_mesh(devices)
            _, state, step, _ = build(config, mesh=mesh)
            state, metrics = step(state, experiment.global_batch(images, mesh),
                                  jax.random.key(1))
            out.append((float(metrics['loss']), jax.tree_util.tree_leaves(
                jax.device_get((state.params, state.batch_stats,
                                state.extra)))))
          (loss1, tree1), (loss4, tree4) = out
          # Two programs (BatchNorm's and NT-Xent's reductions over 4 devices
          # against one) of the first step's loss chain.
          rtol = pinned_rtol('augment', 0, {{}})['loss']
          np.testing.assert_allclose(loss4, loss1, rtol=rtol, err_msg=name)
          # atol 1e-5: MoCo's queued keys are unit vectors whose entries near 0
          # carry the float32 noise of BatchNorm's cross-device reduction order
          # (measured: 2e-6 absolute on entries of 3e-3).
          for a, b in zip(tree1, tree4):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5,
                                       err_msg=name)
          print('OK', name, loss1, loss4, flush=True)
        """)
    env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4',
               JAX_PLATFORMS='cpu')
    result = subprocess.run([sys.executable, '-c', script], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count('OK') == len(methods.NAMES)
