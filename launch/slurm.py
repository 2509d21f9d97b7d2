"""SLURM jobs: a sweep's job array, or one run over several nodes.

    python -m launch.slurm --config=configs/X.py --workdir=DIR \
        --nodes=2 --gpus_per_node=4 [--partition=P --time=24:00:00] \
        [--config.a.b=v ...]

writes DIR/run.sbatch to submit with `sbatch`; exit 2 on a bad flag or config.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Sequence

from absl import flags
from ml_collections import config_flags

from otclr_jax import cli
from otclr_jax import config_files
from otclr_jax import fileio
from otclr_jax import rundir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GRACE_SECONDS = 180  # how long before the time limit the SIGTERM comes


def slurm_script(task_argv: Sequence[str], repo: str, workdir: str,
                 run_names: Sequence[str], *, job_name: str,
                 partition: str = '', gres: str = 'gpu:1',
                 time_limit: str = '24:00:00', cpus_per_task: int = 8,
                 mem: str = '64G', max_parallel: int = 0) -> str:
  """The text of a SLURM job array of one task per run, requeued on SIGTERM.

  Args:
    task_argv: the `launch.sweep` command of a task, without --only_index.
    repo, workdir: the repository root (cwd) and the sweep directory DIR.
    run_names: the runs' names, in array-index order.
    job_name, partition, gres, time_limit, cpus_per_task, mem: `#SBATCH`
      settings of each task; an empty partition or gres is left out.
    max_parallel: at most this many tasks at once; 0 for no limit.
  """
  array = f'0-{len(run_names) - 1}' + (f'%{max_parallel}' if max_parallel
                                        else '')
  directives = [f'job-name={job_name}', f'array={array}',
                f'output={workdir}/{rundir.SLURM_DIR}/%A_%a.out',
                'open-mode=append', 'ntasks=1',
                f'cpus-per-task={cpus_per_task}', f'mem={mem}',
                f'time={time_limit}', 'requeue',
                f'signal=B:TERM@{_GRACE_SECONDS}']
  directives += [f'gres={gres}'] if gres else []
  directives += [f'partition={partition}'] if partition else []
  return _script(repo, directives, [
      'One run per array task: train (resuming from its latest checkpoint),',
      'then evaluate. Written by launch/sweep.py; the run list is runs.json.',
      'Afterwards tabulate with',
      f'  python -m launch.sweep --workdir={workdir} --aggregate_only',
      'Array index -> run:',
      *(f'  {i}: {name}' for i, name in enumerate(run_names))], [
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
          'exit $?'])


def _script(repo: str, directives: Sequence[str], comments: Sequence[str],
            body: Sequence[str]) -> str:
  """A job file: `#SBATCH --` directives, `# ` comments, then `body` run
  from `repo`."""
  return '\n'.join(['#!/bin/bash', *(f'#SBATCH --{d}' for d in directives),
                    '', *(f'# {c}' for c in comments), 'set -u',
                    f'cd {shlex.quote(repo)}', '', *body, ''])


def write_multinode(run_argv: Sequence[str], workdir: str,
                    fv: flags.FlagValues, job_name: str) -> str:
  """Writes `workdir/run.sbatch` and `slurm/`; returns the script's path.

  The script is a SLURM job of one process per GPU, requeued on exit 75.

  Args:
    run_argv: the run's `python -m otclr_jax.main ...`, without --distributed.
    workdir: the run's directory; the job's log goes to workdir/slurm/.
    fv: the flags of `define_job_flags`; an empty --partition is left out.
    job_name: the job's name unless --job_name gives one.
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  rundir.check_directory(workdir, '--workdir')
  nodes, gpus_per_node = fv.nodes, fv.gpus_per_node
  if nodes < 1 or gpus_per_node < 1:
    raise ValueError(f'A job needs >= 1 node and >= 1 GPU per node, got '
                     f'{nodes} x {gpus_per_node}.')
  argv = [*run_argv, '--distributed',
          f'--heartbeat_timeout={fv.heartbeat_timeout}']
  directives = [f'job-name={fv.job_name or job_name}', f'nodes={nodes}',
                f'ntasks-per-node={gpus_per_node}',
                f'gres=gpu:{gpus_per_node}',
                f'cpus-per-task={fv.cpus_per_task}', f'mem={fv.mem}',
                f'time={fv.time}',
                f'output={workdir}/{rundir.SLURM_DIR}/%j.out',
                'open-mode=append', 'requeue',
                # Without B: the signal goes to every task of the job's steps.
                f'signal=TERM@{_GRACE_SECONDS}']
  directives += [f'partition={fv.partition}'] if fv.partition else []
  text = _script(REPO, directives, [
      f'One run on {nodes} node(s) x {gpus_per_node} GPU(s): one process per '
      'GPU. Written by',
      'launch/slurm.py; submit with `sbatch` on this file. Exit 75 (stopped '
      'by SIGTERM,',
      'checkpointed) requeues the job, which resumes.'], [
          f'srun {shlex.join(argv)}',
          'status=$?',
          'if [ "$status" -eq 75 ]; then',
          '  echo "Stopped at a checkpoint (SIGTERM): requeueing job '
          '${SLURM_JOB_ID}."',
          '  scontrol requeue "${SLURM_JOB_ID}"',
          '  exit 0',
          'fi',
          'exit $status'])
  return write_script(workdir, rundir.RUN_SCRIPT, text)


def write_script(workdir: str, name: str, text: str) -> str:
  """Writes the executable job file `workdir/name` and `slurm/`; its path."""
  os.makedirs(os.path.join(workdir, rundir.SLURM_DIR), exist_ok=True)
  path = os.path.join(workdir, name)
  fileio.write_text(path, text)
  os.chmod(path, 0o755)
  return path


def define_job_flags(fv: flags.FlagValues) -> None:
  """The `#SBATCH` flags of a job (also `launch.sweep`'s)."""
  for name, default, text in (
      ('partition', '', 'SLURM partition.'),
      ('time', '24:00:00', 'Time limit; a longer run requeues and resumes.'),
      ('mem', '64G', 'SLURM memory per node (per array task in a sweep).'),
      ('job_name', '', 'SLURM job name (default: the config or sweep file).')):
    flags.DEFINE_string(name, default, text, flag_values=fv)
  for name, default, text in (
      ('cpus_per_task', 8, 'SLURM CPUs per task (per GPU).'),
      ('nodes', 1, 'SLURM nodes of one multi-node run.'),
      ('gpus_per_node', 1, 'GPUs per node; one process each.'),
      ('heartbeat_timeout', 100, 'Seconds after which the processes give up '
       'on a dead one.')):
    flags.DEFINE_integer(name, default, text, flag_values=fv)


def _define_flags(fv: flags.FlagValues, argv: list[str]) -> None:
  config_flags.DEFINE_config_file('config', None, 'The run\'s config file.',
                                  flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  flags.DEFINE_string('workdir', None, 'The run\'s directory; the job file '
                      'is WORKDIR/run.sbatch.', flag_values=fv)
  define_job_flags(fv)


def main(argv: Sequence[str]) -> int:
  """The command line (module docstring); `argv[0]` is the program name."""
  try:
    parsed = config_files.parse_flags(argv, _define_flags, __doc__)
  except config_files.UsageError as e:
    print(f'launch.slurm refused: {e}', file=sys.stderr)
    return cli.EXIT_USAGE
  if parsed is None:
    return 0
  fv, rest = parsed
  if rest or not fv.workdir or fv.config is None:
    print('Usage: python -m launch.slurm --config=FILE --workdir=DIR '
          '--nodes=N --gpus_per_node=G [--config.a.b=v ...]; see --help.',
          file=sys.stderr)
    return cli.EXIT_USAGE
  # Not at the top: `launch.sweep` imports this module without JAX.
  from otclr_jax import experiment  # pylint: disable=g-import-not-at-top
  try:
    experiment.validate_config(fv.config)
    config_path = config_flags.get_config_filename(fv['config'])
    workdir = os.path.abspath(os.path.expanduser(fv.workdir))
    run_argv = [sys.executable, '-m', 'otclr_jax.main',
                f'--config={os.path.abspath(config_path)}',
                f'--workdir={workdir}',
                *config_files.overrides_of(argv)]
    path = write_multinode(
        run_argv, workdir, fv,
        os.path.splitext(os.path.basename(config_path))[0])
  except ValueError as e:
    print(f'launch.slurm refused: {e}', file=sys.stderr)
    return cli.EXIT_USAGE
  print(f'Wrote {path} ({fv.nodes} node(s) x {fv.gpus_per_node} GPU(s), '
        f'one process per GPU).\nSubmit with:  sbatch {path}')
  return 0


if __name__ == '__main__':
  config_files.run(main)
