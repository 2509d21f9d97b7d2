r"""Runs a sweep of pretraining + evaluation runs and tabulates mean ± std.

A sweep file is a config file (big_vision's style): `get_config()` returns
the base config and `get_hyper(hyper)` the runs, as products of overrides of
any config key:

    from configs import cifar10

    def get_config():
      return cifar10.get_config()

    def get_hyper(hyper):
      return hyper.product([
          hyper.sweep('config.seed', [0, 1, 2]),
          hyper.sweep('config.batch_size', [256, 512]),
          hyper.sweep('config.method', ['simclr', 'otclr']),
      ])

`hyper.sweep(key, values)` is one axis, `hyper.fixed(key, value)` one value,
`hyper.product(parts)` their Cartesian product (the first part outermost:
seed first, and an interrupted sweep already holds whole comparisons for its
first seeds), `hyper.zipit(parts)` parts side by side. A run is named after
the keys whose values differ between runs, in order, e.g.
`seed=0,batch_size=256,method=simclr`, and lives in DIR/<name>. Sweeping
`config.ot.epsilon` needs no change here.

    python -m launch.sweep --config=launch/sweeps/cifar10_paper.py \
        --workdir=DIR [--config.data_dir=/data/tfds]
        Checks every run's config, then trains and evaluates each run here,
        one after another (`python -m otclr_jax.main --config=<sweep file>
        --workdir=DIR/<name> --config.<key>=<value>...`), then writes
        DIR/summary.{md,tex,json}. `--config.a.b=v` flags apply to every run.
        Rerunning skips finished runs and resumes the others.
    ... --slurm [--partition=P --gres=gpu:1 --time=24:00:00]
        Writes DIR/sweep.sbatch, a job array with one task per run; submit
        it with `sbatch DIR/sweep.sbatch`. Each task runs this command with
        --only_index=$SLURM_ARRAY_TASK_ID; on SIGTERM (time limit, with
        --signal=B:TERM@180, or preemption) training checkpoints and the task
        requeues itself.
    ... --dry_run            Prints the commands, runs nothing.
    python -m launch.sweep --workdir=DIR --aggregate_only
        Only tabulates DIR/*/eval/results.json.

Trust rules. A run's identity is its resolved config: training stores it in
`DIR/<name>/config.json` and evaluation in `DIR/<name>/eval/config.json`. A
sweep whose runs differ from stored runs in anything that changes the result
(`rundir.result_changing_diff`) is refused before anything runs or `runs.json`
is rewritten, naming the run and the settings; use another --workdir or
delete that run. Results evaluated with other `eval.*` settings (or for
another step) are re-evaluated. A run counts as finished only when its
`status.json` says "finished" at its final step and its results are for that
step. A child that exits 75 (`rundir.EXIT_STOPPED`, preempted) leaves its run
unfinished and stops the sweep with 75: rerun to resume. The summary averages
finished runs only and lists every other run (unfinished, diverged, no
status.json, unreadable results.json) under "Not averaged". Children get
SIGTERM when the sweep process dies, even by SIGKILL (Linux
`PR_SET_PDEATHSIG`; elsewhere they share the sweep's process group, so kill
the group). Progress comes from each run's status.json and metrics.jsonl.

Exit statuses: 0 every run finished; 1 a run failed (or, with
--aggregate_only, a results.json is unreadable); 2 a bad flag, sweep file or
run config (checked before any run starts), or a rerun with other settings;
73 another sweep holds DIR (`rundir.SWEEP_LOCK_FILE`); 75 stopped by
SIGTERM/SIGINT or a preempted run: rerun the same command to resume.

SLURM: a job array written as a plain sbatch file, not submitit. submitit
(1.5.4 with cloudpickle: about 1 MB, 0.15 s to import) pickles a Python
callable and requeues through its own checkpoint protocol; our runs are
command lines whose trainer already checkpoints on SIGTERM and exits 75, so
the array needs only `--signal`, `--requeue` and a trap, readable in the file.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import types
from typing import Any, Callable, Sequence

from absl import flags
from ml_collections import config_flags

from otclr_jax import config_files
from otclr_jax import rundir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join('eval', 'results.json')
_WIDTH = 150  # characters of the live progress line

# A launcher runs one command (argv list) with cwd=REPO, appending its output
# to the log file, and returns the exit status.
Launcher = Callable[[Sequence[str], str], int]


# ----------------------------------------------------------------------------
# The `hyper` helpers a sweep file's get_hyper receives.


def _sweep(key: str, values: Sequence[Any]) -> list[dict[str, Any]]:
  if isinstance(values, (str, bytes)) or not list(values):
    raise ValueError(f'hyper.sweep({key!r}, ...) needs a non-empty list of '
                     f'values, got {values!r}.')
  return [{key: v} for v in values]


def _fixed(key: str, value: Any) -> list[dict[str, Any]]:
  return [{key: value}]


def _product(parts: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
  return [dict(itertools.chain.from_iterable(d.items() for d in combo))
          for combo in itertools.product(*parts)]


def _zipit(parts: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
  if len({len(p) for p in parts}) > 1:
    raise ValueError('hyper.zipit needs parts of equal length, got '
                     f'{[len(p) for p in parts]}.')
  return [dict(itertools.chain.from_iterable(d.items() for d in row))
          for row in zip(*parts)]


HYPER = types.SimpleNamespace(sweep=_sweep, fixed=_fixed, product=_product,
                              zipit=_zipit)


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a sweep.

  Attributes:
    index: position in the sweep, 0-based (the SLURM array task id).
    name: `key=value,...` of the keys whose values differ between runs.
    workdir: `DIR/<name>`, absolute.
    overrides: `(key, value)` of this run, keys without `config.`, in order.
  """
  index: int
  name: str
  workdir: str
  overrides: tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A loaded sweep file.

  Attributes:
    path: the sweep file, absolute; the runs' `--config`.
    config: its `get_config()` with the command line's overrides applied.
    flags: those overrides, `--config.a.b=v`, passed on to every run.
    hypers: `get_hyper(HYPER)`, one dict of overrides per run.
  """
  path: str
  config: Any
  flags: tuple[str, ...]
  hypers: tuple[dict[str, Any], ...]

  @property
  def name(self) -> str:
    return os.path.splitext(os.path.basename(self.path))[0]

  def runs(self, workdir: str) -> list[Run]:
    """The runs under `workdir`, in the order of get_hyper."""
    workdir = os.path.abspath(os.path.expanduser(workdir))
    varying = [k for k in dict.fromkeys(k for h in self.hypers for k in h)
               if len({repr(h.get(k)) for h in self.hypers}) > 1]
    runs = []
    for index, hyper in enumerate(self.hypers):
      name = ','.join(f'{k[len("config."):]}={_safe(hyper.get(k))}'
                      for k in varying) or 'base'
      overrides = tuple((k[len('config.'):], v) for k, v in hyper.items())
      runs.append(Run(index, name, os.path.join(workdir, name), overrides))
    return runs

  def run_config(self, run: Run):
    """The ConfigDict `main` resolves for `run` (same parser, locked)."""
    return config_files.apply_overrides(self.config, list(run.overrides))


def _safe(value: Any) -> str:
  # 'folder:/data/x' must become one path component.
  text = re.sub(r'[^A-Za-z0-9.+-]+', '-', str(value))
  return text.strip('-') if isinstance(value, str) else text


def load_sweep(path: str, config, cli_flags: Sequence[str] = ()) -> Sweep:
  """Reads a sweep file's runs and checks every run's config.

  Args:
    path: the sweep file (with `get_config` and `get_hyper`).
    config: its base config, as `--config` (with `cli_flags`) loaded it.
    cli_flags: the `--config.a.b=v` flags of the command line.

  Returns:
    The sweep.

  Raises:
    ValueError: no get_hyper, a key without `config.`, an unknown field, a
      value of the wrong type, a config training refuses (an unknown method),
      or two runs of one name. The message names the run.
  """
  path = os.path.abspath(os.path.expanduser(path))
  module = types.ModuleType('_sweep')
  module.__file__ = path
  if REPO not in sys.path:  # Sweep files import `configs.X`.
    sys.path.insert(0, REPO)
  with open(path) as f:
    exec(compile(f.read(), path, 'exec'), module.__dict__)  # pylint: disable=exec-used
  if not hasattr(module, 'get_hyper'):
    raise ValueError(f'{path} defines no get_hyper(hyper).')
  hypers = tuple(dict(h) for h in module.get_hyper(HYPER))
  for hyper in hypers:
    for key in hyper:
      if not key.startswith('config.'):
        raise ValueError(f'{path}: sweep keys are config.<field>, got {key!r}.')
  swept = {k[len('config.'):] for h in hypers for k in h}
  for flag in cli_flags:
    key = flag[len('--config.'):].split('=', 1)[0]
    if key in swept:
      raise ValueError(f'{flag}: {path} sweeps config.{key}; change it there.')
  sweep = Sweep(path, config, tuple(cli_flags), hypers)
  runs = sweep.runs(REPO)
  names = [r.name for r in runs]
  if not runs or len(set(names)) != len(names):
    raise ValueError(f'{path}: get_hyper gives the runs {names}; each needs a '
                     'distinct name (remove repeated values).')
  # Lazily: the check needs the model code, the rest of this module does not.
  from otclr_jax import experiment  # pylint: disable=g-import-not-at-top
  for run in runs:
    try:
      experiment.validate_config(sweep.run_config(run))
    except ValueError as e:
      raise ValueError(f'{path} (run {run.name}): {e}') from None
  return sweep


# ----------------------------------------------------------------------------
# Commands and run state.


def command(sweep: Sweep, run: Run, mode: str) -> list[str]:
  """The `python -m otclr_jax.main ...` argv of one run; cwd is the repo root."""
  argv = [sys.executable, '-m', 'otclr_jax.main', f'--config={sweep.path}',
          f'--workdir={run.workdir}', *sweep.flags]
  argv += [config_files.override_flag(o) for o in run.overrides]
  if mode == 'eval':
    argv.append('--config.mode=eval')
  return argv


def latest_checkpoint_step(workdir: str) -> int | None:
  # Orbax names complete checkpoints by their step alone; in-flight saves
  # carry a suffix and must not count.
  directory = os.path.join(workdir, 'checkpoints')
  steps = [int(d) for d in os.listdir(directory)
           if d.isdigit()] if os.path.isdir(directory) else []
  return max(steps) if steps else None


def _records(workdir: str) -> list[dict]:
  """The complete records of metrics.jsonl (a torn last line is skipped)."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue  # A crash or a full disk tore it.
  return records


def final_step(config, workdir: str) -> int | None:
  """Number of steps the run trains for, or None if not known yet.

  With `total_steps > 0` that is the config's; otherwise it is
  `num_epochs * steps_per_epoch` (as training computes it), where
  steps_per_epoch is read off metrics.jsonl (`step / epoch`) rather than by
  loading the dataset.
  """
  if config.total_steps > 0:
    return int(config.total_steps)
  for record in reversed(_records(workdir)):
    if record.get('epoch'):
      return int(config.num_epochs * round(record['step'] / record['epoch']))
  return None


def read_results(workdir: str) -> dict | None:
  """DIR/<run>/eval/results.json, or None if absent.

  Raises:
    ValueError: the file is not valid JSON (the message names it).
  """
  path = os.path.join(workdir, RESULTS)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path} is not valid JSON ({e}).') from e


def identity_conflict(config, workdir: str) -> str | None:
  """Why the run in `workdir` is not the run `config` describes, or None.

  Compares the config that training stored (`rundir.CONFIG_FILE`) with this
  invocation's on every result-changing setting. A run directory that holds
  checkpoints or results but no stored config cannot be identified and is a
  conflict too: its numbers could come from any settings.
  """
  try:
    stored = rundir.read_config(workdir)
  except ValueError as e:
    return str(e)
  if stored is None:
    if (latest_checkpoint_step(workdir) is not None
        or os.path.exists(os.path.join(workdir, RESULTS))):
      return (f'it holds checkpoints or results but no '
              f'{rundir.CONFIG_FILE} recording the settings that produced '
              'them')
    return None
  new = config.to_dict()
  names = rundir.result_changing_diff(stored, new)
  return (f'it was run with other settings: '
          f'{rundir.describe_diff(stored, new, names)}' if names else None)


def _eval_config_conflict(config, workdir: str) -> str | None:
  """Why results.json does not belong to `config`'s evaluation, or None."""
  path = os.path.join(workdir, 'eval', 'config.json')
  try:
    with open(path) as f:
      stored = json.load(f)
  except FileNotFoundError:
    return f'no {path} records how it was evaluated'
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    return f'{path} is not valid JSON ({e})'
  new = json.loads(json.dumps(config.to_dict()))
  names = rundir.result_changing_diff(stored, new)
  # Evaluation settings change the reported numbers (not the training).
  flat_stored, flat_new = rundir.flatten(stored), rundir.flatten(new)
  names += sorted(n for n in set(flat_stored) | set(flat_new)
                  if n.startswith('eval.') and n != 'eval.figures'
                  and flat_stored.get(n) != flat_new.get(n))
  return (f'it was evaluated with other settings: '
          f'{rundir.describe_diff(stored, new, names)}' if names else None)


def stale_results_reason(config, workdir: str) -> str | None:
  """Why existing results.json may not be reported for `config`, or None."""
  try:
    results = read_results(workdir)
  except ValueError as e:
    return str(e)
  if results is None:
    return None
  total = final_step(config, workdir)
  if total is None or results.get('step') != total:
    return f'its results are for step {results.get("step")}, not {total}'
  return _eval_config_conflict(config, workdir)


def is_trained(config, workdir: str) -> bool:
  """Whether training reached the run's final step (status.json says so)."""
  total = final_step(config, workdir)
  if total is None:
    return False
  try:
    status = rundir.read_status(workdir)
  except ValueError:
    return False  # A damaged status.json: training rewrites it.
  if status is not None:
    return status.get('state') == 'finished' and status.get('step') == total
  latest = latest_checkpoint_step(workdir)
  return latest is not None and latest >= total


def is_finished(config, workdir: str) -> bool:
  """Whether the run trained to its end and its results belong to `config`."""
  return (is_trained(config, workdir)
          and os.path.exists(os.path.join(workdir, RESULTS))
          and stale_results_reason(config, workdir) is None)


def progress_line(workdir: str) -> str | None:
  """'step 120/2000, loss 3.2100' from metrics.jsonl and status.json."""
  records = _records(workdir)
  if not records:
    return None
  last = records[-1]
  try:
    total = (rundir.read_status(workdir) or {}).get('total_steps')
  except ValueError:
    total = None
  line = f'step {last.get("step")}' + (f'/{total}' if total else '')
  if isinstance(last.get('loss'), (int, float)):
    line += f', loss {last["loss"]:.4f}'
  return line


# ----------------------------------------------------------------------------
# Local execution.


class SubprocessLauncher:
  """Runs commands one at a time, output to a log file, progress to the console.

  SIGTERM/SIGINT received by the sweep are passed on to the running command
  (training then checkpoints and exits) and recorded in `stop_signal` so that
  the sweep stops instead of evaluating a half-trained run.
  """

  def __init__(self, poll_seconds: float | None = None):
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
      self._proc = subprocess.Popen(list(argv), cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent(os.getpid()))
      shown = None
      while True:
        try:
          code = self._proc.wait(timeout=self.poll_seconds)
          break
        except subprocess.TimeoutExpired:
          shown = self._show_progress(workdir, shown)
      # A command can end between polls: its last progress still shows.
      shown = self._show_progress(workdir, shown)
      self._proc = None
    if shown and self.interactive:
      self._show('')
    return code

  def _show_progress(self, workdir: str, shown: str | None) -> str | None:
    line = progress_line(workdir)
    if line and line != shown:
      self._show(f'{self.prefix}{line}')
      return line
    return shown

  def _show(self, text: str) -> None:
    # On a terminal one line is rewritten in place; a log file (SLURM) gets
    # one line per poll.
    if self.interactive:
      print('\r' + text[:_WIDTH].ljust(_WIDTH), end='\r', flush=True)
    else:
      print(text, flush=True)


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
  """A `preexec_fn` making the child get SIGTERM when the sweep dies.

  A sweep killed by SIGKILL cannot pass a signal on, and its trainer would
  run on as an orphan (and a rerun would start a second one). On Linux the
  kernel sends the child SIGTERM when its parent dies (`PR_SET_PDEATHSIG`),
  so training checkpoints and exits. Elsewhere None: the child stays in the
  sweep's process group, so killing the group ends both.
  """
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


@dataclasses.dataclass
class Outcome:
  """What became of one run in this invocation.

  Attributes:
    run: the run.
    status: 'finished' (already, skipped), 'done', 'failed', 'interrupted'
      (the sweep got a signal), 'stopped' (the child exited
      `rundir.EXIT_STOPPED`) or 'dry_run'.
    detail: what to tell the user.
  """
  run: Run
  status: str
  detail: str = ''


def run_one(sweep: Sweep, run: Run, launcher: Launcher, *, total: int,
            dry_run: bool = False, stop=lambda: None) -> Outcome:
  """Trains (resuming) and evaluates one run unless it is finished.

  Args:
    sweep: the sweep.
    run: which run.
    launcher: runs a command, see `Launcher`.
    total: number of runs in the sweep, for the console line.
    dry_run: print the commands instead of running them.
    stop: returns a signal number once the sweep has been asked to stop.

  Returns:
    What happened.
  """
  config = sweep.run_config(run)
  head = f'[{run.index + 1}/{total}] {run.name}'
  if is_finished(config, run.workdir):
    print(f'{head}: finished, skipped', flush=True)
    return Outcome(run, 'finished')
  train_cmd, eval_cmd = command(sweep, run, 'train'), command(sweep, run, 'eval')
  if dry_run:
    print(f'{head}:\n  {shlex.join(train_cmd)}\n  {shlex.join(eval_cmd)}',
          flush=True)
    return Outcome(run, 'dry_run')
  start = time.time()
  if hasattr(launcher, 'prefix'):
    launcher.prefix = f'{head}: '
  at = lambda: latest_checkpoint_step(run.workdir)
  if is_trained(config, run.workdir):
    stale = stale_results_reason(config, run.workdir)
    print(f'{head}: trained, evaluating'
          + (f' again ({RESULTS}: {stale})' if stale else ''), flush=True)
  else:
    print(f'{head}: training' + (f' (resuming from step {at()})' if at() else '')
          + f', log {os.path.join(run.workdir, "train.log")}', flush=True)
    code = launcher(train_cmd, os.path.join(run.workdir, 'train.log'))
    if code == rundir.EXIT_STOPPED:
      # Preempted: a good checkpoint, not a finished run; the sweep stops so
      # that a requeue resumes it.
      return _report(head, Outcome(run, 'stopped', f'training stopped at step '
                                   f'{at()} (exit {code}); rerun to resume'))
    if code != 0:
      why = ' (diverged: non-finite loss or state)' if (
          code == rundir.EXIT_DIVERGED) else ''
      return _report(head, Outcome(run, 'failed', f'training exited {code}'
                                   f'{why}, see {run.workdir}/train.log'))
    if stop() is not None:
      return _report(head, Outcome(run, 'interrupted',
                                   f'stopped at step {at()}; rerun to resume'))
    final = final_step(config, run.workdir)
    if not is_trained(config, run.workdir) and final is not None:
      return _report(head, Outcome(
          run, 'failed', f'training exited at step {at()} of {final}, see '
          f'{run.workdir}/train.log'))
    # Training may evaluate at its end itself (config.eval.at_end).
    if is_finished(config, run.workdir):
      return _report(head, Outcome(run, 'done', _elapsed(start)))
    print(f'{head}: evaluating, log {os.path.join(run.workdir, "eval.log")}',
          flush=True)
  code = launcher(eval_cmd, os.path.join(run.workdir, 'eval.log'))
  if stop() is not None:
    return _report(head, Outcome(run, 'interrupted', 'during evaluation'))
  if code != 0:
    return _report(head, Outcome(run, 'failed', f'evaluation exited {code}, '
                                 f'see {run.workdir}/eval.log'))
  if not is_finished(config, run.workdir):
    return _report(head, Outcome(
        run, 'failed', f'evaluation wrote no usable {RESULTS} for step '
        f'{final_step(config, run.workdir)} '
        f'({stale_results_reason(config, run.workdir) or "none written"})'))
  return _report(head, Outcome(run, 'done', _elapsed(start)))


def _elapsed(start: float) -> str:
  return 'in ' + time.strftime('%H:%M:%S', time.gmtime(time.time() - start))


def _report(head: str, outcome: Outcome) -> Outcome:
  status = outcome.status.upper() if outcome.status == 'failed' else (
      outcome.status)
  print(f'{head}: {status} {outcome.detail}'.rstrip(), flush=True)
  return outcome


class RunConflictError(ValueError):
  """A run directory holds a run made with other result-changing settings."""


def check_identities(sweep: Sweep, runs: Sequence[Run]) -> None:
  """Refuses runs whose directories hold a run with other settings.

  Raises:
    RunConflictError: naming every conflicting run directory and setting.
  """
  conflicts = [f'  {run.workdir}: {why}' for run in runs
               if (why := identity_conflict(sweep.run_config(run),
                                            run.workdir))]
  if conflicts:
    raise RunConflictError(
        'These run directories hold runs made with other settings than this '
        'sweep asks for, so their results cannot be reported as its results:'
        '\n' + '\n'.join(conflicts) + '\nUse another --workdir, or delete '
        'those run directories to recompute them.')


def run_sweep(sweep: Sweep, workdir: str, *,
              launcher: Launcher | None = None,
              only_index: int | None = None,
              dry_run: bool = False,
              stop_on_error: bool = False,
              aggregate: bool = True) -> int:
  """Runs the sweep's runs in order here; returns the process exit status.

  Args:
    sweep: the sweep.
    workdir: sweep directory DIR; run r lives in DIR/<r.name>.
    launcher: runs one command (default: a subprocess per command).
    only_index: run just this run (a SLURM array task; no sweep lock, the
      tasks of one array run side by side).
    dry_run: print the commands, run nothing.
    stop_on_error: stop at the first failed run instead of going on.
    aggregate: write DIR/summary.* at the end (not for a single array task).

  Returns:
    0 if every run finished; 1 if any failed; `rundir.EXIT_STOPPED` if the
    sweep got SIGTERM/SIGINT or a run stopped early (preempted).

  Raises:
    RunConflictError: a run directory holds a run with other result-changing
      settings (nothing is run or written then).
    rundir.WorkdirLockedError: another sweep runs in `workdir`.
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  runs = sweep.runs(workdir)
  selected = runs
  if only_index is not None:
    if not 0 <= only_index < len(runs):
      raise ValueError(f'--only_index must lie in [0, {len(runs) - 1}], got '
                       f'{only_index}.')
    _check_run_list(runs, workdir)
    selected = [runs[only_index]]
  check_identities(sweep, selected)
  if dry_run:
    for run in selected:
      run_one(sweep, run, launcher, total=len(runs), dry_run=True)
    return 0
  if launcher is None:
    launcher = SubprocessLauncher()
    launcher.install_signal_handlers()
  if only_index is not None:
    return _run_all(sweep, selected, len(runs), workdir, launcher,
                    stop_on_error, aggregate=False)
  with rundir.lock(workdir, rundir.SWEEP_LOCK_FILE):
    write_run_list(sweep, runs, workdir)
    return _run_all(sweep, selected, len(runs), workdir, launcher,
                    stop_on_error, aggregate)


def _run_all(sweep: Sweep, selected: Sequence[Run], total: int, workdir: str,
             launcher: Launcher, stop_on_error: bool, aggregate: bool) -> int:
  stop = lambda: getattr(launcher, 'stop_signal', None)
  outcomes = []
  for run in selected:
    if stop() is None:
      outcomes.append(run_one(sweep, run, launcher, total=total, stop=stop))
    # A command killed by the signal exits non-zero: not a failure of the run.
    if stop() is not None or outcomes[-1].status == 'interrupted':
      name = signal.Signals(stop() or signal.SIGTERM).name
      print(f'Sweep {sweep.name} stopped by {name}; rerun the same command '
            'to resume.', file=sys.stderr, flush=True)
      return rundir.EXIT_STOPPED
    if outcomes[-1].status == 'stopped':
      print(f'Sweep {sweep.name} stopped: {outcomes[-1].run.name} was stopped '
            f'before its final step (exit {rundir.EXIT_STOPPED}); rerun the '
            'same command to resume.', flush=True)
      return rundir.EXIT_STOPPED
    if outcomes[-1].status == 'failed' and stop_on_error:
      break
  failed = [o for o in outcomes if o.status == 'failed']
  counts = {s: sum(o.status == s for o in outcomes)
            for s in ('done', 'finished', 'failed')}
  print(f'Sweep {sweep.name}: {counts["done"]} done, {counts["finished"]} '
        f'already finished, {counts["failed"]} failed, '
        f'{len(selected) - len(outcomes)} not started.', flush=True)
  for outcome in failed:
    print(f'  FAILED {outcome.run.name}: {outcome.detail}', flush=True)
  if aggregate:
    aggregate_dir(workdir)
  return 1 if failed or len(outcomes) < len(selected) else 0


def write_run_list(sweep: Sweep, runs: Sequence[Run], workdir: str) -> str:
  """Writes DIR/runs.json: the sweep's runs, their settings and commands."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, 'runs.json')
  entries = [{'index': r.index, 'name': r.name, 'workdir': r.workdir,
              'overrides': dict(r.overrides),
              'train': shlex.join(command(sweep, r, 'train')),
              'eval': shlex.join(command(sweep, r, 'eval'))} for r in runs]
  with open(path, 'w') as f:
    json.dump({'sweep': sweep.path, 'runs': entries}, f, indent=1)
  return path


def _check_run_list(runs: Sequence[Run], workdir: str) -> None:
  # An array task maps its index through the sweep file as it is now; if the
  # file changed after submission the index would silently name another run.
  path = os.path.join(workdir, 'runs.json')
  if not os.path.exists(path):
    return
  with open(path) as f:
    listed = [e['name'] for e in json.load(f)['runs']]
  if listed != [r.name for r in runs]:
    raise ValueError(f'{path} lists other runs than the sweep file now '
                     'expands to; the sweep file changed after the job was '
                     'written. Restore it or write a new job with --slurm.')


# ----------------------------------------------------------------------------
# SLURM.


def slurm_script(task_argv: Sequence[str], workdir: str,
                 run_names: Sequence[str], *, job_name: str,
                 partition: str = '', gres: str = 'gpu:1',
                 time_limit: str = '24:00:00', cpus_per_task: int = 8,
                 mem: str = '64G', max_parallel: int = 0,
                 grace_seconds: int = 180) -> str:
  """The text of a SLURM job array running each run as one task.

  The batch shell gets SIGTERM `grace_seconds` before the time limit (and on
  preemption); it passes it on, training checkpoints and stops, and the task
  requeues itself to resume from that checkpoint.

  Args:
    task_argv: the `launch.sweep` command of a task, without --only_index.
    workdir: the sweep directory DIR.
    run_names: the runs' names, in array-index order.
    job_name, partition, gres, time_limit, cpus_per_task, mem: the
      `#SBATCH` settings of each task; an empty partition or gres is left out.
    max_parallel: at most this many tasks at once; 0 for no limit.
    grace_seconds: how long before the time limit the SIGTERM comes.

  Returns:
    The script.
  """
  if not run_names:
    raise ValueError('A SLURM array needs at least one run.')
  array = f'0-{len(run_names) - 1}' + (f'%{max_parallel}' if max_parallel
                                        else '')
  lines = ['#!/bin/bash',
           f'#SBATCH --job-name={job_name}',
           f'#SBATCH --array={array}',
           f'#SBATCH --output={workdir}/slurm/%A_%a.out',
           '#SBATCH --open-mode=append',
           '#SBATCH --ntasks=1',
           f'#SBATCH --cpus-per-task={cpus_per_task}',
           f'#SBATCH --mem={mem}',
           f'#SBATCH --time={time_limit}',
           '#SBATCH --requeue',
           f'#SBATCH --signal=B:TERM@{grace_seconds}']
  lines += [f'#SBATCH --gres={gres}'] if gres else []
  lines += [f'#SBATCH --partition={partition}'] if partition else []
  lines += [
      '',
      '# One run per array task: train (resuming from its latest checkpoint),',
      '# then evaluate. Written by launch/sweep.py; the run list is runs.json.',
      '# Afterwards tabulate with',
      f'#   python -m launch.sweep --workdir={workdir} --aggregate_only',
      '# Array index -> run:',
      *(f'#   {i}: {name}' for i, name in enumerate(run_names)),
      'set -u',
      f'cd {shlex.quote(REPO)}',
      '',
      'requeue() {',
      '  echo "SIGTERM: checkpointing, then requeueing task '
      '${SLURM_ARRAY_TASK_ID}."',
      '  kill -TERM "$child" 2>/dev/null',
      '  wait "$child"',
      '  scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
      '  exit 0',
      '}',
      'trap requeue TERM',
      '',
      f'{shlex.join(task_argv)} --only_index="$SLURM_ARRAY_TASK_ID" &',
      'child=$!',
      'wait "$child"',
      'exit $?',
      '']
  return '\n'.join(lines)


def write_slurm(sweep: Sweep, workdir: str, **kwargs) -> str:
  """Writes DIR/runs.json and DIR/sweep.sbatch; returns the script's path."""
  workdir = os.path.abspath(os.path.expanduser(workdir))
  runs = sweep.runs(workdir)
  write_run_list(sweep, runs, workdir)
  os.makedirs(os.path.join(workdir, 'slurm'), exist_ok=True)
  task = [sys.executable, '-m', 'launch.sweep', f'--config={sweep.path}',
          f'--workdir={workdir}', *sweep.flags]
  path = os.path.join(workdir, 'sweep.sbatch')
  with open(path, 'w') as f:
    f.write(slurm_script(task, workdir, [r.name for r in runs], **kwargs))
  os.chmod(path, 0o755)
  return path


# ----------------------------------------------------------------------------
# Aggregation.


@dataclasses.dataclass
class Collected:
  """The results under a sweep directory, sorted into trusted and not.

  Attributes:
    results: results dicts of finished runs (averaged in the summary).
    excluded: (run directory, reason) of every other run with a results.json:
      unfinished, diverged, stopped, without status.json, or unreadable.
    unreadable: how many of `excluded` had a results.json that failed to read.
  """
  results: list[dict]
  excluded: list[tuple[str, str]]
  unreadable: int = 0


def _why_not_averaged(run_dir: str, results: dict) -> str | None:
  """Why a run's results must not enter a mean, or None if it finished."""
  try:
    status = rundir.read_status(run_dir)
  except ValueError as e:
    return str(e)
  if status is None:
    return f'no {rundir.STATUS_FILE}: cannot tell whether training finished'
  state, step = status.get('state'), status.get('step')
  total = status.get('total_steps')
  if state != 'finished' or step != total:
    return f'training {state} at step {step} of {total}'
  if results.get('step') != total:
    return f'results are for step {results.get("step")}, not the final {total}'
  return None


def collect_results(workdir: str) -> Collected:
  """Every DIR/*/eval/results.json, in run-name order, sorted by trust."""
  collected = Collected([], [])
  for path in sorted(glob.glob(os.path.join(workdir, '*', RESULTS))):
    run_dir = os.path.dirname(os.path.dirname(path))
    try:
      results = read_results(run_dir)
      if not isinstance(results, dict):
        raise ValueError(f'{path} holds {type(results).__name__}, not a '
                         'results object.')
    except (OSError, ValueError) as e:
      collected.excluded.append((run_dir, f'unreadable: {e}'))
      collected.unreadable += 1
      continue
    why = _why_not_averaged(run_dir, results)
    if why is None:
      collected.results.append(results)
    else:
      collected.excluded.append((run_dir, why))
  return collected


def _excluded_text(excluded: Sequence[tuple[str, str]], fmt: str) -> str:
  if not excluded:
    return ''
  if fmt == 'markdown':
    lines = ['', '## Not averaged', '',
             *(f'- `{os.path.basename(d)}`: {why}' for d, why in excluded)]
  else:
    lines = ['', '% Not averaged:',
             *(f'%   {os.path.basename(d)}: {why}' for d, why in excluded)]
  return '\n'.join(lines) + '\n'


def aggregate_dir(workdir: str) -> str | None:
  """Writes DIR/summary.{md,tex,json} from the runs' results; returns the Markdown.

  Grouping by (pretrain_dataset, batch_size, method) into mean ± std, with a
  random-init floor row, and the rendering are otclr_jax.tables' (`aggregate`
  -> summary.json, `render_report` -> summary.md / summary.tex). Only
  finished runs are averaged; every other run with a results.json (see
  `collect_results`) is listed under "Not averaged" in summary.md /
  summary.tex and on the console.
  """
  from otclr_jax import tables  # pylint: disable=g-import-not-at-top
  collected = collect_results(workdir)
  results, excluded = collected.results, collected.excluded
  for run_dir, why in excluded:
    print(f'Not averaged: {run_dir}: {why}', file=sys.stderr)
  if not results and not excluded:
    print(f'No {RESULTS} under {workdir}/*/ yet; nothing to tabulate.')
    return None
  markdown = (tables.render_report(results, 'markdown') if results else
              'No finished run yet.\n') + _excluded_text(excluded, 'markdown')
  latex = (tables.render_report(results, 'latex') if results else
           '% No finished run yet.\n') + _excluded_text(excluded, 'latex')
  with open(os.path.join(workdir, 'summary.md'), 'w') as f:
    f.write(markdown)
  with open(os.path.join(workdir, 'summary.tex'), 'w') as f:
    f.write(latex)
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    json.dump(tables.aggregate(results) if results else [], f, indent=1)
  print(f'{len(results)} finished runs tabulated ({len(excluded)} not '
        f'averaged) in {workdir}/summary.{{md,tex,json}}:\n\n{markdown}')
  return markdown


# ----------------------------------------------------------------------------
# Command line.


def _define_flags(fv: flags.FlagValues, argv: list[str]) -> None:
  config_flags.DEFINE_config_file(
      'config', None, 'The sweep file (get_config and get_hyper).',
      flag_values=fv, lock_config=True, sys_argv=argv)
  flags.DEFINE_string('workdir', None, 'Sweep directory; a run goes to '
                      'WORKDIR/<name>.', flag_values=fv)
  flags.DEFINE_bool('slurm', False, 'Write WORKDIR/sweep.sbatch instead of '
                    'running.', flag_values=fv)
  flags.DEFINE_bool('aggregate_only', False, 'Only tabulate '
                    'WORKDIR/*/eval/results.json.', flag_values=fv)
  flags.DEFINE_bool('dry_run', False, 'Print the commands, run nothing.',
                    flag_values=fv)
  flags.DEFINE_integer('only_index', None, 'Run only this run (0-based; a '
                       'SLURM array task).', flag_values=fv)
  flags.DEFINE_bool('stop_on_error', False, 'Stop at the first failed run.',
                    flag_values=fv)
  for name, default, text in (
      ('partition', '', 'SLURM partition.'), ('gres', 'gpu:1', 'SLURM gres.'),
      ('time', '24:00:00', 'Per-task limit; longer runs requeue and resume.'),
      ('mem', '64G', 'SLURM memory per task.'),
      ('job_name', '', 'SLURM job name (default: the sweep file).')):
    flags.DEFINE_string(name, default, text, flag_values=fv)
  flags.DEFINE_integer('cpus_per_task', 8, 'SLURM CPUs per task.',
                       flag_values=fv)
  flags.DEFINE_integer('max_parallel', 0, 'At most this many SLURM tasks at '
                       'once (0: no limit).', flag_values=fv)


def _fail(status: int, message: str) -> int:
  print(message, file=sys.stderr, flush=True)
  return status


def main(argv: Sequence[str]) -> int:
  """The command line (module docstring); `argv[0]` is the program name."""
  try:
    with rundir.stop_on_signals():
      return _main(argv)
  except rundir.StopRequested as e:
    return _fail(rundir.EXIT_STOPPED, f'Sweep stopped by {e.name}; rerun the '
                 'same command to resume.')


def _main(argv: Sequence[str]) -> int:
  try:
    parsed = config_files.parse_flags(argv, _define_flags, __doc__)
  except config_files.UsageError as e:
    return _fail(2, f'Sweep refused: {e}')
  if parsed is None:
    return 0
  fv, rest = parsed
  if rest or not fv.workdir or sum((fv.slurm, fv.aggregate_only,
                                    fv.dry_run)) > 1:
    return _fail(2, 'Usage: python -m launch.sweep --config=SWEEP_FILE '
                 '--workdir=DIR [--config.a.b=v ...] [--slurm | --dry_run] '
                 '(or --workdir=DIR --aggregate_only); see --help.')
  workdir = os.path.abspath(os.path.expanduser(fv.workdir))
  if fv.aggregate_only:
    if not os.path.isdir(workdir):
      return _fail(2, f'--aggregate_only: sweep directory {workdir} does not '
                   'exist (a typo?); nothing was tabulated.')
    aggregate_dir(workdir)
    unreadable = collect_results(workdir).unreadable
    if unreadable:
      return _fail(1, f'{unreadable} results.json file(s) under {workdir} '
                   'could not be read (named above); the summary leaves them '
                   'out.')
    return 0
  if fv.config is None:
    return _fail(2, 'Sweep refused: --config=SWEEP_FILE is required.')
  cli_flags = [a for a in argv[1:] if a.startswith('--config.')]
  try:
    sweep = load_sweep(config_flags.get_config_filename(fv['config']),
                       fv.config, cli_flags)
  except (OSError, ValueError) as e:
    return _fail(2, f'Sweep refused: {e}')
  if fv.slurm:
    path = write_slurm(
        sweep, workdir, job_name=fv.job_name or sweep.name,
        partition=fv.partition, gres=fv.gres, time_limit=fv.time,
        cpus_per_task=fv.cpus_per_task, mem=fv.mem,
        max_parallel=fv.max_parallel)
    print(f'Wrote {path} ({len(sweep.hypers)} array tasks).\nSubmit with:  '
          f'sbatch {path}\nWhen all tasks are done:  python -m launch.sweep '
          f'--workdir={workdir} --aggregate_only')
    return 0
  try:
    return run_sweep(sweep, workdir, only_index=fv.only_index,
                     dry_run=fv.dry_run, stop_on_error=fv.stop_on_error)
  except RunConflictError as e:
    return _fail(2, f'Sweep {sweep.name} refused: {e}')
  except rundir.WorkdirLockedError as e:
    return _fail(rundir.EXIT_LOCKED, f'Sweep {sweep.name} refused: {e}')
  except ValueError as e:  # --only_index out of range, a changed sweep file
    return _fail(2, f'Sweep {sweep.name} refused: {e}')


if __name__ == '__main__':
  sys.exit(main(sys.argv))
