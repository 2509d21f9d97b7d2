"""Runs grouped into table rows: statistics over seeds, paired differences.

The seeds of a run are one row: runs whose stored configs agree in every
result-changing field but the seed, evaluation settings included
(`rundir.evaluation_identity`), probed the same way. A seed counts once
(its first result), in rows, floors and paired differences alike. A row's
numbers are `stat`s, `46.90 ± 0.40 (n=3)` with std at ddof = 1.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any, Iterable, Sequence

from otclr_jax import rundir

METHOD_NAMES = {'simclr': 'SimCLR', 'otclr': 'OTCLR'}
# Row order: each method, then it with OT views (run ids of `run_id`).
RUN_ORDER = ('simclr', 'otclr', 'moco', 'moco+ot', 'byol', 'byol+ot', 'dino',
             'dino+ot')
# The paper's column order; other datasets follow in order of appearance.
DATASET_ORDER = ('cifar10', 'cifar100', 'food101', 'oxford_iiit_pet', 'stl10',
                 'svhn_cropped')
SECTIONS = ('linear', 'random_init', 'clusters', 'views', 'linear_clean_bn')


def stat(values: Iterable[float]) -> dict[str, Any]:
  """{'mean', 'std', 'n'} of numbers; std has ddof = 1 and is None for n = 1."""
  values = [float(v) for v in values]
  std = statistics.stdev(values) if len(values) > 1 else None
  return {'mean': statistics.fmean(values), 'std': std, 'n': len(values)}


def check_result(result: dict[str, Any], path: str) -> None:
  """Raises ValueError naming `path` and the fields unless `result` is shaped
  like an evaluation's results.json, as far as the tables read it."""
  kinds = {'pretrain_dataset': str, 'method': str, 'batch_size': int,
           'seed': (int, type(None))}
  problems = [f'{k}={result.get(k)!r}' for k, kind in kinds.items()
              if not isinstance(result.get(k), kind)
              or isinstance(result.get(k), bool)]
  for section in SECTIONS:
    rows = result.get(section) or {}
    if not isinstance(rows, dict) or not all(
        isinstance(row, dict) for row in rows.values()):
      problems.append(f'{section} is not {{name: {{metric: value}}}}')
      continue
    problems += [f'{section}.{name}.{m}={row[m]!r}'
                 for name, row in rows.items()
                 for m in ('top1', 'top5', 'knn_top1')
                 if row.get(m) is not None and not _is_number(row[m])]
  if problems:
    raise ValueError(f'{path} not the results of an evaluation: '
                     + ', '.join(problems))


def unconverged_probes(result: dict[str, Any]) -> list[str]:
  """'section/dataset' of each probe in `result` that stopped before its
  optimum (at `eval.probe_steps`): its numbers are not the protocol's."""
  return sorted(
      f'{section}/{dataset}' for section in SECTIONS
      for dataset, row in (result.get(section) or {}).items()
      if isinstance(row, dict) and row.get('converged') is False)


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def aggregate_tree(trees: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Numbers at equal paths become stats; missing and null values skipped."""
  keys = list(dict.fromkeys(k for t in trees for k in t))
  out = {}
  for key in keys:
    values = [t[key] for t in trees if t.get(key) is not None]
    if values and all(isinstance(v, dict) for v in values):
      out[key] = aggregate_tree(values)
    elif values and all(_is_number(v) for v in values):
      finite = [v for v in values if math.isfinite(v)]
      if finite:
        out[key] = stat(finite)
  return out


def _rank(order: Sequence[str], name: str) -> tuple[int, str]:
  """Sort key: position in `order`, names outside it after, by name."""
  return (order.index(name) if name in order else len(order), name)


def method_rank(method: str) -> tuple[int, str]:
  return _rank(RUN_ORDER, method)


def run_id(result: dict[str, Any]) -> str:
  """The run's objective and views: 'simclr', 'otclr', 'moco+ot', ..."""
  method = str(result['method'])
  # Results written before they recorded `view_generator` have it in config.
  views = (result.get('view_generator')
           or (result.get('config') or {}).get('views', ''))
  if method == 'otclr' or (method == 'simclr' and views == 'ot'):
    return 'otclr'
  return f'{method}+ot' if views == 'ot' else method


# Identity fields shown elsewhere in a row (title, setting), and the seed.
_SHOWN_FIELDS = ('seed', 'dataset', 'batch_size', 'method', 'views')
_METHOD_PREFIXES = tuple(f'{b}.' for b in rundir.METHOD_BLOCKS)


def _settings(result: dict[str, Any]) -> tuple[tuple[str, str], ...]:
  """`rundir.evaluation_identity` but the seed, and the probe protocol, as
  sorted (name, JSON) pairs; () without a config."""
  config = result.get('config')
  if not isinstance(config, dict):
    return ()
  settings = {n: v for n, v in rundir.evaluation_identity(config).items()
              if n not in _SHOWN_FIELDS}
  protocol = result.get('protocol')
  if isinstance(protocol, dict):
    settings.update({f'protocol.{n}': protocol[n]
                     for n in rundir.PROTOCOL_FIELDS if n in protocol})
  return tuple(sorted((name, json.dumps(value, sort_keys=True))
                      for name, value in settings.items()))


RunKey = tuple[str, int, str, tuple[tuple[str, str], ...]]


def _run_key(result: dict[str, Any]) -> RunKey:
  """Runs with equal keys are seeds of one run: one row."""
  missing = [k for k in ('pretrain_dataset', 'batch_size', 'method')
             if k not in result]
  if missing:
    raise ValueError(f'results dict lacks {missing}; expected the output of '
                     'otclr_jax.evaluation.evaluate.')
  return (str(result['pretrain_dataset']), int(result['batch_size']),
          run_id(result), _settings(result))


def _setting_of(key: RunKey) -> tuple:
  """The block of rows a run competes in (and shares a floor with)."""
  shared = tuple(p for p in key[3] if not p[0].startswith(_METHOD_PREFIXES))
  return (key[0], key[1], shared)


def _sort_key(key: RunKey):
  # Batch sizes descending, as in the paper (512 before 256).
  # A setting's rows stay together, whatever their methods' own blocks.
  return (key[0], -key[1], _setting_of(key)[2], method_rank(key[2]), key[3])


def _labels(keys: Sequence[RunKey], shared: bool = False
            ) -> dict[RunKey, str]:
  """'ot.epsilon=0.05, optim.base_lr=0.3' per run: its values of the settings
  that differ between the runs; a field that rows of one run id lack and
  others have differs too (a method reads its block). `shared`: of the
  settings but the methods' blocks (those of its floor)."""
  fields: dict[str, set[str]] = {}  # the setting names of each run id's rows
  values: dict[str, set[str]] = {}
  for key in keys:
    fields.setdefault(key[2], set()).update(name for name, _ in key[3])
    for name, value in key[3]:
      values.setdefault(name, set()).add(value)
  names = {n for n, v in values.items() if len(v) > 1}
  for key in keys:
    names |= fields[key[2]] - {name for name, _ in key[3]}
  if shared:
    names = {n for n in names if not n.startswith(_METHOD_PREFIXES)}
  protocol = [n for n in names if n.startswith('protocol.')]
  # Rows apart by which instruments scored them, not by their settings.
  by_instruments = any(n not in dict(key[3]) for key in keys for n in protocol)
  labels = {}
  for key in keys:
    own = dict(key[3])
    parts = [f'{n}={_plain(own[n]) if n in own else "(absent)"}'
             for n in sorted(names) if n in own or n in fields[key[2]]]
    if by_instruments:
      parts = [p for p in parts if not p.startswith('protocol.')] + [
          'evaluators: ' + (', '.join(
              what for field, what in (('protocol.probe', 'probe'),
                                       ('protocol.knn_k', 'kNN'))
              if field in own) or 'neither probe nor kNN')]
    labels[key] = ', '.join(parts)
  return labels


def _plain(text: str) -> str:
  value = json.loads(text)
  return value if isinstance(value, str) else text


def _runs_by_seed(results: Sequence[dict[str, Any]]
                  ) -> dict[RunKey, dict[Any, dict[str, Any]]]:
  """{run key: {seed: its first result}}: a seed counts once."""
  by_run: dict[RunKey, dict[Any, dict[str, Any]]] = {}
  for result in results:
    by_run.setdefault(_run_key(result), {}).setdefault(result.get('seed'),
                                                       result)
  return by_run


def repeated_seeds(results: Sequence[dict[str, Any]]
                   ) -> list[tuple[int, int]]:
  """(index, index of the result counted instead) of each result whose seed
  its row already counts: `aggregate` leaves these out."""
  first: dict[tuple[RunKey, Any], int] = {}
  out = []
  for index, result in enumerate(results):
    counted = first.setdefault((_run_key(result), result.get('seed')), index)
    if counted != index:
      out.append((index, counted))
  return out


def aggregate(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Groups the seeds of each run: equal result-changing settings but the seed.

  Args:
    results: results dicts, one per run; without a stored `config` grouped
      by (pretrain_dataset, batch_size, `run_id`).

  Returns:
    One dict per group, in table order: 'pretrain_dataset', 'batch_size',
    'method' (`run_id`), 'title', 'label' (how it differs from other groups),
    'floor_label' (the same without the methods' blocks), 'settings',
    'setting', 'n', 'seeds', 'steps', and per `SECTIONS` the results with
    each finite number replaced by its `stat` over the runs.
  """
  groups = _runs_by_seed(results)
  labels = _labels(list(groups))
  floor_labels = _labels(list(groups), shared=True)
  out = []
  for key in sorted(groups, key=_sort_key):
    runs = list(groups[key].values())
    group = {'pretrain_dataset': key[0], 'batch_size': key[1],
             'method': key[2],
             'title': runs[0].get('title') or method_name(key[2]),
             'label': labels[key], 'floor_label': floor_labels[key],
             'settings': {n: json.loads(v) for n, v in key[3]},
             'setting': _setting_of(key),
             'n': len(runs),
             'seeds': [r.get('seed') for r in runs],
             'steps': [r.get('step') for r in runs]}
    for section in SECTIONS:
      group[section] = aggregate_tree([r.get(section) or {} for r in runs])
    out.append(group)
  return out


def floors(results: Sequence[dict[str, Any]]) -> dict[tuple, Any]:
  """random_init stats per setting (`_setting_of`), one run per seed."""
  by_setting: dict[tuple, dict[Any, dict[str, Any]]] = {}
  for result in results:
    seed = by_setting.setdefault(_setting_of(_run_key(result)), {}).setdefault(
        result.get('seed'), {})
    # Per value: runs of one seed may have evaluated other datasets.
    for dataset, values in (result.get('random_init') or {}).items():
      for metric, value in values.items():
        seed.setdefault(dataset, {}).setdefault(metric, value)
  return {k: aggregate_tree(list(v.values())) for k, v in by_setting.items()}


def method_name(method: str) -> str:
  return METHOD_NAMES.get(method, method)


# Metrics `paired_differences` compares, with their headers.
PAIRED_METRICS = (('top1', 'Probe top-1'), ('top5', 'Probe top-5'),
                  ('knn_top1', 'kNN'))


def _baseline(run: str) -> str | None:
  """The run id an OT-view run is compared with: its objective's augment run."""
  if run == 'otclr':
    return 'simclr'
  return run[:-len('+ot')] if run.endswith('+ot') else None


_NO_SPREAD = 1e-9


def _paired(values: dict[Any, float], base: dict[Any, float]
            ) -> dict[str, Any] | None:
  """The paired comparison of `values` with `base` over their common seeds."""
  seeds = sorted((s for s in values if s in base), key=str)
  if len(seeds) < 2:
    return None
  diffs = [values[s] - base[s] for s in seeds]
  summary = stat(diffs)
  t, p = math.nan, math.nan
  # Accuracies are multiples of 100 / N: equal gains can differ in their last
  # bits, which is no spread (t would be ~1e13).
  if summary['std'] > _NO_SPREAD * max(1.0, *(abs(d) for d in diffs)):
    # Student's paired t-test, two-sided, n - 1 degrees of freedom.
    from scipy import stats as scipy_stats  # pylint: disable=g-import-not-at-top
    t = summary['mean'] / (summary['std'] / math.sqrt(len(diffs)))
    p = float(2 * scipy_stats.t.sf(abs(t), len(diffs) - 1))
  return {'seeds': seeds, 'differences': diffs, **summary, 't': t, 'p': p,
          'wins': sum(d > 0 for d in diffs),
          'unpaired': sorted(set(values) ^ set(base), key=str)}


def _by_seed(runs: dict[Any, dict[str, Any]], section: str, dataset: str,
             metric: str) -> dict[Any, float]:
  """{seed: the finite value of section/dataset/metric} of results by seed."""
  out = {}
  for seed, result in runs.items():
    value = ((result.get(section) or {}).get(dataset) or {}).get(metric)
    if _is_number(value) and math.isfinite(value):
      out[seed] = float(value)
  return out


def paired_differences(results: Sequence[dict[str, Any]]
                       ) -> list[dict[str, Any]]:
  """Seed-by-seed differences: OT views minus augmentations, methods minus floor.

  OT-view runs minus their augment run, every run minus its seed's random
  init, per probe metric and dataset, over at least two common seeds.

  Returns:
    One dict per (setting, comparison, dataset, metric): 'pretrain_dataset',
    'batch_size', 'label', 'method', 'baseline' (a run id or 'random_init'),
    'dataset', 'metric', 'seeds', 'differences' (percentage points), 'mean',
    'std', 'n', 't', 'p' (two-sided paired t-test; NaN when the differences
    do not vary), 'wins' (seeds with a positive difference).
  """
  by_run = _runs_by_seed(results)
  labels = _labels(list(by_run))
  rows = []
  for key in sorted(by_run, key=_sort_key):
    pretrain, batch, run, settings = key
    runs = by_run[key]
    datasets = list(dict.fromkeys(
        d for r in runs.values() for d in (r.get('linear') or {})))
    baselines = [(_baseline(run), 'linear')] if _baseline(run) else []
    baselines.append(('random_init', 'random_init'))
    for baseline, base_section in baselines:
      base_runs = (runs if baseline == 'random_init'
                   else by_run.get((pretrain, batch, baseline, settings), {}))
      for dataset in datasets:
        for metric, _ in PAIRED_METRICS:
          paired = _paired(
              _by_seed(runs, 'linear', dataset, metric),
              _by_seed(base_runs, base_section, dataset, metric))
          if paired:
            rows.append({'pretrain_dataset': pretrain, 'batch_size': batch,
                         'label': labels[key],
                         'method': run, 'baseline': baseline,
                         'dataset': dataset, 'metric': metric, **paired})
  metrics = [m for m, _ in PAIRED_METRICS]
  # Per setting: view comparisons before the floor's, datasets in paper order.
  rows.sort(key=lambda r: (
      _sort_key((r['pretrain_dataset'], r['batch_size'], '', ()))[:2],
      r['label'],
      r['baseline'] == 'random_init', method_rank(r['method']),
      _rank(DATASET_ORDER, r['dataset']), metrics.index(r['metric'])))
  return rows
