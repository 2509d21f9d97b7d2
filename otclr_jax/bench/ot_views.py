"""`python -m otclr_jax.bench ot`: the OT view generator against references.

Each maps `(x, x_strong) [B, H, W, C] -> views [B, H, W, C]` in [0, 1].
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Callable, Sequence

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from ott.geometry import geometry
from ott.problems.linear import linear_problem
from ott.solvers.linear import sinkhorn

from otclr_jax import ot
from otclr_jax.bench import common

# Max abs pixel difference from `ot_views`: a quarter of an 8-bit grey level.
VIEW_ATOL = 1e-3


@dataclasses.dataclass(frozen=True)
class OTSettings:
  """Static settings of the view generator (docs/method.md section 8)."""
  grid_size: int = 16
  epsilon: float = 0.05
  num_iters: int = 20
  alpha: float = 0.5


def make_ott_dense(s: OTSettings) -> Callable:
  """(a) ott-jax dense `Geometry` in lse mode, materialised plan, scatter."""
  cost = jnp.asarray(ot.grid_cost(s.grid_size), jnp.float32)
  # inner = T: exactly T iterations (docs/method.md section 3).
  solver = sinkhorn.Sinkhorn(
      min_iterations=s.num_iters, max_iterations=s.num_iters,
      inner_iterations=s.num_iters, implicit_diff=None)

  def per_problem(a, b):
    geom = geometry.Geometry(cost_matrix=cost, epsilon=s.epsilon)
    out = solver(linear_problem.LinearProblem(geom, a.ravel(), b.ravel()))
    return ot.dense_displace(out.matrix, s.alpha)

  measure, _, _, reconstruct = make_stages(s)

  def views(x, x_strong):
    a, b, mass, offset = measure(x, x_strong)
    p_bar = jax.vmap(per_problem)(a, b)
    return reconstruct(p_bar, mass, offset, x.shape[1], x.shape[2])

  return jax.jit(views)


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
    return importlib.import_module('ot')
  except ImportError:
    return None


def numpy_splat_tables(grid_size: int, alpha: float):
  """Float64 target vertex and bilinear weight per packet, `[4, N, N]` each."""
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
  """(b) POT float64 `ot.sinkhorn` + `np.bincount` splat, problem by problem."""
  m = s.grid_size
  cost = ot.grid_cost(m)
  index, weight = numpy_splat_tables(m, s.alpha)
  flat_index = index.ravel()
  measure, _, _, reconstruct = make_stages(s)

  def views(x, x_strong):
    a, b, mass, offset = measure(x, x_strong)
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
    `measure(x, x_strong) -> (a, b, mass, offset)` (histograms `[B * C, m,
    m]` of both images, interpolated mass and offset), `sinkhorn(a, b) -> (u,
    v)`, `splat(u, v) -> p_bar`, `reconstruct(p_bar, mass, offset, H, W) ->
    views [B, H, W, C]`; chained, they compute `ot_views`.
  """

  def measure(x, x_strong):
    p_src, mass_src, off_src = ot.image_to_measure(x, s.grid_size)
    p_str, mass_str, off_str = ot.image_to_measure(x_strong, s.grid_size)
    mass = (1.0 - s.alpha) * mass_src + s.alpha * mass_str
    offset = (1.0 - s.alpha) * off_src + s.alpha * off_str
    m = s.grid_size
    return p_src.reshape(-1, m, m), p_str.reshape(-1, m, m), mass, offset

  def reconstruct(p_bar, mass, offset, height, width):
    p_bar = p_bar.reshape(mass.shape + p_bar.shape[-2:])
    return ot.measure_to_image(p_bar, mass, offset, height, width)

  scalings = jax.jit(
      lambda a, b: ot.sinkhorn_scalings(a, b, s.epsilon, s.num_iters))
  splat = jax.jit(
      lambda u, v: ot.displace_from_scalings(u, v, s.alpha, s.epsilon))
  return (jax.jit(measure), scalings, splat,
          jax.jit(reconstruct, static_argnums=(3, 4)))


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
  diffs = {k: float(np.max(np.abs(views - outputs['c'])))
           for k, views in outputs.items() if k != 'c'}
  ok = {k: d <= VIEW_ATOL for k, d in diffs.items()}
  return ', '.join(f"{k}: {d:.2e}{'' if ok[k] else ' MISMATCH'}"
                   for k, d in diffs.items()), all(ok.values())


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
  return [common.time_ms(fn, *fn_args, repeats=repeats, min_time_s=min_time_s)
          for fn, fn_args in calls]


def run(fv: flags.FlagValues) -> int:
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
  other = common.other_core()
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
    rng = np.random.default_rng(fv.seed)
    shape = (batch_size, fv.image_size, fv.image_size, 3)
    x, x_strong = (jnp.asarray(rng.random(shape, np.float32))
                   for _ in range(2))
    outputs = {k: np.asarray(fn(x, x_strong)) for k, (_, fn) in impls.items()}
    text, ok = _check_views(outputs)
    all_ok &= ok
    print(f'check B={batch_size}: max |views - (c)| (atol {VIEW_ATOL:g}) '
          f'{text}')
    for k, (_, fn) in impls.items():
      rows[k].values[batch_size], rows[k].minima[batch_size] = common.time_ms(
          fn, x, x_strong, repeats=fv.repeats, min_time_s=fv.min_time_s)
    timings = _time_stages(stages, x, x_strong, fv.repeats, fv.min_time_s)
    for row, (median, minimum) in zip(stage_rows, timings):
      row.values[batch_size], row.minima[batch_size] = median, minimum
    stage_sum.values[batch_size] = sum(t[0] for t in timings)
    stage_sum.minima[batch_size] = sum(t[1] for t in timings)

  table = [rows[k] for k in ('a', 'b', 'c') if k in rows]
  table += stage_rows + [stage_sum, rows['core']]
  c = rows['c']
  ratios = [(f'ratio ({k})/(c)', k) for k in ('a', 'b') if k in rows]
  table += [Row(label, {b: rows[k].values[b] / c.values[b]
                        for b in batch_sizes}, unit='x')
            for label, k in ratios + [(f'ratio core={other}/(c)', 'core')]]
  table.append(Row('(c) ms per 64 images',
                   {b: c.values[b] * 64 / b for b in batch_sizes},
                   {b: c.minima[b] * 64 / b for b in batch_sizes}))
  print(format_table(batch_sizes, table))
  if not all_ok:
    print(f'ERROR: an implementation differs from (c) by more than '
          f'{VIEW_ATOL:g}; the timings do not compare like with like.')
  return 0 if all_ok else 1

