"""`python -m otclr_jax.bench train`: the complexity table of every method."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from otclr_jax import ot
from otclr_jax.bench import common


def _splits(config, num_train: int, seed: int):
  """(train, test) `Split`s and their source's name: random uint8 if absent."""
  from otclr_jax import data  # pylint: disable=g-import-not-at-top
  try:
    return [data.load_split(config.dataset, split, config.image_size,
                            config.data_dir or None, download=False)
            for split in ('train', 'test')], config.dataset
  except Exception:  # pylint: disable=broad-except
    rng = np.random.default_rng(seed)
    shape = (config.image_size, config.image_size, 3)
    return [data.Split(
        rng.integers(0, 256, (num,) + shape, dtype=np.uint8),
        rng.integers(0, 10, num, dtype=np.int32), 10,
        [str(c) for c in range(10)])
            for num in (num_train, config.monitor.num_test)], 'random uint8'


@dataclasses.dataclass
class Variant:
  """One compiled training step of the `train` table."""
  title: str  # the run's, e.g. 'OTCLR'
  model: Any
  step: Any
  state: Any
  step_flops: float
  fwd_flops: float
  params_m: float
  eval_params_m: float
  times: list[float] = dataclasses.field(default_factory=list)
  label: str = ''  # the table's: the title, with the core where it varies

  @property
  def ms(self) -> float:
    return 1e3 * statistics.median(self.times)


def _compile_variant(config, batch, key, mesh) -> Variant:
  """Compiles `config`'s step; counts its FLOPs and parameters."""
  from otclr_jax import experiment, step as step_lib  # pylint: disable=g-import-not-at-top
  run, state, step = step_lib.build(config, 100, mesh)
  compiled = step.lower(state, batch, key).compile()
  # XLA skips a convolution's zero padding: below the papers' naive counts.
  views_in = jnp.zeros((2 * batch.shape[0],) + batch.shape[1:], jnp.float32)
  variables = {'params': state.params['net'], 'batch_stats': state.batch_stats}
  fwd = jax.jit(lambda v, x: run.model.apply(v, x, train=False))
  return Variant(
      run.recipe.title, run.model, compiled, state, common.flops(compiled),
      common.flops(fwd.lower(variables, views_in).compile()),
      step_lib.pretraining_params(state) / 1e6,
      experiment.count_params(state.params['net']['encoder']) / 1e6)


def _time_views(base, clean, repeats: int) -> dict[str, float]:
  """Median ms of both OT views of a batch, as the OTCLR step makes them."""
  otc = base.ot
  views_ms = {}
  for core in ot.CORES:
    views = functools.partial(
        ot.ot_views, alpha=otc.alpha, grid_size=otc.grid_size,
        epsilon=otc.epsilon, num_iters=otc.num_iters, core=core)
    both = jax.jit(
        lambda x, s1, s2, views=views: (views(x, s1), views(x, s2)))
    views_ms[core], _ = common.time_ms(both, clean, clean[::-1], clean,
                                       repeats=2 * repeats, min_time_s=1.0)
  return views_ms


def _time_stages(base, views: str, variant: Variant, clean, key,
                 repeats: int) -> tuple[float, float]:
  """Median ms of the SimCLR step's views and network fwd+bwd, jitted apart."""
  from otclr_jax import views as views_lib  # pylint: disable=g-import-not-at-top
  config = base.copy_and_resolve_references()
  config.method, config.views = 'simclr', views
  make = jax.jit(lambda x, k: views_lib.make_views(config, x, k)[:2])
  views_ms, _ = common.time_ms(make, clean, key, repeats=2 * repeats)
  model, batch_stats = variant.model, variant.state.batch_stats

  def outputs(params, x):
    out, _ = model.apply({'params': params, 'batch_stats': batch_stats}, x,
                         train=True, mutable=['batch_stats'])
    return sum(jnp.sum(o) for o in jax.tree_util.tree_leaves(out))

  both = jnp.concatenate(make(clean, key))
  network = jax.jit(jax.grad(outputs))
  network_ms, _ = common.time_ms(network, variant.state.params['net'], both,
                                 repeats=repeats)
  return views_ms, network_ms


def _pipeline_per_s(images, batch_size: int, seed: int, mesh) -> float:
  """Host input pipeline: batches gathered and handed to the devices per s."""
  from otclr_jax import data, experiment  # pylint: disable=g-import-not-at-top
  batches = data.train_batches(images, batch_size, seed)
  next(batches)
  n = 50
  start = time.perf_counter()
  for _ in range(n):
    jax.block_until_ready(experiment.global_batch(next(batches), mesh))
  per_s = n / (time.perf_counter() - start)
  getattr(batches, 'close', lambda: None)()
  return per_s


def run(fv: flags.FlagValues) -> int:
  """The `train` subcommand: prints the complexity table and the ratios."""
  base = fv.config
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from otclr_jax import experiment, methods, tables  # pylint: disable=g-import-not-at-top

  batch_size, size = base.batch_size, base.image_size
  mesh = experiment.make_mesh()
  splits, source = _splits(
      base, max(4 * batch_size, 1024, base.monitor.num_train), fv.seed)
  images = splits[0].images
  host_batch = images[:batch_size]
  batch = experiment.global_batch(host_batch, mesh)
  key = jax.device_put(jax.random.key(fv.seed),
                       NamedSharding(mesh, PartitionSpec()))

  other = common.other_core()
  names = ['simclr'] + [m for m in (fv.methods or methods.NAMES)
                        if m != 'simclr']
  unknown = sorted(set(names) - set(methods.NAMES))
  if unknown:
    raise ValueError(f'--methods: unknown {unknown}; expected some of '
                     f'{methods.NAMES}.')
  settings = {f'{m}/{v}': (m, v, ot.DEFAULT_CORE)
              for m in names for v in ('augment', 'ot')}
  settings[f'simclr/ot/{other}'] = ('simclr', 'ot', other)
  otclr = 'simclr/ot'
  variants = {}
  for name, (method, views, core) in settings.items():
    config = base.copy_and_resolve_references()
    config.method, config.views, config.ot.core = method, views, core
    v = variants[name] = _compile_variant(config, batch, key, mesh)
    v.label = v.title + (f' core={core}' if name.startswith(otclr) else '')
    print(f'compiled {name} step', flush=True)

  for v in variants.values():  # warm-up
    v.state, metrics = v.step(v.state, batch, key)
    jax.block_until_ready(metrics)
  for _ in range(fv.repeats):
    for v in variants.values():  # alternated, so drifts in load hit all
      start = time.perf_counter()
      v.state, metrics = v.step(v.state, batch, key)
      jax.block_until_ready(metrics)
      v.times.append(time.perf_counter() - start)
  peak = common.matmul_peak_gflops()
  model, state = variants[otclr].model, variants[otclr].state
  encoder_vars = {'params': state.params['net'],
                  'batch_stats': state.batch_stats}
  encode = jax.jit(lambda v, x: model.apply(v, x, train=False)[0])
  clean = jnp.asarray(host_batch, jnp.float32) / 255.0
  eval_compiled = encode.lower(encoder_vars, clean).compile()
  eval_flops = common.flops(eval_compiled)
  eval_ms, _ = common.time_ms(eval_compiled, encoder_vars, clean,
                              repeats=2 * fv.repeats)
  monitor_ms, monitor_images = _time_monitor(base, model, state, splits,
                                             fv.repeats)
  views_ms = _time_views(base, clean, fv.repeats)
  stages = {v: _time_stages(base, v, variants[f'simclr/{v}'], clean, key,
                            fv.repeats) for v in ('augment', 'ot')}
  pipeline_per_s = _pipeline_per_s(images, batch_size, fv.seed, mesh)
  device = jax.devices()[0]
  print(f'\nbatch {batch_size}, {size}x{size}, dtype {base.dtype}, conv_impl '
        f'{base.model.conv_impl}, {len(jax.devices())} x '
        f'{device.device_kind} ({device.platform}); median of {fv.repeats} '
        f'alternated steps; GFLOPs per image pair, forward')

  def row(stage, method, params_m, flops, ms):
    return dict(stage=stage, method=method, params_m=params_m,
                gflops=flops / batch_size / 1e9, step_ms=ms,
                throughput=1e3 * batch_size / ms)

  rows = [row('Pretraining', v.label, v.params_m, v.fwd_flops, v.ms)
          for v in variants.values()]
  rows += [row('Linear eval.', v.title, v.eval_params_m, eval_flops, eval_ms)
           for v in (variants[f'{m}/augment'] for m in names)]
  print(tables.complexity_table(rows))
  print(f'\nfloat32 matmul peak ({common.PEAK_MATMUL_SIZE}^2, same run): '
        f'{peak:.1f} GFLOP/s. Achieved (XLA cost analysis of the step / '
        'median step time):')
  for v in variants.values():
    gflop_s = v.step_flops / v.ms / 1e6
    print(f'  {v.label}: {gflop_s:.1f} GFLOP/s = {gflop_s / peak:.2f} x peak')
  print()
  for m in names:
    ot_v, aug_v = variants[f'{m}/ot'], variants[f'{m}/augment']
    print(f'{ot_v.title} / {aug_v.title} step time: {ot_v.ms / aug_v.ms:.3f}')
  print(f'OTCLR step core={other} / core={ot.DEFAULT_CORE}: '
        f'{variants[f"{otclr}/{other}"].ms / variants[otclr].ms:.3f}')
  for core in ot.CORES:
    step_ms = variants[otclr if core == ot.DEFAULT_CORE
                       else f'{otclr}/{core}'].ms
    print(f'OT views core={core} (2 x {batch_size} images): '
          f'{views_ms[core]:.1f} ms = {100 * views_ms[core] / step_ms:.2f}% '
          f'of the OTCLR step ({step_ms:.1f} ms)')
  for views, (views_stage, network) in stages.items():
    step_ms = variants[f'simclr/{views}'].ms
    rest = step_ms - views_stage - network
    print(f'{variants[f"simclr/{views}"].title} step {step_ms:.1f} ms by '
          f'stage: views {views_stage:.1f} ms ({100 * views_stage / step_ms:.1f}'
          f'%), network forward + backward on 2 x {batch_size} views '
          f'{network:.1f} ms ({100 * network / step_ms:.1f}%), the rest (loss, '
          f'update, metrics) {rest:.1f} ms ({100 * rest / step_ms:.1f}%)')
  otclr_ms = variants[otclr].ms
  print(f'Input pipeline ({source}): {pipeline_per_s:,.0f} batches/s vs '
        f'{1e3 / otclr_ms:.2f} steps/s = '
        f'{pipeline_per_s * otclr_ms / 1e3:,.0f}x')
  every = base.monitor.every_steps
  monitor_text = (f'every {every} steps: {monitor_ms:.1f} ms = '
                  f'{100 * monitor_ms / (every * otclr_ms):.3f}% of '
                  f'{every} OTCLR steps' if every > 0 else
                  'off (config.monitor.every_steps=0)')
  print(f'kNN monitor ({monitor_images} of {source}): {monitor_ms:.1f} ms '
        f'per call; {monitor_text}')
  return 0


def _time_monitor(config, model, state, splits, repeats: int
                  ) -> tuple[float, str]:
  """Median ms of one kNN monitor call on `splits`, and their sizes."""
  from otclr_jax.evaluation import monitor  # pylint: disable=g-import-not-at-top
  knn = monitor.KnnMonitor(config, model, *splits)
  knn(state)  # compiles
  return common.time_ms(knn, state, repeats=repeats)[0], (
      f'{len(knn.train_images)} train / {len(knn.test_images)} test images')

