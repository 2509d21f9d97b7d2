"""Checkpointing of the training state; the only module that imports Orbax."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
from typing import Any, Callable

from absl import logging as absl_logging
import jax
import orbax.checkpoint as ocp

from otclr_jax import cli
from otclr_jax import rundir


# Orbax warnings about what this module does on purpose: read-only managers
# for evaluation and export, and checkpoints read without Orbax's metadata.
_DELIBERATE = ('CheckpointManagerOptions.read_only=True',
               'Given directory is read only',
               'Metadata file does not exist',
               'Failed to get item metadata')


class _DropOrbaxInfo(logging.Filter):
  """Drops Orbax's INFO chatter (dozens of lines per save) and its warnings
  about deliberate choices; keeps the other warnings."""

  def filter(self, record):
    if f'{os.sep}orbax{os.sep}' not in record.pathname:
      return True
    return (record.levelno >= logging.WARNING
            and not str(record.msg).startswith(_DELIBERATE))


def quiet_logs() -> None:
  """Silences Orbax below WARNING on absl's handler, and the leftovers of
  its failed reads (call from entry points: it sets sys.unraisablehook)."""
  absl_logging.get_absl_handler().addFilter(_DropOrbaxInfo())
  default = sys.unraisablehook

  def hook(unraisable):
    # A coroutine of a failed Orbax read raising as it is collected: the
    # failure itself was reported already (a skipped checkpoint).
    code = getattr(unraisable.object, 'cr_code', None)
    if not (code is not None and f'{os.sep}orbax{os.sep}' in code.co_filename
            and isinstance(unraisable.exc_value, Exception)):
      default(unraisable)

  sys.unraisablehook = hook


# A checkpoint's items; `restore_part` reads `<step>/default` directly.
_STATE = 'default'
_CONFIG = 'config'


def _this_process_only() -> ocp.options.MultiprocessingOptions:
  """Orbax options for a reader on this process alone: it skips the barriers."""
  index = jax.process_index()
  return ocp.options.MultiprocessingOptions(primary_host=index,
                                            active_processes={index})


def stored_config(workdir: str) -> tuple[dict[str, Any], int] | None:
  """`Checkpointer.stored_config` of `workdir`; creates nothing."""
  if not os.path.isdir(os.path.join(workdir, rundir.CHECKPOINTS_DIR)):
    return None
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    return ckpt.stored_config()
  finally:
    ckpt.close()


class Checkpointer:
  """Keeps the last `keep` checkpoints of a state pytree in a workdir.

  Saves are asynchronous: `wait()` before exiting. All processes save the
  same global state; a `read_only` one is this process's alone. An
  interrupted save leaves a temporary directory that Orbax ignores.
  """

  def __init__(self, workdir: str, keep: int = 3, read_only: bool = False):
    """Opens (or creates) `workdir/checkpoints`.

    Args:
      workdir: the run's directory.
      keep: how many of the newest checkpoints to keep.
      read_only: create and clean up nothing (a run training there saves on).
    """
    self.directory = os.path.join(os.path.abspath(workdir),
                                  rundir.CHECKPOINTS_DIR)
    self._read_only = read_only
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=(_STATE, _CONFIG),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, create=not read_only,
            cleanup_tmp_directories=not read_only, read_only=read_only,
            **({'multiprocessing_options': _this_process_only()}
               if read_only else {})))

  def latest_step(self) -> int | None:
    """Step of the newest complete checkpoint, or None when there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any,
           config: dict[str, Any] | None = None) -> None:
    """Saves `state` as checkpoint `step` (a no-op if that step exists).

    Args:
      step: the checkpoint's step.
      state: the pytree to save.
      config: the run's config as a JSON-able dict, for `stored_config`.
    """
    if self._read_only:
      raise RuntimeError(f'{self.directory} was opened read-only.')
    if step in self._manager.all_steps():
      return
    # Orbax reports a full disk from a dozen writer threads, each with its
    # traceback; a save that cannot fit fails here, in one line, instead.
    need = sum(getattr(x, 'nbytes', 0)
               for x in jax.tree_util.tree_leaves(state))
    free = shutil.disk_usage(self.directory).free
    if free < need:
      raise OSError(errno.ENOSPC, f'No space left on device ({need / 1e6:.0f} '
                    f'MB to write, {free / 1e6:.0f} MB free)',
                    os.path.join(self.directory, str(step)))
    items = {_STATE: ocp.args.StandardSave(state)}
    if config is not None:
      items[_CONFIG] = ocp.args.JsonSave(json.loads(json.dumps(config)))
    self._manager.save(step, args=ocp.args.Composite(**items))

  def restore(self, target: Any, step: int) -> Any:
    """Checkpoint `step` in the structure of `target`, placed like it."""
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    return self._manager.restore(step, args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardRestore(abstract)}))[_STATE]

  def stored_config(self) -> tuple[dict[str, Any], int] | None:
    """`(config, step)` of the newest checkpoint holding a config, or None."""
    for step in sorted(self.all_steps(), reverse=True):
      try:
        config = self._manager.restore(step, args=ocp.args.Composite(
            **{_CONFIG: ocp.args.JsonRestore()}))[_CONFIG]
      except (KeyError, FileNotFoundError, ValueError):
        continue  # saved without a config, or that item is unreadable
      if isinstance(config, dict):
        return config, step
    return None

  def restore_newest(self, target: Any,
                     check: Callable[[Any], str | None] | None = None
                     ) -> tuple[Any, int | None]:
    """Restores the newest checkpoint that loads and passes `check`.

    Others are skipped with a warning; once an older one restores, the
    skipped newer ones move to `workdir/checkpoints_skipped/<step>`.

    Args:
      target: a pytree like the saved state (e.g. a freshly initialised one).
      check: returns None to accept a restored state, or why to skip it.

    Returns:
      `(state, step)`, the state placed like `target`, or `(target, None)`
      when there is no checkpoint.

    Raises:
      cli.BrokenRunError: no checkpoint restores (each step and why).
    """
    skipped = []
    for step in sorted(self.all_steps(), reverse=True):
      try:
        state = self.restore(target, step)
        problem = check(state) if check is not None else None
      except Exception as e:  # pylint: disable=broad-except
        problem = describe_error(e)
      if problem is None:
        for bad, _ in skipped:
          self._set_aside(bad)
        return state, step
      absl_logging.warning('Skipping checkpoint %s: %s',
                           os.path.join(self.directory, str(step)), problem)
      skipped.append((step, problem))
    if skipped:
      reasons = '; '.join(f'step {s}: {p}' for s, p in skipped)
      raise cli.BrokenRunError(
          f'No checkpoint in {self.directory} restores ({reasons}). Move '
          'that directory aside to start afresh.')
    return target, None

  def _set_aside(self, step: int) -> None:
    if self._read_only:
      return
    source = os.path.join(self.directory, str(step))
    aside = os.path.join(os.path.dirname(self.directory),
                         rundir.SKIPPED_CHECKPOINTS_DIR)
    os.makedirs(aside, exist_ok=True)
    dest, n = os.path.join(aside, str(step)), 1
    while os.path.exists(dest):
      dest, n = os.path.join(aside, f'{step}.{n}'), n + 1
    os.replace(source, dest)
    absl_logging.warning('Moved the skipped checkpoint %s to %s.', source,
                         dest)
    self._manager.reload()

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


class NetworkMismatchError(ValueError):
  """A checkpoint's network is not the one the config builds."""


def _leaf_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  leaves = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: hasattr(x, 'shape'))[0]
  return {jax.tree_util.keystr(p): tuple(leaf.shape) for p, leaf in leaves}


def restore_part(workdir: str, step: int, item: Any) -> Any:
  """Reads only the entries of `item` from checkpoint `step` in `workdir`.

  `item`: a nested dict of some saved fields holding arrays or
  ShapeDtypeStructs of the saved shapes; nothing else is read.

  Returns:
    `item`'s structure with the saved values, on the default device.

  Raises:
    FileNotFoundError: no checkpoint `step` in `workdir`.
    NetworkMismatchError: a part of `item` is not all of the saved part.
  """
  path = os.path.join(rundir.checkpoint_dir(workdir, step), _STATE)
  if not os.path.isdir(path):
    raise FileNotFoundError(f'No checkpoint for step {step}: {path} does not '
                            'exist.')
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, item)
  options = _this_process_only()
  with ocp.Checkpointer(
      ocp.PyTreeCheckpointHandler(multiprocessing_options=options),
      multiprocessing_options=options) as reader:
    # Partial restore skips whole parts (the optimiser's state), never part
    # of a network: what `item` asks of a part must be all the part holds.
    saved = reader.metadata(path).item_metadata
    saved = getattr(saved, 'tree', saved) or {}
    want = _leaf_shapes(abstract)
    have = _leaf_shapes({k: v for k, v in saved.items() if k in item})
    if want != have:
      missing, extra = sorted(want.keys() - have), sorted(have.keys() - want)
      reshaped = sorted(k for k in want.keys() & have if want[k] != have[k])
      raise NetworkMismatchError(
          f'checkpoint {path} holds another network than the config builds '
          f'({len(missing)} entries missing, e.g. {missing[:1]}; '
          f'{len(extra)} more saved, e.g. {extra[:1]}; {len(reshaped)} of '
          f'other shapes, e.g. {reshaped[:1]}): the model settings are not '
          'the run\'s.')
    return reader.restore(path, args=ocp.args.PyTreeRestore(
        item=abstract,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=True))


def describe_error(error: BaseException) -> str:
  """The innermost cause (TensorStore wraps it) as 'Type: first line'[:300]."""
  while error.__cause__ is not None:
    error = error.__cause__
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  first = lines[0][:300] if lines else '(no message)'
  return f'{type(error).__name__}: {first}'
