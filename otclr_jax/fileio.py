"""Crash-safe file writes: a crash never leaves a truncated file behind."""

from __future__ import annotations

import os
import uuid
from typing import BinaryIO, Callable


def atomic_write(path: str, write: Callable[[BinaryIO], None]) -> None:
  """Writes `path` so that a crash never leaves a truncated file behind.

  Args:
    path: the destination; its directory is created if needed.
    write: fills the open binary file, e.g. `lambda f: np.savez(f, x=x)`.
  """
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp_path = f'{path}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp'
  try:
    # Same directory: the rename is atomic; 'x', not mkstemp: umask applies.
    with open(tmp_path, 'xb') as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp_path, path)
  except BaseException as e:
    if os.path.exists(tmp_path):
      os.remove(tmp_path)
    if isinstance(e, OSError) and e.filename is None:
      # Writes to an open file name no path: a full disk should say which.
      raise OSError(e.errno, e.strerror or str(e), path) from e
    raise


def write_text(path: str, text: str) -> None:
  """`atomic_write` of UTF-8 text."""
  atomic_write(path, lambda f: f.write(text.encode('utf-8')))
