"""Helpers shared by test modules; fixtures live in conftest.py."""

import errno
import fcntl
import os

from otclr_jax import rundir


def is_locked(workdir: str, name: str = rundir.LOCK_FILE) -> bool:
  """Whether an open file holds the flock of `workdir/name`; creates nothing.

  flock conflicts between two open files even within one process, so this
  sees this process's own locks too.
  """
  try:
    fd = os.open(os.path.join(workdir, name), os.O_RDONLY)
  except FileNotFoundError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      return True
    raise
  finally:
    os.close(fd)
  return False
