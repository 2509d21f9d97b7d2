"""Tests for otclr_jax.losses."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from otclr_jax import losses
from otclr_jax import models
from otclr_jax import ot
from tests.helpers import chain
from tests.helpers import numpy_variables
from tests.helpers import ot_chain
from tests.helpers import ot_cost_scale
from tests.helpers import rounding_tol

# Jitted entry points: one compilation per shape is much cheaper on a shared CPU
# than eager op-by-op dispatch. Eager calls remain where behaviour may differ.
_nt_xent = jax.jit(losses.nt_xent, static_argnames='temperature')
_STATIC_OT = ('grid_size', 'num_iters')
_ot_views = jax.jit(ot.ot_views, static_argnames=_STATIC_OT)
_image_cost = jax.jit(ot.image_sinkhorn_cost, static_argnames=_STATIC_OT)
_regulariser = jax.jit(losses.sinkhorn_regulariser, static_argnames=_STATIC_OT)


def _images(seed, batch=3, size=8):
  keys = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.uniform(k, (batch, size, size, 3)) for k in keys]


OT_KW = dict(grid_size=4, epsilon=0.05, num_iters=5)


def _regulariser_atol(x, xs1, xs2, xh1, xh2):
  """How far two float32 evaluations of `sinkhorn_regulariser` may differ.

  Each of its four image costs, relative to the magnitudes the cost adds
  up (`ot_cost_scale`, bounding the potentials that carry the measures'
  errors too); then the sum of four, the mean over the batch of 3 and the
  factor 1/2. Half the sum of four costs: 2 x the largest scale.
  """
  scale = max(ot_cost_scale(*(ot.image_to_measure(t, 4)[0] for t in pair),
                            0.05, 5)
              for pair in ((xh1, x), (xh2, x), (xh1, xs1), (xh2, xs2)))
  n = chain(ot_chain(4, 5, (8, 8), 'cost'), 4, 3, stages=2)
  return rounding_tol(n) * 2 * scale


def _nt_xent_reference(z1, z2, temperature):
  """Loop-by-anchor NumPy float64 transcription of docs/method.md section 6."""
  z = np.concatenate([z1, z2]).astype(np.float64)
  z /= np.linalg.norm(z, axis=1, keepdims=True)
  n = z.shape[0]
  batch = n // 2
  total, correct = 0.0, 0
  for i in range(n):
    p = (i + batch) % n
    sims = {j: float(z[i] @ z[j]) / temperature for j in range(n) if j != i}
    total -= np.log(np.exp(sims[p]) / sum(np.exp(s) for s in sims.values()))
    negatives = [s for j, s in sims.items() if j != p]
    correct += int(all(sims[p] > s for s in negatives))
  return total / n, correct / n


def _nt_xent_atol(batch, dim, temperature=0.5, extra=0):
  """How far two float32 evaluations of NT-Xent may differ.

  Normalising (a sum of dim, rsqrt, the product), the dot products of dim,
  / temperature, logsumexp (the shift, exp, the sum over 2 batch - 1
  logits, log), - positive, the mean over 2 batch anchors; `extra` stages
  on the inputs before. The positive logit and the logsumexp are each
  1-Lipschitz in logits up to 1 / temperature: an absolute scale of
  2 / temperature.
  """
  return rounding_tol(dim, dim, 2 * batch - 1, 2 * batch, stages=extra + 5,
                      funcs=3) * 2 / temperature


def _random_pair(seed, batch, dim, noise=1.0):
  rng = np.random.default_rng(seed)
  z1 = rng.normal(size=(batch, dim))
  z2 = z1 + noise * rng.normal(size=(batch, dim))
  return z1.astype(np.float32), z2.astype(np.float32)


class TestNTXent:
  """NT-Xent against a loop over anchors in NumPy."""

  @pytest.mark.parametrize('seed, batch, dim, temperature, noise', [
      (1, 1, 4, 0.5, 1.0), (2, 2, 3, 0.5, 1.0), (5, 5, 8, 0.5, 1.0),
      (16, 16, 8, 0.5, 1.0), (7, 7, 16, 0.1, 1.0), (9, 9, 5, 2.0, 1.0),
      # Noisy positives in 3 dimensions: some anchors right, some wrong.
      (3, 32, 3, 0.5, 0.7),
  ])
  def test_nt_xent_matches_numpy_reference(self, seed, batch, dim, temperature,
                                                 noise):
    z1, z2 = _random_pair(seed, batch, dim, noise)
    loss, top1 = _nt_xent(jnp.asarray(z1), jnp.asarray(z2), temperature)
    ref_loss, ref_top1 = _nt_xent_reference(z1, z2, temperature)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    np.testing.assert_allclose(loss, ref_loss, rtol=0,
                               atol=_nt_xent_atol(batch, dim, temperature))
    if noise < 1:
      assert 0.0 < ref_top1 < 1.0
    # A count over 2B anchors, divided once in float32.
    np.testing.assert_allclose(top1, ref_top1, rtol=rounding_tol(stages=1),
                               atol=0)

  def test_nt_xent_identical_views_have_top1_one(self):
    z, _ = _random_pair(4, 12, 6)
    loss, top1 = _nt_xent(jnp.asarray(z), jnp.asarray(z))
    assert float(top1) == 1.0
    np.testing.assert_allclose(loss, _nt_xent_reference(z, z, 0.5)[0], rtol=0,
                               atol=_nt_xent_atol(12, 6))

  def test_nt_xent_closed_forms(self):
    # B = 1: the positive is the only other embedding, so the softmax is 1.
    loss, top1 = losses.nt_xent(jnp.array([[1.0, 2.0]]),
                                jnp.array([[-3.0, 0.5]]))
    np.testing.assert_allclose(loss, 0.0, rtol=0, atol=_nt_xent_atol(1, 2))
    assert float(top1) == 1.0
    # Collapse: all 2B logits equal, loss log(2B - 1), and ties count as wrong.
    batch = 4
    z = jnp.ones((batch, 3))
    loss, top1 = _nt_xent(z, z)
    np.testing.assert_allclose(loss, np.log(2 * batch - 1), rtol=0,
                               atol=_nt_xent_atol(batch, 3))
    assert float(top1) == 0.0

  def test_nt_xent_symmetry_and_invariances(self):
    z1, z2 = _random_pair(5, 10, 8)
    z1, z2 = jnp.asarray(z1), jnp.asarray(z2)
    base = _nt_xent(z1, z2)
    perm = np.random.default_rng(0).permutation(10)
    for other in (_nt_xent(z2, z1),
                  _nt_xent(z1[perm], z2[perm]),
                  _nt_xent(3.0 * z1, 0.2 * z2)):
      # One program; the swaps reorder its sums and the scalings round the
      # inputs once more.
      np.testing.assert_allclose(other[0], base[0], rtol=0,
                                 atol=_nt_xent_atol(10, 8, extra=1))
      np.testing.assert_allclose(other[1], base[1], rtol=0, atol=0)

  def test_nt_xent_jit_bfloat16_and_gradients_are_finite(self):
    z1, z2 = _random_pair(6, 8, 4)
    z1, z2 = jnp.asarray(z1), jnp.asarray(z2)
    eager = losses.nt_xent(z1, z2)
    jitted = jax.jit(losses.nt_xent)(z1, z2)
    # Two programs: op by op, and one fused computation.
    np.testing.assert_allclose(jitted[0], eager[0], rtol=0,
                               atol=_nt_xent_atol(8, 4))

    loss16, _ = _nt_xent(z1.astype(jnp.bfloat16), z2.astype(jnp.bfloat16))
    assert loss16.dtype == jnp.float32
    np.testing.assert_allclose(loss16, eager[0], rtol=2e-2)

    # A zero row and a huge row: the masked self-similarities must not leak NaN.
    z1 = z1.at[0].set(0.0).at[1].multiply(1e6)
    grads = jax.jit(jax.grad(lambda a, b: losses.nt_xent(a, b, 0.05)[0],
                             argnums=(0, 1)))(z1, z2)
    assert all(np.all(np.isfinite(g)) for g in grads)

  def test_nt_xent_with_batch_sharded_over_devices_uses_global_negatives(self):
    # A fresh process: the host device count is fixed when JAX starts. The
    # sharded loss reduces over devices in another order: another program.
    script = textwrap.dedent("""
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from otclr_jax import losses
        assert jax.device_count() == 4, jax.devices()
        rng = np.random.default_rng(0)
        z1, z2 = (rng.normal(size=(8, 5)).astype(np.float32) for _ in range(2))
        mesh = Mesh(np.array(jax.devices()), ('data',))
        shard = NamedSharding(mesh, P('data'))
        fn = jax.jit(losses.nt_xent)
        loss, top1 = fn(jax.device_put(z1, shard), jax.device_put(z2, shard))
        ref_loss, ref_top1 = fn(z1, z2)
        np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=ATOL)
        np.testing.assert_allclose(top1, ref_top1, rtol=0, atol=0)
        print('OK', float(loss))
    """).replace('ATOL', repr(_nt_xent_atol(8, 5)))
    env = dict(os.environ, JAX_PLATFORMS='cpu',
               XLA_FLAGS='--xla_force_host_platform_device_count=4')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, '-c', script], cwd=root, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('OK')

  def test_nt_xent_bad_inputs_raise(self):
    z = jnp.ones((4, 3))
    with pytest.raises(ValueError, match='equal shapes'):
      losses.nt_xent(z, jnp.ones((5, 3)))
    with pytest.raises(ValueError, match=r'\[B, D\]'):
      losses.nt_xent(jnp.ones((4,)), jnp.ones((4,)))
    with pytest.raises(ValueError, match='temperature'):
      losses.nt_xent(z, z, temperature=0.0)


class TestSinkhornRegulariser:
  """The Sinkhorn regulariser and the learnt alpha."""

  def test_sinkhorn_regulariser_is_the_written_combination(self):
    x, xs1, xs2 = _images(0)
    xh1 = _ot_views(x, xs1, alpha=0.5, **OT_KW)
    xh2 = _ot_views(x, xs2, alpha=0.5, **OT_KW)
    reg = losses.sinkhorn_regulariser(x, xs1, xs2, xh1, xh2, **OT_KW)
    # Two programs each: eager against jitted, and one fused regulariser
    # against four jitted costs combined in float64.
    atol = _regulariser_atol(x, xs1, xs2, xh1, xh2)
    np.testing.assert_allclose(
        _regulariser(x, xs1, xs2, xh1, xh2, **OT_KW), reg, rtol=0, atol=atol)
    s = lambda a, b: np.asarray(_image_cost(a, b, **OT_KW), np.float64)
    expected = 0.5 * np.mean(s(xh1, x) + s(xh2, x) + s(xh1, xs1) + s(xh2, xs2))
    assert reg.shape == () and reg.dtype == jnp.float32
    np.testing.assert_allclose(reg, expected, rtol=0, atol=atol)
    # The generated view is the source measure: the swapped order differs, by
    # more than the tolerance that told the others apart.
    swapped = 0.5 * np.mean(s(x, xh1) + s(x, xh2) + s(xs1, xh1) + s(xs2, xh2))
    assert abs(swapped - expected) > 10 * atol, (swapped, expected, atol)

  def test_sinkhorn_regulariser_bad_shapes_raise(self):
    x, xs1, xs2 = _images(0)
    with pytest.raises(ValueError, match='one shape'):
      losses.sinkhorn_regulariser(x, xs1, xs2, x, x[:2], **OT_KW)
    with pytest.raises(ValueError, match='one shape'):
      losses.sinkhorn_regulariser(x[0], xs1[0], xs2[0], x[0], x[0], **OT_KW)

  def test_fixed_alpha_regulariser_does_not_change_parameter_gradients(self):
    """docs/method.md section 6 note: with a fixed alpha, beta has no effect."""
    model = models.SimCLRNet(models.ResNet(stem='cifar'), proj_hidden_dim=16,
                             proj_dim=8)
    x, xs1, xs2 = _images(1, batch=4)
    # The views are data: generated outside the differentiated function.
    xh1 = _ot_views(x, xs1, alpha=0.5, **OT_KW)
    xh2 = _ot_views(x, xs2, alpha=0.5, **OT_KW)
    variables = numpy_variables(model, (8, 8, 8, 3))

    def loss_fn(params, beta, x, xs1, xs2, xh1, xh2):
      (_, z), _ = model.apply(
          {'params': params, 'batch_stats': variables['batch_stats']},
          jnp.concatenate([xh1, xh2]), train=True, mutable=['batch_stats'])
      reg = losses.sinkhorn_regulariser(x, xs1, xs2, xh1, xh2, **OT_KW)
      # The train step's combination (otclr_jax/step.py).
      nce, _ = losses.nt_xent(z[:4], z[4:], 0.5)
      return nce + beta * reg, {'nce': nce, 'sinkhorn': reg}

    # beta is a traced argument: one compilation serves both values.
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    images = (x, xs1, xs2, xh1, xh2)
    (loss0, parts0), grads0 = grad_fn(variables['params'], 0.0, *images)
    (loss1, parts1), grads1 = grad_fn(variables['params'], 1.0, *images)

    # S_eps includes the entropy term, so it can be negative; not 0.
    assert abs(float(parts1['sinkhorn'])) > 1e-3
    # One program: its NT-Xent part does not depend on beta, so loss0 is that
    # NT-Xent bit for bit and loss1 rounds it plus the regulariser once; the
    # difference rounds once more.
    np.testing.assert_array_equal(parts0['nce'], parts1['nce'])
    np.testing.assert_array_equal(loss0, parts0['nce'])
    np.testing.assert_allclose(
        loss1 - loss0, parts1['sinkhorn'], rtol=0,
        atol=rounding_tol(stages=1) * (abs(float(loss1))
                                + abs(float(parts1['sinkhorn']))))
    leaves0, leaves1 = jax.tree.leaves(grads0), jax.tree.leaves(grads1)
    assert any(np.any(g != 0) for g in leaves0)
    for g0, g1 in zip(leaves0, leaves1):
      np.testing.assert_allclose(g1, g0, rtol=0, atol=0)

  def test_learnable_alpha_gets_a_sinkhorn_gradient(self):
    x, xs1, xs2 = _images(2)

    # The images are arguments, as in a train step (not closed-over constants).
    def reg_fn(logit, x, xs1, xs2):
      alpha = losses.alpha_from_logit(logit)
      xh1 = ot.ot_views(x, xs1, alpha=alpha, **OT_KW)
      xh2 = ot.ot_views(x, xs2, alpha=alpha, **OT_KW)
      return losses.sinkhorn_regulariser(x, xs1, xs2, xh1, xh2, **OT_KW)

    # L_Sinkhorn is only piecewise smooth in alpha: the splat has kinks where
    # packets cross grid vertices (alpha = 1/2 puts every even displacement on a
    # vertex), and the min-shift and clipping add more. 0.4 is a smooth point.
    logit = jnp.float32(losses.alpha_to_logit(0.4))
    value, grad = jax.jit(jax.value_and_grad(reg_fn))(logit, x, xs1, xs2)
    assert np.isfinite(value) and np.isfinite(grad)
    assert abs(float(grad)) > 1e-6
    # Central difference of float32 evaluations.
    h = 1e-2
    reg_jit = jax.jit(reg_fn)
    fd = (float(reg_jit(logit + h, x, xs1, xs2))
          - float(reg_jit(logit - h, x, xs1, xs2))) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-2)

  def test_alpha_logit_round_trip(self):
    # float32 sigmoid: exp, the sum and the division; rounding the logit x to
    # float32 moves alpha by (1 - alpha) |x| u relative: k = |x|.
    rtol = lambda x: (rounding_tol(stages=2, funcs=1)
                      + rounding_tol(stages=1, k=abs(x)))
    for alpha in (0.1, 0.5, 0.9):
      logit = losses.alpha_to_logit(alpha)
      np.testing.assert_allclose(losses.alpha_from_logit(logit), alpha,
                                 rtol=rtol(logit))
    np.testing.assert_allclose(losses.alpha_from_logit(0.0), 0.5, rtol=rtol(0))
    np.testing.assert_allclose(losses.alpha_from_logit(np.log(3.0)), 0.75,
                               rtol=rtol(np.log(3.0)))
    for bad in (0.0, 1.0, -0.2):
      with pytest.raises(ValueError, match='strictly'):
        losses.alpha_to_logit(bad)
