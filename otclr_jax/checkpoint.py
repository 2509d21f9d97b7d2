"""Checkpointing of the training state; the only module that imports Orbax."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class _DropOrbaxInfo(logging.Filter):
  """Drops Orbax's INFO chatter (dozens of lines per save), keeps warnings."""

  def filter(self, record):
    return (record.levelno >= logging.WARNING
            or f'{os.sep}orbax{os.sep}' not in record.pathname)


def quiet_logs() -> None:
  """Silences Orbax below WARNING on absl's handler (call from entry points)."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  absl_logging.get_absl_handler().addFilter(_DropOrbaxInfo())


class Checkpointer:
  """Keeps the last `keep` checkpoints of a state pytree under `workdir/checkpoints`.

  Saves are asynchronous (training continues while the arrays are written);
  `wait()` blocks until the last one is on disk, so call it before exiting.
  An interrupted save leaves only a temporary directory that Orbax ignores and
  cleans up, so the latest complete checkpoint is always the one restored.
  """

  def __init__(self, workdir: str, keep: int = 3, read_only: bool = False):
    """Opens (or creates) `workdir/checkpoints`.

    Args:
      workdir: the run's directory.
      keep: how many of the newest checkpoints to keep.
      read_only: for readers such as evaluation: creates nothing and leaves
        temporary directories alone, so a run still training there keeps its
        in-flight save.
    """
    if keep < 1:
      raise ValueError(f'keep_checkpoints must be >= 1, got {keep}.')
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    self._read_only = read_only
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, create=not read_only,
            cleanup_tmp_directories=not read_only, read_only=read_only))

  def latest_step(self) -> int | None:
    """Step of the newest complete checkpoint, or None when there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any) -> None:
    """Saves `state` as checkpoint `step` (a no-op if that step exists)."""
    if self._read_only:
      raise RuntimeError(f'{self.directory} was opened read-only.')
    if step in self._manager.all_steps():
      return
    self._manager.save(step, args=ocp.args.StandardSave(state))

  def restore(self, target: Any, step: int | None = None) -> Any:
    """Restores checkpoint `step` (default: latest) into the structure of `target`.

    Args:
      target: a pytree with the same structure, shapes, dtypes and shardings as
        the saved state, e.g. a freshly initialised state.
      step: which checkpoint; None for the latest.

    Returns:
      The restored pytree, placed like `target`.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'No checkpoint under {self.directory}.')
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
