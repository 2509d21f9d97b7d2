"""`python -m otclr_jax.bench resnet`: the encoder fwd+bwd per `conv_impl`."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from otclr_jax import conv
from otclr_jax.bench import common
from otclr_jax.methods import base


def _encoder_step(config, impl: str, x: jax.Array):
  """Compiled encoder forward + backward at `x`, its variables, its FLOPs."""
  model = base.encoder(config).clone(conv_impl=impl)

  def loss(params, batch_stats, x):
    h, updates = model.apply({'params': params, 'batch_stats': batch_stats},
                             x, train=True, mutable=['batch_stats'])
    return jnp.mean(jnp.square(h)), updates['batch_stats']

  variables = jax.jit(functools.partial(model.init, train=False))(
      jax.random.key(0), x)
  args = (variables['params'], variables['batch_stats'], x)
  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  compiled = step.lower(*args).compile()
  return compiled, args, common.flops(compiled)


def _conv_layers(config) -> dict[tuple[Any, ...], int]:
  """Count of each (input shape, kernel shape, strides, padding) convolution."""
  model = base.encoder(config).clone(conv_impl='xla')
  x = jax.ShapeDtypeStruct(
      (config.batch_size, config.image_size, config.image_size, 3),
      jnp.float32)
  variables = jax.eval_shape(functools.partial(model.init, train=False),
                             jax.random.key(0), x)
  jaxpr = jax.make_jaxpr(functools.partial(model.apply, train=False))(
      variables, x)
  layers = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'conv_general_dilated':
      key = (eqn.invars[0].aval.shape, eqn.invars[1].aval.shape,
             tuple(eqn.params['window_strides']),
             tuple(map(tuple, eqn.params['padding'])))
      layers[key] = layers.get(key, 0) + 1
  return layers


def _conv_step(impl: str, x_shape, kernel_shape, strides, padding):
  """Jitted forward + both gradients of one convolution, and its inputs."""
  conv_fn = conv.conv_function(impl)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(x_shape, np.float32))
  kernel = jnp.asarray(rng.standard_normal(kernel_shape, np.float32))

  def loss(x, kernel):
    y = conv_fn(x, kernel, strides, padding, dimension_numbers=(
        jax.lax.conv_dimension_numbers(x_shape, kernel_shape,
                                       ('NHWC', 'HWIO', 'NHWC'))))
    return jnp.sum(jnp.square(y))

  return jax.jit(jax.grad(loss, argnums=(0, 1))), (x, kernel)


def _print_layers(config, repeats: int) -> None:
  """Per convolution: fwd+bwd ms under 'xla' and 'matmul', and 'auto'."""
  print('\nper convolution, forward + backward (dx, dkernel), median ms:')
  print('| input | kernel | stride | count | xla | matmul | xla / matmul '
        '| auto on CPU |')
  print('|---|---|---|---|---|---|---|---|')
  for (x_shape, k_shape, strides, padding), count in _conv_layers(
      config).items():
    ms = {}
    for impl in ('xla', 'matmul'):
      fn, args = _conv_step(impl, x_shape, k_shape, strides, padding)
      jax.block_until_ready(fn(*args))
      ms[impl], _ = common.time_ms(fn, *args, repeats=repeats)
    auto = 'matmul' if conv.matmul_is_faster(x_shape, strides) else 'xla'
    print(f'| {list(x_shape)} | {list(k_shape)} | {strides[0]} | {count} '
          f'| {ms["xla"]:.1f} | {ms["matmul"]:.1f} '
          f'| {ms["xla"] / ms["matmul"]:.2f} | {auto} |')


def run(fv: flags.FlagValues) -> int:
  """The `resnet` subcommand: the encoder fwd+bwd per `model.conv_impl`."""
  config = fv.config
  impls = list(fv.conv_impls)
  for impl in impls:
    conv.conv_function(impl)
  rng = np.random.default_rng(fv.seed)
  b, size = config.batch_size, config.image_size
  x = jnp.asarray(rng.random((b, size, size, 3), np.float32))
  steps = {impl: _encoder_step(config, impl, x) for impl in impls}
  # One FLOP count for every row: XLA's, of lax.conv.
  flops = (steps['xla'] if 'xla' in steps
           else _encoder_step(config, 'xla', x))[2]
  for compiled, args, _ in steps.values():
    jax.block_until_ready(compiled(*args))  # warm-up
  times = {impl: [] for impl in impls}
  for _ in range(fv.repeats):
    for impl, (compiled, args, _) in steps.items():  # alternated
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times[impl].append(time.perf_counter() - start)
  peak = common.matmul_peak_gflops()
  device = jax.devices()[0]
  print(f'ResNet {config.model.stage_sizes} ({config.model.stem} stem) '
        f'forward + backward, batch {b}, {size}x{size}, {config.dtype}, '
        f'{device.device_kind} ({device.platform}); median (min) of '
        f'{fv.repeats} alternated steps; {flops / 1e9:.1f} GFLOP per step '
        f'(XLA cost analysis, lax.conv); float32 matmul peak {peak:.1f} '
        'GFLOP/s')
  ref = statistics.median(times[impls[0]])
  for impl in impls:
    med = statistics.median(times[impl])
    gflop_s = flops / med / 1e9
    print(f'  conv_impl={impl}: {1e3 * med:.1f} ms '
          f'({1e3 * min(times[impl]):.1f}), {gflop_s:.1f} GFLOP/s = '
          f'{gflop_s / peak:.2f} x peak, {med / ref:.2f} x {impls[0]}')
  if fv.per_layer:
    _print_layers(config, fv.repeats)
  return 0

