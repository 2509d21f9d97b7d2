"""Benchmarks: `python -m otclr_jax.bench <subcommand> [flags]`.

Subcommands:
  ot   Milliseconds per batch of the whole OT view generator (docs/method.md
       sections 2-5: resize to the grid, Sinkhorn, displacement splat,
       reconstruction) for our `ot.ot_views` (default core) against ott-jax's
       dense solver and POT, plus `ot_views` with its other Sinkhorn core and
       a per-stage breakdown of `ot_views`. Before timing, every
       implementation's views are compared with `ot_views` (max abs pixel
       difference): the rows compute the same thing.

  train
       The paper's complexity table for SimCLR and OTCLR on a config: parameters,
       GFLOPs per image pair (XLA cost analysis of the compiled step and of the
       forward pass), median step time and image pairs/s with the steps
       alternated in one process after a warm-up, the OTCLR/SimCLR ratio; the
       OTCLR step and the OT views once per Sinkhorn core (`ot.core`: 'ott'
       and 'separable'), with their ratio; the same for the linear-evaluation
       forward; the OT views' share of the step; the host input
       pipeline's batches/s next to the step's; and the kNN monitor's ms per
       call with its share of the `config.monitor.every_steps` steps between
       two calls.

Config overrides use `main`'s spelling and parser (`config_files`):
`--config.ot.epsilon=0.1` or `--override ot.epsilon=0.1`; a typo fails with a
suggestion.

Each subcommand registers its own argparse sub-parser in `build_parser`; a new
one adds an `_add_<name>_parser` function there.

POT is a test-only dependency. It is imported lazily with its TensorFlow,
PyTorch, CuPy and JAX backends disabled (otherwise its import probes, and
loads, every installed array library); without POT the POT row is skipped.

The per-stage breakdown calls the public pieces of `otclr_jax.ot` that
`ot_views` itself runs (`sinkhorn_scalings`, `displace_from_scalings`), so the
stages time exactly the code of row (c).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import math
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ott.geometry import geometry
from ott.problems.linear import linear_problem
from ott.solvers.linear import sinkhorn

from otclr_jax import config_files
from otclr_jax import ot

# Max abs pixel difference (images in [0, 1]) tolerated between an
# implementation and `ot_views`: a quarter of an 8-bit grey level. Float32
# lse-mode and float64 POT iterates differ from ours by far less than this.
VIEW_ATOL = 1e-3

# Targets from the issue for `ot_views` on the 2-core CPU.
TARGET_SPEEDUP_OTT_DENSE = 50.0
TARGET_SPEEDUP_POT = 20.0
TARGET_MS_PER_64_IMAGES = 10.0


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


def run_ot(args: argparse.Namespace) -> int:
  """The `ot` subcommand. Returns 1 if an implementation disagrees with (c)."""
  s = OTSettings(args.grid_size, args.epsilon, args.num_iters, args.alpha)
  if args.repeats < 1:
    raise ValueError(f'--repeats must be >= 1, got {args.repeats}.')
  if args.min_time_s < 0:
    raise ValueError(f'--min_time_s must be >= 0, got {args.min_time_s}.')
  if not args.batch_sizes or min(args.batch_sizes) < 1:
    raise ValueError(f'--batch_sizes must be >= 1, got {args.batch_sizes}.')
  if args.grid_size > args.image_size:
    raise ValueError(
        f'--grid_size {args.grid_size} exceeds --image_size {args.image_size}.')
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
  print(f'OT view generator: {args.image_size}x{args.image_size}x3 images, '
        f'm={s.grid_size}, T={s.num_iters}, eps={s.epsilon:g}, '
        f'alpha={s.alpha:g}, (c) core={ot.DEFAULT_CORE}. ms per batch: median (min) over at least '
        f'{args.repeats} calls and {args.min_time_s:g} s per row, after one '
        'warm-up call, block_until_ready.')
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
  for batch_size in args.batch_sizes:
    x, x_strong = _bench_images(batch_size, args.image_size, args.seed)
    # The warm-up call compiles; its output is checked against (c).
    outputs = {k: np.asarray(fn(x, x_strong)) for k, (_, fn) in impls.items()}
    text, ok = _check_views(outputs)
    all_ok &= ok
    print(f'check B={batch_size}: max |views - (c)| (atol {VIEW_ATOL:g}) '
          f'{text}')
    for k, (_, fn) in impls.items():
      rows[k].values[batch_size], rows[k].minima[batch_size] = time_ms(
          fn, x, x_strong, repeats=args.repeats, min_time_s=args.min_time_s)
    timings = _time_stages(stages, x, x_strong, args.repeats, args.min_time_s)
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
                   {b: c.values[b] * 64 / b for b in args.batch_sizes},
                   {b: c.minima[b] * 64 / b for b in args.batch_sizes}))
  print(format_table(args.batch_sizes, table))

  print('targets (on medians):')
  for k, target in (('a', TARGET_SPEEDUP_OTT_DENSE),
                    ('b', TARGET_SPEEDUP_POT)):
    if k not in rows:
      print(f'  (c) >= {target:g}x faster than ({k}): not measured')
      continue
    ratios = [rows[k].values[b] / c.values[b] for b in args.batch_sizes]
    met = 'MET' if min(ratios) >= target else 'MISSED'
    print(f'  (c) >= {target:g}x faster than ({k}): {met} '
          f"({', '.join(f'{r:.1f}x' for r in ratios)})")
  per64 = [c.values[b] * 64 / b for b in args.batch_sizes]
  met = 'MET' if max(per64) < TARGET_MS_PER_64_IMAGES else 'MISSED'
  print(f'  (c) < {TARGET_MS_PER_64_IMAGES:g} ms per 64 images: {met} '
        f"({', '.join(f'{v:.2f} ms' for v in per64)})")
  if not all_ok:
    print(f'ERROR: an implementation differs from (c) by more than '
          f'{VIEW_ATOL:g}; the timings do not compare like with like.')
  return 0 if all_ok else 1


# ----------------------------------------------------------------------------
# Command line.


def _add_ot_parser(subparsers) -> None:
  p = subparsers.add_parser(
      'ot', help='time the OT view generator against ott-jax and POT',
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--batch_sizes', type=int, nargs='+', default=[64, 256],
                 help='images per batch (each has 3 channels)')
  p.add_argument('--repeats', type=int, default=7,
                 help='minimum timed calls per row; the median is printed')
  p.add_argument('--min_time_s', type=float, default=2.0,
                 help='fast rows repeat until this many seconds have passed')
  p.add_argument('--image_size', type=int, default=32, help='H = W in pixels')
  p.add_argument('--grid_size', type=int, default=16, help='m')
  p.add_argument('--num_iters', type=int, default=20, help='Sinkhorn T')
  p.add_argument('--epsilon', type=float, default=0.05)
  p.add_argument('--alpha', type=float, default=0.5)
  p.add_argument('--seed', type=int, default=0, help='seed of the images')
  p.set_defaults(func=run_ot)


# ----------------------------------------------------------------------------
# train: the complexity table.

TARGET_STEP_RATIO = 1.02  # OT views vs augmentations, same method (issue 10)
TARGET_PIPELINE_OVER_STEP = 3.0
TARGET_OT_SHARE = 0.02


def load_config(path: str, overrides: Sequence[str] = ()):
  """A config file with overrides (`--config.a.b=v` or `a.b=v`), as `main`."""
  return config_files.apply_overrides(config_files.load(path), overrides)


def _flops(compiled) -> float:
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0]
  return float(analysis.get('flops', float('nan')))


def _train_images(config, num: int, seed: int) -> np.ndarray:
  """Training images for the pipeline timing: the config's dataset if it is
  prepared here, else random uint8 (gathering cost does not depend on content)."""
  from otclr_jax import data  # pylint: disable=g-import-not-at-top
  try:
    return data.load_split(config.dataset, 'train', config.image_size,
                           config.data_dir or None,
                           download=False).images, config.dataset
  except Exception:  # pylint: disable=broad-except
    rng = np.random.default_rng(seed)
    shape = (num, config.image_size, config.image_size, 3)
    return rng.integers(0, 256, shape, dtype=np.uint8), 'random uint8'


def run_train(args: argparse.Namespace) -> int:
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from otclr_jax import data, experiment, methods  # pylint: disable=g-import-not-at-top

  base = load_config(args.config, args.override)
  if args.batch_size:
    base.batch_size = args.batch_size
  batch_size, size = base.batch_size, base.image_size
  mesh = experiment.make_mesh()
  replicated = NamedSharding(mesh, PartitionSpec())
  images, source = _train_images(base, max(4 * batch_size, 1024), args.seed)
  host_batch = images[:batch_size]
  batch = experiment.global_batch(host_batch, mesh)
  key = jax.device_put(jax.random.key(args.seed), replicated)

  # Every method with both view generators (default Sinkhorn core), then
  # OTCLR (SimCLR + OT views) with the other core.
  cores = (ot.DEFAULT_CORE, _other_core())
  variants = {f'{m}/{v}': (m, v, ot.DEFAULT_CORE)
              for m in methods.NAMES for v in ('augment', 'ot')}
  variants[f'simclr/ot/{cores[1]}'] = ('simclr', 'ot', cores[1])
  otclr = 'simclr/ot'
  steps, states, flops, fwd_flops, titles = {}, {}, {}, {}, {}
  params_m, eval_params_m = {}, {}
  for name, (method, views, core) in variants.items():
    config = base.copy_and_resolve_references()
    config.method, config.views, config.ot.core = method, views, core
    run = experiment.setup(config, steps_per_epoch=100)
    state = experiment.initial_state(config, run, mesh)
    step = experiment.jit_train_step(config, run, mesh)
    compiled = step.lower(state, batch, key).compile()
    flops[name] = _flops(compiled)
    steps[name], states[name] = compiled, state
    titles[name] = run.title
    # Both views of the batch: the forward FLOPs of B image pairs through the
    # trained network. XLA counts only multiply-adds on real pixels, not on a
    # convolution's zero padding, which at 32 x 32 (1 x 1 maps in the last
    # stage) is much of the naive count that papers quote.
    views_in = jnp.zeros((2 * batch_size, size, size, 3), jnp.float32)
    variables = {'params': state.params['net'], 'batch_stats': state.batch_stats}
    fwd_flops[name] = _flops(jax.jit(
        lambda v, x, model=run.model: model.apply(v, x, train=False)).lower(
            variables, views_in).compile())
    # Pretraining: the trained network and its targets (MoCo: query + key
    # encoders with heads, the paper's 23.01M); evaluation: the encoder.
    params_m[name] = experiment.pretraining_params(state) / 1e6
    eval_params_m[name] = experiment.count_params(
        state.params['net']['encoder']) / 1e6
    print(f'compiled {name} step', flush=True)

  times = {name: [] for name in variants}
  for name in variants:  # warm-up
    states[name], metrics = steps[name](states[name], batch, key)
    jax.block_until_ready(metrics)
  for _ in range(args.repeats):
    for name in variants:  # alternated, so drifts in machine load hit all
      start = time.perf_counter()
      states[name], metrics = steps[name](states[name], batch, key)
      jax.block_until_ready(metrics)
      times[name].append(time.perf_counter() - start)
  step_ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}

  # Linear evaluation: the frozen encoder's forward pass on clean images.
  config = base.copy_and_resolve_references()
  config.method, config.views = 'simclr', 'ot'
  model = experiment.create_model(config)
  state = states[otclr]
  encoder_vars = {'params': state.params['net'],
                  'batch_stats': state.batch_stats}
  encode = jax.jit(lambda v, x: model.apply(v, x, train=False)[0])
  clean = jnp.asarray(host_batch, jnp.float32) / 255.0
  eval_compiled = encode.lower(encoder_vars, clean).compile()
  eval_flops = _flops(eval_compiled)
  eval_ms, _ = time_ms(eval_compiled, encoder_vars, clean,
                       repeats=2 * args.repeats)

  # The kNN monitor (otclr_jax/evaluation/monitor.py) as training calls it.
  monitor_ms, monitor_images = _time_monitor(base, model, state, args)

  # The OT views of a whole batch (both views), as the OTCLR step makes them.
  otc = base.ot
  views_ms = {}
  for core in cores:
    views_fn = jax.jit(functools.partial(
        lambda x, s1, s2, core: (
            ot.ot_views(x, s1, otc.alpha, otc.grid_size, otc.epsilon,
                        otc.num_iters, core),
            ot.ot_views(x, s2, otc.alpha, otc.grid_size, otc.epsilon,
                        otc.num_iters, core)), core=core))
    views_ms[core], _ = time_ms(views_fn, clean, clean[::-1], clean,
                                repeats=2 * args.repeats, min_time_s=1.0)

  # Host input pipeline: gather a batch and hand it to the devices.
  batches = data.train_batches(images, batch_size, args.seed)
  next(batches)
  n = 50
  start = time.perf_counter()
  for _ in range(n):
    jax.block_until_ready(experiment.global_batch(next(batches), mesh))
  pipeline_per_s = n / (time.perf_counter() - start)
  getattr(batches, 'close', lambda: None)()

  device = jax.devices()[0]
  print(f'\nconfig {args.config}, batch {batch_size}, {size}x{size}, dtype '
        f'{base.dtype}, {len(jax.devices())} x {device.device_kind} '
        f'({device.platform}); median of {args.repeats} alternated steps; '
        f'default core {ot.DEFAULT_CORE}')
  print('| Stage | Method | Params (M) | GFLOPs fwd / pair | GFLOPs step / pair '
        '| Step (ms) | Thrpt. (pairs/s) |')
  print('|---|---|---|---|---|---|---|')
  for name in variants:
    ms = step_ms[name]
    label = titles[name]
    if name.count('/') == 2 or name == otclr:
      label += f' core={variants[name][2]}'
    print(f'| Pretraining | {label} | {params_m[name]:.2f} | '
          f'{fwd_flops[name] / batch_size / 1e9:.3f} '
          f'| {flops[name] / batch_size / 1e9:.3f} | {ms:.1f} '
          f'| {1e3 * batch_size / ms:,.0f} |')
  for method in methods.NAMES:
    # Same frozen encoder with either views: they exist only in pretraining.
    print(f'| Linear eval. | {titles[method + "/augment"]} | '
          f'{eval_params_m[method + "/augment"]:.2f} | '
          f'{eval_flops / batch_size / 1e9:.3f} / image | - | {eval_ms:.1f} '
          f'| {1e3 * batch_size / eval_ms:,.0f} images/s |')
  pipe_ratio = pipeline_per_s / (1e3 / step_ms[otclr])
  print()
  for method in methods.NAMES:
    r = step_ms[f'{method}/ot'] / step_ms[f'{method}/augment']
    print(f'{titles[method + "/ot"]} / {titles[method + "/augment"]} step '
          f'time: {r:.3f} (target <= {TARGET_STEP_RATIO}: '
          f'{"met" if r <= TARGET_STEP_RATIO else "MISSED"})')
  other = cores[1]
  print(f'OTCLR step core={other} / core={ot.DEFAULT_CORE}: '
        f'{step_ms[f"{otclr}/{other}"] / step_ms[otclr]:.3f}')
  for core in cores:
    share = views_ms[core] / step_ms[
        otclr if core == ot.DEFAULT_CORE else f'{otclr}/{core}']
    print(f'OT views core={core} (2 x {batch_size} images): '
          f'{views_ms[core]:.1f} ms = {100 * share:.2f}% of the OTCLR step '
          f'(target < {100 * TARGET_OT_SHARE:.0f}%: '
          f'{"met" if share < TARGET_OT_SHARE else "MISSED"})')
  print(f'Input pipeline ({source}): {pipeline_per_s:,.0f} batches/s vs '
        f'{1e3 / step_ms[otclr]:.2f} steps/s = {pipe_ratio:,.0f}x (target >= '
        f'{TARGET_PIPELINE_OVER_STEP:.0f}x: '
        f'{"met" if pipe_ratio >= TARGET_PIPELINE_OVER_STEP else "MISSED"})')
  every = base.monitor.every_steps
  monitor_text = (f'every {every} steps: {monitor_ms:.1f} ms = '
                  f'{100 * monitor_ms / (every * step_ms[otclr]):.3f}% of '
                  f'{every} OTCLR steps' if every > 0 else
                  'off (config.monitor.every_steps=0)')
  print(f'kNN monitor ({monitor_images}): {monitor_ms:.1f} ms per call; '
        f'{monitor_text}')
  return 0


def _time_monitor(config, model, state, args) -> tuple[float, str]:
  """Median ms of one kNN monitor call, and which images it embeds.

  The config's dataset when it is prepared here, else random uint8 images
  and labels (the cost does not depend on content).
  """
  from otclr_jax import data  # pylint: disable=g-import-not-at-top
  from otclr_jax.evaluation import monitor  # pylint: disable=g-import-not-at-top
  try:
    splits = [data.load_split(config.dataset, split,
                              config.image_size,
                              config.data_dir or None,
                              download=False)
              for split in ('train', 'test')]
    source = config.dataset
  except Exception:  # pylint: disable=broad-except
    rng = np.random.default_rng(args.seed)
    shape = (config.image_size, config.image_size, 3)
    splits = [data.Split(
        rng.integers(0, 256, (num,) + shape, dtype=np.uint8),
        rng.integers(0, 10, num, dtype=np.int32), 10,
        [str(c) for c in range(10)])
              for num in (config.monitor.num_train, config.monitor.num_test)]
    source = 'random uint8'
  knn = monitor.KnnMonitor(config, model, *splits)
  knn(state)  # compiles
  ms, _ = time_ms(knn, state, repeats=args.repeats)
  return ms, (f'{len(knn.train_images)} train / {len(knn.test_images)} test '
              f'images of {source}')


def _add_train_parser(subparsers) -> None:
  p = subparsers.add_parser(
      'train', help="the paper's complexity table for SimCLR vs OTCLR",
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--config', required=True, help='configs/X.py')
  p.add_argument('--batch_size', type=int, default=0,
                 help='override config.batch_size (0 keeps it)')
  p.add_argument('--override', nargs='*', default=[],
                 help='config overrides as on the training command line: '
                 'a.b=value or --config.a.b=value, e.g. dtype=bfloat16 (the '
                 'flags --config.a.b=value also work directly)')
  p.add_argument('--repeats', type=int, default=5,
                 help='timed steps per method, alternated')
  p.add_argument('--seed', type=int, default=0)
  p.set_defaults(func=run_train)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m otclr_jax.bench', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  subparsers = parser.add_subparsers(dest='command', required=True)
  _add_ot_parser(subparsers)
  _add_train_parser(subparsers)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  argv, overrides = config_files.split_config_flags(argv)
  args = build_parser().parse_args(argv)
  if overrides:
    if not hasattr(args, 'override'):
      raise ValueError(f'{args.command} takes no config overrides, got '
                       f'{overrides}.')
    args.override = list(args.override) + overrides
  return args.func(args)


if __name__ == '__main__':
  sys.exit(main())
