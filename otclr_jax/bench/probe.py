"""Seconds of the linear probe on one cached feature set (docs/method.md
section 7): every fit's lambda, held-out top-1, Newton steps and final
gradient norm."""

from __future__ import annotations

import statistics
import time
import zipfile

from absl import app
from absl import flags

from otclr_jax.evaluation import features
from otclr_jax.evaluation import probe


def run_probe(flag_values: flags.FlagValues) -> int:
  """Fits the probe `--repeats` times on `--features`; prints one table."""
  prefix = flag_values.features
  if not prefix:
    raise app.UsageError(
        'probe needs --features=<run>/eval/features/<tag>/<dataset key> '
        '(the cache files without _train.npz / _test.npz).')
  splits = {}
  for split in ('train', 'test'):
    path = f'{prefix}_{split}.npz'
    try:
      splits[split] = features.read_cache(path)
    except (KeyError, ValueError, zipfile.BadZipFile) as e:
      raise app.UsageError(f'{path} is not a feature cache '
                           f'({type(e).__name__}: {e}).') from e
  (train_x, train_y, num_classes), (test_x, test_y, _) = (
      splits['train'], splits['test'])
  seconds = []
  for _ in range(flag_values.repeats):
    start = time.perf_counter()
    row = probe.linear_probe(train_x, train_y, test_x, test_y, num_classes)
    seconds.append(time.perf_counter() - start)
  print(f'linear probe, {prefix}: train {train_x.shape}, test '
        f'{test_x.shape}, {num_classes} classes')
  print('| fit | lambda | held-out top-1 | Newton steps | gradient norm | '
        'converged |')
  print('|---|---|---|---|---|---|')
  for fit in row['fits']:
    name, held = (('refit (all train)', '-') if fit.get('refit') else
                  ('held-out selection', f"{fit['val_top1']:.2f}"))
    print(f"| {name} | {fit['lambda']:g} | {held} | {fit['steps']} | "
          f"{fit['grad_norm']:.1e} | {fit['converged']} |")
  print(f"top-1 {row['top1']:.2f}%, top-5 {row['top5']:.2f}%, lambda "
        f"{row['weight_decay']:g}; {statistics.median(seconds):.1f} s (median "
        f'of {len(seconds)}, min {min(seconds):.1f} s)')
  return 0
