"""What the benchmarks share: wall-clock medians, FLOP counts, a matmul peak."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from otclr_jax import ot

PEAK_MATMUL_SIZE = 2048


def time_ms(fn: Callable, *args, repeats: int, min_time_s: float = 0.0
            ) -> tuple[float, float]:
  """Median and min ms of >= `repeats` synced calls, over >= `min_time_s` s."""
  times = []
  start_all = time.perf_counter()
  while (len(times) < repeats
         or time.perf_counter() - start_all < min_time_s):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times), 1e3 * min(times)


def flops(compiled) -> float:
  """FLOPs of a compiled computation by XLA's cost analysis (nan if absent)."""
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


def other_core() -> str:
  """The Sinkhorn core that is not `ot.DEFAULT_CORE`."""
  return next(c for c in ot.CORES if c != ot.DEFAULT_CORE)
