"""The multi-node SLURM job of one run (launch/slurm.py), without SLURM.

The written script is checked line by line and then run by bash with fake
`srun` and `scontrol` on the PATH that record what they were asked.
"""

import json
import os
import shlex
import signal
import stat
import subprocess
import sys

from launch import slurm
from launch import sweep as sweep_lib
from tests import helpers


def _header(script):
  return [l for l in script.splitlines() if l.startswith('#SBATCH')]


def _srun_argv(script):
  (line,) = [l for l in script.splitlines() if l.startswith('srun ')]
  return shlex.split(line)[1:]


def test_launch_slurm_writes_one_task_per_gpu(tmp_path, capsys):
  workdir = tmp_path / 'big'
  assert slurm.main(['slurm', '--config=configs/digits.py',
                     f'--workdir={workdir}', '--nodes=2', '--gpus_per_node=4',
                     '--partition=gpu', '--time=02:00:00',
                     '--heartbeat_timeout=60',
                     '--config.batch_size=512']) == 0
  path = workdir / 'run.sbatch'
  assert f'sbatch {path}' in capsys.readouterr().out
  script = path.read_text()
  header = _header(script)
  for line in ('#SBATCH --nodes=2', '#SBATCH --ntasks-per-node=4',
               '#SBATCH --gres=gpu:4', '#SBATCH --requeue',
               '#SBATCH --partition=gpu', '#SBATCH --time=02:00:00',
               '#SBATCH --job-name=digits',
               f'#SBATCH --output={workdir}/slurm/%j.out'):
    assert line in header, header
  # SIGTERM to every task (no `B:`, which would signal the batch shell only).
  assert any(l.startswith('#SBATCH --signal=TERM@') for l in header)
  argv = _srun_argv(script)
  assert argv[:3] == [sys.executable, '-m', 'otclr_jax.main']
  assert f'--config={helpers.REPO}/configs/digits.py' in argv
  assert f'--workdir={workdir}' in argv
  assert '--config.batch_size=512' in argv
  # JAX reads the coordinator, process count and id from SLURM itself.
  assert '--distributed' in argv and '--heartbeat_timeout=60' in argv
  assert not [a for a in argv if a.startswith(('--coordinator_address',
                                               '--process_id'))]
  assert (workdir / 'slurm').is_dir()
  assert os.stat(path).st_mode & stat.S_IXUSR
  subprocess.run(['bash', '-n', str(path)], check=True)


def _run_script(tmp_path, script, srun_status):
  """Runs `script` with fake srun (exiting `srun_status`) and scontrol."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir(parents=True, exist_ok=True)
  calls = tmp_path / 'calls'
  for name, status in (('srun', srun_status), ('scontrol', 0)):
    fake = bin_dir / name
    fake.write_text(f'#!/bin/bash\necho "{name} $*" >> {calls}\n'
                    f'exit {status}\n')
    fake.chmod(0o755)
  env = dict(os.environ, PATH=f'{bin_dir}:{os.environ["PATH"]}',
             SLURM_JOB_ID='4242')
  proc = subprocess.run(['bash', str(script)], env=env, capture_output=True,
                        text=True, timeout=60, check=False)
  return proc, calls.read_text().splitlines()


def test_a_stopped_run_requeues_the_job_and_a_failure_does_not(tmp_path):
  workdir = tmp_path / 'big'
  assert slurm.main(['slurm', '--config=configs/digits.py',
                     f'--workdir={workdir}', '--nodes=2',
                     '--gpus_per_node=2']) == 0
  script = workdir / 'run.sbatch'
  proc, calls = _run_script(tmp_path / 'stopped', script, 75)
  assert proc.returncode == 0, proc.stderr
  assert calls[0].startswith('srun ') and '--distributed' in calls[0]
  assert calls[1:] == ['scontrol requeue 4242']
  proc, calls = _run_script(tmp_path / 'finished', script, 0)
  assert (proc.returncode, len(calls)) == (0, 1)
  proc, calls = _run_script(tmp_path / 'failed', script, 1)
  assert (proc.returncode, len(calls)) == (1, 1)


def test_sweep_slurm_writes_a_multinode_job_for_a_one_run_sweep(tmp_path,
                                                                capsys):
  path = helpers.write_sweep(tmp_path / 's.py', helpers.tiny_grid())
  workdir = tmp_path / 'sweep'
  assert sweep_lib.main(['sweep', f'--config={path}', f'--workdir={workdir}',
                         '--slurm', '--nodes=4', '--gpus_per_node=8']) == 0
  script = (workdir / 'run.sbatch').read_text()
  assert '#SBATCH --nodes=4' in _header(script)
  assert '#SBATCH --ntasks-per-node=8' in _header(script)
  argv = _srun_argv(script)
  (run,) = sweep_lib.load_sweep(path).runs(str(workdir))
  assert f'--workdir={run.workdir}' in argv and '--distributed' in argv
  assert not (workdir / 'sweep.sbatch').exists()
  # A sweep of several runs gets none.
  path = helpers.write_sweep(tmp_path / 's.py', helpers.tiny_grid(seeds=(0, 1)))
  assert sweep_lib.main(['sweep', f'--config={path}',
                         f'--workdir={tmp_path / "other"}', '--slurm',
                         '--nodes=2']) == 2
  assert 'expands to 2 runs' in capsys.readouterr().err
  assert not (tmp_path / 'other' / 'run.sbatch').exists()


def test_slurm_script_has_one_task_per_run(tmp_path):
  workdir = str(tmp_path / 'sweep')
  paper = helpers.sweep_file('cifar10_paper')
  code = sweep_lib.main(['sweep', f'--config={paper}',
                         f'--workdir={workdir}', '--slurm', '--partition=gpu',
                         '--time=02:00:00', '--config.data_dir=/tfds'])
  assert code == 0
  script = open(os.path.join(workdir, 'sweep.sbatch')).read()
  header = [l for l in script.splitlines() if l.startswith('#SBATCH')]
  for line in ('#SBATCH --array=0-11', '#SBATCH --requeue',
               '#SBATCH --partition=gpu', '#SBATCH --time=02:00:00',
               '#SBATCH --gres=gpu:1'):
    assert line in header
  assert any(l.startswith('#SBATCH --signal=B:TERM@') for l in header)
  assert 'trap requeue TERM' in script
  assert 'scontrol requeue' in script
  (task,) = [l for l in script.splitlines()
             if 'launch.sweep' in l and not l.startswith('#')]
  argv = shlex.split(task.rstrip(' &'))
  assert argv[:4] == [sys.executable, '-m', 'launch.sweep',
                      f'--config={helpers.sweep_file("cifar10_paper")}']
  assert f'--workdir={workdir}' in argv
  assert '--config.data_dir=/tfds' in argv
  assert '--only_index=$SLURM_ARRAY_TASK_ID' in argv
  subprocess.run(['bash', '-n', os.path.join(workdir, 'sweep.sbatch')],
                 check=True)

  listed = json.load(open(os.path.join(workdir, 'runs.json')))['runs']
  runs = sweep_lib.load_sweep(helpers.sweep_file('cifar10_paper')).runs(workdir)
  assert [e['name'] for e in listed] == [r.name for r in runs]
  assert [e['index'] for e in listed] == list(range(12))
  assert '--config.data_dir=/tfds' in listed[5]['train']
  assert listed[5]['eval'].endswith('--config.mode=eval')


def test_slurm_task_passes_sigterm_on_and_requeues_itself(tmp_path):
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'scontrol').write_text(
      f'#!/bin/sh\necho "$@" > {tmp_path}/scontrol.txt\n')
  (bin_dir / 'scontrol').chmod(0o755)
  (tmp_path / 'child.py').write_text(helpers.STOPPABLE_CHILD)
  stopped, ready = tmp_path / 'stopped', tmp_path / 'ready'
  script = slurm.slurm_script(['python', '-m', 'launch.sweep'], helpers.REPO,
                              str(tmp_path), ['a', 'b'], job_name='t')
  fake = shlex.join([sys.executable, str(tmp_path / 'child.py'), str(stopped),
                     str(ready)])
  script = '\n'.join(fake + ' &' if line.endswith(' &') else line
                     for line in script.splitlines())
  (tmp_path / 'job.sh').write_text(script)
  env = {**os.environ, 'PATH': f'{bin_dir}:{os.environ["PATH"]}',
         'SLURM_ARRAY_JOB_ID': '7', 'SLURM_ARRAY_TASK_ID': '1'}
  job = subprocess.Popen(['bash', str(tmp_path / 'job.sh')], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  helpers.when_ready(str(ready), lambda: job.send_signal(signal.SIGTERM)).join()
  out = job.communicate(timeout=30)[0].decode()
  assert job.returncode == 0, out
  assert stopped.read_text() == 'stopped'
  assert (tmp_path / 'scontrol.txt').read_text().split() == ['requeue', '7_1']
