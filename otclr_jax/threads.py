"""How many threads a host computation (BLAS, OpenMP) may use.

OpenBLAS's and OpenMP's threads spin while they wait for one another, so one
on a busy core stalls the rest (docs/results.md times the digits probe).
"""

from __future__ import annotations

import os
import time

# Where one of these is set, whoever started the process has shared the
# cores out, and the pools stay as they are.
THREAD_VARIABLES = ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS',
                    'MKL_NUM_THREADS')


def _running_elsewhere() -> int:
  """Tasks running now besides this thread: the median of five reads, 10 ms
  apart, of /proc/loadavg's count of running tasks (0 without /proc)."""
  counts = []
  for _ in range(5):
    try:
      with open('/proc/loadavg') as f:
        counts.append(int(f.read().split()[3].split('/')[0]) - 1)
    except (OSError, IndexError, ValueError):
      return 0
    time.sleep(0.01)
  return sorted(counts)[2]


def host_threads() -> int | None:
  """Threads for a BLAS or OpenMP computation starting now: None (as they
  are) where `THREAD_VARIABLES` set them, else the cores this process may
  use that nothing else runs on, at least 1."""
  if any(os.environ.get(name) for name in THREAD_VARIABLES):
    return None
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
           else os.cpu_count() or 1)
  return max(1, cores - _running_elsewhere())
