"""How every command-line tool ends: one exception -> status table, one line.

Tools end through `run(main)` (`config_files.run` under `app.run`):
`status_of` maps an escaped exception to a status (docs/operations.md): 2
`UsageError` or a bad path, 65 `DivergedRunError`, 73 `WorkdirLockedError`
or an unwritable path, 75 `StopRequested` (also during start-up), 1 a full
disk, a `BrokenRunError` or an unknown exception (a bug: traceback). Imports
nothing heavy.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Sequence

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 65
EXIT_LOCKED = 73
EXIT_CANT_CREATE = 73
EXIT_STOPPED = 75


class UsageError(ValueError):
  """A mistake the user can fix (a flag, field, file or dataset): status 2."""


class DivergedRunError(ValueError):
  """A run or checkpoint is not finite (status 65)."""


class BrokenRunError(RuntimeError):
  """A run's stored state cannot be used: no checkpoint restores (status 1)."""


class WorkdirLockedError(RuntimeError):
  """Another process holds a workdir's lock (status 73)."""


# A path the user named is of the wrong kind or absent: a usage error.
_PATH_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
                errno.ELOOP, errno.ENAMETOOLONG)
_CANT_WRITE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


def one_line(error: BaseException) -> str:
  """The error's message on one line (no traceback, no line breaks)."""
  text = ' '.join(str(error).split())
  return text or type(error).__name__


# Orbax's TensorStore reports a full disk as a ValueError naming the file.
_NO_SPACE = re.compile(r"No space left on device|os_error_code='28'")
_FAILED_PATH = re.compile(r'(?:Failed writing|local file):? "([^"]+)"')


def disk_full_path(error: BaseException,
                   default: str = 'a file') -> str | None:
  """Where a full disk failed if `error` or what caused it is one, else None.

  `default` is named when the error names no path.
  """
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
      return error.filename or default
    if _NO_SPACE.search(str(error)):
      paths = _FAILED_PATH.findall(str(error))
      return paths[-1] if paths else default
    error = error.__cause__ or error.__context__
  return None


def status_of(error: BaseException) -> tuple[int, str] | None:
  """(exit status, one line) for an expected failure; None for a bug."""
  if isinstance(error, StopRequested):
    return EXIT_STOPPED, (f'Stopped by {error.name}; nothing is half-written. '
                          'Rerun the same command to resume.')
  if isinstance(error, KeyboardInterrupt):
    return EXIT_STOPPED, ('Stopped by SIGINT; rerun the same command to '
                          'resume.')
  from absl import app  # pylint: disable=g-import-not-at-top
  for kinds, status in ((WorkdirLockedError, EXIT_LOCKED),
                        (DivergedRunError, EXIT_DIVERGED),
                        (BrokenRunError, EXIT_FAILED),
                        ((UsageError, app.UsageError), EXIT_USAGE)):
    if isinstance(error, kinds):
      return status, one_line(error)
  if isinstance(error, FileNotFoundError) and error.errno is None:
    return EXIT_USAGE, one_line(error)  # a file or run the user named
  where = disk_full_path(error)
  if where is not None:
    return EXIT_FAILED, (f'Disk full: could not write {where} (No space left '
                         'on device). Free space and rerun the same command '
                         '(a run resumes from its newest complete '
                         'checkpoint).')
  if isinstance(error, OSError):
    what = f'{error.filename}: ' if error.filename else ''
    if error.errno in _CANT_WRITE_ERRNOS:
      return EXIT_CANT_CREATE, (f'Cannot write {what}{error.strerror}; give a '
                                'path this user can write.')
    if error.errno in _PATH_ERRNOS:
      return EXIT_USAGE, (f'{what}{error.strerror or one_line(error)}; check '
                          'the path given on the command line.')
  return None


def report(error: BaseException,
           usage_errors: tuple[type[BaseException], ...] = ()) -> int:
  """Prints `error` as one line (a bug: its traceback); returns the status.

  Args:
    error: what ended the tool.
    usage_errors: further exception types that are usage errors here.
  """
  mapped = status_of(error)
  if mapped is None and isinstance(error, usage_errors):
    mapped = EXIT_USAGE, one_line(error)
  if mapped is None:
    import traceback  # pylint: disable=g-import-not-at-top
    traceback.print_exception(type(error), error, error.__traceback__)
    return EXIT_FAILED
  status, line = mapped
  print(line if status == EXIT_STOPPED else f'error: {line}',
        file=sys.stderr, flush=True)
  return status


def call(main: Callable[[Sequence[str]], Any], argv: Sequence[str],
         usage_errors: tuple[type[BaseException], ...] = ()) -> int:
  """`main(argv)`'s exit status, an escaped exception mapped by the table."""
  try:
    status = main(list(argv))
  except SystemExit as e:
    status = e.code
  except BaseException as e:  # pylint: disable=broad-except
    return report(e, usage_errors)
  if status is None:
    return EXIT_OK
  return status if isinstance(status, int) else EXIT_FAILED


def run(main: Callable[[Sequence[str]], Any]) -> None:
  """Runs a tool's `main(sys.argv)` and exits with its status (the table)."""
  install_early_stop()
  exit_now(call(main, sys.argv))


def _stop_during_start_up(signum, _):
  name = signal.Signals(signum).name
  try:
    os.write(2, f'Stopped by {name} while starting; nothing was changed. '
             'Rerun the same command.\n'.encode())
  finally:
    os._exit(EXIT_STOPPED)  # pylint: disable=protected-access


def install_early_stop() -> None:
  """SIGTERM/SIGINT exit 75 until a tool sets its own (writes are atomic)."""
  for signum in (signal.SIGTERM, signal.SIGINT):
    if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler,
                                    None):
      signal.signal(signum, _stop_during_start_up)


class StopRequested(BaseException):
  """SIGTERM/SIGINT in `stop_on_signals`; a BaseException, so not swallowed."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum

  @property
  def name(self) -> str:
    """'SIGTERM' or 'SIGINT'."""
    return signal.Signals(self.signum).name


def exit_now(status: int) -> None:
  """Exits with `status`; a failure skips the runtime's shutdown, which
  crashes under a running computation (close files first)."""
  sys.stdout.flush()
  sys.stderr.flush()
  if status == 0:
    sys.exit(0)
  try:
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.flush()
  except ImportError:
    pass
  os._exit(status)  # pylint: disable=protected-access


# Signals of the current `stop_on_signals` block (a finaliser loses a raise).
_requested: list[int] = []


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
  """Turns SIGTERM/SIGINT into `StopRequested` in the block (main thread).

  A tool catches it and returns `EXIT_STOPPED` with one line. A `fileio`
  write is complete or absent; a raise dropped in a finaliser surfaces at
  the next `check_stop()`. Handlers are restored on exit; blocks do not nest.
  """

  def handle(signum, _):
    _requested.append(signum)
    raise StopRequested(signum)

  def unraisable(info):
    # A dropped raise is kept in `_requested`; its traceback would only alarm.
    if not isinstance(info.exc_value, StopRequested):
      previous_hook(info)

  del _requested[:]
  previous_hook = sys.unraisablehook
  sys.unraisablehook = unraisable
  previous = {s: signal.signal(s, handle)
              for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    sys.unraisablehook = previous_hook
    del _requested[:]


def check_stop() -> None:
  """Raises `StopRequested` if a signal came in this block (between parts)."""
  if _requested:
    raise StopRequested(_requested[0])


class StopFlag:
  """Turns SIGTERM/SIGINT into a flag a loop checks between its steps
  (training: it checkpoints, then stops); main thread only."""

  def __init__(self):
    self.signal = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, _):
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning('Received %s: saving a checkpoint and stopping.',
                    signal.Signals(signum).name)
    self.signal = signum

  def __exit__(self, *_):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
