"""Run directory (workdir) rules: stored files, the lock, run identity.

Exit statuses and signals are `cli`'s (docs/operations.md, "Exit statuses").
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
from typing import Any, Iterator, Sequence

from absl import logging

from otclr_jax import cli
from otclr_jax import config_files
from otclr_jax import fileio

CONFIG_FILE = 'config.json'
STATUS_FILE = 'status.json'
LOCK_FILE = '.lock'
# A sweep directory's lock: one sweep at a time launches into it.
SWEEP_LOCK_FILE = '.sweep.lock'
# eval/'s own lock: a run can be evaluated while it trains, by one writer.
EVAL_LOCK_FILE = '.eval.lock'
METRICS_FILE = 'metrics.jsonl'
# What the run trains on (dataset, images, classes, source digest); a resume
# must match it.
DATA_FILE = 'data.json'
CHECKPOINTS_DIR = 'checkpoints'
# Evaluation outputs; results.json binds the others (`write_evaluation`).
EVAL_DIR = 'eval'
RESULTS_FILE = os.path.join(EVAL_DIR, 'results.json')
EVAL_CONFIG_FILE = os.path.join(EVAL_DIR, 'config.json')
FEATURES_DIR = os.path.join(EVAL_DIR, 'features')
FIGURES_DIR = os.path.join(EVAL_DIR, 'figures')
# Checkpoints that failed to restore are moved here, not deleted.
SKIPPED_CHECKPOINTS_DIR = 'checkpoints_skipped'
TENSORBOARD_DIR = 'tensorboard'
ENCODER_DIR = 'encoder'
ENCODER_FILE = 'encoder.msgpack'
# Slurm jobs: the script (a sweep's array job, or one multi-node run) and
# the directory of their logs.
SWEEP_SCRIPT = 'sweep.sbatch'
RUN_SCRIPT = 'run.sbatch'
SLURM_DIR = 'slurm'
# A sweep directory's files.
RUNS_FILE = 'runs.json'
TRAIN_LOG = 'train.log'
EVAL_LOG = 'eval.log'
SUMMARY_FILES = ('summary.md', 'summary.tex', 'summary.json')
# A sweep directory's random-init floors, shared by its runs (`eval.floor_dir`).
FLOORS_DIR = 'floors'


def checkpoint_dir(workdir: str, step: int) -> str:
  """`<workdir>/checkpoints/<step>`, absolute."""
  return os.path.join(os.path.abspath(workdir), CHECKPOINTS_DIR,
                      str(int(step)))


def probe_file(step: int, dataset_key: str) -> str:
  """The probe an evaluation saves, relative to the workdir."""
  return os.path.join(EVAL_DIR, f'probe_step{int(step)}_{dataset_key}.npz')


def encoder_file(step: int | None = None) -> str:
  """`encoder/encoder.msgpack`, or `encoder/encoder_step<S>.msgpack`."""
  name = (ENCODER_FILE if step is None
          else f'encoder_step{int(step)}.msgpack')
  return os.path.join(ENCODER_DIR, name)


def features_file(tag: str, dataset_key: str, split: str) -> str:
  """An encoder's cached features of one split, relative to the workdir."""
  return os.path.join(FEATURES_DIR, tag, f'{dataset_key}_{split}.npz')


def floor_files(floor_dir: str, digest: str) -> tuple[str, str]:
  """A shared random-init floor's file and its lock, absolute."""
  path = os.path.join(os.path.abspath(os.path.expanduser(floor_dir)),
                      f'floor_{digest}.json')
  return path, path + '.lock'


def step_results_file(step: int) -> str:
  """A step's own copy of results.json, relative to eval/."""
  return f'results_step{int(step)}.json'

STATES = ('running', 'finished', 'stopped', 'diverged', 'failed')

# Settings that never change a run's result; LENGTH_FIELDS: the caller's call.
IGNORED_FIELDS = ('mode', 'data_dir', 'compilation_cache_dir',
                  'log_every_steps', 'checkpoint_every_steps',
                  'keep_checkpoints')
IGNORED_PREFIXES = ('eval.', 'monitor.')
LENGTH_FIELDS = ('total_steps', 'num_epochs')
# `eval.*` fields that change no result file (results made otherwise hold).
EVAL_UNUSED_FIELDS = ('eval.figures', 'eval.at_end', 'eval.floor_dir')
# `eval.*` fields that change what a number measures; the others choose which
# numbers exist or change none (a probe stopped at probe_steps is flagged).
EVAL_RESULT_FIELDS = ('eval.num_view_images', 'eval.embedding',
                      'eval.views_dataset')
# results.json protocol fields that identify the probe and kNN instruments
# (`probe.PROTOCOL`, `knn.PROTOCOL`): another value is another table row and
# stale results for a sweep.
PROTOCOL_FIELDS = ('probe', 'l2_grid', 'probe_tolerance', 'holdout_fraction',
                   'holdout_seed', 'knn_k', 'knn_temperature')
# Top-level fields of a run's other stages: the training step is traced
# without them, so runs that differ only there share one jitted step. Not
# `IGNORED_FIELDS`: the seed changes results, log_every_steps the step.
STEP_UNREAD_FIELDS = ('mode', 'seed', 'dataset', 'data_dir', 'monitor', 'eval',
                      'checkpoint_every_steps', 'keep_checkpoints',
                      'compilation_cache_dir')
# Methods' own blocks; a run reads only its own (tests/test_rundir.py checks).
METHOD_BLOCKS = ('moco', 'byol', 'dino')


class CorruptFileError(cli.UsageError):
  """A stored file of the workdir is not the JSON object it should be."""


def check_directory(path: str, what: str) -> None:
  """Refuses `path` if it or a parent exists and is not a directory.

  Args:
    path: a directory the command will create or use.
    what: how the user gave it, for the message (e.g. '--workdir').

  Raises:
    cli.UsageError: `path` or a parent is not a directory.
  """
  probe = os.path.abspath(os.path.expanduser(path))
  # The nearest part of the path that exists decides.
  while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
    probe = os.path.dirname(probe)
  if os.path.lexists(probe) and not os.path.isdir(probe):
    kind = ('a dangling symlink' if os.path.islink(probe)
            and not os.path.exists(probe) else 'not a directory')
    raise cli.UsageError(f'{what} {path}: {probe} is {kind}; give a '
                         'directory (or a path that does not exist yet).')


class IncompleteEvaluationError(cli.UsageError):
  """eval/ holds files of more than one evaluation (one was interrupted)."""


def read_json_file(path: str) -> dict[str, Any] | None:
  """A JSON object the project wrote, or None; CorruptFileError if torn."""
  try:
    with open(path) as f:
      value = json.load(f)
  except FileNotFoundError:
    return None
  except IsADirectoryError:
    raise CorruptFileError(f'{path} is a directory, not a JSON file; '
                           'move it away.') from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CorruptFileError(
        f'{path} is corrupt ({e}); delete it (a run\'s config is also stored '
        'in each of its checkpoints and is checked from there) or restore it '
        'from a backup.') from e
  if not isinstance(value, dict):
    raise CorruptFileError(f'{path} is corrupt: expected a JSON object, got '
                           f'{type(value).__name__}.')
  return value


def read_status(workdir: str) -> dict[str, Any] | None:
  """`workdir/status.json`, or None; CorruptFileError if not a JSON object."""
  return read_json_file(os.path.join(workdir, STATUS_FILE))


def write_status(workdir: str, state: str, step: int,
                 total_steps: int) -> None:
  """Atomically writes `workdir/status.json`; `step`: optimiser steps done."""
  if state not in STATES:
    raise ValueError(f'status state must be one of {STATES}, got {state!r}.')
  status = {'state': state, 'step': int(step), 'total_steps': int(total_steps),
            'updated': datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec='seconds')}
  fileio.write_text(os.path.join(workdir, STATUS_FILE),
                    json.dumps(status, indent=1) + '\n')


def read_config(workdir: str) -> dict[str, Any] | None:
  """`workdir/config.json` as a dict, or None; CorruptFileError if corrupt."""
  return read_json_file(os.path.join(workdir, CONFIG_FILE))


def write_config(workdir: str, config: dict[str, Any]) -> None:
  """Atomically writes `config` (e.g. `ConfigDict.to_dict()`) as config.json."""
  write_json(os.path.join(workdir, CONFIG_FILE), config)


# Fields added after runs were stored, with what their absence meant: a
# stored config without one is the same run as one with this value.
ADDED_FIELDS = {'ot.source': 'image', 'ot.detail': 'none',
                'ot.colour': 'before'}


def _run_settings(config: dict[str, Any]) -> dict[str, Any]:
  """`config_files.flatten(config)`, `ADDED_FIELDS` filled in their blocks."""
  flat = config_files.flatten(config)
  for name, value in ADDED_FIELDS.items():
    block = name.rsplit('.', 1)[0] + '.'
    if name not in flat and any(n.startswith(block) for n in flat):
      flat[name] = value
  return flat


def _ignored(name: str, unread: tuple[str, ...], length: bool) -> bool:
  return (name in IGNORED_FIELDS or (not length and name in LENGTH_FIELDS)
          or name.startswith(IGNORED_PREFIXES) or name.startswith(unread))


def _unread_blocks(*methods: Any) -> tuple[str, ...]:
  # Read if either method reads it (a MoCo run evaluated with a SimCLR config).
  return tuple(f'{block}.' for block in METHOD_BLOCKS if block not in methods)


def identity(config: dict[str, Any]) -> dict[str, Any]:
  """The settings that decide a run's result, as {dotted name: value}.

  Leaves out `IGNORED_FIELDS`, `eval.*`, `monitor.*` and other methods' blocks.

  Args:
    config: a config dict (`to_dict()` or config.json); JSON round-tripped,
      so a tuple equals the list it was stored as.
  """
  flat = _run_settings(config)
  unread = _unread_blocks(config.get('method'))
  return {n: v for n, v in flat.items() if not _ignored(n, unread, length=True)}


def result_changing_diff(stored: dict[str, Any], new: dict[str, Any], *,
                         length: bool = False) -> list[str]:
  """Sorted dotted names of the settings that differ and change the result.

  Ignores what `identity` leaves out and, unless `length`, the run length
  (training compares the resolved total); a key in one dict only differs.

  Args:
    stored: the stored config (`read_config`).
    new: the config of this invocation (`ConfigDict.to_dict()`).
    length: whether the run length counts.
  """
  unread = _unread_blocks(stored.get('method'), new.get('method'))
  return sorted(n for n in _differing(_run_settings(stored), _run_settings(new))
                if not _ignored(n, unread, length))


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
  """The keys whose values differ, a key in one dict only included."""
  missing = object()
  return [n for n in set(a) | set(b) if a.get(n, missing) != b.get(n, missing)]


def _eval_fields(config: dict[str, Any], keep) -> dict[str, Any]:
  flat = config_files.flatten(config)
  return {n: v for n, v in flat.items() if n.startswith('eval.') and keep(n)}


def evaluation_identity(config: dict[str, Any]) -> dict[str, Any]:
  """`identity` (length included) plus `EVAL_RESULT_FIELDS`: the settings
  whose results are one run's numbers."""
  return {**identity(config),
          **_eval_fields(config, lambda n: n in EVAL_RESULT_FIELDS)}


def evaluation_diff(stored: dict[str, Any], new: dict[str, Any]) -> list[str]:
  """`result_changing_diff` with the length and every `eval.*` field but
  `EVAL_UNUSED_FIELDS`: why results made by `stored` are not `new`'s."""
  used = lambda n: n not in EVAL_UNUSED_FIELDS
  return sorted(result_changing_diff(stored, new, length=True) + _differing(
      _eval_fields(stored, used), _eval_fields(new, used)))


def describe_diff(stored: dict[str, Any], new: dict[str, Any],
                  names: list[str]) -> str:
  """`'method: 'otclr' -> 'simclr'; seed: 0 -> 1'` for the names given."""
  stored = config_files.flatten(stored)
  new = config_files.flatten(new)
  show = lambda d, n: repr(d[n]) if n in d else '(absent)'
  return '; '.join(f'{n}: {show(stored, n)} -> {show(new, n)}' for n in names)


def write_json(path: str, value: Any) -> None:
  """Atomically writes `value` as indented JSON (every JSON file we write)."""
  fileio.write_text(path, json.dumps(value, indent=1, sort_keys=True,
                                     allow_nan=False) + '\n')


def _digest(path: str) -> str | None:
  try:
    with open(path, 'rb') as f:
      return hashlib.sha256(f.read()).hexdigest()
  except FileNotFoundError:
    return None


def write_evaluation(workdir: str, results: dict[str, Any],
                     files: dict[str, str],
                     written: Sequence[str] = ()) -> dict[str, Any]:
  """Writes `files` under eval/, then results.json binding their sha256.

  Args:
    workdir: the run directory.
    results: the results dict (JSON-safe).
    files: {name relative to eval/: text}, e.g. tables.md, config.json.
    written: names relative to eval/ of files this evaluation wrote before
      (the fitted probes), bound too.

  Returns:
    `results` as written, with `files`.
  """
  out_dir = os.path.join(workdir, EVAL_DIR)
  digests = {name: digest for name in written
             if (digest := _digest(os.path.join(out_dir, name)))}
  for name, text in files.items():
    fileio.write_text(os.path.join(out_dir, name), text)
    digests[name] = hashlib.sha256(text.encode('utf-8')).hexdigest()
  results = {**results, 'files': digests}
  write_json(os.path.join(workdir, RESULTS_FILE), results)
  return results


def read_results(workdir: str) -> dict[str, Any] | None:
  """`eval/results.json` if every file it binds matches, or None if absent.

  Raises:
    CorruptFileError: results.json is not a JSON object.
    IncompleteEvaluationError: a file it binds is missing or was rewritten.
  """
  results = read_json_file(os.path.join(workdir, RESULTS_FILE))
  if results is None:
    return None
  for name, digest in (results.get('files') or {}).items():
    path = os.path.join(workdir, EVAL_DIR, name)
    if _digest(path) != digest:
      raise IncompleteEvaluationError(
          f'{path} does not belong to {os.path.join(workdir, RESULTS_FILE)} '
          '(an evaluation was interrupted between its writes); evaluate '
          'again.')
  return results


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """`metrics.jsonl`'s records; [] without it; a torn last line is dropped.

  Raises:
    CorruptFileError: a line before the last is not a record with a `step`.
  """
  path = os.path.join(workdir, METRICS_FILE)
  try:
    with open(path, encoding='utf-8', errors='replace') as f:
      lines = f.readlines()
  except FileNotFoundError:
    return []
  except IsADirectoryError as e:
    raise CorruptFileError(f'{path} is a directory, not the metrics file.') \
        from e
  numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
  records = []
  for number, line in numbered:
    try:
      record = json.loads(line)
      if not isinstance(record, dict) or not isinstance(
          record.get('step'), int):
        raise ValueError('not a record with an integer "step"')
    except ValueError as e:
      if number == numbered[-1][0]:
        logging.warning('Dropping the torn last line %d of %s (%s): %r',
                        number, path, e, line[:80])
        continue
      raise CorruptFileError(
          f'{path} line {number} is not a metrics record ({e}); fix or '
          'delete that line and rerun.') from None
    records.append(record)
  return records


def latest_checkpoint_step(workdir: str) -> int | None:
  """The newest complete checkpoint's step (not in-flight saves), or None."""
  directory = os.path.join(workdir, CHECKPOINTS_DIR)
  try:
    names = os.listdir(directory)
  except (FileNotFoundError, NotADirectoryError):
    return None
  steps = [int(d) for d in names if d.isdigit()]
  return max(steps) if steps else None


# Paths of the locks this process holds: flock conflicts within a process
# too, so nested users re-enter.
_held: set[str] = set()


@contextlib.contextmanager
def waiting_lock(path: str) -> Iterator[None]:
  """A blocking exclusive flock on the file `path`; the OS drops it if the
  process dies. Not `lock`'s: that one refuses instead of waiting (a
  second run in a workdir is a mistake, a second fit of one floor is not)
  and re-enters within a process."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      logging.info('Waiting for %s, held by another process.', path)
      fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)


@contextlib.contextmanager
def lock(workdir: str, name: str = LOCK_FILE) -> Iterator[None]:
  """Holds an exclusive, non-blocking, re-entrant flock on `workdir/name`.

  Creates `workdir` if needed; the OS releases the lock if the process dies.

  Args:
    workdir: the run directory.
    name: the lock file, `LOCK_FILE` (training) or `EVAL_LOCK_FILE`.

  Raises:
    cli.WorkdirLockedError: another process holds it (named if readable).
  """
  path = os.path.realpath(os.path.join(workdir, name))
  if path in _held:
    yield
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise
      holder = os.read(fd, 64).decode('ascii', 'replace').strip()
      who = f'process {holder}' if holder.isdigit() else 'another process'
      raise cli.WorkdirLockedError(
          f'{os.path.abspath(workdir)} is in use by {who} (lock {path}). '
          'One workdir holds one run: wait for it to end, stop it, or use '
          'another --workdir.') from None
    # Written once the lock is ours, so a waiting reader sees the holder.
    os.ftruncate(fd, 0)
    os.write(fd, f'{os.getpid()}\n'.encode())
    _held.add(path)
    try:
      yield
    finally:
      _held.discard(path)
      os.ftruncate(fd, 0)
  finally:
    os.close(fd)  # closing the last descriptor releases the flock
