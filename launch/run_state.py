"""What a sweep reads off a run directory (docs/operations.md "Sweeps")."""

from __future__ import annotations

import os

from otclr_jax import optim
from otclr_jax import rundir


def _records(workdir: str) -> list[dict]:
  """metrics.jsonl's records; [] when a damaged line makes them unknown."""
  try:
    return rundir.read_metrics(workdir)
  except rundir.CorruptFileError:
    return []


def final_step(config, workdir: str) -> int | None:
  """Number of steps the run trains for, or None if not known yet."""
  spe = next((round(r['step'] / r['epoch']) for r in
              reversed(_records(workdir)) if r.get('epoch')), None)
  if spe is None and config.total_steps <= 0:
    return None
  return optim.run_steps(config.total_steps, config.num_epochs, spe or 0)


def identity_conflict(config, workdir: str) -> str | None:
  """Why the run in `workdir` is not the run `config` describes, or None."""
  try:
    stored = rundir.read_config(workdir)
  except ValueError as e:
    return str(e)
  if stored is None:
    if (rundir.latest_checkpoint_step(workdir) is not None
        or os.path.exists(os.path.join(workdir, rundir.RESULTS_FILE))):
      return (f'it holds checkpoints or results but no '
              f'{rundir.CONFIG_FILE} recording the settings that produced '
              'them')
    return None
  new = config.to_dict()
  # Length included: a longer rerun would stretch finished runs' schedules.
  names = rundir.result_changing_diff(stored, new, length=True)
  return (f'it was run with other settings: '
          f'{rundir.describe_diff(stored, new, names)}' if names else None)


def _eval_config_conflict(config, workdir: str,
                          results: dict) -> str | None:
  """Why results.json does not belong to `config`'s evaluation, or None."""
  stored = results.get('config')
  if not isinstance(stored, dict):
    path = os.path.join(workdir, rundir.EVAL_CONFIG_FILE)
    try:
      stored = rundir.read_json_file(path)
    except rundir.CorruptFileError as e:
      return str(e)
    if stored is None:
      return f'no {path} records how it was evaluated'
  new = config.to_dict()
  names = rundir.evaluation_diff(stored, new)
  return (f'it was evaluated with other settings: '
          f'{rundir.describe_diff(stored, new, names)}' if names else None)


def _probe_protocol_conflict(results: dict) -> str | None:
  """Why a results file's probe or kNN was computed another way, or None."""
  protocol = results.get('protocol') or {}
  rows = [row for row in (results.get('linear') or {}).values()
          if isinstance(row, dict)]
  # Here: it loads JAX, which a sweep needs for nothing else.
  # pylint: disable=g-import-not-at-top
  from otclr_jax.evaluation import knn
  from otclr_jax.evaluation import probe
  # pylint: enable=g-import-not-at-top
  current = {}
  if 'probe' in protocol or any('top1' in row for row in rows):
    current.update(probe.PROTOCOL)
  if 'knn_k' in protocol or any('knn_top1' in row for row in rows):
    current.update(knn.PROTOCOL)
  changed = [f'{key} {protocol.get(key)} (now {value})'
             for key, value in current.items() if protocol.get(key) != value]
  return ('its linear probe was fitted with another protocol: '
          + ', '.join(changed)) if changed else None


def stale_results_reason(config, workdir: str) -> str | None:
  """Why existing results.json may not be reported for `config`, or None."""
  try:
    results = rundir.read_results(workdir)
  except ValueError as e:
    return str(e)
  if results is None:
    return None
  total = final_step(config, workdir)
  if total is None or results.get('step') != total:
    return f'its results are for step {results.get("step")}, not {total}'
  return (_probe_protocol_conflict(results)
          or _eval_config_conflict(config, workdir, results))


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
  latest = rundir.latest_checkpoint_step(workdir)
  return latest is not None and latest >= total


def is_finished(config, workdir: str) -> bool:
  """Whether the run trained to its end and its results belong to `config`."""
  return (is_trained(config, workdir)
          and os.path.exists(os.path.join(workdir, rundir.RESULTS_FILE))
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
