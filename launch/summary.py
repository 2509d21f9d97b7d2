"""A sweep's summary: mean ± std tables over the finished runs of DIR.

Only runs whose status.json says "finished" at their final step, with results
for that step, are averaged; every other run with a results.json is listed
under "Not averaged" with the reason.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys
from typing import Sequence

from launch import run_state
from otclr_jax import rundir
from otclr_jax import tables


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


def _listed_runs(workdir: str) -> set[str] | None:
  """The run names DIR/runs.json lists (the sweep's), or None without one."""
  try:
    with open(os.path.join(workdir, 'runs.json')) as f:
      return {e['name'] for e in json.load(f)['runs']}
  except FileNotFoundError:
    return None


def collect_results(workdir: str) -> Collected:
  """Every DIR/*/eval/results.json, in run-name order, sorted by trust.

  With a DIR/runs.json, only the runs it lists are averaged: a run directory
  of another sweep in DIR (other names, maybe the same settings) would count
  a seed twice.
  """
  collected = Collected([], [])
  listed = _listed_runs(workdir)
  for path in sorted(glob.glob(os.path.join(workdir, '*', run_state.RESULTS))):
    run_dir = os.path.dirname(os.path.dirname(path))
    if listed is not None and os.path.basename(run_dir) not in listed:
      collected.excluded.append((run_dir, 'not a run of this sweep '
                                 '(runs.json does not list it)'))
      continue
    try:
      results = run_state.read_results(run_dir)
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
  """Writes DIR/summary.{md,tex,json}; returns the Markdown.

  Grouping by (pretrain_dataset, batch_size, method) into mean ± std, with a
  random-init floor row, and the rendering are otclr_jax.tables' (`aggregate`
  -> summary.json, `render_report` -> summary.md / summary.tex). Only
  finished runs are averaged; every other run with a results.json (see
  `collect_results`) is listed under "Not averaged" in summary.md /
  summary.tex and on the console.
  """
  collected = collect_results(workdir)
  results, excluded = collected.results, collected.excluded
  for run_dir, why in excluded:
    print(f'Not averaged: {run_dir}: {why}', file=sys.stderr)
  if not results and not excluded:
    print(f'No {run_state.RESULTS} under {workdir}/*/ yet; nothing to '
          'tabulate.')
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
