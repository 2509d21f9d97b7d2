r"""Runs a sweep of pretraining + evaluation runs and tabulates mean ± std.

    python -m launch.sweep --config=SWEEP_FILE --workdir=DIR [--config.a.b=v]
        [--dry_run | --slurm [--partition=P ...]] [--stop_on_error]
    python -m launch.sweep --config=ONE_RUN_SWEEP_FILE --workdir=DIR --slurm \
        --nodes=N --gpus_per_node=G   # one run over N x G GPUs: DIR/run.sbatch
    python -m launch.sweep --workdir=DIR --aggregate_only

A sweep file's `get_hyper(hyper)` combines `hyper.sweep(key, values)`,
`.fixed(key, value)`, `.product(parts)` and `.zipit(parts)` over
`get_config()`; docs/operations.md "Sweeps" gives the rules.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import runpy
import shlex
import signal
import sys
import time
import types
from typing import Any, Callable, Sequence

from absl import flags
from ml_collections import config_flags

from launch import launcher as launcher_lib
from launch import run_state
from launch import slurm
from launch import summary
from otclr_jax import cli
from otclr_jax import config_files
from otclr_jax import rundir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (argv, log file) -> exit status, run with cwd=REPO.
Launcher = Callable[[Sequence[str], str], int]


class _FixedKey(str):
  """A key set by `hyper.fixed`: part of every run, not of the run names."""


def _sweep(key: str, values: Sequence[Any]) -> list[dict[str, Any]]:
  if isinstance(values, (str, bytes)) or not list(values):
    raise ValueError(f'hyper.sweep({key!r}, ...) needs a non-empty list of '
                     f'values, got {values!r}.')
  return [{key: v} for v in values]


def _merge(dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
  merged = {}
  for d in dicts:
    for key, value in d.items():
      if key in merged:
        raise ValueError(f'{key} is set by two parts of one hyper.product or '
                         'hyper.zipit; set it once.')
      merged[key] = value
  return merged


def _zipit(parts: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
  if len({len(p) for p in parts}) > 1:
    raise ValueError('hyper.zipit needs parts of equal length, got '
                     f'{[len(p) for p in parts]}.')
  return [_merge(row) for row in zip(*parts)]


HYPER = types.SimpleNamespace(
    sweep=_sweep, fixed=lambda key, value: [{_FixedKey(key): value}],
    product=lambda parts: [_merge(c) for c in itertools.product(*parts)],
    zipit=_zipit)


@dataclasses.dataclass(frozen=True)
class Run:
  """One run: `index` (its SLURM array task id), name, workdir, overrides."""
  index: int
  name: str
  workdir: str
  overrides: tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A sweep file's path, config with `flags` applied, and overrides per run."""
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
    named = [k for k in dict.fromkeys(k for h in self.hypers for k in h)
             if not isinstance(k, _FixedKey)]
    # The runs of one seed and network share one random-init floor.
    shared = (() if self.config.eval.floor_dir else
              (('eval.floor_dir', os.path.join(workdir, rundir.FLOORS_DIR)),))
    runs = []
    for index, hyper in enumerate(self.hypers):
      name = ','.join(f'{k[len("config."):]}={_safe(hyper.get(k))}'
                      for k in named) or 'base'
      overrides = tuple((k[len('config.'):], v)
                        for k, v in hyper.items()) + shared
      runs.append(Run(index, name, os.path.join(workdir, name), overrides))
    return runs

  def run_config(self, run: Run):
    """The ConfigDict `main` resolves for `run` (same parser, locked)."""
    return config_files.apply_overrides(self.config, list(run.overrides))


def _safe(value: Any) -> str:
  # 'folder:/data/x' must become one path component.
  text = re.sub(r'[^A-Za-z0-9.+-]+', '-', str(value))
  return text.strip('-') if isinstance(value, str) else text


def load_sweep(path: str, cli_flags: Sequence[str] = (),
               config=None) -> Sweep:
  """Reads a sweep file and checks every run's config.

  Args:
    path: the sweep file (with `get_config` and `get_hyper`).
    cli_flags: `--config.a.b=v` flags for every run (the command line's).
    config: the base config, `cli_flags` applied; None loads `get_config()`.

  Raises:
    ValueError: one line naming the file and run.
  """
  path = os.path.abspath(os.path.expanduser(path))
  if REPO not in sys.path:  # Sweep files import `configs.X`.
    sys.path.insert(0, REPO)
  try:
    module = runpy.run_path(path)
    if 'get_hyper' not in module or 'get_config' not in module:
      raise ValueError('it defines no get_config() and get_hyper(hyper)')
    if config is None:
      config = config_files.apply_overrides(module['get_config'](), cli_flags)
    hypers = tuple(dict(h) for h in module['get_hyper'](HYPER))
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'{path}: {type(e).__name__}: {e}') from None
  for key, value in ((k, v) for h in hypers for k, v in h.items()):
    if not key.startswith('config.'):
      raise ValueError(f'{path}: sweep keys are config.<field>, got {key!r}.')
    if isinstance(value, dict):
      raise ValueError(f'{path}: {key} is a block of fields; sweep each '
                       f'field, e.g. {key}.{next(iter(value), "field")}.')
  swept = {k[len('config.'):] for h in hypers for k in h}
  for flag in cli_flags:
    key = flag[len('--config.'):].split('=', 1)[0]
    if key in swept:
      raise ValueError(f'{flag}: {path} sweeps config.{key}; change it there.')
  sweep = Sweep(path, config, tuple(cli_flags), hypers)
  names = [r.name for r in sweep.runs(REPO)]
  if not names:
    raise ValueError(f'{path}: get_hyper gives no runs (an empty grid); '
                     'give each hyper.sweep at least one value.')
  if len(set(names)) != len(names):
    raise ValueError(f'{path}: get_hyper gives duplicate run names {names}; '
                     'remove repeated values.')
  # pylint: disable-next=g-import-not-at-top
  from otclr_jax.evaluation import evaluate
  for run in sweep.runs(REPO):
    try:
      evaluate.validate(sweep.run_config(run))
    except Exception as e:  # pylint: disable=broad-except
      what = '' if isinstance(e, ValueError) else f'{type(e).__name__}: '
      raise ValueError(f'{path} (run {run.name}): {what}{e}') from None
  return sweep


def command(sweep: Sweep, run: Run, mode: str) -> list[str]:
  """The `python -m otclr_jax.main ...` argv of one run; cwd is the repo."""
  argv = [sys.executable, '-m', 'otclr_jax.main', f'--config={sweep.path}',
          f'--workdir={run.workdir}', *sweep.flags]
  argv += [config_files.override_flag(o) for o in run.overrides]
  return argv + ['--config.mode=eval'] if mode == 'eval' else argv


def run_one(sweep: Sweep, run: Run, launcher: Launcher, *, total: int,
            dry_run: bool = False, stop=lambda: None) -> tuple[str, str]:
  """Trains and evaluates one unfinished run; `stop()` is a signal or None.

  Returns:
    The run's status ('finished', 'done', 'failed', 'interrupted', 'stopped'
    or 'dry_run') and a detail for the user.
  """
  config, wd = sweep.run_config(run), run.workdir
  head = f'[{run.index + 1}/{total}] {run.name}'

  def report(status: str, detail: str = '') -> tuple[str, str]:
    shown = 'FAILED' if status == 'failed' else status
    print(f'{head}: {shown} {detail}'.rstrip(), flush=True)
    return status, detail

  if run_state.is_finished(config, wd):
    print(f'{head}: finished, skipped', flush=True)
    return 'finished', ''
  if dry_run:
    print(f'{head}:\n  {shlex.join(command(sweep, run, "train"))}\n  '
          f'{shlex.join(command(sweep, run, "eval"))}', flush=True)
    return 'dry_run', ''
  start = time.time()
  elapsed = lambda: 'in ' + time.strftime('%H:%M:%S',
                                          time.gmtime(time.time() - start))
  if hasattr(launcher, 'prefix'):
    launcher.prefix = f'{head}: '
  at = lambda: rundir.latest_checkpoint_step(wd)
  train_log = os.path.join(wd, rundir.TRAIN_LOG)
  eval_log = os.path.join(wd, rundir.EVAL_LOG)
  if run_state.is_trained(config, wd):
    stale = run_state.stale_results_reason(config, wd)
    print(f'{head}: trained, evaluating'
          + (f' again ({rundir.RESULTS_FILE}: {stale})' if stale else ''),
          flush=True)
  else:
    resumed = f' (resuming from step {at()})' if at() else ''
    print(f'{head}: training{resumed}, log {train_log}', flush=True)
    code = launcher(command(sweep, run, 'train'), train_log)
    # A command killed by the sweep's signal exits non-zero: no failure.
    if stop() is not None:
      return report('interrupted', f'stopped at step {at()}; rerun to resume')
    if code == cli.EXIT_STOPPED:
      # Preempted: the sweep stops so that a requeue resumes it.
      return report('stopped', f'training stopped at step {at()} (exit '
                    f'{code}); rerun to resume')
    if code != 0:
      why = (' (diverged: non-finite loss or state)'
             if code == cli.EXIT_DIVERGED else '')
      return report('failed', f'training exited {code}{why}, see '
                    f'{train_log}')
    final = run_state.final_step(config, wd)
    if not run_state.is_trained(config, wd) and final is not None:
      return report('failed', f'training exited at step {at()} of {final}, '
                    f'see {train_log}')
    # Training may evaluate at its end itself (config.eval.at_end).
    if run_state.is_finished(config, wd):
      return report('done', elapsed())
    print(f'{head}: evaluating, log {eval_log}', flush=True)
  code = launcher(command(sweep, run, 'eval'), eval_log)
  if stop() is not None:
    return report('interrupted', 'during evaluation')
  if code == cli.EXIT_STOPPED:
    return report('stopped', f'evaluation stopped (exit {code}); rerun to '
                  'resume')
  if code != 0:
    return report('failed', f'evaluation exited {code}, see {eval_log}')
  if not run_state.is_finished(config, wd):
    why = run_state.stale_results_reason(config, wd) or 'none written'
    return report('failed', f'evaluation wrote no usable {rundir.RESULTS_FILE} '
                  f'for step {run_state.final_step(config, wd)} ({why})')
  return report('done', elapsed())


class RunConflictError(cli.UsageError):
  """A run directory holds a run made with other result-changing settings."""


def check_identities(sweep: Sweep, runs: Sequence[Run]) -> None:
  """Raises RunConflictError naming every run directory of `runs` that holds
  a run made with other result-changing settings than `sweep` asks for."""
  conflicts = [f'{run.workdir}: {why}' for run in runs
               if (why := run_state.identity_conflict(sweep.run_config(run),
                                                      run.workdir))]
  if conflicts:
    raise RunConflictError(
        f'{len(conflicts)} run directories hold runs made with other '
        'settings than this sweep asks for, so their results cannot be '
        'reported as its results: ' + '; '.join(conflicts) + '. Use another '
        '--workdir, or delete those run directories to recompute them.')


def run_sweep(sweep: Sweep, workdir: str, *,
              launcher: Launcher | None = None,
              only_index: int | None = None,
              dry_run: bool = False,
              stop_on_error: bool = False,
              aggregate: bool = True) -> int:
  """Runs the sweep's runs (or `only_index`: no lock, no summary) in order here.

  Returns:
    0 all finished; 1 any failed; `cli.EXIT_STOPPED` on a signal or stop.

  Raises:
    RunConflictError: run directories hold runs with other settings.
    cli.WorkdirLockedError: another sweep runs in `workdir`.
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  runs = selected = sweep.runs(workdir)
  if only_index is not None:
    if not 0 <= only_index < len(runs):
      raise ValueError(f'--only_index must lie in [0, {len(runs) - 1}], got '
                       f'{only_index}.')
    _check_run_list(sweep, runs, workdir)
    selected = [runs[only_index]]
  check_identities(sweep, selected)
  if dry_run:
    for run in selected:
      run_one(sweep, run, launcher, total=len(runs), dry_run=True)
    return 0
  if launcher is None:
    launcher = launcher_lib.SubprocessLauncher(REPO)
    launcher.install_signal_handlers()
  if only_index is not None:
    return _run_all(sweep, selected, len(runs), launcher, stop_on_error)
  with rundir.lock(workdir, rundir.SWEEP_LOCK_FILE):
    write_run_list(sweep, runs, workdir)
    status = _run_all(sweep, selected, len(runs), launcher, stop_on_error)
    if aggregate and status != cli.EXIT_STOPPED:
      # A run whose evaluation failed keeps older results: not this sweep's.
      configs = {run.workdir: sweep.run_config(run) for run in runs}
      summary.aggregate_dir(workdir, lambda run_dir: (
          run_state.stale_results_reason(configs[run_dir], run_dir)
          if run_dir in configs else None))
    return status


def _run_all(sweep: Sweep, selected: Sequence[Run], total: int,
             launcher: Launcher, stop_on_error: bool) -> int:
  stop = lambda: getattr(launcher, 'stop_signal', None)
  statuses, failed = [], []
  start = time.time()
  for run in selected:
    if stop() is None:
      status, detail = run_one(sweep, run, launcher, total=total, stop=stop)
      statuses.append(status)
      failed += [(run.name, detail)] if status == 'failed' else []
      # From the runs this invocation trained or evaluated.
      worked, left = statuses.count('done'), len(selected) - len(statuses)
      if worked and left:
        eta = (time.time() - start) / worked * left
        print(f'Sweep {sweep.name}: {len(statuses)} of {len(selected)} runs '
              f'through, about {time.strftime("%H:%M:%S", time.gmtime(eta))} '
              'left.', flush=True)
    # A run ends 'interrupted' only once the signal is set.
    if stop() is not None:
      print(f'Sweep {sweep.name} stopped by {signal.Signals(stop()).name}; '
            'rerun the same command to resume.', file=sys.stderr, flush=True)
      return cli.EXIT_STOPPED
    if statuses[-1] == 'stopped':
      print(f'Sweep {sweep.name} stopped: {run.name} was stopped before its '
            f'final step (exit {cli.EXIT_STOPPED}); rerun the same command '
            'to resume.', flush=True)
      return cli.EXIT_STOPPED
    if statuses[-1] == 'failed' and stop_on_error:
      break
  print(f'Sweep {sweep.name}: {statuses.count("done")} done, '
        f'{statuses.count("finished")} already finished, {len(failed)} '
        f'failed, {len(selected) - len(statuses)} not started.', flush=True)
  for name, detail in failed:
    print(f'  FAILED {name}: {detail}', flush=True)
  return (cli.EXIT_FAILED if failed or len(statuses) < len(selected)
          else cli.EXIT_OK)


def write_run_list(sweep: Sweep, runs: Sequence[Run], workdir: str) -> None:
  """Writes DIR/runs.json: the sweep's runs, their settings and commands."""
  entries = [{'index': r.index, 'name': r.name, 'workdir': r.workdir,
              'overrides': dict(r.overrides),
              'config': sweep.run_config(r).to_dict(),
              'train': shlex.join(command(sweep, r, 'train')),
              'eval': shlex.join(command(sweep, r, 'eval'))} for r in runs]
  rundir.write_json(os.path.join(workdir, rundir.RUNS_FILE),
                    {'sweep': sweep.path, 'runs': entries})


def _check_run_list(sweep: Sweep, runs: Sequence[Run], workdir: str) -> None:
  # An edited sweep file would map an array index to another run, or give a
  # run other settings than the tasks that already ran it.
  path = os.path.join(workdir, rundir.RUNS_FILE)
  listed = summary.listed_runs(workdir)
  if listed is None:
    return
  fix = ('the sweep file changed after the job was written. Restore it or '
         'write a new job with --slurm.')
  if [e['name'] for e in listed] != [r.name for r in runs]:
    raise ValueError(f'{path} lists other runs than the sweep file now '
                     f'expands to; {fix}')
  for run, entry in zip(runs, listed):
    stored = entry.get('config')
    if not isinstance(stored, dict):
      raise ValueError(f'{path} does not record the settings of run '
                       f'{run.name}; write a new job with --slurm.')
    new = sweep.run_config(run).to_dict()
    names = rundir.evaluation_diff(stored, new)
    if names:
      raise ValueError(f'{path} lists run {run.name} with other settings '
                       f'({rundir.describe_diff(stored, new, names)}); {fix}')


def write_slurm(sweep: Sweep, workdir: str, **kwargs) -> str:
  """Writes DIR/runs.json and DIR/sweep.sbatch; returns the script's path."""
  workdir = os.path.abspath(os.path.expanduser(workdir))
  runs = sweep.runs(workdir)
  check_identities(sweep, runs)
  write_run_list(sweep, runs, workdir)
  task = [sys.executable, '-m', 'launch.sweep', f'--config={sweep.path}',
          f'--workdir={workdir}', *sweep.flags]
  text = slurm.slurm_script(task, REPO, workdir, [r.name for r in runs],
                            **kwargs)
  return slurm.write_script(workdir, rundir.SWEEP_SCRIPT, text)


def _write_multinode(sweep: Sweep, workdir: str, fv: flags.FlagValues) -> int:
  """`--slurm --nodes=N`: DIR/run.sbatch for the sweep's one run."""
  runs = sweep.runs(workdir)
  if len(runs) != 1:
    return _refuse(f'Sweep refused: --nodes={fv.nodes} x --gpus_per_node='
                   f'{fv.gpus_per_node} writes one multi-node job for one '
                   f'run, but {sweep.path} expands to {len(runs)} runs; fix '
                   'its axes with --config.a.b=v or use a one-run sweep file.')
  try:
    check_identities(sweep, runs)
    path = slurm.write_multinode(command(sweep, runs[0], 'train'), workdir,
                                 fv, sweep.name)
  except ValueError as e:
    return _refuse(f'Sweep refused: {e}')
  print(f'Wrote {path}: run {runs[0].name} on {fv.nodes} node(s) x '
        f'{fv.gpus_per_node} GPU(s), one process per GPU.\nSubmit with:  '
        f'sbatch {path}')
  return 0


def _define_flags(fv: flags.FlagValues, argv: list[str]) -> None:
  config_flags.DEFINE_config_file(
      'config', None, 'The sweep file (get_config and get_hyper).',
      flag_values=fv, lock_config=True, sys_argv=argv)
  for name, text in (
      ('slurm', 'Write WORKDIR/sweep.sbatch instead of running.'),
      ('aggregate_only', 'Only tabulate WORKDIR/*/eval/results.json.'),
      ('dry_run', 'Print the commands, run nothing.'),
      ('stop_on_error', 'Stop at the first failed run.')):
    flags.DEFINE_bool(name, False, text, flag_values=fv)
  for name, default, text in (
      ('workdir', None, 'Sweep directory; a run goes to WORKDIR/<name>.'),
      ('gres', 'gpu:1', 'SLURM gres.')):
    flags.DEFINE_string(name, default, text, flag_values=fv)
  for name, default, text in (
      ('only_index', None, 'Run only this run (0-based; a SLURM array task).'),
      ('max_parallel', 0, 'At most this many SLURM tasks at once (0: no '
       'limit).')):
    flags.DEFINE_integer(name, default, text, flag_values=fv)
  slurm.define_job_flags(fv)


def _fail(status: int, message: str) -> int:
  print(message, file=sys.stderr, flush=True)
  return status


def _refuse(message: str) -> int:
  return _fail(cli.EXIT_USAGE, message)


def main(argv: Sequence[str]) -> int:
  """The command line (module docstring); `argv[0]` is the program name."""
  try:
    with cli.stop_on_signals():
      return _main(argv)
  except cli.StopRequested as e:
    return _fail(cli.EXIT_STOPPED, f'Sweep stopped by {e.name}; rerun the '
                 'same command to resume.')


def _main(argv: Sequence[str]) -> int:
  try:
    parsed = config_files.parse_flags(argv, _define_flags, __doc__)
  except config_files.UsageError as e:
    return _refuse(f'Sweep refused: {e}')
  if parsed is None:
    return 0
  fv, rest = parsed
  if (rest or not fv.workdir or fv.slurm + fv.aggregate_only + fv.dry_run > 1
      or (fv.only_index is not None and (fv.slurm or fv.aggregate_only))):
    return _refuse('Usage: python -m launch.sweep --config=SWEEP_FILE '
                   '--workdir=DIR [--config.a.b=v ...] [--slurm | --dry_run | '
                   '--only_index=I] (or --workdir=DIR --aggregate_only); see '
                   '--help.')
  workdir = os.path.abspath(os.path.expanduser(fv.workdir))
  rundir.check_directory(workdir, '--workdir')
  if fv.aggregate_only:
    if not os.path.isdir(workdir):
      return _refuse(f'--aggregate_only: sweep directory {workdir} does not '
                   'exist (a typo?); nothing was tabulated.')
    unreadable = summary.aggregate_dir(workdir).unreadable
    if unreadable:
      return _fail(cli.EXIT_FAILED, f'{unreadable} results.json file(s) '
                   f'under {workdir} could not be read (named above); the '
                   'summary leaves them out.')
    return 0
  if fv.config is None:
    return _refuse('Sweep refused: --config=SWEEP_FILE is required.')
  try:
    sweep = load_sweep(config_flags.get_config_filename(fv['config']),
                       config_files.overrides_of(argv),
                       fv.config)
  except (OSError, ValueError) as e:
    return _refuse(f'Sweep refused: {e}')
  if fv.slurm and fv.nodes * fv.gpus_per_node > 1:
    return _write_multinode(sweep, workdir, fv)
  if fv.slurm:
    try:
      path = write_slurm(
          sweep, workdir, job_name=fv.job_name or sweep.name,
          partition=fv.partition, gres=fv.gres, time_limit=fv.time,
          cpus_per_task=fv.cpus_per_task, mem=fv.mem,
          max_parallel=fv.max_parallel)
    except RunConflictError as e:
      return _refuse(f'Sweep {sweep.name} refused: {e}')
    print(f'Wrote {path} ({len(sweep.hypers)} array tasks).\nSubmit with:  '
          f'sbatch {path}\nWhen all tasks are done:  python -m launch.sweep '
          f'--workdir={workdir} --aggregate_only')
    return 0
  try:
    return run_sweep(sweep, workdir, only_index=fv.only_index,
                     dry_run=fv.dry_run, stop_on_error=fv.stop_on_error)
  except cli.WorkdirLockedError as e:
    return _fail(cli.EXIT_LOCKED, f'Sweep {sweep.name} refused: {e}')
  except ValueError as e:  # a run conflict, --only_index, a changed file
    return _refuse(f'Sweep {sweep.name} refused: {e}')


if __name__ == '__main__':
  config_files.run(main)
