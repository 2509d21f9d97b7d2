"""Markdown and LaTeX tables of evaluation results, in the paper's layouts.

Tables take results dicts of `otclr_jax.evaluation.evaluate` (one
`<workdir>/eval/results.json` per run) and `fmt`, 'markdown' or 'latex'. The
seeds of a run are one row (`aggregate`): `46.90 ± 0.40 (n=3)`, std with
ddof = 1. Bold marks each column's best within a block of comparable rows.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from typing import Any, Iterable, NamedTuple, Sequence

from otclr_jax import rundir

METHOD_NAMES = {'simclr': 'SimCLR', 'otclr': 'OTCLR'}
# Row order: each method, then it with OT views (run ids of `run_id`).
RUN_ORDER = ('simclr', 'otclr', 'moco', 'moco+ot', 'byol', 'byol+ot', 'dino',
             'dino+ot')
DATASET_NAMES = {
    'cifar10': 'CIFAR-10', 'cifar100': 'CIFAR-100', 'food101': 'Food-101',
    'oxford_iiit_pet': 'Pets', 'stl10': 'STL-10', 'svhn_cropped': 'SVHN',
    'digits': 'Digits', 'imagenet300': 'ImageNet-300',
    'imagenet2012': 'ImageNet',
}
# The paper's column order; other datasets follow in order of appearance.
DATASET_ORDER = ('cifar10', 'cifar100', 'food101', 'oxford_iiit_pet', 'stl10',
                 'svhn_cropped')
SECTIONS = ('linear', 'random_init', 'clusters', 'views', 'linear_clean_bn')
# (key, header, +1 if higher is better else -1).
CLUSTER_METRICS = (('silhouette', 'Silhouette', 1),
                   ('compactness', 'Compactness', -1),
                   ('centroid_margin', 'Centroid Margin', 1),
                   ('inter_intra_ratio', 'Inter/Intra', 1))
VIEW_METRICS = (('view_distance', 'View Dist.', -1),
                ('view_cosine', 'View Cos.', 1),
                ('anchor_distance', 'Anchor Dist.', -1),
                ('pixel_l2', 'Pixel L2', -1),
                ('pixel_rms', 'Pixel RMS', -1))
LINEAR_METRICS = {'top1': 'Top-1', 'top5': 'Top-5', 'knn_top1': 'kNN'}
FORMATS = ('markdown', 'latex')
FLOOR_LABEL = 'Random init'
# Rows of `linear_clean_bn` runs: checkpoint vs clean-image BatchNorm stats.
BN_STORED_LABEL = ' (BN: stored)'
BN_CLEAN_LABEL = ' (BN: clean train)'
# `protocol.embedding` of evaluate; absent means 'h'.
EMBEDDING_NAMES = {'z': 'z, l2-normalised projection output',
                   'h': 'h, l2-normalised backbone features'}

_EMPTY = {'markdown': '–', 'latex': '--'}
_PM = {'markdown': ' ± ', 'latex': r' $\pm$ '}
_LATEX_SPECIAL = {'&': r'\&', '%': r'\%', '$': r'\$', '#': r'\#', '_': r'\_',
                  '{': r'\{', '}': r'\}', '~': r'\textasciitilde{}',
                  '^': r'\textasciicircum{}', '\\': r'\textbackslash{}'}


def stat(values: Iterable[float]) -> dict[str, Any]:
  """{'mean', 'std', 'n'} of numbers; std has ddof = 1 and is None for n = 1."""
  values = [float(v) for v in values]
  if not values:
    raise ValueError('stat needs at least one value.')
  std = statistics.stdev(values) if len(values) > 1 else None
  return {'mean': statistics.fmean(values), 'std': std, 'n': len(values)}


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _aggregate_tree(trees: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Numbers at equal paths become stats; missing and null values skipped."""
  keys = list(dict.fromkeys(k for t in trees for k in t))
  out = {}
  for key in keys:
    values = [t[key] for t in trees if t.get(key) is not None]
    if values and all(isinstance(v, dict) for v in values):
      out[key] = _aggregate_tree(values)
    elif values and all(_is_number(v) for v in values):
      finite = [v for v in values if math.isfinite(v)]
      if finite:
        out[key] = stat(finite)
  return out


def _rank(order: Sequence[str], name: str) -> tuple[int, str]:
  """Sort key: position in `order`, names outside it after, by name."""
  return (order.index(name) if name in order else len(order), name)


def _method_rank(method: str) -> tuple[int, str]:
  return _rank(RUN_ORDER, method)


def run_id(result: dict[str, Any]) -> str:
  """The run's objective and views: 'simclr', 'otclr', 'moco+ot', ..."""
  method = str(result['method'])
  views = result.get('view_generator', '')
  if method == 'otclr' or (method == 'simclr' and views == 'ot'):
    return 'otclr'
  return f'{method}+ot' if views == 'ot' else method


# Identity fields shown elsewhere in a row (title, setting), and the seed.
_SHOWN_FIELDS = ('seed', 'dataset', 'batch_size', 'method', 'views')
_METHOD_PREFIXES = tuple(f'{b}.' for b in rundir.METHOD_BLOCKS)


def _settings(result: dict[str, Any]) -> tuple[tuple[str, str], ...]:
  """`rundir.identity` but the seed as sorted (name, JSON) pairs; () if none."""
  config = result.get('config')
  if not isinstance(config, dict):
    return ()
  return tuple(sorted(
      (name, json.dumps(value, sort_keys=True))
      for name, value in rundir.identity(config).items()
      if name not in _SHOWN_FIELDS))


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
  return (key[0], -key[1], key[3], _method_rank(key[2]))


def _differing(keys: Sequence[RunKey]) -> list[str]:
  """The setting names whose values differ between the given runs."""
  values: dict[str, set[str]] = {}
  for key in keys:
    for name, value in key[3]:
      values.setdefault(name, set()).add(value)
  return sorted(n for n, v in values.items() if len(v) > 1)


def _label(key: RunKey, names: Sequence[str]) -> str:
  """'ot.epsilon=0.05, optim.base_lr=0.3': the run's values of `names`."""
  own = dict(key[3])
  return ', '.join(f'{n}={_plain(own[n])}' for n in names if n in own)


def _plain(text: str) -> str:
  value = json.loads(text)
  return value if isinstance(value, str) else text


def aggregate(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Groups the seeds of each run: equal result-changing settings but the seed.

  Args:
    results: results dicts, one per run; without a stored `config` grouped
      by (pretrain_dataset, batch_size, `run_id`).

  Returns:
    One dict per group, in table order: 'pretrain_dataset', 'batch_size',
    'method' (`run_id`), 'title', 'label' (how it differs from other groups),
    'settings', 'setting', 'n', 'seeds', 'steps', and per `SECTIONS` the
    results with each finite number replaced by its `stat` over the runs.
  """
  groups: dict[RunKey, list[dict[str, Any]]] = {}
  for result in results:
    groups.setdefault(_run_key(result), []).append(result)
  names = _differing(list(groups))
  out = []
  for key in sorted(groups, key=_sort_key):
    runs = groups[key]
    group = {'pretrain_dataset': key[0], 'batch_size': key[1],
             'method': key[2],
             'title': runs[0].get('title') or method_name(key[2]),
             'label': _label(key, names),
             'settings': {n: json.loads(v) for n, v in key[3]},
             'setting': _setting_of(key),
             'n': len(runs),
             'seeds': [r.get('seed') for r in runs],
             'steps': [r.get('step') for r in runs]}
    for section in SECTIONS:
      group[section] = _aggregate_tree([r.get(section) or {} for r in runs])
    out.append(group)
  return out


def _floors(results: Sequence[dict[str, Any]]) -> dict[tuple, Any]:
  """random_init stats per setting (`_setting_of`), one run per seed."""
  by_setting: dict[tuple, dict[Any, dict[str, Any]]] = {}
  for result in results:
    by_setting.setdefault(_setting_of(_run_key(result)), {}).setdefault(
        result.get('seed'), result.get('random_init') or {})
  return {k: _aggregate_tree(list(v.values())) for k, v in by_setting.items()}


def dataset_name(name: str) -> str:
  """Display name: 'cifar10' -> 'CIFAR-10', 'folder:/data/birds' -> 'birds'."""
  if name.startswith('folder:'):
    return os.path.basename(os.path.normpath(name[len('folder:'):])) or name
  return DATASET_NAMES.get(name, name)


def method_name(method: str) -> str:
  return METHOD_NAMES.get(method, method)


def _escape(text: str, fmt: str) -> str:
  if fmt == 'latex':
    return ''.join(_LATEX_SPECIAL.get(c, c) for c in text)
  return text.replace('|', r'\|')


def _bold(text: str, fmt: str) -> str:
  return rf'\textbf{{{text}}}' if fmt == 'latex' else f'**{text}**'


def _number(value: float, digits: int) -> str:
  # digits == 0 marks counts such as throughput: thousands separators.
  return f'{value:,.0f}' if digits == 0 else f'{value:.{digits}f}'


def _value_text(value, digits, fmt) -> str:
  if value is None:
    return _EMPTY[fmt]
  text = _number(value['mean'], digits)
  if value['n'] > 1:
    text += _PM[fmt] + _number(value['std'], digits)
  return text


def _check_fmt(fmt: str) -> None:
  if fmt not in FORMATS:
    raise ValueError(f'fmt must be one of {FORMATS}, got {fmt!r}.')


class _Row(NamedTuple):
  labels: tuple[str, ...]
  cells: tuple[tuple[dict[str, Any] | None, ...], ...]
  block: Any = None  # rows of one block compete for bold; None: never bold.
  highlight: bool = False
  section: Any = None  # a LaTeX \midrule separates sections.


class _Spec(NamedTuple):
  label_headers: tuple[str, ...]
  columns: tuple[tuple[str, str], ...]  # (group header, sub-header)
  directions: tuple[int, ...]
  digits: tuple[int, ...]
  merge_labels: int = 0  # leading label columns merged with \multirow.
  raw_headers: bool = False  # column headers are already LaTeX.


def _best_flags(rows: Sequence[_Row], spec: _Spec) -> list[list[list[bool]]]:
  flags = [[[False] * len(cell) for cell in row.cells] for row in rows]
  blocks: dict[Any, list[int]] = {}
  for i, row in enumerate(rows):
    if row.block is not None:
      blocks.setdefault(row.block, []).append(i)
  for members in blocks.values():
    if len(members) < 2:
      continue
    for col, (direction, digits) in enumerate(zip(spec.directions,
                                                  spec.digits)):
      for pos in range(len(rows[members[0]].cells[col])):
        # Compare as displayed, so equal printed values are both bold.
        shown = {i: round(rows[i].cells[col][pos]['mean'], max(digits, 0))
                 for i in members if rows[i].cells[col][pos] is not None}
        if not shown:
          continue
        best = (max if direction > 0 else min)(shown.values())
        for i, value in shown.items():
          flags[i][col][pos] = value == best
  return flags


def _cell_text(cell, bold, digits, fmt) -> str:
  if all(v is None for v in cell):
    return _EMPTY[fmt]
  parts = [_value_text(v, digits, fmt) for v in cell]
  parts = [_bold(p, fmt) if b else p for p, b in zip(parts, bold)]
  text = ' / '.join(parts)
  counts = {v['n'] for v in cell if v is not None}
  if len(counts) == 1 and max(counts) > 1:
    text += f' (n={counts.pop()})'
  elif len(counts) > 1:
    # Different run counts in one cell: say each.
    text = ' / '.join(
        p + (f' (n={v["n"]})' if v is not None and v['n'] > 1 else '')
        for p, v in zip(parts, cell))
  return text


def _render(spec: _Spec, rows: Sequence[_Row], fmt: str) -> str:
  _check_fmt(fmt)
  flags = _best_flags(rows, spec)
  body = [[_cell_text(cell, flag, digits, fmt)
           for cell, flag, digits in zip(row.cells, row_flags, spec.digits)]
          for row, row_flags in zip(rows, flags)]
  if fmt == 'markdown':
    return _render_markdown(spec, rows, body)
  return _render_latex(spec, rows, body)


def _render_markdown(spec, rows, body) -> str:
  header = list(spec.label_headers) + [
      f'{g} {s}'.strip() for g, s in spec.columns]
  align = [':--'] * len(spec.label_headers) + ['--:'] * len(spec.columns)
  lines = ['| ' + ' | '.join(header) + ' |', '| ' + ' | '.join(align) + ' |']
  for row, cells in zip(rows, body):
    labels = [_escape(l, 'markdown') for l in row.labels]
    lines.append('| ' + ' | '.join(labels + cells) + ' |')
  return '\n'.join(lines) + '\n'


def _latex_header(spec: _Spec) -> list[str]:
  def bold(text: str, raw: bool = False) -> str:
    return _bold(text if raw else _escape(text, 'latex'), 'latex')

  groups: list[tuple[str, int]] = []
  for group, _ in spec.columns:
    if groups and groups[-1][0] == group:
      groups[-1] = (group, groups[-1][1] + 1)
    else:
      groups.append((group, 1))
  if not any(sub for _, sub in spec.columns):
    return [' & '.join([bold(h) for h in spec.label_headers] +
                       [bold(g, spec.raw_headers) for g, _ in groups])
            + r' \\']
  first = [rf'\multirow{{2}}{{*}}{{{bold(h)}}}' for h in spec.label_headers]
  rules, col = [], len(spec.label_headers) + 1
  for group, width in groups:
    first.append(
        rf'\multicolumn{{{width}}}{{c}}{{{bold(group, spec.raw_headers)}}}')
    rules.append(rf'\cmidrule(lr){{{col}-{col + width - 1}}}')
    col += width
  second = '& ' * len(spec.label_headers) + ' & '.join(
      bold(s) for _, s in spec.columns)
  return [' & '.join(first) + r' \\', ' '.join(rules), second + r' \\']


def _render_latex(spec, rows, body) -> str:
  colspec = 'l' * len(spec.label_headers) + 'c' * len(spec.columns)
  lines = [rf'\begin{{tabular}}{{{colspec}}}', r'\toprule',
           *_latex_header(spec), r'\midrule']
  labels = [[_escape(l, 'latex') for l in row.labels] for row in rows]
  for col in range(spec.merge_labels):
    i = 0
    while i < len(rows):
      j = i + 1
      prefix = rows[i].labels[:col + 1]
      while j < len(rows) and rows[j].labels[:col + 1] == prefix:
        j += 1
      if j - i > 1:
        labels[i][col] = rf'\multirow{{{j - i}}}{{*}}{{{labels[i][col]}}}'
      for k in range(i + 1, j):
        labels[k][col] = ''
      i = j
  for i, (row, cells) in enumerate(zip(rows, body)):
    if i and row.section != rows[i - 1].section:
      lines.append(r'\midrule')
    cells = labels[i] + cells
    if row.highlight and spec.merge_labels:
      # \rowcolor would paint over the \multirow text of the merged labels.
      cells = cells[:spec.merge_labels] + [
          r'\cellcolor{oursrow}' + c for c in cells[spec.merge_labels:]]
    elif row.highlight:
      lines.append(r'\rowcolor{oursrow}')
    lines.append(' & '.join(cells) + r' \\')
  lines += [r'\bottomrule', r'\end{tabular}']
  return '\n'.join(lines) + '\n'


def _datasets(groups, section: str) -> list[str]:
  seen = list(dict.fromkeys(d for g in groups for d in g[section]))
  return ([d for d in DATASET_ORDER if d in seen]
          + [d for d in seen if d not in DATASET_ORDER])


def _several_settings(groups) -> bool:
  return len({g['setting'] for g in groups}) > 1


def _last_of_setting(groups, i: int) -> bool:
  """Whether group i is the last of its setting (`_setting_of`)."""
  return (i + 1 == len(groups)
          or groups[i + 1]['setting'] != groups[i]['setting'])


def _suffix(g: dict[str, Any], several: bool) -> str:
  """' (Digits, b=64, ot.epsilon=0.05)': the setting if `several`, the label."""
  parts = ([dataset_name(g['pretrain_dataset']), f'b={g["batch_size"]}']
           if several else [])
  parts += [g['label']] if g.get('label') else []
  return f' ({", ".join(parts)})' if parts else ''


def linear_table(results: Sequence[dict[str, Any]], fmt: str = 'markdown', *,
                 metrics: Sequence[str] = ('top1', 'top5'),
                 datasets: Sequence[str] | None = None,
                 include_random_init: bool = True) -> str:
  """Linear evaluation, methods x datasets (the paper's full_linear_eval).

  Args:
    results: results dicts, one per run.
    fmt: 'markdown' or 'latex'.
    metrics: per-dataset columns, from 'top1', 'top5', 'knn_top1'.
    datasets: column order; default the paper's order, then the others.
    include_random_init: add a floor row per setting, pooled over seeds.

  Returns:
    The table; row labels name the setting when there are several.
  """
  _check_fmt(fmt)
  unknown = [m for m in metrics if m not in LINEAR_METRICS]
  if unknown or not metrics:
    raise ValueError(f'metrics must be a non-empty subset of '
                     f'{tuple(LINEAR_METRICS)}, got {tuple(metrics)}.')
  groups = aggregate(results)
  datasets = list(datasets) if datasets else _datasets(groups, 'linear')
  several = _several_settings(groups)
  spec = _Spec(label_headers=('Method',),
               columns=tuple((dataset_name(d), LINEAR_METRICS[m])
                             for d in datasets for m in metrics),
               directions=(1,) * len(datasets) * len(metrics),
               digits=(2,) * len(datasets) * len(metrics))

  def cells(section):
    return tuple((section.get(d, {}).get(m),) for d in datasets
                 for m in metrics)

  floors = _floors(results) if include_random_init else {}
  rows = []
  for i, g in enumerate(groups):
    setting = g['setting']
    suffix = _suffix(g, several)
    clean = g.get('linear_clean_bn')
    name = g['title']
    rows.append(_Row((name + (BN_STORED_LABEL if clean else '') + suffix,),
                     cells(g['linear']), block=setting,
                     highlight=g['method'] == 'otclr', section=setting))
    if clean:
      rows.append(_Row((name + BN_CLEAN_LABEL + suffix,), cells(clean),
                       block=setting, highlight=g['method'] == 'otclr',
                       section=setting))
    if _last_of_setting(groups, i) and floors.get(setting):
      rows.append(_Row((FLOOR_LABEL + suffix,), cells(floors[setting]),
                       section=(setting, 'floor')))
  return _render(spec, rows, fmt)


def ablation_table(results: Sequence[dict[str, Any]], fmt: str = 'markdown',
                   *, datasets: Sequence[str] | None = None,
                   include_random_init: bool = True) -> str:
  """Pretraining dataset x batch size x method, 'Top-1 / Top-5' cells."""
  _check_fmt(fmt)
  groups = aggregate(results)
  datasets = list(datasets) if datasets else _datasets(groups, 'linear')
  spec = _Spec(label_headers=('Pretraining Dataset', 'Batch Size', 'Method'),
               columns=tuple((dataset_name(d), 'Top-1 / Top-5')
                             for d in datasets),
               directions=(1,) * len(datasets), digits=(2,) * len(datasets),
               merge_labels=2)
  floors = _floors(results) if include_random_init else {}

  def cells(section):
    return tuple((section.get(d, {}).get('top1'),
                  section.get(d, {}).get('top5')) for d in datasets)

  rows = []
  for i, g in enumerate(groups):
    setting = g['setting']
    labels = (dataset_name(setting[0]), str(setting[1]))
    rows.append(_Row(labels + (g['title'] + _suffix(g, False),),
                     cells(g['linear']),
                     block=setting, highlight=g['method'] == 'otclr',
                     section=setting[0]))
    if _last_of_setting(groups, i) and floors.get(setting):
      rows.append(_Row(labels + (FLOOR_LABEL,), cells(floors[setting]),
                       section=setting[0]))
  return _render(spec, rows, fmt)


def augmentation_table(results: Sequence[dict[str, Any]],
                       fmt: str = 'markdown') -> str:
  """Cluster and view metrics of the two view generators per encoder."""
  _check_fmt(fmt)
  groups = aggregate(results)
  several = _several_settings(groups)
  keys = CLUSTER_METRICS + VIEW_METRICS
  arrows = {1: ' ↑', -1: ' ↓'} if fmt == 'markdown' else {
      1: r' $\uparrow$', -1: r' $\downarrow$'}
  spec = _Spec(label_headers=('Encoder', 'Views'),
               columns=tuple((h + arrows[d], '') for _, h, d in keys),
               directions=tuple(d for _, _, d in keys),
               digits=(4,) * len(keys), merge_labels=1, raw_headers=True)
  rows = []
  for g in groups:
    encoder = g['title']
    encoder += _suffix(g, several)
    for generator in sorted(g['views'], key=_method_rank):
      values = g['views'][generator]
      rows.append(_Row((encoder, method_name(generator)),
                       tuple((values.get(k),) for k, _, _ in keys),
                       block=id(g), highlight=generator == 'otclr',
                       section=id(g)))
  return _render(spec, rows, fmt)


def cluster_table(results: Sequence[dict[str, Any]],
                  fmt: str = 'markdown') -> str:
  """K-means cluster metrics of the test features, rows dataset x method."""
  _check_fmt(fmt)
  groups = aggregate(results)
  several = _several_settings(groups)
  spec = _Spec(label_headers=('Dataset', 'Method'),
               columns=tuple((h, '') for _, h, _ in CLUSTER_METRICS),
               directions=tuple(d for _, _, d in CLUSTER_METRICS),
               digits=(4,) * len(CLUSTER_METRICS), merge_labels=1)
  rows = []
  for dataset in _datasets(groups, 'clusters'):
    for g in groups:
      if dataset not in g['clusters']:
        continue
      label = g['title'] + _suffix(g, several)
      rows.append(_Row((dataset_name(dataset), label),
                       tuple((g['clusters'][dataset].get(k),)
                             for k, _, _ in CLUSTER_METRICS),
                       block=(dataset, g['setting']),
                       highlight=g['method'] == 'otclr', section=dataset))
  return _render(spec, rows, fmt)


COMPLEXITY_COLUMNS = (('params_m', 'Params (M)', 2), ('gflops', 'GFLOPs', 3),
                      ('step_ms', 'Step (ms)', 2), ('throughput', 'Thrpt.', 0))


def complexity_table(rows: Sequence[dict[str, Any]],
                     fmt: str = 'markdown') -> str:
  """Cost per stage and method (the paper's complexity table).

  Args:
    rows: dicts of 'stage', 'method', 'params_m', 'gflops' (per image),
      'step_ms', 'throughput' (images/s); repeats averaged, gaps dashed.
    fmt: 'markdown' or 'latex'.

  Returns:
    The table, stages in order of appearance.
  """
  _check_fmt(fmt)
  grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
  for row in rows:
    if 'stage' not in row or 'method' not in row:
      raise ValueError(f'complexity rows need stage and method, got {row}.')
    grouped.setdefault((str(row['stage']), str(row['method'])), []).append(row)
  spec = _Spec(label_headers=('Stage', 'Method'),
               columns=tuple((h, '') for _, h, _ in COMPLEXITY_COLUMNS),
               directions=(1,) * len(COMPLEXITY_COLUMNS),
               digits=tuple(d for _, _, d in COMPLEXITY_COLUMNS),
               merge_labels=1)
  out = []
  for (stage, method), members in grouped.items():
    values = _aggregate_tree(members)
    out.append(_Row((stage, method_name(method)),
                    tuple((values.get(k),) for k, _, _ in COMPLEXITY_COLUMNS),
                    highlight=method == 'otclr', section=stage))
  return _render(spec, out, fmt)


# Metrics `paired_differences` compares, with their headers.
PAIRED_METRICS = (('top1', 'Probe top-1'), ('top5', 'Probe top-5'),
                  ('knn_top1', 'kNN'))


def _baseline(run: str) -> str | None:
  """The run id an OT-view run is compared with: its objective's augment run."""
  if run == 'otclr':
    return 'simclr'
  return run[:-len('+ot')] if run.endswith('+ot') else None


def _paired(values: dict[Any, float], base: dict[Any, float]
            ) -> dict[str, Any] | None:
  """The paired comparison of `values` with `base` over their common seeds."""
  seeds = sorted((s for s in values if s in base), key=str)
  if len(seeds) < 2:
    return None
  diffs = [values[s] - base[s] for s in seeds]
  summary = stat(diffs)
  t, p = math.nan, math.nan
  if summary['std'] > 0:
    # Student's paired t-test, two-sided, n - 1 degrees of freedom.
    from scipy import stats as scipy_stats  # pylint: disable=g-import-not-at-top
    t = summary['mean'] / (summary['std'] / math.sqrt(len(diffs)))
    p = float(2 * scipy_stats.t.sf(abs(t), len(diffs) - 1))
  return {'seeds': seeds, 'differences': diffs, **summary, 't': t, 'p': p,
          'wins': sum(d > 0 for d in diffs)}


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
  by_run: dict[RunKey, dict[Any, dict[str, Any]]] = {}
  for result in results:
    by_run.setdefault(_run_key(result), {}).setdefault(result.get('seed'),
                                                       result)
  names = _differing(list(by_run))
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
                         'label': _label(key, names),
                         'method': run, 'baseline': baseline,
                         'dataset': dataset, 'metric': metric, **paired})
  metrics = [m for m, _ in PAIRED_METRICS]
  # Per setting: view comparisons before the floor's, datasets in paper order.
  rows.sort(key=lambda r: (
      _sort_key((r['pretrain_dataset'], r['batch_size'], '', ()))[:2],
      r['label'],
      r['baseline'] == 'random_init', _method_rank(r['method']),
      _rank(DATASET_ORDER, r['dataset']), metrics.index(r['metric'])))
  return rows


def paired_table(results: Sequence[dict[str, Any]],
                 fmt: str = 'markdown') -> str:
  """`paired_differences` as a table; empty when no comparison has 2 seeds."""
  _check_fmt(fmt)
  rows = paired_differences(results)
  if not rows:
    return ''
  titles = {g['method']: g['title'] for g in aggregate(results)}
  headers = ('Dataset', 'Comparison', 'Metric', 'Per seed',
             'Mean ± std', 't', 'p', 'Positive')
  names = dict(PAIRED_METRICS)
  several = len({(r['pretrain_dataset'], r['batch_size']) for r in rows}) > 1
  body = []
  for r in rows:
    base = (FLOOR_LABEL if r['baseline'] == 'random_init'
            else titles.get(r['baseline'], method_name(r['baseline'])))
    comparison = f'{titles.get(r["method"], method_name(r["method"]))} − {base}'
    comparison += _suffix(r, several)
    per_seed = ', '.join(f'{d:+.2f}' for d in r['differences'])
    mean = _value_text(r, 2, fmt)
    body.append([dataset_name(r['dataset']), comparison, names[r['metric']],
                 per_seed, mean,
                 _EMPTY[fmt] if math.isnan(r['t']) else f'{r["t"]:.2f}',
                 _EMPTY[fmt] if math.isnan(r['p']) else f'{r["p"]:.3f}',
                 f'{r["wins"]}/{r["n"]}'])
  if fmt == 'markdown':
    lines = ['| ' + ' | '.join(headers) + ' |',
             '| ' + ' | '.join([':--'] * 3 + ['--:'] * 5) + ' |']
    lines += ['| ' + ' | '.join(_escape(c, fmt) for c in row) + ' |'
              for row in body]
    return '\n'.join(lines) + '\n'
  lines = [r'\begin{tabular}{lllccccc}', r'\toprule',
           ' & '.join(_bold(_escape(h, fmt).replace('±', _PM[fmt].strip()),
                            fmt) for h in headers) + r' \\',
           r'\midrule']
  for row in body:
    cells = [_escape(c, fmt) for c in row[:4]] + [row[4]] + [
        _escape(c, fmt) for c in row[5:]]
    lines.append(' & '.join(c.replace('−', '$-$') for c in cells) + r' \\')
  lines += [r'\bottomrule', r'\end{tabular}']
  return '\n'.join(lines) + '\n'


def embedding_label(results: Sequence[dict[str, Any]]) -> str:
  """Which embedding the runs' cluster and view metrics used, in words."""
  used = sorted({(r.get('protocol') or {}).get('embedding', 'h')
                 for r in results})
  return '; '.join(EMBEDDING_NAMES.get(e, str(e)) for e in used)


def render_report(results: Sequence[dict[str, Any]],
                  fmt: str = 'markdown') -> str:
  """All results tables, each under a heading (a comment in LaTeX)."""
  _check_fmt(fmt)
  embedding = embedding_label(results)
  parts = [
      ('Linear probe and kNN (%, complete test splits)',
       linear_table(results, fmt, metrics=('top1', 'top5', 'knn_top1'))),
      ('Linear probe by pretraining dataset and batch size',
       ablation_table(results, fmt)),
      (f'View quality (same encoder, two view generators; embedding '
       f'{embedding})', augmentation_table(results, fmt)),
      (f'Cluster metrics of the test embeddings (K-means, K = classes; '
       f'embedding {embedding})', cluster_table(results, fmt)),
  ]
  paired = paired_table(results, fmt)
  if paired:
    parts.append(('Paired differences over seeds (percentage points; '
                  'Student\'s paired t-test, two-sided)', paired))
  if fmt == 'markdown':
    return '\n'.join(f'### {title}\n\n{table}' for title, table in parts)
  header = ('% Requires \\usepackage{booktabs,multirow,colortbl} and '
            '\\definecolor{oursrow}{...}.\n')
  return header + '\n'.join(f'% {title}\n{table}' for title, table in parts)
