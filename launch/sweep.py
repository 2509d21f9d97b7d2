r"""Runs a grid of pretraining + evaluation runs and tabulates mean ± std.

A sweep file is a Python file whose `get_sweep()` returns a dict:

    {'config': 'configs/cifar10.py',            # base config, repo-relative
     'grid': {'method': ['simclr', 'moco'],      # the axes, each a list
              'views': ['augment', 'ot'],        # optional; default ['']
              'batch_size': [256, 512],
              'seed': [0, 1, 2],
              'dataset': ['cifar10']},
     'overrides': {'total_steps': 100,           # optional, fixed for all runs
                   'ot.grid_size': 8}}

The runs are the Cartesian product of the grid, seed-major (an interrupted
sweep already holds whole method x batch-size comparisons for its first seeds),
each named `<dataset>_<method>[-<views>]_b<batch>_s<seed>` with workdir
`DIR/<name>` (no `-<views>` for views '', the method's historical views:
OT for 'otclr', augmentations otherwise).

    python -m launch.sweep launch/sweeps/cifar10_paper.py --workdir=DIR
        Trains and evaluates every run here, one after another, then writes
        DIR/summary.{md,tex,json}. Rerunning skips finished runs and resumes
        half-finished ones from their latest checkpoint.
    ... --slurm [--partition=P --gres=gpu:1 --time=24:00:00]
        Writes DIR/sweep.sbatch, a job array with one task per run (submit it
        with `sbatch DIR/sweep.sbatch`); each task calls this module with
        --only_index=$SLURM_ARRAY_TASK_ID.
    ... --aggregate_only     Only tabulates DIR/*/eval/results.json.
    ... --dry_run            Prints the commands without running them.

SWEEP may also be a bare name from launch/sweeps/, e.g. `digits_smoke`.

Trust rules. A run's identity is its resolved config: training stores it in
`DIR/<name>/config.json` and evaluation in `DIR/<name>/eval/config.json`. A
rerun whose settings differ from a stored run in anything that changes the
result (`rundir.result_changing_diff`) is refused before anything runs or
`runs.json` is rewritten, naming the run and the settings; use another
--workdir or delete that run. Results evaluated with other `eval.*` settings
(or for another step) are re-evaluated. A run counts as finished only when its
`status.json` says "finished" at its final step and its results are for that
step. A child that exits 75 (`rundir.EXIT_STOPPED`, preempted) leaves its run
unfinished and stops the sweep with 75: rerun to resume. The summary averages
finished runs only and lists every other run (unfinished, diverged, no
status.json, unreadable results.json) under "Not averaged"; --aggregate_only
exits 1 if a results.json is unreadable and 2 if DIR does not exist. Children
get SIGTERM when the sweep process dies, even by SIGKILL (Linux
`PR_SET_PDEATHSIG`; elsewhere they share the sweep's process group, so kill
the group).
"""

from __future__ import annotations

import argparse
import ast
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
from typing import Any, Callable, Mapping, Sequence

from otclr_jax import config_files
from otclr_jax import rundir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEPS_DIR = os.path.join(REPO, 'launch', 'sweeps')
AXES = ('method', 'views', 'batch_size', 'seed', 'dataset')
# Axes a sweep file may leave out, and the value they then take.
OPTIONAL_AXES = {'views': ['']}
RESULTS = os.path.join('eval', 'results.json')
_WIDTH = 150  # characters of the live progress line

# A launcher runs one command (argv list) with cwd=REPO, appending its output
# to the log file, and returns the exit status.
Launcher = Callable[[Sequence[str], str], int]


@dataclasses.dataclass(frozen=True)
class Run:
  """One cell of the grid.

  Attributes:
    index: position in the sweep, 0-based (the SLURM array task id).
    name: `<dataset>_<method>[-<views>]_b<batch>_s<seed>`.
    workdir: `DIR/<name>`, absolute.
    method, views, batch_size, seed, dataset: the grid values of this run.
    overrides: every `--config.*` value of this run, grid values included,
      in command-line order.
  """
  index: int
  name: str
  workdir: str
  method: str
  views: str
  batch_size: int
  seed: int
  dataset: str
  overrides: tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A parsed sweep file.

  Attributes:
    name: the sweep file's stem, e.g. 'cifar10_paper'.
    config: base config path relative to the repository root.
    grid: {axis: list of values} for every one of AXES.
    overrides: fixed `--config.<key>` values applied to every run.
  """
  name: str
  config: str
  grid: Mapping[str, Sequence[Any]]
  overrides: Mapping[str, Any]

  def runs(self, workdir: str) -> list[Run]:
    """Expands the grid into runs under `workdir`, seed-major."""
    workdir = os.path.abspath(workdir)
    runs = []
    product = itertools.product(self.grid['seed'], self.grid['dataset'],
                                self.grid['batch_size'], self.grid['method'],
                                self.grid['views'])
    for index, (seed, dataset, batch_size, method, views) in enumerate(
        product):
      name = run_name(dataset, method, batch_size, seed, views)
      overrides = (('method', method),
                   *((('views', views),) if views else ()),
                   ('batch_size', batch_size), ('seed', seed),
                   ('dataset', dataset), *self.overrides.items())
      runs.append(Run(index, name, os.path.join(workdir, name), method,
                      views, batch_size, seed, dataset, overrides))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
      raise ValueError(f'Sweep {self.name} has duplicate run names {names}; '
                       'remove repeated values from its grid.')
    return runs


def run_name(dataset: str, method: str, batch_size: int, seed: int,
             views: str = '') -> str:
  # 'folder:/data/x' must become one path component.
  safe = re.sub(r'[^A-Za-z0-9.-]+', '-', dataset).strip('-')
  method = f'{method}-{views}' if views else method
  return f'{safe}_{method}_b{batch_size}_s{seed}'


# ----------------------------------------------------------------------------
# Sweep files and configs.


def resolve_sweep_path(sweep: str) -> str:
  """A path to a sweep file, or a bare name of one in launch/sweeps/."""
  candidates = [sweep, os.path.join(SWEEPS_DIR, sweep),
                os.path.join(SWEEPS_DIR, sweep + '.py')]
  for path in candidates:
    if os.path.isfile(path):
      return os.path.abspath(path)
  raise ValueError(f'No sweep file {sweep!r}: give a path to a Python file '
                   f'with get_sweep(), or one of {list_sweeps()}.')


def list_sweeps() -> list[str]:
  return sorted(os.path.splitext(os.path.basename(p))[0]
                for p in glob.glob(os.path.join(SWEEPS_DIR, '[!_]*.py')))


def _import_file(path: str, module_name: str) -> types.ModuleType:
  # Compiled from source each time: a cached .pyc of a sweep file rewritten
  # within the same second could hold the old grid.
  module = types.ModuleType(module_name)
  module.__file__ = path
  # Config files import their siblings as `configs.default`.
  if REPO not in sys.path:
    sys.path.insert(0, REPO)
  with open(path) as f:
    exec(compile(f.read(), path, 'exec'), module.__dict__)  # pylint: disable=exec-used
  return module


def load_sweep(sweep: str,
               extra_overrides: Mapping[str, Any] | None = None) -> Sweep:
  """Reads and checks a sweep file.

  Args:
    sweep: path to the sweep file or a name in launch/sweeps/.
    extra_overrides: more fixed overrides (from --override), applied last.

  Returns:
    The sweep, with every override checked against the base config.

  Raises:
    ValueError: a missing or malformed field, an unknown config key or a value
      of the wrong type.
  """
  path = resolve_sweep_path(sweep)
  name = os.path.splitext(os.path.basename(path))[0]
  module = _import_file(path, f'_sweep_{name}')
  if not hasattr(module, 'get_sweep'):
    raise ValueError(f'{path} defines no get_sweep().')
  spec = dict(module.get_sweep())
  unknown = set(spec) - {'config', 'grid', 'overrides'}
  if unknown or 'config' not in spec or 'grid' not in spec:
    raise ValueError(f"{path}: get_sweep() must return a dict with keys "
                     f"'config', 'grid' and optionally 'overrides'; got "
                     f'{sorted(spec)}.')
  grid = {**OPTIONAL_AXES, **dict(spec['grid'])}
  if set(grid) != set(AXES):
    raise ValueError(f'{path}: the grid must list exactly the axes {AXES} '
                     f"('views' may be left out), got "
                     f'{sorted(spec["grid"])}.')
  for axis, values in grid.items():
    if isinstance(values, (str, bytes)) or not values:
      raise ValueError(f'{path}: grid[{axis!r}] must be a non-empty list, '
                       f'got {values!r}.')
    grid[axis] = list(values)
  overrides = {**dict(spec.get('overrides', {})), **(extra_overrides or {})}
  for key in AXES:
    if key in overrides:
      raise ValueError(f'{path}: {key!r} is a grid axis; list it in the grid, '
                       'not in overrides.')
  result = Sweep(name, spec['config'], grid, overrides)
  config = base_config(result)
  for run in result.runs(os.getcwd()):
    try:
      apply_overrides(config, run.overrides)
    except ValueError as e:
      raise ValueError(f'{path} (run {run.name}): {e}') from e
  return result


def base_config(sweep: Sweep):
  """The sweep's base ConfigDict, as `--config=<path>` would load it."""
  path = os.path.join(REPO, sweep.config)
  if not os.path.isfile(path):
    raise ValueError(f'Sweep {sweep.name}: no config file {sweep.config} '
                     f'under {REPO}.')
  stem = os.path.splitext(os.path.basename(path))[0]
  return _import_file(path, f'_sweep_config_{stem}').get_config()


def apply_overrides(config, overrides: Sequence[tuple[str, Any]]):
  """A locked copy of `config` with `(key, value)` overrides applied.

  The parser `main` uses on its command line (`config_files.apply_overrides`,
  `ml_collections.config_flags` on a locked config): an unknown field fails
  with a suggestion ('Did you mean "epsilon"?'), a value that does not parse
  as the field's type fails too, so a sweep is refused before any run starts.

  Raises:
    ValueError: a bad key or value (the message names the override).
  """
  return config_files.apply_overrides(config, list(overrides))


def parse_override(text: str) -> tuple[str, Any]:
  """`'ot.epsilon=0.1'` (or `'--config.ot.epsilon=0.1'`) -> `('ot.epsilon', 0.1)`.

  The spelling is `config_files.override_flag`'s; values that are Python
  literals become those, others stay strings. The key and the value are
  checked against the config later, by `apply_overrides`.
  """
  try:
    flag = config_files.override_flag(text)
  except ValueError as e:
    raise ValueError(f'--override: {e}') from e
  key, _, raw = flag[len(f'--{config_files.FLAG}.'):].partition('=')
  try:
    value = ast.literal_eval(raw)
  except (SyntaxError, ValueError):
    value = raw
  return key, value


# ----------------------------------------------------------------------------
# Commands and run state.


def command(sweep: Sweep, run: Run, mode: str) -> list[str]:
  """The `python -m otclr_jax.main ...` argv of one run; cwd is the repo root."""
  argv = [sys.executable, '-m', 'otclr_jax.main', f'--config={sweep.config}',
          f'--workdir={run.workdir}']
  argv += [config_files.override_flag((k, v)) for k, v in run.overrides]
  if mode == 'eval':
    argv.append('--config.mode=eval')
  return argv


def latest_checkpoint_step(workdir: str) -> int | None:
  # Orbax names complete checkpoints by their step alone; in-flight saves
  # carry a suffix and must not count.
  steps = [int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints'))
           if d.isdigit()] if os.path.isdir(
               os.path.join(workdir, 'checkpoints')) else []
  return max(steps) if steps else None


def final_step(config, workdir: str) -> int | None:
  """Number of steps the run trains for, or None if not known yet.

  With `total_steps > 0` that is the config's; otherwise it is
  `num_epochs * steps_per_epoch` (as in train.total_steps_for), where
  steps_per_epoch is read off metrics.jsonl (`step / epoch`) rather than by
  loading the dataset.
  """
  if config.total_steps > 0:
    return int(config.total_steps)
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  for line in reversed(lines):
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue  # A torn last line (crash, full disk): use an earlier one.
    if record.get('epoch'):
      per_epoch = round(record['step'] / record['epoch'])
      return int(config.num_epochs * per_epoch)
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


def _describe(stored: dict, new: dict, names: Sequence[str]) -> str:
  flat = lambda d: dict(_flatten(json.loads(json.dumps(d))))
  stored, new = flat(stored), flat(new)
  show = lambda d, n: repr(d[n]) if n in d else '(absent)'
  return ', '.join(f'{n}: {show(stored, n)} -> {show(new, n)}' for n in names)


def _flatten(tree: dict, prefix: str = ''):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _flatten(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key}', value


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
  return (f'it was run with other settings: {_describe(stored, new, names)}'
          if names else None)


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
  new = config.to_dict()
  names = rundir.result_changing_diff(stored, new)
  # Evaluation settings change the reported numbers (not the training).
  flat_stored, flat_new = dict(_flatten(stored)), dict(_flatten(
      json.loads(json.dumps(new))))
  names += sorted(n for n in set(flat_stored) | set(flat_new)
                  if n.startswith('eval.') and n != 'eval.figures'
                  and flat_stored.get(n) != flat_new.get(n))
  return (f'it was evaluated with other settings: '
          f'{_describe(stored, new, names)}' if names else None)


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


def is_finished(config, workdir: str) -> bool:
  """Whether the run trained to its end and its results belong to `config`.

  Finished means: `status.json` says "finished" (or, for the step count
  alone, the newest checkpoint is the final step), and eval/results.json is
  for the final step and was made with this config's evaluation settings.
  """
  return (is_trained(config, workdir)
          and os.path.exists(os.path.join(workdir, RESULTS))
          and stale_results_reason(config, workdir) is None)


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


# ----------------------------------------------------------------------------
# Local execution.


class SubprocessLauncher:
  """Runs commands one at a time, output to a log file, progress to the console.

  SIGTERM/SIGINT received by the sweep are passed on to the running command
  (train.py then checkpoints and exits) and recorded in `stop_signal` so that
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
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
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
          shown = self._show_progress(log_path, shown)
      # A command can end between polls: its last progress line still shows.
      shown = self._show_progress(log_path, shown)
      self._proc = None
    if shown and self.interactive:
      self._show('')
    return code

  def _show_progress(self, log_path: str, shown: str | None) -> str | None:
    line = _last_progress_line(log_path)
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
  sweep's process group, so killing the group (as SLURM and a shell's
  job control do) ends both.
  """
  if not sys.platform.startswith('linux'):
    return None
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
  except (OSError, AttributeError):
    return None

  def set_death_signal():
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    # The parent may have died between fork and prctl.
    if os.getppid() != parent_pid:
      os.kill(os.getpid(), signal.SIGTERM)

  return set_death_signal


def _last_progress_line(log_path: str) -> str | None:
  with open(log_path, 'rb') as f:
    f.seek(max(os.path.getsize(log_path) - 8192, 0))
    tail = f.read().decode('utf-8', 'replace').splitlines()
  for line in reversed(tail):
    at = line.find('] step ')
    if at >= 0:
      return line[at + 2:]
  return None


@dataclasses.dataclass
class Outcome:
  """What became of one run in this invocation."""
  run: Run
  # 'finished', 'done', 'failed', 'interrupted' (the sweep got a signal),
  # 'stopped' (the child exited rundir.EXIT_STOPPED) or 'dry_run'.
  status: str
  detail: str = ''


def run_one(sweep: Sweep, run: Run, config, launcher: Launcher, *,
            total: int, dry_run: bool = False, stop=lambda: None) -> Outcome:
  """Trains (resuming) and evaluates one run unless it is finished.

  Args:
    sweep: the sweep.
    run: which run.
    config: the run's resolved ConfigDict (for its step count).
    launcher: runs a command, see `Launcher`.
    total: number of runs in the sweep, for the console line.
    dry_run: print the commands instead of running them.
    stop: returns a signal number once the sweep has been asked to stop.

  Returns:
    What happened.
  """
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
  if is_trained(config, run.workdir):
    stale = stale_results_reason(config, run.workdir)
    print(f'{head}: trained, evaluating'
          + (f' again ({RESULTS}: {stale})' if stale else ''), flush=True)
  else:
    resumed = latest_checkpoint_step(run.workdir)
    print(f'{head}: training'
          + (f' (resuming from step {resumed})' if resumed else '')
          + f', log {os.path.join(run.workdir, "train.log")}', flush=True)
    code = launcher(train_cmd, os.path.join(run.workdir, 'train.log'))
    if code == rundir.EXIT_STOPPED:
      # Preempted (or stop_after_steps): a good checkpoint, not a finished
      # run; the sweep stops so that a requeue resumes it.
      return _report(head, Outcome(
          run, 'stopped', f'training stopped at step '
          f'{latest_checkpoint_step(run.workdir)} (exit {code}); rerun to '
          'resume'))
    if code != 0:
      why = ' (diverged: non-finite loss or state)' if (
          code == rundir.EXIT_DIVERGED) else ''
      return _report(head, Outcome(run, 'failed', f'training exited {code}'
                                   f'{why}, see {run.workdir}/train.log'))
    if stop() is not None:
      return _report(head, Outcome(
          run, 'interrupted', f'stopped at step '
          f'{latest_checkpoint_step(run.workdir)}; rerun to resume'))
    if not is_trained(config, run.workdir) and final_step(
        config, run.workdir) is not None:
      return _report(head, Outcome(
          run, 'failed', f'training exited at step '
          f'{latest_checkpoint_step(run.workdir)} of '
          f'{final_step(config, run.workdir)}, see {run.workdir}/train.log'))
    # Training may evaluate at its end itself (config.eval.at_end).
    if is_finished(config, run.workdir):
      return _report(head, Outcome(run, 'done', _elapsed(start)))
    print(f'{head}: evaluating, log {os.path.join(run.workdir, "eval.log")}',
          flush=True)
  code = launcher(eval_cmd, os.path.join(run.workdir, 'eval.log'))
  if code != 0:
    return _report(head, Outcome(run, 'failed', f'evaluation exited {code}, '
                                 f'see {run.workdir}/eval.log'))
  if stop() is not None:
    return _report(head, Outcome(run, 'interrupted', 'during evaluation'))
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


def run_sweep(sweep: Sweep, workdir: str, *,
              launcher: Launcher | None = None,
              only_index: int | None = None,
              dry_run: bool = False,
              stop_on_error: bool = False,
              aggregate: bool = True) -> int:
  """Runs the sweep's runs in order here; returns the process exit code.

  Args:
    sweep: the sweep.
    workdir: sweep directory DIR; run r lives in DIR/<r.name>.
    launcher: runs one command (default: a subprocess per command).
    only_index: run just this run (a SLURM array task).
    dry_run: print the commands, run nothing.
    stop_on_error: stop at the first failed run instead of going on.
    aggregate: write DIR/summary.* at the end (not for a single array task).

  Returns:
    0 if every run finished; 1 if any failed; 128 + signal if interrupted;
    `rundir.EXIT_STOPPED` if a run stopped early (preempted).

  Raises:
    RunConflictError: a run directory holds a run with other result-changing
      settings (nothing is run or written then).
  """
  runs = sweep.runs(workdir)
  if only_index is not None:
    if not 0 <= only_index < len(runs):
      raise ValueError(f'--only_index must lie in [0, {len(runs) - 1}], got '
                       f'{only_index}.')
    _check_run_list(runs, workdir)
    selected = [runs[only_index]]
  else:
    selected = runs
  base = base_config(sweep)
  check_identities(base, selected)
  if only_index is None and not dry_run:
    write_run_list(sweep, runs, workdir)
  if launcher is None and not dry_run:
    launcher = SubprocessLauncher()
    launcher.install_signal_handlers()

  def stop():
    return getattr(launcher, 'stop_signal', None)

  outcomes = []
  for run in selected:
    if stop() is None:
      config = apply_overrides(base, run.overrides)
      outcome = run_one(sweep, run, config, launcher, total=len(runs),
                        dry_run=dry_run, stop=stop)
      outcomes.append(outcome)
    # A command killed by the signal exits non-zero: not a failure of the run.
    if stop() is not None or outcome.status == 'interrupted':
      print(f'Sweep {sweep.name} stopped by a signal; rerun the same command '
            'to resume.', flush=True)
      return 128 + (stop() or signal.SIGTERM)
    if outcome.status == 'stopped':
      print(f'Sweep {sweep.name} stopped: {outcome.run.name} was stopped '
            f'before its final step (exit {rundir.EXIT_STOPPED}); rerun the '
            'same command to resume.', flush=True)
      return rundir.EXIT_STOPPED
    if outcome.status == 'failed' and stop_on_error:
      break
  failed = [o for o in outcomes if o.status == 'failed']
  if not dry_run:
    counts = {s: sum(o.status == s for o in outcomes)
              for s in ('done', 'finished', 'failed')}
    print(f'Sweep {sweep.name}: {counts["done"]} done, {counts["finished"]} '
          f'already finished, {counts["failed"]} failed, '
          f'{len(selected) - len(outcomes)} not started.', flush=True)
    for outcome in failed:
      print(f'  FAILED {outcome.run.name}: {outcome.detail}', flush=True)
    if aggregate and only_index is None:
      aggregate_dir(workdir)
  return 1 if failed or len(outcomes) < len(selected) else 0


class RunConflictError(ValueError):
  """A run directory holds a run made with other result-changing settings."""


def check_identities(base, runs: Sequence[Run]) -> None:
  """Refuses runs whose directories hold a run with other settings.

  Args:
    base: the sweep's base ConfigDict.
    runs: the runs about to be run.

  Raises:
    RunConflictError: naming every conflicting run directory and setting.
  """
  conflicts = []
  for run in runs:
    why = identity_conflict(apply_overrides(base, run.overrides), run.workdir)
    if why:
      conflicts.append(f'  {run.workdir}: {why}')
  if conflicts:
    raise RunConflictError(
        'These run directories hold runs made with other settings than this '
        'sweep asks for, so their results cannot be reported as its results:'
        '\n' + '\n'.join(conflicts) + '\nUse another --workdir, or delete '
        'those run directories to recompute them.')


def write_run_list(sweep: Sweep, runs: Sequence[Run], workdir: str) -> str:
  """Writes DIR/runs.json: the sweep's runs, their names and commands."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, 'runs.json')
  entries = [{'index': r.index, 'name': r.name, 'workdir': r.workdir,
              'method': r.method, 'views': r.views,
              'batch_size': r.batch_size, 'seed': r.seed,
              'dataset': r.dataset,
              'train': shlex.join(command(sweep, r, 'train')),
              'eval': shlex.join(command(sweep, r, 'eval'))} for r in runs]
  with open(path, 'w') as f:
    json.dump({'sweep': sweep.name, 'config': sweep.config, 'runs': entries},
              f, indent=1)
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


def slurm_script(sweep_path: str, workdir: str, run_names: Sequence[str], *,
                 job_name: str, partition: str = '', gres: str = 'gpu:1',
                 time_limit: str = '24:00:00', cpus_per_task: int = 8,
                 mem: str = '64G', max_parallel: int = 0,
                 grace_seconds: int = 180,
                 extra_args: Sequence[str] = ()) -> str:
  """The text of a SLURM job array running each run as one task.

  The batch shell gets SIGTERM `grace_seconds` before the time limit (and on
  preemption); it passes it on, training checkpoints and stops, and the task
  requeues itself to resume from that checkpoint.

  Args:
    sweep_path: the sweep file, absolute.
    workdir: the sweep directory DIR.
    run_names: the runs' names, in array-index order.
    job_name, partition, gres, time_limit, cpus_per_task, mem: the
      `#SBATCH` settings of each task; an empty partition or gres is left out.
    max_parallel: at most this many tasks at once; 0 for no limit.
    grace_seconds: how long before the time limit the SIGTERM comes.
    extra_args: more arguments for `launch.sweep` (e.g. `--override=...`).

  Returns:
    The script.
  """
  workdir = os.path.abspath(workdir)
  num_runs = len(run_names)
  if num_runs < 1:
    raise ValueError('A SLURM array needs at least one run.')
  array = f'0-{num_runs - 1}' + (f'%{max_parallel}' if max_parallel else '')
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
  if gres:
    lines.append(f'#SBATCH --gres={gres}')
  if partition:
    lines.append(f'#SBATCH --partition={partition}')
  sweep_cmd = shlex.join([sys.executable, '-m', 'launch.sweep', sweep_path,
                          f'--workdir={workdir}', *extra_args])
  lines += [
      '',
      '# One run per array task: train (resuming from its latest checkpoint),',
      '# then evaluate. Generated by launch/sweep.py; do not edit the run',
      '# list by hand (see runs.json). Afterwards tabulate with',
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
      f'{sweep_cmd} --only_index="$SLURM_ARRAY_TASK_ID" &',
      'child=$!',
      'wait "$child"',
      'exit $?',
      '']
  return '\n'.join(lines)


def write_slurm(sweep: Sweep, sweep_path: str, workdir: str,
                **kwargs) -> str:
  """Writes DIR/runs.json and DIR/sweep.sbatch; returns the script's path."""
  runs = sweep.runs(workdir)
  write_run_list(sweep, runs, workdir)
  os.makedirs(os.path.join(os.path.abspath(workdir), 'slurm'), exist_ok=True)
  path = os.path.join(workdir, 'sweep.sbatch')
  with open(path, 'w') as f:
    f.write(slurm_script(sweep_path, workdir, [r.name for r in runs],
                         **kwargs))
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
    return (f'no {rundir.STATUS_FILE}: cannot tell whether training finished')
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

  Grouping by (pretrain_dataset, batch_size, method) into mean ± std and the
  rendering are otclr_jax.tables' (`aggregate` -> summary.json,
  `render_report` -> summary.md / summary.tex); without that module only the
  raw results go to summary.json. Only finished runs are averaged; every
  other run with a results.json (see `collect_results`) is listed under
  "Not averaged" in summary.md / summary.tex and on the console.
  """
  collected = collect_results(workdir)
  results, excluded = collected.results, collected.excluded
  for run_dir, why in excluded:
    print(f'Not averaged: {run_dir}: {why}', file=sys.stderr)
  if not results and not excluded:
    print(f'No {RESULTS} under {workdir}/*/ yet; nothing to tabulate.')
    return None
  try:
    from otclr_jax import tables  # pylint: disable=g-import-not-at-top
  except ImportError:
    tables = None
  if tables is None:
    with open(os.path.join(workdir, 'summary.json'), 'w') as f:
      json.dump({'results': results}, f, indent=1)
    print(f'otclr_jax.tables is not available: wrote the {len(results)} raw '
          f'results to {workdir}/summary.json only.')
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


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog='python -m launch.sweep',
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('sweep', nargs='?',
                      help='sweep file, or a name in launch/sweeps/ '
                      '(optional with --aggregate_only)')
  parser.add_argument('--workdir', required=True,
                      help='sweep directory; run r goes to WORKDIR/<name>')
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument('--slurm', action='store_true',
                    help='write WORKDIR/sweep.sbatch instead of running')
  mode.add_argument('--aggregate_only', action='store_true',
                    help='only tabulate WORKDIR/*/eval/results.json')
  mode.add_argument('--dry_run', action='store_true',
                    help='print the commands, run nothing')
  parser.add_argument('--only_index', type=int, default=None,
                      help='run only this run (0-based; SLURM array task)')
  parser.add_argument('--stop_on_error', action='store_true',
                      help='stop at the first failed run')
  parser.add_argument('--override', action='append', default=[],
                      metavar='KEY=VALUE',
                      help='extra fixed config override for every run, e.g. '
                      'data_dir=/data/tfds (repeatable)')
  slurm = parser.add_argument_group('SLURM (with --slurm)')
  slurm.add_argument('--partition', default='')
  slurm.add_argument('--gres', default='gpu:1')
  slurm.add_argument('--time', default='24:00:00',
                     help='per-task limit; longer runs requeue and resume')
  slurm.add_argument('--cpus_per_task', type=int, default=8)
  slurm.add_argument('--mem', default='64G')
  slurm.add_argument('--max_parallel', type=int, default=0,
                     help='at most this many tasks at once (0: no limit)')
  slurm.add_argument('--job_name', default='')
  args = parser.parse_args(argv)
  if args.sweep is None and not args.aggregate_only:
    parser.error('SWEEP is required unless --aggregate_only.')
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.aggregate_only:
    if not os.path.isdir(args.workdir):
      print(f'--aggregate_only: sweep directory {args.workdir} does not '
            'exist (a typo?); nothing was tabulated.', file=sys.stderr)
      return 2
    aggregate_dir(args.workdir)
    unreadable = collect_results(args.workdir).unreadable
    if unreadable:
      print(f'{unreadable} results.json file(s) under {args.workdir} could not '
            'be read (named above); the summary leaves them out.',
            file=sys.stderr)
      return 1
    return 0
  try:
    extra = dict(parse_override(o) for o in args.override)
    sweep = load_sweep(args.sweep, extra)
  except ValueError as e:
    # A typo in a sweep file or an --override: refused before anything runs.
    print(f'Sweep refused: {e}', file=sys.stderr)
    return 2
  if args.slurm:
    extra_args = [f'--override={o}' for o in args.override]
    path = write_slurm(
        sweep, resolve_sweep_path(args.sweep), args.workdir,
        job_name=args.job_name or sweep.name, partition=args.partition,
        gres=args.gres, time_limit=args.time,
        cpus_per_task=args.cpus_per_task, mem=args.mem,
        max_parallel=args.max_parallel, extra_args=extra_args)
    print(f'Wrote {path} ({len(sweep.runs(args.workdir))} array tasks).\n'
          f'Submit with:  sbatch {path}\nWhen all tasks are done:  python -m '
          f'launch.sweep --workdir={args.workdir} --aggregate_only')
    return 0
  try:
    return run_sweep(sweep, args.workdir, only_index=args.only_index,
                     dry_run=args.dry_run, stop_on_error=args.stop_on_error)
  except RunConflictError as e:
    print(f'Sweep {sweep.name} refused: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
