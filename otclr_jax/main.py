"""Entry point: `python -m otclr_jax.main --config=configs/X.py --workdir=DIR`.

`--config.mode=train` (default) pretrains, resuming from DIR if it holds a
checkpoint, then evaluates (`config.eval.at_end`) and draws the figures
(`config.eval.figures`); `--config.mode=eval` evaluates DIR's newest
checkpoint and draws the figures. Any config field can be overridden, e.g.
`--config.ot.epsilon=0.1`; `--config.method=moco --config.views=ot` picks the
objective and the view generator. `--config=configs/X.py --helpconfig` lists
every field with its value and comment.

Exit statuses are `cli`'s table (docs/operations.md).
"""

import contextlib
import hashlib
import logging as std_logging
import os
import platform
import time
from typing import Any, Iterable, Sequence

from absl import flags
from absl import logging
import jax
import ml_collections
from ml_collections import config_flags

from otclr_jax import checkpoint
from otclr_jax import cli
from otclr_jax import config_files
from otclr_jax import experiment
from otclr_jax import rundir
from otclr_jax import train
from otclr_jax.evaluation import evaluate
from otclr_jax.evaluation import monitor


def _define_flags(fv: flags.FlagValues, argv: list[str]) -> None:
  config_flags.DEFINE_config_file(
      'config', None, 'Training configuration file.', lock_config=True,
      flag_values=fv, sys_argv=argv)
  define = lambda kind, name, default, text: kind(
      name, default, text, flag_values=fv)
  define(flags.DEFINE_string, 'workdir', None, 'Directory for checkpoints, '
         'logs and results.')
  define(flags.DEFINE_bool, 'distributed', False, 'Call '
         'jax.distributed.initialize() first (one process per host or GPU; '
         "coordinator from the cluster environment, e.g. SLURM's variables, "
         'unless the three flags below are given).')
  define(flags.DEFINE_string, 'coordinator_address', None, 'host:port of '
         'process 0 for a multi-process run (default: '
         '$JAX_COORDINATOR_ADDRESS); implies --distributed.')
  define(flags.DEFINE_integer, 'num_processes', None, 'Processes in a '
         'multi-process run (default: $JAX_NUM_PROCESSES).')
  define(flags.DEFINE_integer, 'process_id', None, "This process's index in "
         '[0, num_processes) (default: $JAX_PROCESS_ID).')
  define(flags.DEFINE_integer, 'heartbeat_timeout', 100, 'Seconds without a '
         'heartbeat after which a multi-process run declares a process dead '
         'and ends the others.')
  define(flags.DEFINE_integer, 'shutdown_timeout', 86400, 'Seconds the '
         'processes other than 0 wait at the end for process 0 (its '
         'evaluation and figures) before giving up.')

_ENV = {'coordinator_address': 'JAX_COORDINATOR_ADDRESS',
        'num_processes': 'JAX_NUM_PROCESSES', 'process_id': 'JAX_PROCESS_ID'}


def _cpu_flags_digest() -> str:
  """12 hex digits naming this CPU's instruction-set flags (/proc/cpuinfo)."""
  try:
    with open('/proc/cpuinfo') as f:
      flags = next((line for line in f if line.startswith('flags')), '')
  except OSError:
    flags = ''
  return hashlib.sha256((flags or platform.processor()
                         or platform.machine()).encode()).hexdigest()[:12]


def use_compilation_cache(config: ml_collections.ConfigDict) -> str | None:
  """Points XLA's persistent compilation cache at `config.compilation_cache_dir`.

  On CPU, one subdirectory per instruction set (not in JAX's cache key). A
  no-op if the field is '' or $JAX_COMPILATION_CACHE_DIR is set.

  Returns:
    The directory in use, or None when this left JAX's setting alone.
  """
  if not config.compilation_cache_dir or os.environ.get(
      'JAX_COMPILATION_CACHE_DIR'):
    return None
  path = os.path.expanduser(config.compilation_cache_dir)
  if jax.default_backend() == 'cpu':
    path = os.path.join(path, f'cpu-{_cpu_flags_digest()}')
  jax.config.update('jax_compilation_cache_dir', path)
  return path


def distributed_settings(distributed: bool, coordinator_address: str | None,
                         num_processes: int | None, process_id: int | None,
                         heartbeat_timeout: int = 100,
                         shutdown_timeout: int = 86400,
                         environ=None) -> dict[str, Any] | None:
  """The keyword arguments of `jax.distributed.initialize`, or None for one process.

  The three settings come from flags or `_ENV`, all or none (then
  `distributed` lets JAX read the cluster's environment, e.g. SLURM's).

  Raises:
    experiment.ConfigError: only some of the three are given, or malformed.
  """
  environ = os.environ if environ is None else environ
  given = {'coordinator_address': coordinator_address,
           'num_processes': num_processes, 'process_id': process_id}
  values = {n: (environ.get(_ENV[n]) or None) if v in (None, '') else v
            for n, v in given.items()}
  known = [n for n, v in values.items() if v is not None]
  if known and len(known) < len(values):
    missing = [f'--{n} (or ${_ENV[n]})' for n in values if n not in known]
    raise experiment.ConfigError(
        f'A multi-process run needs --coordinator_address, --num_processes '
        f'and --process_id; {", ".join(missing)} missing.')
  timeouts = {'heartbeat_timeout_seconds': heartbeat_timeout,
              'shutdown_timeout_seconds': shutdown_timeout}
  for name, value in timeouts.items():
    if value < 1:
      raise experiment.ConfigError(
          f'--{name[:-len("_seconds")]} must be >= 1 second, got {value}.')
  if not known:
    return timeouts if distributed else None
  try:
    count, index = int(values['num_processes']), int(values['process_id'])
  except ValueError:
    raise experiment.ConfigError(
        f'--num_processes ({values["num_processes"]!r}) and --process_id '
        f'({values["process_id"]!r}) must be integers.') from None
  if count < 1 or not 0 <= index < count:
    raise experiment.ConfigError(
        f'--process_id must lie in [0, --num_processes={count}), got '
        f'{index}.')
  address = values['coordinator_address']
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit():
    raise experiment.ConfigError(
        f'--coordinator_address must be host:port, got {address!r}.')
  return {'coordinator_address': address, 'num_processes': count,
          'process_id': index, **timeouts}


def evaluate_and_draw(config, workdir: str,
                      step: int | None = None) -> dict:
  """Evaluates `workdir` under its eval lock, draws figures, returns results."""
  # No lock in a missing directory: evaluate reports it, none is created.
  with (rundir.lock(workdir, rundir.EVAL_LOCK_FILE)
        if os.path.isdir(workdir) else contextlib.nullcontext()):
    evaluation = evaluate.evaluate_run(config, workdir, step)
    if not config.eval.figures:
      return evaluation.results
    try:
      from otclr_jax import figures  # pylint: disable=g-import-not-at-top
      paths = figures.report_single(
          config, workdir, results=evaluation.results,
          views=evaluation.views, test=evaluation.test)
      logging.info('Figures: %s', ', '.join(paths))
    except Exception:  # pylint: disable=broad-except
      logging.exception('Drawing the figures failed; the evaluation results '
                        'are complete. Redraw with `python -m '
                        'otclr_jax.figures report --workdir=%s`.', workdir)
  return evaluation.results


# The kNN monitor training logs (`config.monitor`).
make_monitor = monitor.KnnMonitor


def run(config, workdir: str, overridden: Iterable[str] = ()) -> int:
  """Trains or evaluates `workdir` as `config.mode` says; returns the exit status.

  Expected failures end in one error line (no traceback) and their status.

  Args:
    config: the run's config.
    workdir: the run directory (`~` is expanded).
    overridden: dotted fields set on the command line (checked in eval mode).
  """
  workdir = os.path.expanduser(workdir)
  phase = 'start-up'
  try:
    # Wrong-kind paths are refused before caches or the workdir are created.
    rundir.check_directory(workdir, '--workdir')
    if config.data_dir:
      rundir.check_directory(config.data_dir, '--config.data_dir')
    cache = use_compilation_cache(config)
    if cache:
      logging.info('XLA compilation cache: %s', cache)
    if config.mode == 'eval':
      experiment.adopt_run_config(config, workdir, overridden)
    evaluate.validate(config)
    if config.mode == 'eval' or config.eval.at_end:
      evaluate.check_data(config)
    if config.mode == 'train':
      phase = 'training'
      result = train.train(config, workdir, make_monitor=make_monitor)
      if result.status != 'finished':
        return cli.EXIT_STOPPED
      if not config.eval.at_end:
        return 0
    if jax.process_index() != 0:
      # Waits at JAX's shutdown barrier (--shutdown_timeout): no short deadline.
      logging.info('Evaluation runs on process 0; process %d waits for it.',
                   jax.process_index())
      return 0
    phase = 'evaluation'
    with cli.stop_on_signals():
      try:
        evaluate_and_draw(config, workdir)
      except cli.WorkdirLockedError as e:
        if config.mode == 'eval':
          raise
        # That evaluation began before this run's last checkpoint.
        logging.warning('Training finished; its evaluation is skipped: the '
                        'evaluation lock is in use (%s). eval/ may hold an '
                        'earlier step: rerun with --config.mode=eval once '
                        'that evaluation ends.', e)
    return 0
  except cli.StopRequested as e:
    logging.error('%s during %s: stopped with nothing half-written; rerun the '
                  'same command to resume %s.', e.name, phase, workdir)
    return cli.EXIT_STOPPED
  except Exception as e:  # pylint: disable=broad-except
    if jax.process_count() > 1 and isinstance(e, jax.errors.JaxRuntimeError):
      # A peer died: end before the shutdown barrier waits for it.
      logging.error('Process %d of %d lost contact with the others (%s): a '
                    'process of this run died or cannot be reached. Rerun '
                    'every process to resume from the newest checkpoint in '
                    '%s.', jax.process_index(), jax.process_count(),
                    ' '.join(str(e).split())[:300], workdir)
      return cli.EXIT_FAILED
    # cli's table; an exception it does not know is a bug: traceback.
    mapped = cli.status_of(e)
    if mapped is None:
      raise
    logging.error('%s', mapped[1])
    return mapped[0]


class _NoTpuProbe(std_logging.Filter):
  """Drops JAX's note that no TPU is here: the user asked for none (a CUDA
  backend that fails to start is still reported)."""

  def filter(self, record):
    return not str(record.msg).startswith("Unable to initialize backend 'tpu'")


class _ShortPrefix(std_logging.Formatter):
  """absl's line prefix without the date, microseconds and thread id:
  'I 04:05:16 train.py:100] ...' (the level letter first, as absl's)."""

  def format(self, record):
    when = time.strftime('%H:%M:%S', time.localtime(record.created))
    text = (f'{record.levelname[0]} {when} {record.filename}:'
            f'{record.lineno}] {record.getMessage()}')
    if record.exc_info:
      text += '\n' + self.formatException(record.exc_info)
    return text


def main(argv: Sequence[str]) -> int:
  """The command line (module docstring); exit statuses: `cli`'s table."""
  parsed = config_files.parse_flags(argv, _define_flags, __doc__)
  if parsed is None:
    return 0
  fv, rest = parsed
  if rest or fv.config is None or not fv.workdir:
    raise config_files.UsageError(
        f'usage: python -m otclr_jax.main --config=configs/X.py --workdir=DIR '
        f'[--config.a.b=v ...]{"; unexpected " + str(rest) if rest else ""}; '
        'every setting is a --config.a.b=v flag.')
  checkpoint.quiet_logs()
  logging.get_absl_handler().setFormatter(_ShortPrefix())
  std_logging.getLogger('jax._src.xla_bridge').addFilter(_NoTpuProbe())
  try:
    settings = distributed_settings(
        fv.distributed, fv.coordinator_address, fv.num_processes,
        fv.process_id, fv.heartbeat_timeout, fv.shutdown_timeout)
  except experiment.ConfigError as e:
    logging.error('%s', e)
    return cli.EXIT_USAGE
  if settings is not None:
    jax.distributed.initialize(**settings)
  logging.info('process %d of %d, local devices %s', jax.process_index(),
               jax.process_count(), jax.local_devices())
  overridden = config_flags.get_override_values(fv['config'])
  # A failure's exit skips the runtime's shutdown (`cli.exit_now`).
  return run(fv.config, fv.workdir, overridden)


if __name__ == '__main__':
  config_files.run(main)
