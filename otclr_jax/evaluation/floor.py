"""The random-init floor, fitted once for the runs that share it.

Runs that agree on the untrained encoder (docs/method.md section 7) store its
rows (probe, kNN) in `config.eval.floor_dir` under a digest of its identity:
the first run fits them while the others wait; later runs read them back.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Callable

from absl import logging

from otclr_jax import rundir

# A row of results.json: (key path, value), e.g. (('random_init', 'digits',
# 'top1'), 95.6).
Row = tuple[tuple[str, ...], Any]


def digest(identity: dict[str, Any]) -> str:
  """The first 16 hex digits of sha256 of `identity` as sorted JSON."""
  text = json.dumps(identity, sort_keys=True, allow_nan=False)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def floor_file(floor_dir: str, identity: dict[str, Any]) -> str:
  """The file of `identity`'s floor in `floor_dir` (`rundir.floor_files`)."""
  return rundir.floor_files(floor_dir, digest(identity))[0]


def _read(path: str, identity: dict[str, Any]) -> list[Row] | None:
  stored = rundir.read_json_file(path)
  if stored is None:
    return None
  if stored.get('identity') != json.loads(json.dumps(identity)):
    raise rundir.CorruptFileError(
        f'{path} holds the floor of another identity than its name says; '
        'delete it to fit the floor again.')
  return [(tuple(path_), value) for path_, value in stored['rows']]


def load_or_fit(floor_dir: str, identity: dict[str, Any],
                fit: Callable[[], list[Row]], workdir: str
                ) -> tuple[list[Row], str, bool]:
  """The floor's rows for `identity`: stored ones, else `fit()` stored now.

  Args:
    floor_dir: the directory shared by the runs (created if needed).
    identity: JSON-safe settings that decide the floor.
    fit: computes the rows (JSON-safe values); called at most once per
      identity across processes sharing `floor_dir`.
    workdir: the run asking, recorded beside rows it fits.

  Returns:
    `(rows, path of the stored floor, whether this call fitted it)`.
  """
  path, lock = rundir.floor_files(floor_dir, digest(identity))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  rows = _read(path, identity)
  if rows is None:
    with rundir.waiting_lock(lock):
      rows = _read(path, identity)
      if rows is None:
        start = time.perf_counter()
        rows = fit()
        rundir.write_json(path, {
            'identity': identity, 'rows': [[list(p), v] for p, v in rows],
            'fitted_by': os.path.abspath(workdir),
            'seconds': time.perf_counter() - start})
        logging.info('Random-init floor stored in %s.', path)
        return rows, path, True
  logging.info('Random-init floor read from %s (not refitted).', path)
  return rows, path, False
