"""Markdown and LaTeX tables of evaluation results, in the paper's layouts.

Tables take results dicts of `otclr_jax.evaluation.evaluate` (one
`<workdir>/eval/results.json` per run) and `fmt`, 'markdown' or 'latex'. The
seeds of a run are one row (`aggregate.aggregate`): `46.90 ± 0.40 (n=3)`,
std with ddof = 1. Bold marks each column's best within a block of comparable
rows.
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Any, NamedTuple, Sequence

from otclr_jax import aggregate

DATASET_NAMES = {
    'cifar10': 'CIFAR-10', 'cifar100': 'CIFAR-100', 'food101': 'Food-101',
    'oxford_iiit_pet': 'Pets', 'stl10': 'STL-10', 'svhn_cropped': 'SVHN',
    'digits': 'Digits', 'imagenet300': 'ImageNet-300',
    'imagenet2012': 'ImageNet',
}
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
# SimCLR's views are their strong endpoints: its pixel distances are 0 by
# construction, not better, so no value of these is marked best.
NOT_RANKED = ('pixel_l2', 'pixel_rms')
LINEAR_METRICS = {'top1': 'Top-1', 'top5': 'Top-5', 'knn_top1': 'kNN'}
FORMATS = ('markdown', 'latex')
FLOOR_LABEL = 'Random init'
# `protocol.embedding` of evaluate; absent means 'h'.
EMBEDDING_NAMES = {'z': 'z, l2-normalised projection output',
                   'h': 'h, l2-normalised backbone features'}

_EMPTY = {'markdown': '–', 'latex': '--'}
_PM = {'markdown': ' ± ', 'latex': r' $\pm$ '}
_LATEX_SPECIAL = {'&': r'\&', '%': r'\%', '$': r'\$', '#': r'\#', '_': r'\_',
                  '{': r'\{', '}': r'\}', '~': r'\textasciitilde{}',
                  '^': r'\textasciicircum{}', '\\': r'\textbackslash{}'}


def dataset_name(name: str) -> str:
  """Display name: 'cifar10' -> 'CIFAR-10', 'folder:/data/birds' -> 'birds'."""
  if name.startswith('folder:'):
    return os.path.basename(os.path.normpath(name[len('folder:'):])) or name
  return DATASET_NAMES.get(name, name)


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


class _Column(NamedTuple):
  header: str  # equal neighbours share one LaTeX header cell
  sub: str = ''  # sub-header
  direction: int = 1  # +1: higher is better; -1: lower; 0: never bold.
  digits: int = 2


class _Spec(NamedTuple):
  label_headers: tuple[str, ...]
  columns: tuple[_Column, ...]
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
    for col, (_, _, direction, digits) in enumerate(spec.columns):
      for pos in range(len(rows[members[0]].cells[col])):
        # Compare as displayed, so equal printed values are both bold.
        shown = {i: round(rows[i].cells[col][pos]['mean'], max(digits, 0))
                 for i in members if rows[i].cells[col][pos] is not None}
        if not shown or not direction:
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


def _render(spec: _Spec, rows: Sequence[_Row], fmt: str,
            body: Sequence[Sequence[str]] | None = None) -> str:
  """The table of `rows`; `body` gives their cells as text instead."""
  if body is None:
    body = [[_cell_text(cell, flag, column.digits, fmt) for cell, flag, column
             in zip(row.cells, row_flags, spec.columns)]
            for row, row_flags in zip(rows, _best_flags(rows, spec))]
  if fmt == 'markdown':
    return _render_markdown(spec, rows, body)
  return _render_latex(spec, rows, body)


def _render_markdown(spec, rows, body) -> str:
  header = list(spec.label_headers) + [
      f'{c.header} {c.sub}'.strip() for c in spec.columns]
  align = [':--'] * len(spec.label_headers) + ['--:'] * len(spec.columns)
  lines = ['| ' + ' | '.join(header) + ' |', '| ' + ' | '.join(align) + ' |']
  for row, cells in zip(rows, body):
    labels = [_escape(l, 'markdown') for l in row.labels]
    lines.append('| ' + ' | '.join(labels + cells) + ' |')
  return '\n'.join(lines) + '\n'


def _latex_header(spec: _Spec) -> list[str]:
  def bold(text: str, raw: bool = False) -> str:
    return _bold(text if raw else _escape(text, 'latex'), 'latex')

  groups = [(group, len(list(members))) for group, members
            in itertools.groupby(c.header for c in spec.columns)]
  if not any(c.sub for c in spec.columns):
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
      bold(c.sub) for c in spec.columns)
  return [' & '.join(first) + r' \\', ' '.join(rules), second + r' \\']


def _render_latex(spec, rows, body) -> str:
  colspec = 'l' * len(spec.label_headers) + 'c' * len(spec.columns)
  lines = [rf'\begin{{tabular}}{{{colspec}}}', r'\toprule',
           *_latex_header(spec), r'\midrule']
  labels = [[_escape(l, 'latex') for l in row.labels] for row in rows]
  for col in range(spec.merge_labels):
    start = 0
    for _, same in itertools.groupby(row.labels[:col + 1] for row in rows):
      span = len(list(same))
      if span > 1:
        labels[start][col] = (
            rf'\multirow{{{span}}}{{*}}{{{labels[start][col]}}}')
      for k in range(start + 1, start + span):
        labels[k][col] = ''
      start += span
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
  return ([d for d in aggregate.DATASET_ORDER if d in seen]
          + [d for d in seen if d not in aggregate.DATASET_ORDER])


def _groups(results, fmt: str) -> tuple[list[dict[str, Any]], bool]:
  """The runs' rows (`aggregate.aggregate`) and whether settings differ."""
  _check_fmt(fmt)
  groups = aggregate.aggregate(results)
  return groups, len({g['setting'] for g in groups}) > 1


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
  groups, several = _groups(results, fmt)
  datasets = list(datasets) if datasets else _datasets(groups, 'linear')
  spec = _Spec(label_headers=('Method',),
               columns=tuple(_Column(dataset_name(d), LINEAR_METRICS[m])
                             for d in datasets for m in metrics))

  def cells(section):
    return tuple((section.get(d, {}).get(m),) for d in datasets
                 for m in metrics)

  floors = aggregate.floors(results) if include_random_init else {}
  rows = []
  for setting, members in itertools.groupby(groups, lambda g: g['setting']):
    for g in members:
      suffix = _suffix(g, several)
      probes = [('', g['linear'])]
      if g['linear_clean_bn']:
        # Checkpoint against clean-image BatchNorm statistics.
        probes = [(' (BN: stored)', g['linear']),
                  (' (BN: clean train)', g['linear_clean_bn'])]
      for bn_label, probe in probes:
        rows.append(_Row((g['title'] + bn_label + suffix,), cells(probe),
                         block=setting, highlight=g['method'] == 'otclr',
                         section=setting))
    if floors.get(setting):
      floor_suffix = _suffix({**g, 'label': g['floor_label']}, several)
      rows.append(_Row((FLOOR_LABEL + floor_suffix,), cells(floors[setting]),
                       section=(setting, 'floor')))
  return _render(spec, rows, fmt)


def ablation_table(results: Sequence[dict[str, Any]], fmt: str = 'markdown',
                   *, datasets: Sequence[str] | None = None,
                   include_random_init: bool = True) -> str:
  """Pretraining dataset x batch size x method, 'Top-1 / Top-5' cells."""
  groups, _ = _groups(results, fmt)
  datasets = list(datasets) if datasets else _datasets(groups, 'linear')
  spec = _Spec(label_headers=('Pretraining Dataset', 'Batch Size', 'Method'),
               columns=tuple(_Column(dataset_name(d), 'Top-1 / Top-5')
                             for d in datasets), merge_labels=2)
  floors = aggregate.floors(results) if include_random_init else {}

  def cells(section):
    return tuple((section.get(d, {}).get('top1'),
                  section.get(d, {}).get('top5')) for d in datasets)

  rows = []
  for setting, members in itertools.groupby(groups, lambda g: g['setting']):
    labels = (dataset_name(setting[0]), str(setting[1]))
    rows += [_Row(labels + (g['title'] + _suffix(g, False),),
                  cells(g['linear']), block=setting,
                  highlight=g['method'] == 'otclr', section=setting[0])
             for g in members]
    if floors.get(setting):
      rows.append(_Row(labels + (FLOOR_LABEL,), cells(floors[setting]),
                       section=setting[0]))
  return _render(spec, rows, fmt)


def augmentation_table(results: Sequence[dict[str, Any]],
                       fmt: str = 'markdown') -> str:
  """Cluster and view metrics of the two view generators per encoder."""
  groups, several = _groups(results, fmt)
  keys = CLUSTER_METRICS + VIEW_METRICS
  arrows = {1: ' ↑', -1: ' ↓'} if fmt == 'markdown' else {
      1: r' $\uparrow$', -1: r' $\downarrow$'}
  spec = _Spec(label_headers=('Encoder', 'Views'),
               columns=tuple(_Column(h + arrows[d], '',
                                     0 if k in NOT_RANKED else d, 4)
                             for k, h, d in keys),
               merge_labels=1, raw_headers=True)
  rows = []
  for g in groups:
    encoder = g['title'] + _suffix(g, several)
    for generator in sorted(g['views'], key=aggregate.method_rank):
      values = g['views'][generator]
      rows.append(_Row((encoder, aggregate.method_name(generator)),
                       tuple((values.get(k),) for k, _, _ in keys),
                       block=id(g), highlight=generator == 'otclr',
                       section=id(g)))
  return _render(spec, rows, fmt)


def cluster_table(results: Sequence[dict[str, Any]],
                  fmt: str = 'markdown') -> str:
  """K-means cluster metrics of the test features, rows dataset x method."""
  groups, several = _groups(results, fmt)
  spec = _Spec(label_headers=('Dataset', 'Method'),
               columns=tuple(_Column(h, '', d, 4)
                             for _, h, d in CLUSTER_METRICS), merge_labels=1)
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
               columns=tuple(_Column(h, digits=d)
                             for _, h, d in COMPLEXITY_COLUMNS), merge_labels=1)
  out = []
  for (stage, method), members in grouped.items():
    values = aggregate.aggregate_tree(members)
    out.append(_Row((stage, aggregate.method_name(method)),
                    tuple((values.get(k),) for k, _, _ in COMPLEXITY_COLUMNS),
                    highlight=method == 'otclr', section=stage))
  return _render(spec, out, fmt)


def paired_table(results: Sequence[dict[str, Any]],
                 fmt: str = 'markdown') -> str:
  """`paired_differences` as a table; empty when no comparison has 2 seeds."""
  _check_fmt(fmt)
  rows = aggregate.paired_differences(results)
  if not rows:
    return ''
  titles = {g['method']: g['title'] for g in aggregate.aggregate(results)}
  spec = _Spec(label_headers=('Dataset', 'Comparison', 'Metric'),
               columns=tuple(map(_Column, ('Per seed', f'Mean{_PM[fmt]}std',
                                           't', 'p', 'Positive'))),
               raw_headers=True)
  names = dict(aggregate.PAIRED_METRICS)
  several = len({(r['pretrain_dataset'], r['batch_size']) for r in rows}) > 1
  labels, body = [], []
  for r in rows:
    base = (FLOOR_LABEL if r['baseline'] == 'random_init'
            else titles.get(r['baseline'],
                            aggregate.method_name(r['baseline'])))
    title = titles.get(r['method'], aggregate.method_name(r['method']))
    comparison = f'{title} − {base}' + _suffix(r, several)
    per_seed = ', '.join(f'seed {s}: {d:+.2f}'
                         for s, d in zip(r['seeds'], r['differences']))
    if r.get('unpaired'):
      per_seed += ('; without a pair: seed '
                   + ', '.join(str(s) for s in r['unpaired']))
    labels.append(_Row((dataset_name(r['dataset']), comparison,
                        names[r['metric']]), ()))
    body.append([
        _escape(per_seed, fmt), _value_text(r, 2, fmt),
        _EMPTY[fmt] if math.isnan(r['t']) else f'{r["t"]:.2f}',
        _EMPTY[fmt] if math.isnan(r['p']) else f'{r["p"]:.3f}',
        f'{r["wins"]}/{r["n"]}'])
  table = _render(spec, labels, fmt, body)
  return table.replace('−', '$-$') if fmt == 'latex' else table


def render_report(results: Sequence[dict[str, Any]],
                  fmt: str = 'markdown') -> str:
  """All results tables, each under a heading (a comment in LaTeX)."""
  parts = [
      ('Linear probe and kNN (%, complete test splits)',
       linear_table(results, fmt, metrics=('top1', 'top5', 'knn_top1'))),
      ('Linear probe by pretraining dataset and batch size',
       ablation_table(results, fmt)),
  ]
  unconverged = [
      f'{r.get("title") or aggregate.method_name(aggregate.run_id(r))} '
      f'seed {r.get("seed")} ({", ".join(where)})' for r in results
      if (where := aggregate.unconverged_probes(r))]
  if unconverged:
    parts.insert(0, ('Warning', ('% ' if fmt == 'latex' else '')
                     + 'Not at their optimum: the linear probes of '
                     + '; '.join(unconverged) + ' stopped at '
                     'eval.probe_steps (probe_fits in results.json); their '
                     "probe numbers are not the protocol's.\n"))
  embedding = '; '.join(EMBEDDING_NAMES.get(e, str(e)) for e in sorted(
      {(r.get('protocol') or {}).get('embedding', 'h') for r in results}))
  # The sections of evaluators that ran (eval.evaluators).
  if any('views' in r for r in results):
    parts.append((f'View quality (same encoder, two view generators; '
                  f'embedding {embedding})', augmentation_table(results, fmt)))
  if any('clusters' in r for r in results):
    parts.append((f'Cluster metrics of the test embeddings (K-means, K = '
                  f'classes; embedding {embedding})',
                  cluster_table(results, fmt)))
  paired = paired_table(results, fmt)
  if paired:
    parts.append(('Paired differences over seeds (percentage points; '
                  'Student\'s paired t-test, two-sided)', paired))
  if fmt == 'markdown':
    return '\n'.join(f'### {title}\n\n{table}' for title, table in parts)
  header = ('% Requires \\usepackage{booktabs,multirow,colortbl} and '
            '\\definecolor{oursrow}{...}.\n')
  return header + '\n'.join(f'% {title}\n{table}' for title, table in parts)
