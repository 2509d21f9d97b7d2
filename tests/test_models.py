"""Tests for otclr_jax.models."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from otclr_jax import conv
from otclr_jax import models
from tests.helpers import numpy_variables
from tests.helpers import rounding_tol


def _count(tree):
  return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(tree)))


def _abstract_variables(module, shape):
  return jax.eval_shape(
      lambda: module.init(jax.random.key(0), jnp.zeros(shape), train=False))


def _resnet_param_count(stem_kernel, stage_sizes=(2, 2, 2, 2)):
  """Closed-form parameter count of a ResNet without fc (convs have no bias).

  Args:
    stem_kernel: side of the first convolution (7 for imagenet, 3 for cifar).
    stage_sizes: blocks per stage, ResNet-18's by default.

  Returns:
    Number of trainable parameters (conv kernels + BatchNorm scale and bias).
  """
  conv = lambda k, cin, cout: k * k * cin * cout
  bn = lambda c: 2 * c
  total = conv(stem_kernel, 3, 64) + bn(64)
  cin = 64
  for cout, blocks in zip((64, 128, 256, 512), stage_sizes):
    for block in range(blocks):
      total += conv(3, cin, cout) + bn(cout) + conv(3, cout, cout) + bn(cout)
      if block == 0 and cin != cout:
        total += conv(1, cin, cout) + bn(cout)
      cin = cout
  return total


def _jit_apply(model, train):
  # One compilation is cheaper than the op-by-op compilations of eager apply.
  if train:
    return jax.jit(lambda v, x: model.apply(v, x, train=True,
                                            mutable=['batch_stats']))
  return jax.jit(lambda v, x: model.apply(v, x, train=False))


NHWC = ('NHWC', 'HWIO', 'NHWC')


def _conv_matmul_jaxpr(size: int) -> str:
  """Jaxpr of a 3 x 3, stride 1, pad 1 `conv_matmul` of [2, size, size, 4]."""
  x = jnp.ones((2, size, size, 4))
  kernel = jnp.ones((3, 3, 4, 5))
  return str(jax.make_jaxpr(
      lambda x, k: conv.conv_matmul(x, k, (1, 1), ((1, 1), (1, 1)),
                                      dimension_numbers=NHWC))(x, kernel))


_X = jnp.ones((1, 4, 4, 2))
_K = jnp.ones((3, 3, 2, 2))


def _conv_loss(conv, strides, padding, probe):
  """Scalar whose gradients are the convolution's VJP of `probe`."""
  def loss(x, kernel):
    y = conv(x, kernel, (strides, strides), padding,
             dimension_numbers=jax.lax.conv_dimension_numbers(
                 x.shape, kernel.shape, ('NHWC', 'HWIO', 'NHWC')))
    return jnp.sum(y * probe), y
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


# Convolutions as the model runs them: (H, C_in, C_out, kernel, stride,
# padding). The 7x7/2 stem, 3x3 at strides 1 and 2 on even and odd maps
# (down to the 1 x 1 map of the last stage), the 1x1/2 shortcut, and
# flax's 'SAME' and 'VALID' spellings.
CONV_CASES = [
    (32, 3, 8, 7, 2, ((3, 3), (3, 3))),
    (8, 4, 6, 3, 1, ((1, 1), (1, 1))),
    (8, 4, 6, 3, 2, ((1, 1), (1, 1))),
    (5, 4, 6, 3, 2, ((1, 1), (1, 1))),
    (2, 8, 6, 3, 2, ((1, 1), (1, 1))),
    (2, 8, 6, 3, 1, ((1, 1), (1, 1))),
    (2, 8, 6, 3, 1, 'SAME'),
    (1, 8, 6, 3, 1, ((1, 1), (1, 1))),
    (8, 4, 6, 1, 2, ((0, 0), (0, 0))),
    (2, 8, 6, 1, 2, ((0, 0), (0, 0))),
    (6, 4, 6, 3, 2, 'SAME'),
    (7, 4, 6, 3, 1, 'VALID'),
]


class TestResNet:
  """Parameter counts, shapes, modes and blocks of the networks."""

  def test_parameter_counts_are_torchvisions_and_the_papers(self):
    # torchvision's resnet18 and resnet34 without their fc (512 * 1000 + 1000).
    variables = _abstract_variables(models.ResNet(stem='imagenet'),
                                    (2, 32, 32, 3))
    assert _resnet_param_count(7) == 11_689_512 - 513_000
    assert _count(variables['params']) == 11_176_512
    assert round(_count(variables['params']) / 1e6, 2) == 11.18  # the paper's
    # One running mean and one running variance per BatchNorm channel.
    kernels = [v for k, v in flax.traverse_util.flatten_dict(
        variables['params']).items() if k[-1] == 'kernel']
    assert _count(variables['batch_stats']) == (
        _count(variables['params']) - _count(kernels))
    resnet34 = _abstract_variables(models.ResNet(stage_sizes=(3, 4, 6, 3)),
                                   (2, 32, 32, 3))
    assert _count(resnet34['params']) == 21_797_672 - 513_000
    cifar = _abstract_variables(models.ResNet(stem='cifar'), (2, 32, 32, 3))
    assert _count(cifar['params']) == _resnet_param_count(3) == 11_168_832

  def test_stage_sizes_set_the_depth(self):
    one = models.ResNet(stage_sizes=(1, 1, 1, 1), stem='cifar')
    variables = _abstract_variables(one, (2, 32, 32, 3))
    assert _count(variables['params']) == _resnet_param_count(3, (1, 1, 1, 1))
    assert sorted(k for k in variables['params'] if 'block' in k) == [
        f'stage{s}_block1' for s in range(1, 5)]
    for bad in ((2, 2, 2), (2, 0, 2, 2)):
      with pytest.raises(ValueError, match='stage_sizes'):
        models.ResNet(stage_sizes=bad)

  def test_heads_reproduce_the_papers_parameter_counts(self):
    """The paper's 23.01M MoCo pretraining parameters: 2 x (backbone + head)
    of the default head."""
    wide = _abstract_variables(
        models.SimCLRNet(proj_hidden_dim=2048, proj_dim=128), (2, 32, 32, 3))
    # Dense without bias, BatchNorm scale + bias, Dense with bias.
    assert _count(wide['params']['head']) == (
        512 * 2048 + 2 * 2048 + 2048 * 128 + 128)
    variables = _abstract_variables(models.SimCLRNet(), (2, 32, 32, 3))
    head = _count(variables['params']['head'])
    backbone = _count(variables['params']['encoder'])
    assert (head, backbone) == (328_832, 11_176_512)
    assert round(2 * (backbone + head) / 1e6, 2) == 23.01

  def test_params_are_float32_even_for_bfloat16(self):
    variables = _abstract_variables(
        models.SimCLRNet(models.ResNet(dtype=jnp.bfloat16)), (2, 32, 32, 3))
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(variables)}
    assert dtypes == {jnp.dtype(jnp.float32)}

  @pytest.mark.parametrize('stem, size, last_spatial', [
      ('imagenet', 32, 1),
      ('imagenet', 96, 3),
      ('cifar', 32, 4),
      ('cifar', 96, 12),
  ])
  def test_output_and_last_stage_shapes(self, stem, size, last_spatial):
    model = models.SimCLRNet(models.ResNet(stem=stem), proj_hidden_dim=64,
                             proj_dim=16)
    x = jnp.zeros((3, size, size, 3))
    variables = _abstract_variables(model, x.shape)
    (h, z), state = jax.eval_shape(
        lambda v: model.apply(v, x, train=False, capture_intermediates=True),
        variables)
    assert h.shape == (3, 512) and h.dtype == jnp.float32
    assert z.shape == (3, 16) and z.dtype == jnp.float32
    last = state['intermediates']['encoder']['stage4_block2']['__call__'][0]
    assert last.shape == (3, last_spatial, last_spatial, 512)

  def test_train_mode_updates_batch_stats_and_eval_mode_does_not(self):
    model = models.SimCLRNet(models.ResNet(stem='imagenet'), proj_hidden_dim=32,
                             proj_dim=8)
    x = jax.random.uniform(jax.random.key(1), (4, 32, 32, 3))
    # Same first example, different rest of the batch.
    x_alt = x.at[1:].set(jax.random.uniform(jax.random.key(2), (3, 32, 32, 3)))
    variables = numpy_variables(model, x.shape)
    old_stats = variables['batch_stats']
    apply_train, apply_eval = _jit_apply(model, True), _jit_apply(model, False)

    (h_train, _), updates = apply_train(variables, x)
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), old_stats,
                           updates['batch_stats'])
    assert all(jax.tree.leaves(changed))
    (h_train_alt, _), _ = apply_train(variables, x_alt)
    assert not np.allclose(h_train[0], h_train_alt[0], atol=1e-3)

    # Eval mode needs no mutable collection (flax raises if it tried to write
    # one) and each example's output does not depend on the rest of the batch.
    h_eval, _ = apply_eval(variables, x)
    h_eval_alt, _ = apply_eval(variables, x_alt)
    # One program, one shape: example 0's arithmetic does not depend on the
    # other examples' values, so it is the same bit for bit.
    np.testing.assert_array_equal(h_eval[0], h_eval_alt[0])

    # The head's running statistics follow an exponential average with momentum
    # 0.9 of the biased batch statistics of the hidden pre-activations.
    kernel = np.asarray(variables['params']['head']['hidden']['kernel'],
                        np.float64)
    pre = np.asarray(h_train, np.float64) @ kernel
    new_head = updates['batch_stats']['head']['bn']
    np.testing.assert_allclose(new_head['mean'], 0.1 * pre.mean(0),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new_head['var'], 0.9 + 0.1 * pre.var(0),
                               rtol=1e-4, atol=1e-5)

  def test_bfloat16_runs_and_returns_float32(self):
    # The batch and float32 network of the test above: its compiled eval-mode
    # apply gives the reference.
    x = jax.random.uniform(jax.random.key(1), (4, 32, 32, 3))
    model32 = models.SimCLRNet(proj_hidden_dim=32, proj_dim=8)
    model16 = models.SimCLRNet(models.ResNet(dtype=jnp.bfloat16),
                               proj_hidden_dim=32, proj_dim=8)
    variables = numpy_variables(model32, x.shape)
    h32, z32 = _jit_apply(model32, False)(variables, x)
    (h16, z16), updates = _jit_apply(model16, True)(variables, x)
    h16_eval, z16_eval = _jit_apply(model16, False)(variables, x)
    for out in (h16, z16, h16_eval, z16_eval):
      assert out.dtype == jnp.float32
      assert np.all(np.isfinite(out))
    assert {leaf.dtype for leaf in jax.tree.leaves(updates)} == {
        jnp.dtype(jnp.float32)}
    # Same parameters, lower precision: close in relative norm.
    rel = np.linalg.norm(h16_eval - h32) / np.linalg.norm(h32)
    assert rel < 0.05, rel
    rel = np.linalg.norm(z16_eval - z32) / np.linalg.norm(z32)
    assert rel < 0.05, rel

  def test_zero_init_residual_block_starts_as_identity(self):
    x = jax.random.uniform(jax.random.key(1), (2, 4, 4, 8))
    block = models.BasicBlock(8, zero_init_residual=True)
    variables = block.init(jax.random.key(0), x, train=False)
    np.testing.assert_array_equal(variables['params']['bn2']['scale'], 0.0)
    np.testing.assert_array_equal(variables['params']['bn1']['scale'], 1.0)
    # Non-negative inputs pass through relu(x + 0) unchanged.
    y, _ = block.apply(variables, x, train=True, mutable=['batch_stats'])
    np.testing.assert_allclose(y, x, rtol=0, atol=0)

    default = models.BasicBlock(8).init(jax.random.key(0), x, train=False)
    np.testing.assert_array_equal(default['params']['bn2']['scale'], 1.0)

  def test_downsampling_block_has_projection_shortcut(self):
    block = models.BasicBlock(16, strides=2)
    variables = jax.eval_shape(
        lambda: block.init(jax.random.key(0), jnp.zeros((2, 8, 8, 8)),
                           train=False))
    assert variables['params']['shortcut_conv']['kernel'].shape == (1, 1, 8, 16)
    y = jax.eval_shape(lambda v: block.apply(v, jnp.zeros((2, 8, 8, 8)),
                                             train=False), variables)
    assert y.shape == (2, 4, 4, 16)


class TestConv:
  """The matmul convolutions and separable pooling against lax and flax."""

  @pytest.mark.parametrize('size, cin, cout, k, strides, padding', CONV_CASES)
  def test_conv_matmul_equals_lax_conv_with_gradients(self, size, cin, cout, k,
                                                            strides, padding):
    kx, kk, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (3, size, size, cin))
    kernel = jax.random.normal(kk, (k, k, cin, cout))
    out_shape = jax.eval_shape(
        lambda: jax.lax.conv_general_dilated(
            x, kernel, (strides, strides), padding,
            dimension_numbers=('NHWC', 'HWIO', 'NHWC'))).shape
    probe = jax.random.normal(kp, out_shape)
    (_, y_ref), (dx_ref, dk_ref) = _conv_loss(
        jax.lax.conv_general_dilated, strides, padding, probe)(x, kernel)
    (_, y), (dx, dk) = _conv_loss(
        conv.conv_matmul, strides, padding, probe)(x, kernel)
    assert y.shape == y_ref.shape == out_shape
    # Two programs summing the same products in other orders: an output over
    # the kernel's fan-in, an input's gradient over k x k x cout, a kernel's
    # over the probe's batch and pixels; each rounds relative to the sum of
    # its terms' magnitudes, the same convolution of |x|, |kernel|, |probe|.
    (_, y_abs), (dx_abs, dk_abs) = _conv_loss(
        jax.lax.conv_general_dilated, strides, padding, jnp.abs(probe))(
            jnp.abs(x), jnp.abs(kernel))
    for got, ref, terms, sums in ((y, y_ref, y_abs, kernel.shape[:-1]),
                                  (dx, dx_ref, dx_abs, (k, k, cout)),
                                  (dk, dk_ref, dk_abs, probe.shape[:-1])):
      np.testing.assert_allclose(
          got, ref, rtol=0, atol=rounding_tol(sums) * float(jnp.max(terms)))

  @pytest.mark.parametrize('size, shapes', [
      # One live tap (the centre): a [2, 4] x [4, 5] product.
      (1, ('f32[2,4]', 'f32[4,5]')),
      # 4 pixels, 9 live taps: one [2, 2 * 2 * 4] x [16, 2 * 2 * 5] product of
      # the whole map, no shifted copies.
      (2, ('f32[2,16]', 'f32[16,20]')),
  ])
  def test_conv_matmul_skips_taps_that_read_only_padding(self, size, shapes):
    jaxpr = _conv_matmul_jaxpr(size)
    assert 'concatenate' not in jaxpr
    assert all(shape in jaxpr for shape in shapes)

  @pytest.mark.parametrize('call, match', [
      (lambda: models.ResNet(stem='resnet'), 'stem'),
      (lambda: models.SimCLRNet(models.ResNet(stem='')), 'stem'),
      (lambda: models.ResNet().init(jax.random.key(0), jnp.zeros((32, 32, 3)),
                                    train=False), r'\[B, H, W, C\]'),
      (lambda: conv.conv_matmul(_X, _K, (1, 1), ((1, 1), (1, 1)),
                                dimension_numbers=NHWC, rhs_dilation=(2, 2)),
       'undilated'),
      (lambda: conv.conv_matmul(_X, jnp.ones((3, 3, 1, 2)), (1, 1),
                                ((1, 1), (1, 1)), dimension_numbers=NHWC,
                                feature_group_count=2), 'ungrouped'),
      # lax's default is NCHW.
      (lambda: conv.conv_matmul(_X, _K, (1, 1), ((1, 1), (1, 1))), 'NHWC'),
      (lambda: conv.conv_function('cudnn'), 'conv_impl'),
      (lambda: conv.max_pool_function('cudnn'), 'conv_impl'),
      (lambda: models.ResNet(conv_impl='im2col'), 'conv_impl'),
  ])
  def test_bad_settings_raise(self, call, match):
    with pytest.raises(ValueError, match=match):
      call()

  def test_auto_conv_picks_matmul_on_small_cpu_maps_only(self):
    conv_fn = conv.conv_function('auto')
    def ops(size):
      x, kernel = jnp.ones((1, size, size, 2)), jnp.ones((3, 3, 2, 2))
      return str(jax.make_jaxpr(
          lambda x, k: conv_fn(x, k, (1, 1), ((1, 1), (1, 1)),
                            dimension_numbers=NHWC))(x, kernel))
    assert jax.default_backend() == 'cpu'
    # A 16 x 16 output is the largest `auto` hands to the matmul.
    assert conv.CONV_MATMUL_MAX_OUT_PIXELS == 16 * 16
    for size in (1, 2, 16):
      small = ops(size)
      assert 'dot_general' in small and 'conv_general_dilated' not in small
    large = ops(17)
    assert 'conv_general_dilated' in large and 'dot_general' not in large

  @pytest.mark.parametrize('size, window, strides, padding', [
      (16, 3, 2, 1),  # the imagenet stem's pool at 32 px
      (7, 3, 2, 1),   # odd size: the last window is cut by the padding
      (8, 2, 2, 0),
      (9, 3, 1, 1),
  ])
  def test_separable_max_pool_equals_flax_max_pool_with_gradients(
      self, size, window, strides, padding):
    kx, kp = jax.random.split(jax.random.key(0))
    # After a ReLU, as in the stem: windows of tied zeros included.
    x = jax.random.normal(kx, (3, size, size, 5))
    args = ((window, window), (strides, strides),
            ((padding, padding), (padding, padding)))
    ref_pool = lambda x: flax.linen.max_pool(x, *args[:1], strides=args[1],
                                             padding=args[2])
    sep_pool = lambda x: conv.max_pool_separable(x, *args)
    y_ref = ref_pool(jax.nn.relu(x))
    probe = jax.random.normal(kp, y_ref.shape)
    def grad(pool):
      return jax.jit(jax.grad(lambda x: jnp.sum(pool(jax.nn.relu(x)) * probe)))
    y = sep_pool(jax.nn.relu(x))
    assert y.shape == y_ref.shape
    np.testing.assert_array_equal(y, y_ref)  # a maximum is exact
    # Each input gets the sum of the probes of the windows whose unique
    # maximum it is (zeros' gradient dies in the ReLU): at most
    # ceil(window / strides)^2 float32 terms per input, summed in another
    # order, each at most max |probe|.
    n = (-(-window // strides)) ** 2
    np.testing.assert_allclose(
        grad(sep_pool)(x), grad(ref_pool)(x), rtol=0,
        atol=rounding_tol(n) * n * float(jnp.max(jnp.abs(probe))))

  def test_max_pool_follows_conv_impl(self):
    x = jnp.ones((1, 8, 8, 2))
    def ops(impl):
      pool = conv.max_pool_function(impl)
      return str(jax.make_jaxpr(
          lambda x: pool(x, (3, 3), (2, 2), ((1, 1), (1, 1))))(x))
    assert jax.default_backend() == 'cpu'
    for impl in ('auto', 'matmul'):
      assert 'reduce_window' not in ops(impl)
    assert 'reduce_window' in ops('xla')

  @pytest.mark.parametrize('stem', models.STEMS)
  def test_conv_impls_share_parameters_and_outputs(self, stem):
    x = jax.random.uniform(jax.random.key(1), (4, 32, 32, 3))
    nets = {impl: models.SimCLRNet(models.ResNet(stem=stem, conv_impl=impl),
                                   proj_hidden_dim=32, proj_dim=8)
            for impl in ('xla', 'matmul')}
    trees = {impl: _abstract_variables(net, x.shape)
             for impl, net in nets.items()}
    assert (jax.tree.structure(trees['xla'])
            == jax.tree.structure(trees['matmul']))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), trees['xla']) == (
        jax.tree.map(lambda a: (a.shape, a.dtype), trees['matmul']))

    variables = numpy_variables(nets['xla'], x.shape)
    # Eval mode: twenty layers of float32 rounding in another summation order.
    evals = {impl: _jit_apply(net, False)(variables, x)
             for impl, net in nets.items()}
    for got, ref in zip(evals['matmul'], evals['xla']):
      np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    # Train mode normalises by the statistics of 4 examples (of 1 pixel in the
    # last stage), which amplifies the rounding differences tenfold.
    trains = {impl: _jit_apply(net, True)(variables, x)
              for impl, net in nets.items()}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3,
                                                         atol=1e-3),
                 trains['matmul'], trains['xla'])
