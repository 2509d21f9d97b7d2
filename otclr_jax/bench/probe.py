"""Seconds of the linear probe on one evaluation's cached features
(docs/method.md section 7): every fit's lambda, held-out top-1, Newton
steps and final gradient norm."""

from __future__ import annotations

import math
import os
import statistics
import time

from absl import app
from absl import flags

from otclr_jax import threads as threads_lib
from otclr_jax.evaluation import features
from otclr_jax.evaluation import probe


def run(flag_values: flags.FlagValues) -> int:
  """Fits the probe `--repeats` times on one cache; prints one table."""
  if not (flag_values.workdir and flag_values.tag):
    raise app.UsageError(
        'probe needs --workdir=<run> and --tag=<step<N> or init> (a '
        'directory of <run>/eval/features), and --dataset if not digits.')
  splits = features.load_cache(os.path.expanduser(flag_values.workdir),
                               flag_values.tag, flag_values.dataset)
  (train_x, train_y, num_classes), (test_x, test_y, _) = (
      splits['train'], splits['test'])
  # What the first fit's rule sees; each fit reads the load again.
  threads = threads_lib.host_threads() or 'as set'
  seconds = []
  for _ in range(flag_values.repeats):
    start = time.perf_counter()
    row = probe.linear_probe(train_x, train_y, test_x, test_y, num_classes,
                             backend=flag_values.backend)
    seconds.append(time.perf_counter() - start)
  print(f'linear probe, {flag_values.dataset} features of '
        f'{flag_values.workdir} ({flag_values.tag}): train {train_x.shape}, '
        f'test {test_x.shape}, {num_classes} classes, backend '
        f'{flag_values.backend}, BLAS threads {threads}')
  print('| fit | lambda | held-out top-1 | Newton steps | gradient norm | '
        'converged |')
  print('|---|---|---|---|---|---|')
  for fit in row['fits']:
    name, held = (('refit (all train)', '-') if fit.get('refit') else
                  ('held-out selection', f"{fit['val_top1']:.2f}"))
    print(f"| {name} | {fit['lambda']:g} | {held} | {fit['steps']} | "
          f"{fit['grad_norm']:.1e} | {fit['converged']} |")
  print(f"top-1 {row['top1']:.2f}%, top-5 {row.get('top5', math.nan):.2f}%, "
        f"lambda "
        f"{row['weight_decay']:g}; {statistics.median(seconds):.1f} s (median "
        f'of {len(seconds)}, min {min(seconds):.1f} s)')
  return 0
