"""A sweep's summary: mean ± std tables over the finished runs of DIR."""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
from typing import Callable, Sequence

from otclr_jax import aggregate
from otclr_jax import fileio
from otclr_jax import rundir
from otclr_jax import tables


@dataclasses.dataclass
class Collected:
  """The results under a sweep directory, sorted into trusted and not.

  Attributes:
    results: results dicts of finished runs (averaged in the summary).
    excluded: (run directory, reason) of every other run.
    unreadable: how many of `excluded` had a results.json that failed to read.
  """
  results: list[dict]
  excluded: list[tuple[str, str]]
  unreadable: int = 0


def _why_not_averaged(run_dir: str, results: dict | None) -> str | None:
  """Why a run's results must not enter a mean, or None if it finished."""
  try:
    status = rundir.read_status(run_dir)
  except ValueError as e:
    return str(e)
  if status is None:
    if not os.path.isdir(run_dir):
      return 'not started'
    return f'no {rundir.STATUS_FILE}: cannot tell whether training finished'
  state, step = status.get('state'), status.get('step')
  total = status.get('total_steps')
  if state != 'finished' or step != total:
    return f'training {state} at step {step} of {total}'
  if results is None:
    return f'trained, not evaluated (no {rundir.RESULTS_FILE})'
  if results.get('step') != total:
    return f'results are for step {results.get("step")}, not the final {total}'
  try:
    trained = rundir.read_config(run_dir)
  except ValueError as e:
    return str(e)
  evaluated = results.get('config')
  if isinstance(trained, dict) and isinstance(evaluated, dict):
    names = rundir.result_changing_diff(evaluated, trained, length=True)
    if names:
      # E.g. the directory was trained afresh after these results were made.
      return ('its results belong to another run than the one its '
              f'{rundir.CONFIG_FILE} describes ('
              f'{rundir.describe_diff(evaluated, trained, names)})')
  unconverged = aggregate.unconverged_probes(results)
  if unconverged:
    return ('its linear probe did not reach its optimum ('
            + ', '.join(unconverged) + '; see probe_fits in results.json): '
            'evaluate again with a larger eval.probe_steps')
  if not isinstance(evaluated, dict):
    return (f'neither {rundir.RESULTS_FILE} nor {rundir.EVAL_CONFIG_FILE} '
            'records the config that made these results, so their row '
            'cannot be told')
  return None


def listed_runs(workdir: str) -> list[dict] | None:
  """DIR/runs.json's run entries (each with its `name`), None without one;
  raises if torn."""
  path = os.path.join(workdir, rundir.RUNS_FILE)
  try:
    listed = rundir.read_json_file(path)
    if listed is None:
      return None
    return [{**e, 'name': str(e['name'])} for e in listed['runs']]
  except (KeyError, TypeError) as e:
    raise rundir.CorruptFileError(
        f'{path} is not a run list ({type(e).__name__}: {e}); write it again '
        'with the sweep command, or delete it.') from None


def _with_config(run_dir: str, results: dict) -> dict:
  """`results` carrying its config (else eval/config.json's)."""
  if isinstance(results.get('config'), dict):
    return results
  try:
    stored = rundir.read_json_file(os.path.join(run_dir,
                                                rundir.EVAL_CONFIG_FILE))
  except ValueError:
    stored = None
  return {**results, 'config': stored} if stored else results


def collect_results(workdir: str,
                    stale: Callable[[str], str | None] | None = None
                    ) -> Collected:
  """The results of the runs DIR/runs.json lists (or all), sorted by trust;
  `stale(run dir)` says why results are not the ones asked for, or None."""
  collected = Collected([], [])
  listed = listed_runs(workdir)
  present = sorted(
      os.path.basename(os.path.dirname(os.path.dirname(p)))
      for p in glob.glob(os.path.join(workdir, '*', rundir.RESULTS_FILE)))
  if listed is None:
    names = sorted(set(present) | {
        os.path.basename(os.path.dirname(p)) for p in glob.glob(
            os.path.join(workdir, '*', rundir.STATUS_FILE))})
  else:
    names = list(dict.fromkeys(e['name'] for e in listed))
    collected.excluded += [
        (os.path.join(workdir, n), 'not a run of this sweep (runs.json does '
         'not list it)') for n in present if n not in set(names)]
  finished = []  # the run directories of collected.results
  for name in names:
    run_dir = os.path.join(workdir, name)
    try:
      results = rundir.read_results(run_dir)
      if results is not None:
        aggregate.check_result(results,
                               os.path.join(run_dir, rundir.RESULTS_FILE))
    except rundir.IncompleteEvaluationError as e:
      collected.excluded.append((run_dir, f'incomplete evaluation: {e}'))
      continue
    except (OSError, ValueError) as e:
      collected.excluded.append((run_dir, f'unreadable: {e}'))
      collected.unreadable += 1
      continue
    if results is not None:
      results = _with_config(run_dir, results)
    why = _why_not_averaged(run_dir, results) or (stale and stale(run_dir))
    if why is None:
      collected.results.append(results)
      finished.append(run_dir)
    else:
      collected.excluded.append((run_dir, why))
  repeated = dict(aggregate.repeated_seeds(collected.results))
  collected.excluded += [(finished[index], (
      f'seed {collected.results[index].get("seed")} of its row is counted '
      f'from {os.path.basename(finished[counted])} (a seed counts once; '
      'these runs differ only in evaluation settings that no row tells '
      'apart, e.g. eval.datasets)')) for index, counted in repeated.items()]
  collected.results = [r for i, r in enumerate(collected.results)
                       if i not in repeated]
  considered = len(names) + sum(n not in set(names) for n in present)
  # Every run is in a table or in "Not averaged", with its reason.
  assert len(collected.results) + len(collected.excluded) == considered, (
      len(collected.results), len(collected.excluded), considered)
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


def aggregate_dir(workdir: str,
                  stale: Callable[[str], str | None] | None = None
                  ) -> Collected:
  """Writes DIR/summary.{md,tex,json} of `collect_results(workdir, stale)`."""
  collected = collect_results(workdir, stale)
  results, excluded = collected.results, collected.excluded
  for run_dir, why in excluded:
    print(f'Not averaged: {run_dir}: {why}', file=sys.stderr)
  if not results and not excluded:
    itself = os.path.exists(os.path.join(workdir, rundir.RESULTS_FILE))
    print(f'No {rundir.RESULTS_FILE} under {workdir}/*/ yet; nothing to '
          'tabulate.' + (f' {workdir} is itself a run (its tables are in its '
                         f'{rundir.EVAL_DIR}/); give the directory of runs.'
                         if itself else ''))
    return collected
  markdown = (tables.render_report(results, 'markdown') if results else
              'No finished run yet.\n') + _excluded_text(excluded, 'markdown')
  latex = (tables.render_report(results, 'latex') if results else
           '% No finished run yet.\n') + _excluded_text(excluded, 'latex')
  rows = aggregate.aggregate(results)
  for row in rows:
    del row['setting']  # the grouping key; `settings` and `label` say it
  # Everything is rendered before the first file is replaced.
  md_file, tex_file, json_file = rundir.SUMMARY_FILES
  fileio.write_text(os.path.join(workdir, md_file), markdown)
  fileio.write_text(os.path.join(workdir, tex_file), latex)
  rundir.write_json(os.path.join(workdir, json_file), {
      'rows': rows,
      'not_averaged': [{'run': os.path.basename(d), 'workdir': d, 'why': why}
                       for d, why in excluded]})
  print(f'{len(results)} finished runs tabulated ({len(excluded)} not '
        f'averaged) in {workdir}/summary.{{md,tex,json}}:\n\n{markdown}')
  return collected
