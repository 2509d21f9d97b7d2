"""A SLURM job array for a sweep: one task per run, requeued on preemption.

A plain sbatch file rather than submitit: submitit (1.5.4 with cloudpickle,
about 1 MB, 0.15 s to import) pickles a Python callable and requeues it
through its own checkpoint protocol, while our runs are command lines whose
trainer already checkpoints on SIGTERM and exits 75. The array needs only
`--signal`, `--requeue` and a trap, and the file stays readable.
"""

from __future__ import annotations

import shlex
from typing import Sequence


def slurm_script(task_argv: Sequence[str], repo: str, workdir: str,
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
    repo: the directory the task runs in (the repository root).
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
      f'cd {shlex.quote(repo)}',
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
