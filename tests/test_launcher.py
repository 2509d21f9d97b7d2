"""The subprocess launcher of sweeps (launch/launcher.py): signals, progress,
children that die with their parent."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from launch import launcher as launcher_lib
from tests import helpers


def test_launcher_passes_a_stop_signal_on_and_shows_progress(tmp_path,
                                                             capsys):
  (tmp_path / 'child.py').write_text(helpers.STOPPABLE_CHILD)
  stopped, ready = tmp_path / 'stopped', tmp_path / 'ready'
  launcher = launcher_lib.SubprocessLauncher(helpers.REPO, poll_seconds=0.05)
  launcher.prefix = '[1/1] run: '
  thread = helpers.when_ready(str(ready),
                              lambda: launcher._handle(signal.SIGTERM, None))
  (tmp_path / 'run').mkdir()
  code = launcher([sys.executable, str(tmp_path / 'child.py'), str(stopped),
                   str(ready), str(tmp_path / 'run')],
                  str(tmp_path / 'run' / 'train.log'))
  thread.join()
  assert code == 0
  assert stopped.read_text() == 'stopped'
  assert launcher.stop_signal == signal.SIGTERM
  assert 'not progress' in open(tmp_path / 'run' / 'train.log').read()
  # Progress comes from metrics.jsonl and status.json, not the log text.
  assert '[1/1] run: step 1/2, loss 2.5000' in capsys.readouterr().out


_SLEEPER = textwrap.dedent("""
    import os, sys, time
    open(sys.argv[1], 'w').write(str(os.getpid()))
    time.sleep(120)
""")


_SWEEP_PROCESS = textwrap.dedent("""
    import sys
    import os
    from launch import launcher
    launcher.SubprocessLauncher(os.getcwd(), poll_seconds=0.1)(
        [sys.executable, sys.argv[1], sys.argv[2]], sys.argv[3])
""")


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie (exited, not yet reaped by init) counts as dead.
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().split(') ')[-1][0] != 'Z'
  except FileNotFoundError:
    return False


@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason='PR_SET_PDEATHSIG is Linux-only')
def test_children_die_with_a_killed_sweep(tmp_path):
  (tmp_path / 'sleeper.py').write_text(_SLEEPER)
  pid_file = tmp_path / 'child.pid'
  parent = subprocess.Popen(
      [sys.executable, '-c', _SWEEP_PROCESS, str(tmp_path / 'sleeper.py'),
       str(pid_file),
       str(tmp_path / 'run' / 'train.log')], cwd=helpers.REPO)
  deadline = time.time() + 60
  while not (pid_file.exists() and pid_file.read_text()):
    assert time.time() < deadline and parent.poll() is None
    time.sleep(0.05)
  child = int(pid_file.read_text())
  assert _alive(child)
  parent.send_signal(signal.SIGKILL)
  parent.wait()
  deadline = time.time() + 10
  while _alive(child) and time.time() < deadline:
    time.sleep(0.05)
  alive = _alive(child)
  if alive:
    os.kill(child, signal.SIGKILL)
  assert not alive, 'the child outlived the SIGKILLed sweep'
