"""Benchmarks: `python -m otclr_jax.bench <ot|train|resnet> [flags]`.

  ot   ms per batch of the OT view generator (docs/method.md sections 2-5):
       our `ot.ot_views` (row (c), default core) against ott-jax's dense
       solver (a), POT (b), `ot_views` with its other Sinkhorn core and each
       stage of `ot_views` (d: the public pieces of `otclr_jax.ot` it runs),
       with their ratios. Every implementation's views are first compared
       with (c)'s (max abs pixel difference): the rows compute the same thing.
  train --config=configs/X.py
       `tables.complexity_table` of every method of `methods.NAMES` with both
       view generators, and of OTCLR per Sinkhorn core: parameters, forward
       GFLOPs per image pair (XLA cost analysis), median step time and pairs/s
       (steps alternated in one process after a warm-up), and the linear
       evaluation's forward. Then each step's GFLOP/s beside this machine's
       float32 matmul peak (timed in the same run), the OT/augment step-time
       ratio per method, the OT views' share of the OTCLR step, the input
       pipeline's batches/s over the step's, and the kNN monitor's cost.
  resnet --config=configs/X.py
       ResNet-18 forward + backward (training-mode BatchNorm) at
       `config.batch_size` per `--conv_impls` value of `model.conv_impl`,
       alternated, with GFLOP/s and ratios; `--per_layer` times every
       convolution under 'xla' and 'matmul' beside the choice of 'auto'.
       `launch/bench_torch.py` times PyTorch's ResNet-18 the same way.

Config fields are overridden as `--config.a.b=v` on a locked config (a typo
fails with a suggestion). The benchmark prints medians and ratios; it judges
no targets. POT, a test-only dependency, is imported lazily with its
TensorFlow, PyTorch, CuPy and JAX backends disabled (its import would
otherwise load every installed array library); without POT row (b) is skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from ott.geometry import geometry
from ott.problems.linear import linear_problem
from ott.solvers.linear import sinkhorn

from otclr_jax import models
from otclr_jax import ot

COMMANDS = ('ot', 'train', 'resnet')

# Max abs pixel difference (images in [0, 1]) tolerated between an
# implementation and `ot_views`: a quarter of an 8-bit grey level. Float32
# lse-mode and float64 POT iterates differ from ours by far less than this.
VIEW_ATOL = 1e-3

# Side of the square float32 matmul that measures the machine's peak.
PEAK_MATMUL_SIZE = 2048


# ----------------------------------------------------------------------------
# Implementations of the view generator, all with the same signature
# `fn(x [B, H, W, C], x_strong [B, H, W, C]) -> views [B, H, W, C]`.


@dataclasses.dataclass(frozen=True)
class OTSettings:
  """Static settings of the view generator (docs/method.md section 8)."""
  grid_size: int = 16
  epsilon: float = 0.05
  num_iters: int = 20
  alpha: float = 0.5


def _measures(x, x_strong, s: OTSettings):
  """Histograms `[B * C, m, m]` of both images, interpolated mass and offset."""
  p_src, mass_src, off_src = ot.image_to_measure(x, s.grid_size)
  p_str, mass_str, off_str = ot.image_to_measure(x_strong, s.grid_size)
  mass = (1.0 - s.alpha) * mass_src + s.alpha * mass_str
  offset = (1.0 - s.alpha) * off_src + s.alpha * off_str
  m = s.grid_size
  return p_src.reshape(-1, m, m), p_str.reshape(-1, m, m), mass, offset


def _reconstruct(p_bar, mass, offset, height: int, width: int):
  """`[B * C, m, m]` splatted histograms back to images `[B, H, W, C]`."""
  p_bar = p_bar.reshape(mass.shape + p_bar.shape[-2:])
  return ot.measure_to_image(p_bar, mass, offset, height, width)


def _views_with(per_problem: Callable, x, x_strong, s: OTSettings):
  """View generator around a per-channel `(a, b) [m, m] -> p_bar [m, m]`."""
  a, b, mass, offset = _measures(x, x_strong, s)
  p_bar = jax.vmap(per_problem)(a, b)
  return _reconstruct(p_bar, mass, offset, x.shape[1], x.shape[2])


def _exact_iterations(num_iters: int, **kwargs) -> sinkhorn.Sinkhorn:
  # min = max = inner = T runs exactly T iterations, with unrolled gradients
  # (docs/method.md section 3 explains why inner must equal T).
  return sinkhorn.Sinkhorn(
      min_iterations=num_iters, max_iterations=num_iters,
      inner_iterations=num_iters, implicit_diff=None, **kwargs)


def make_ott_dense(s: OTSettings) -> Callable:
  """(a) ott-jax dense `Geometry` in lse mode, materialised plan, scatter."""
  cost = jnp.asarray(ot.grid_cost(s.grid_size), jnp.float32)
  solver = _exact_iterations(s.num_iters)

  def per_problem(a, b):
    geom = geometry.Geometry(cost_matrix=cost, epsilon=s.epsilon)
    out = solver(linear_problem.LinearProblem(geom, a.ravel(), b.ravel()))
    return ot.dense_displace(out.matrix, s.alpha)

  return jax.jit(functools.partial(_views_with, per_problem, s=s))


def make_ot_views(s: OTSettings, core: str = ot.DEFAULT_CORE) -> Callable:
  """(c) our jitted `ot.ot_views` with a Sinkhorn core."""
  return jax.jit(functools.partial(
      ot.ot_views, alpha=s.alpha, grid_size=s.grid_size, epsilon=s.epsilon,
      num_iters=s.num_iters, core=core))


def import_pot():
  """POT with its non-NumPy backends disabled, or None if not installed."""
  for backend in ('TENSORFLOW', 'PYTORCH', 'CUPY', 'JAX'):
    os.environ.setdefault(f'POT_BACKEND_DISABLE_{backend}', '1')
  try:
    pot = importlib.import_module('ot')
  except ImportError:
    return None
  # Run as a script from inside the package, `ot` would be our own module.
  return pot if hasattr(pot, 'sinkhorn') else None


def numpy_splat_tables(grid_size: int, alpha: float):
  """Flat target vertex and bilinear weight of every packet, `[4, N, N]` each.

  The floor/fraction form of docs/method.md section 4, in float64.
  """
  r = ot.grid_points(grid_size)
  g = ((1.0 - alpha) * r[:, None, :] + alpha * r[None, :, :]) * (grid_size - 1)
  k = np.clip(np.floor(g), 0, grid_size - 2).astype(np.int64)
  t = g - k
  index, weight = [], []
  for dr in (0, 1):
    for dc in (0, 1):
      index.append((k[..., 0] + dr) * grid_size + k[..., 1] + dc)
      weight.append(np.where(dr, t[..., 0], 1.0 - t[..., 0])
                    * np.where(dc, t[..., 1], 1.0 - t[..., 1]))
  return np.stack(index), np.stack(weight)


def make_pot(s: OTSettings, pot) -> Callable:
  """(b) POT `ot.sinkhorn` in a Python loop + NumPy splat of each plan.

  Measure and reconstruction are the jitted JAX functions `ot_views` uses;
  Sinkhorn and the splat run in NumPy float64, one problem at a time. The splat
  scatter-adds with `np.bincount`, ~10x faster than `np.add.at` for this size.
  """
  m = s.grid_size
  cost = ot.grid_cost(m)
  index, weight = numpy_splat_tables(m, s.alpha)
  flat_index = index.ravel()
  measures = jax.jit(functools.partial(_measures, s=s))

  @functools.partial(jax.jit, static_argnums=(3, 4))
  def reconstruct(p_bar, mass, offset, height, width):
    return _reconstruct(p_bar, mass, offset, height, width)

  def views(x, x_strong):
    a, b, mass, offset = measures(x, x_strong)
    a = np.asarray(a, np.float64).reshape(a.shape[0], -1)
    b = np.asarray(b, np.float64).reshape(b.shape[0], -1)
    p_bar = np.empty_like(a)
    for i in range(a.shape[0]):
      plan = pot.sinkhorn(a[i], b[i], cost, reg=s.epsilon,
                          numItermax=s.num_iters, stopThr=0.0, warn=False)
      p_bar[i] = np.bincount(flat_index, (weight * plan).ravel(),
                             minlength=m * m)
    p_bar = jnp.asarray(p_bar.reshape(-1, m, m), jnp.float32)
    return reconstruct(p_bar, mass, offset, x.shape[1], x.shape[2])

  return views


def make_stages(s: OTSettings):
  """(d) `ot_views` split into separately jitted stages.

  Returns:
    `(measure, sinkhorn, splat, reconstruct)`: `measure(x, x_strong) -> (a, b,
    mass, offset)`, `sinkhorn(a, b) -> (u, v)`, `splat(u, v) -> p_bar`,
    `reconstruct(p_bar, mass, offset, H, W) -> views`; chained, they compute
    `ot_views`.
  """
  measure = jax.jit(functools.partial(_measures, s=s))
  scalings = jax.jit(
      lambda a, b: ot.sinkhorn_scalings(a, b, s.epsilon, s.num_iters))
  splat = jax.jit(
      lambda u, v: ot.displace_from_scalings(u, v, s.alpha, s.epsilon))
  reconstruct = jax.jit(_reconstruct, static_argnums=(3, 4))
  return measure, scalings, splat, reconstruct


# ----------------------------------------------------------------------------
# Timing.


def time_ms(fn: Callable, *args, repeats: int, min_time_s: float = 0.0
            ) -> tuple[float, float]:
  """Median and minimum wall time of `fn(*args)` in ms, device synchronised.

  Calls `fn` at least `repeats` times and until `min_time_s` seconds have
  passed, so the median of a fast function rests on many calls. The minimum is
  reported beside it because other processes share the CPU: it estimates the
  unloaded time.
  """
  times = []
  start_all = time.perf_counter()
  while (len(times) < repeats
         or time.perf_counter() - start_all < min_time_s):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times), 1e3 * min(times)


def _bench_images(batch_size: int, image_size: int, seed: int):
  rng = np.random.default_rng(seed)
  shape = (batch_size, image_size, image_size, 3)
  x = jnp.asarray(rng.random(shape, np.float32))
  x_strong = jnp.asarray(rng.random(shape, np.float32))
  return x, x_strong


@dataclasses.dataclass
class Row:
  """A table row: a label and, per batch size, a value and maybe a minimum."""
  label: str
  values: dict[int, float] = dataclasses.field(default_factory=dict)
  minima: dict[int, float] = dataclasses.field(default_factory=dict)
  unit: str = ''


def format_table(batch_sizes: Sequence[int], rows: Sequence[Row]) -> str:
  width = max(len(r.label) for r in rows) + 2
  cell = 20
  lines = [f"{'':<{width}}" + ''.join(f'{f"B={b}":>{cell}}'
                                      for b in batch_sizes)]
  for row in rows:
    cells = []
    for b in batch_sizes:
      text = f'{row.values[b]:.2f}{row.unit}' if b in row.values else '-'
      if b in row.minima:
        text += f' ({row.minima[b]:.2f})'
      cells.append(f'{text:>{cell}}')
    lines.append(f'{row.label:<{width}}' + ''.join(cells))
  return '\n'.join(lines)


def _check_views(outputs: dict[str, np.ndarray]) -> tuple[str, bool]:
  """Max abs difference of each implementation's views from (c)'s."""
  parts, ok_all = [], True
  for k, views in outputs.items():
    if k == 'c':
      continue
    diff = float(np.max(np.abs(views - outputs['c'])))
    ok = diff <= VIEW_ATOL
    ok_all &= ok
    parts.append(f"{k}: {diff:.2e}{'' if ok else ' MISMATCH'}")
  return ', '.join(parts), ok_all


def _time_stages(stages, x, x_strong, repeats: int, min_time_s: float):
  """Median and minimum ms of each (d) stage, on the previous stage's output."""
  measure, scalings, splat, reconstruct = stages
  height, width = x.shape[1], x.shape[2]
  a, b, mass, offset = jax.block_until_ready(measure(x, x_strong))
  u, v = jax.block_until_ready(scalings(a, b))
  p_bar = jax.block_until_ready(splat(u, v))
  calls = [(measure, (x, x_strong)), (scalings, (a, b)), (splat, (u, v)),
           (reconstruct, (p_bar, mass, offset, height, width))]
  jax.block_until_ready(reconstruct(*calls[-1][1]))
  return [time_ms(fn, *fn_args, repeats=repeats, min_time_s=min_time_s)
          for fn, fn_args in calls]


def _other_core() -> str:
  """The Sinkhorn core that is not `ot.DEFAULT_CORE`."""
  return next(c for c in ot.CORES if c != ot.DEFAULT_CORE)


def _ratio_row(label: str, num: Row, den: Row) -> Row:
  return Row(label, {b: num.values[b] / den.values[b] for b in den.values},
             unit='x')


def run_ot(fv: flags.FlagValues) -> int:
  """The `ot` subcommand. Returns 1 if an implementation disagrees with (c)."""
  s = OTSettings(fv.grid_size, fv.epsilon, fv.num_iters, fv.alpha)
  batch_sizes = [int(b) for b in fv.batch_sizes]
  if fv.repeats < 1:
    raise ValueError(f'--repeats must be >= 1, got {fv.repeats}.')
  if fv.min_time_s < 0:
    raise ValueError(f'--min_time_s must be >= 0, got {fv.min_time_s}.')
  if not batch_sizes or min(batch_sizes) < 1:
    raise ValueError(f'--batch_sizes must be >= 1, got {batch_sizes}.')
  if fv.grid_size > fv.image_size:
    raise ValueError(
        f'--grid_size {fv.grid_size} exceeds --image_size {fv.image_size}.')
  pot = import_pot()

  impls = {
      'a': ('(a) ott dense Geometry lse + dense splat', make_ott_dense(s))}
  if pot is not None:
    impls['b'] = ('(b) POT loop + NumPy splat', make_pot(s, pot))
  impls['c'] = ('(c) otclr_jax ot.ot_views', make_ot_views(s))
  other = _other_core()
  impls['core'] = (f'ot.ot_views core={other}', make_ot_views(s, other))
  stages = make_stages(s)

  print(f'devices: {jax.devices()}')
  print(f'OT view generator: {fv.image_size}x{fv.image_size}x3 images, '
        f'm={s.grid_size}, T={s.num_iters}, eps={s.epsilon:g}, '
        f'alpha={s.alpha:g}, (c) core={ot.DEFAULT_CORE}. ms per batch: '
        f'median (min) over at least {fv.repeats} calls and '
        f'{fv.min_time_s:g} s per row, after one warm-up call, '
        'block_until_ready.')
  if pot is None:
    print('note: POT is not installed (pip install pot); row (b) skipped.')
  else:
    print('(b): POT float64 Sinkhorn + np.bincount splat per problem in a '
          'Python loop; measure/reconstruct in jitted JAX (as in (c)).')

  rows = {k: Row(label) for k, (label, _) in impls.items()}
  stage_rows = [Row(f'  (d) {name}') for name in (
      'measure (resize x, x_s)', 'Sinkhorn (T iters)', 'displacement splat',
      'reconstruct (upsample, clip)')]
  stage_sum = Row('  (d) sum of stages')
  all_ok = True
  for batch_size in batch_sizes:
    x, x_strong = _bench_images(batch_size, fv.image_size, fv.seed)
    # The warm-up call compiles; its output is checked against (c).
    outputs = {k: np.asarray(fn(x, x_strong)) for k, (_, fn) in impls.items()}
    text, ok = _check_views(outputs)
    all_ok &= ok
    print(f'check B={batch_size}: max |views - (c)| (atol {VIEW_ATOL:g}) '
          f'{text}')
    for k, (_, fn) in impls.items():
      rows[k].values[batch_size], rows[k].minima[batch_size] = time_ms(
          fn, x, x_strong, repeats=fv.repeats, min_time_s=fv.min_time_s)
    timings = _time_stages(stages, x, x_strong, fv.repeats, fv.min_time_s)
    for row, (median, minimum) in zip(stage_rows, timings):
      row.values[batch_size], row.minima[batch_size] = median, minimum
    stage_sum.values[batch_size] = sum(t[0] for t in timings)
    stage_sum.minima[batch_size] = sum(t[1] for t in timings)

  table = [rows[k] for k in ('a', 'b', 'c') if k in rows]
  table += stage_rows + [stage_sum, rows['core']]
  table += [_ratio_row(f'ratio ({k})/(c)', rows[k], rows['c'])
            for k in ('a', 'b') if k in rows]
  table.append(_ratio_row(f'ratio core={other}/(c)', rows['core'], rows['c']))
  c = rows['c']
  table.append(Row('(c) ms per 64 images',
                   {b: c.values[b] * 64 / b for b in batch_sizes},
                   {b: c.minima[b] * 64 / b for b in batch_sizes}))
  print(format_table(batch_sizes, table))
  if not all_ok:
    print(f'ERROR: an implementation differs from (c) by more than '
          f'{VIEW_ATOL:g}; the timings do not compare like with like.')
  return 0 if all_ok else 1


# ----------------------------------------------------------------------------
# train: the complexity table.


def _flops(compiled) -> float:
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0]
  return float(analysis.get('flops', float('nan')))


def matmul_peak_gflops(size: int = PEAK_MATMUL_SIZE, repeats: int = 3
                       ) -> float:
  """GFLOP/s of a jitted float32 [size, size] x [size, size] matmul, now."""
  a = jnp.asarray(np.random.default_rng(0).random((size, size), np.float32))
  matmul = jax.jit(jnp.dot).lower(a, a).compile()
  ms, _ = time_ms(matmul, a, a, repeats=repeats)
  return 2.0 * size ** 3 / ms / 1e6


def _splits(config, num_train: int, seed: int):
  """Train and test `Split`s of the config's dataset and its name.

  Random uint8 images and labels (`num_train` and `monitor.num_test`) when
  the dataset is not prepared here: gathering and embedding cost the same.
  """
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
  run = experiment.setup(config, steps_per_epoch=100)
  state = experiment.initial_state(config, run, mesh)
  step = step_lib.jit_train_step(
      run.method, config, run.model, run.tx, run.schedule, mesh,
      total_steps=run.total_steps, steps_per_epoch=run.steps_per_epoch)
  compiled = step.lower(state, batch, key).compile()
  # Both views of the batch: the forward FLOPs of B image pairs through the
  # trained network. XLA counts only multiply-adds on real pixels, not on a
  # convolution's zero padding, which at 32 x 32 (1 x 1 maps in the last
  # stage) is much of the naive count that papers quote.
  views_in = jnp.zeros((2 * batch.shape[0],) + batch.shape[1:], jnp.float32)
  variables = {'params': state.params['net'], 'batch_stats': state.batch_stats}
  fwd = jax.jit(lambda v, x: run.model.apply(v, x, train=False))
  # Pretraining: the trained network and its targets (MoCo: query + key
  # encoders with heads, the paper's 23.01M); evaluation: the encoder.
  return Variant(
      run.title, compiled, state, _flops(compiled),
      _flops(fwd.lower(variables, views_in).compile()),
      experiment.pretraining_params(state) / 1e6,
      experiment.count_params(state.params['net']['encoder']) / 1e6)


def _time_views(base, clean, repeats: int) -> dict[str, float]:
  """Median ms of both OT views of a batch, as the OTCLR step makes them."""
  otc = base.ot
  views_ms = {}
  for core in ot.CORES:
    views_fn = jax.jit(functools.partial(
        lambda x, s1, s2, core: (
            ot.ot_views(x, s1, otc.alpha, otc.grid_size, otc.epsilon,
                        otc.num_iters, core),
            ot.ot_views(x, s2, otc.alpha, otc.grid_size, otc.epsilon,
                        otc.num_iters, core)), core=core))
    views_ms[core], _ = time_ms(views_fn, clean, clean[::-1], clean,
                                repeats=2 * repeats, min_time_s=1.0)
  return views_ms


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


def run_train(base, fv: flags.FlagValues) -> int:
  """The `train` subcommand: prints the complexity table and the ratios."""
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

  # Every method with both view generators (default Sinkhorn core), then
  # OTCLR (SimCLR + OT views) with the other core.
  other = _other_core()
  settings = {f'{m}/{v}': (m, v, ot.DEFAULT_CORE)
              for m in methods.NAMES for v in ('augment', 'ot')}
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
  peak = matmul_peak_gflops()

  # Linear evaluation: the frozen encoder's forward pass on clean images.
  config = base.copy_and_resolve_references()
  config.method, config.views = 'simclr', 'ot'
  model = experiment.create_model(config)
  state = variants[otclr].state
  encoder_vars = {'params': state.params['net'],
                  'batch_stats': state.batch_stats}
  encode = jax.jit(lambda v, x: model.apply(v, x, train=False)[0])
  clean = jnp.asarray(host_batch, jnp.float32) / 255.0
  eval_compiled = encode.lower(encoder_vars, clean).compile()
  eval_flops = _flops(eval_compiled)
  eval_ms, _ = time_ms(eval_compiled, encoder_vars, clean,
                       repeats=2 * fv.repeats)
  monitor_ms, monitor_images = _time_monitor(base, model, state, splits,
                                             fv.repeats)
  views_ms = _time_views(base, clean, fv.repeats)
  pipeline_per_s = _pipeline_per_s(images, batch_size, fv.seed, mesh)

  device = jax.devices()[0]
  print(f'\nbatch {batch_size}, {size}x{size}, dtype {base.dtype}, conv_impl '
        f'{base.model.conv_impl}, {len(jax.devices())} x '
        f'{device.device_kind} ({device.platform}); median of {fv.repeats} '
        f'alternated steps; GFLOPs per image pair, forward')
  rows = [dict(stage='Pretraining', method=v.label, params_m=v.params_m,
               gflops=v.fwd_flops / batch_size / 1e9, step_ms=v.ms,
               throughput=1e3 * batch_size / v.ms)
          for v in variants.values()]
  # Same frozen encoder with either views: they exist only in pretraining.
  rows += [dict(stage='Linear eval.', method=variants[f'{m}/augment'].title,
                params_m=variants[f'{m}/augment'].eval_params_m,
                gflops=eval_flops / batch_size / 1e9, step_ms=eval_ms,
                throughput=1e3 * batch_size / eval_ms)
           for m in methods.NAMES]
  print(tables.complexity_table(rows))
  print(f'\nfloat32 matmul peak ({PEAK_MATMUL_SIZE}^2, same run): '
        f'{peak:.1f} GFLOP/s. Achieved (XLA cost analysis of the step / '
        'median step time):')
  for v in variants.values():
    gflop_s = v.step_flops / v.ms / 1e6
    print(f'  {v.label}: {gflop_s:.1f} GFLOP/s = {gflop_s / peak:.2f} x peak')
  print()
  for m in methods.NAMES:
    ot_v, aug_v = variants[f'{m}/ot'], variants[f'{m}/augment']
    print(f'{ot_v.title} / {aug_v.title} step time: {ot_v.ms / aug_v.ms:.3f}')
  print(f'OTCLR step core={other} / core={ot.DEFAULT_CORE}: '
        f'{variants[f"{otclr}/{other}"].ms / variants[otclr].ms:.3f}')
  for core in ot.CORES:
    step_ms = variants[otclr if core == ot.DEFAULT_CORE
                       else f'{otclr}/{core}'].ms
    print(f'OT views core={core} (2 x {batch_size} images): '
          f'{views_ms[core]:.1f} ms = {100 * views_ms[core] / step_ms:.2f}% '
          'of the OTCLR step')
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
  """Median ms of one kNN monitor call (otclr_jax/evaluation/monitor.py) on `splits`."""
  from otclr_jax.evaluation import monitor  # pylint: disable=g-import-not-at-top
  knn = monitor.KnnMonitor(config, model, *splits)
  knn(state)  # compiles
  return time_ms(knn, state, repeats=repeats)[0], (
      f'{len(knn.train_images)} train / {len(knn.test_images)} test images')


# ----------------------------------------------------------------------------
# resnet: the encoder's forward + backward per convolution implementation.


def _encoder_step(config, impl: str, x: jax.Array):
  """Compiled ResNet-18 forward + backward at `x`, its variables, its FLOPs."""
  model = models.ResNet18(stem=config.model.stem, conv_impl=impl,
                          dtype=jnp.dtype(config.dtype))

  def loss(params, batch_stats, x):
    h, updates = model.apply({'params': params, 'batch_stats': batch_stats},
                             x, train=True, mutable=['batch_stats'])
    return jnp.mean(jnp.square(h)), updates['batch_stats']

  variables = jax.jit(functools.partial(model.init, train=False))(
      jax.random.key(0), x)
  args = (variables['params'], variables['batch_stats'], x)
  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  compiled = step.lower(*args).compile()
  return compiled, args, _flops(compiled)


def _conv_layers(config) -> dict[tuple[Any, ...], int]:
  """Each distinct convolution of ResNet-18 and how often it occurs.

  Keys are (input shape, kernel shape, strides, padding), read from the
  traced forward pass with `lax.conv`.
  """
  model = models.ResNet18(stem=config.model.stem, conv_impl='xla')
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
  conv = models.conv_function(impl)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(x_shape, np.float32))
  kernel = jnp.asarray(rng.standard_normal(kernel_shape, np.float32))

  def loss(x, kernel):
    y = conv(x, kernel, strides, padding, dimension_numbers=(
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
      ms[impl], _ = time_ms(fn, *args, repeats=repeats)
    auto = ('matmul' if models.matmul_is_faster(x_shape, k_shape, strides)
            else 'xla')
    print(f'| {list(x_shape)} | {list(k_shape)} | {strides[0]} | {count} '
          f'| {ms["xla"]:.1f} | {ms["matmul"]:.1f} '
          f'| {ms["xla"] / ms["matmul"]:.2f} | {auto} |')


def run_resnet(config, fv: flags.FlagValues) -> int:
  """The `resnet` subcommand: ResNet-18 fwd+bwd per `model.conv_impl`."""
  impls = list(fv.conv_impls)
  for impl in impls:
    models.conv_function(impl)
  rng = np.random.default_rng(fv.seed)
  b, size = config.batch_size, config.image_size
  x = jnp.asarray(rng.random((b, size, size, 3), np.float32))
  steps = {impl: _encoder_step(config, impl, x) for impl in impls}
  # One FLOP count for every row: XLA's, of the convolutions as lax.conv.
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
  peak = matmul_peak_gflops()
  device = jax.devices()[0]
  print(f'ResNet-18 ({config.model.stem} stem) forward + backward, batch {b}, '
        f'{size}x{size}, {config.dtype}, {device.device_kind} '
        f'({device.platform}); median (min) of {fv.repeats} alternated steps; '
        f'{flops / 1e9:.1f} GFLOP per step (XLA cost analysis, lax.conv); '
        f'float32 matmul peak {peak:.1f} GFLOP/s')
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


# ----------------------------------------------------------------------------
# Command line.


def define_flags(flag_values: flags.FlagValues = flags.FLAGS,
                 sys_argv: Sequence[str] | None = None) -> None:
  """Defines the benchmark's flags on `flag_values`.

  Args:
    flag_values: where to define them (tests pass a fresh `FlagValues`).
    sys_argv: the command line whose `--config.a.b=v` overrides
      `config_flags` registers (default `sys.argv`).
  """
  fv = dict(flag_values=flag_values)
  config_flags.DEFINE_config_file(
      'config', None, 'Config file (train, resnet); override fields as '
      '--config.a.b=v.', lock_config=True, sys_argv=sys_argv, **fv)
  flags.DEFINE_integer('repeats', 5, 'Timed calls per row (ot: at least); '
                       'the median is printed.', **fv)
  flags.DEFINE_integer('seed', 0, 'Seed of the images.', **fv)
  flags.DEFINE_list('batch_sizes', ['64', '256'], 'ot: images per batch '
                    '(each has 3 channels).', **fv)
  flags.DEFINE_float('min_time_s', 2.0, 'ot: fast rows repeat until this '
                     'many seconds have passed.', **fv)
  flags.DEFINE_integer('image_size', 32, 'ot: H = W in pixels.', **fv)
  flags.DEFINE_integer('grid_size', 16, 'ot: grid side m.', **fv)
  flags.DEFINE_integer('num_iters', 20, 'ot: Sinkhorn iterations T.', **fv)
  flags.DEFINE_float('epsilon', 0.05, 'ot: entropic regularisation.', **fv)
  flags.DEFINE_float('alpha', 0.5, 'ot: interpolation weight.', **fv)
  flags.DEFINE_list('conv_impls', ['xla', 'matmul', 'auto'], 'resnet: '
                    'model.conv_impl values to time; ratios are to the '
                    'first.', **fv)
  flags.DEFINE_bool('per_layer', False, 'resnet: also time every '
                    'convolution under xla and matmul.', **fv)


def main(argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS
         ) -> int:
  """Runs the subcommand `argv[1]` with the parsed `flag_values`."""
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise app.UsageError(
        f'Expected one subcommand of {COMMANDS}, got {list(argv[1:])}.')
  command = argv[1]
  if command == 'ot':
    return run_ot(flag_values)
  config = flag_values.config
  if config is None:
    raise app.UsageError(f'{command} needs --config=configs/X.py.')
  return (run_train if command == 'train' else run_resnet)(config,
                                                           flag_values)


def run() -> None:
  """`python -m otclr_jax.bench <ot|train|resnet> [flags]`."""
  define_flags()
  app.run(lambda argv: sys.exit(main(argv)))


if __name__ == '__main__':
  run()
