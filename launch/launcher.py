"""Runs one command of a sweep as a child process, and keeps it in hand."""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
from typing import Callable, Sequence

from launch import run_state

_WIDTH = 150  # characters of the live progress line


class SubprocessLauncher:
  """Runs commands one at a time, passing SIGTERM/SIGINT on (`stop_signal`)."""

  def __init__(self, cwd: str, poll_seconds: float | None = None):
    self.cwd = cwd
    self.interactive = sys.stdout.isatty()
    self.poll_seconds = poll_seconds or (5.0 if self.interactive else 600.0)
    self.stop_signal = None
    self.prefix = ''
    self._proc = None

  def install_signal_handlers(self) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, self._handle)

  def _handle(self, signum, _):
    self.stop_signal = signum
    print(f'\nReceived {signal.Signals(signum).name}: stopping the current '
          'command (training saves a checkpoint first).', flush=True)
    if self._proc is not None and self._proc.poll() is None:
      self._proc.send_signal(signum)

  def __call__(self, argv: Sequence[str], log_path: str) -> int:
    workdir = os.path.dirname(log_path)
    os.makedirs(workdir, exist_ok=True)
    with open(log_path, 'a') as log:
      log.write(f'\n$ {shlex.join(argv)}\n')
      log.flush()
      self._proc = subprocess.Popen(list(argv), cwd=self.cwd, stdout=log,
                                    stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent(os.getpid()))
      shown = code = None
      while code is None:
        try:
          code = self._proc.wait(timeout=self.poll_seconds)
        except subprocess.TimeoutExpired:
          pass
        # Also once it ended: its last progress still shows.
        shown = self._show_progress(workdir, shown)
      self._proc = None
    if shown and self.interactive:
      self._show('')
    return code

  def _show_progress(self, workdir: str, shown: str | None) -> str | None:
    line = run_state.progress_line(workdir)
    if line and line != shown:
      self._show(f'{self.prefix}{line}')
      return line
    return shown

  def _show(self, text: str) -> None:
    if self.interactive:
      print('\r' + text[:_WIDTH].ljust(_WIDTH), end='\r', flush=True)
    else:
      print(text, flush=True)


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
  """A `preexec_fn` giving the child SIGTERM when the sweep dies, or None."""
  if not sys.platform.startswith('linux'):
    return None
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None

  def set_death_signal():
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    # The parent may have died between fork and prctl.
    if os.getppid() != parent_pid:
      os.kill(os.getpid(), signal.SIGTERM)

  return set_death_signal
