"""Tests of the Markdown / LaTeX result tables."""

from otclr_jax import aggregate
from otclr_jax import tables
from tests.helpers import configured_results
from tests.helpers import paired_results
from tests.helpers import run_results


# Listed out of order on purpose: OTCLR before SimCLR.
RESULTS = [run_results('otclr', 0, 46.5, floor=10.0),
           run_results('simclr', 0, 40.0, 10.0),
           run_results('otclr', 1, 47.5, floor=12.0)]


def test_linear_table_markdown():
  expected = (
      '| Method | CIFAR-10 Top-1 | CIFAR-10 Top-5 | SVHN Top-1 | SVHN Top-5 |\n'
      '| :-- | --: | --: | --: | --: |\n'
      '| SimCLR | 40.00 | **90.00** | 30.00 | **80.00** |\n'
      '| OTCLR | **47.00 ± 0.71** (n=2) | **90.00 ± 0.00** (n=2) '
      '| **37.00 ± 0.71** (n=2) | **80.00 ± 0.00** (n=2) |\n'
      '| Random init | 11.00 ± 1.41 (n=2) | 50.00 ± 0.00 (n=2) | – | – |'
      '\n')
  assert tables.linear_table(RESULTS) == expected


def test_linear_table_latex():
  expected = '\n'.join([
      r'\begin{tabular}{lcccc}',
      r'\toprule',
      r'\multirow{2}{*}{\textbf{Method}} & '
      r'\multicolumn{2}{c}{\textbf{CIFAR-10}} & '
      r'\multicolumn{2}{c}{\textbf{SVHN}} \\',
      r'\cmidrule(lr){2-3} \cmidrule(lr){4-5}',
      r'& \textbf{Top-1} & \textbf{kNN} & \textbf{Top-1} & \textbf{kNN} \\',
      r'\midrule',
      r'SimCLR & 40.00 & \textbf{30.00} & 30.00 & -- \\',
      r'\rowcolor{oursrow}',
      r'OTCLR & \textbf{47.00 $\pm$ 0.71} (n=2) & '
      r'\textbf{30.00 $\pm$ 0.00} (n=2) & \textbf{37.00 $\pm$ 0.71} (n=2) & '
      r'-- \\',
      r'\midrule',
      r'Random init & 11.00 $\pm$ 1.41 (n=2) & -- & -- & -- \\',
      r'\bottomrule',
      r'\end{tabular}', ''])
  got = tables.linear_table(RESULTS, 'latex', metrics=('top1', 'knn_top1'))
  assert got == expected


def test_single_run_table_has_plain_values_and_no_bold():
  text = tables.linear_table(RESULTS[:1], include_random_init=False)
  assert text.splitlines()[2] == '| OTCLR | 46.50 | 90.00 | 36.50 | 80.00 |'
  assert len(text.splitlines()) == 3


def test_ablation_table_latex_multirow_and_cell_colour():
  runs = RESULTS + [run_results('simclr', 0, 30.0, 5.0, batch_size=512)]
  lines = tables.ablation_table(runs, 'latex', datasets=['cifar10'],
                                include_random_init=False).splitlines()
  assert lines[2] == (r'\multirow{2}{*}{\textbf{Pretraining Dataset}} & '
                      r'\multirow{2}{*}{\textbf{Batch Size}} & '
                      r'\multirow{2}{*}{\textbf{Method}} & '
                      r'\multicolumn{1}{c}{\textbf{CIFAR-10}} \\')
  assert lines[4] == r'& & & \textbf{Top-1 / Top-5} \\'
  assert lines[6:9] == [
      r'\multirow{3}{*}{CIFAR-10} & 512 & SimCLR & 30.00 / 90.00 \\',
      r' & \multirow{2}{*}{256} & SimCLR & 40.00 / \textbf{90.00} \\',
      r' &  & \cellcolor{oursrow}OTCLR & \cellcolor{oursrow}\textbf{47.00 '
      r'$\pm$ 0.71} / \textbf{90.00 $\pm$ 0.00} (n=2) \\']
  markdown = tables.ablation_table(runs, datasets=['cifar10'])
  floor = ('| CIFAR-10 | 256 | Random init | 11.00 ± 1.41 / 50.00 ± 0.00 '
           '(n=2) |')
  assert floor in markdown


def test_augmentation_table():
  text = tables.augmentation_table(RESULTS[1:2])
  header, _, simclr, otclr = text.splitlines()
  assert header.startswith(
      '| Encoder | Views | Silhouette ↑ | Compactness ↓ ')
  assert header.endswith('| Anchor Dist. ↓ | Pixel L2 ↓ | Pixel RMS ↓ |')
  # Same encoder, two generators: lower view distance wins; SimCLR's pixel
  # distances are 0 by construction, so neither pixel column is ranked.
  assert simclr == ('| SimCLR | SimCLR | **0.1000** | **0.0500** | **0.3000** '
                    '| **1.0000** | 0.5000 | **0.8000** | **0.6000** '
                    '| 0.0000 | – |')
  assert otclr.split(' | ')[6:] == ['**0.3000**', '**0.8000**', '**0.6000**',
                                    '0.1700', '– |']
  latex = tables.augmentation_table(RESULTS[1:2], 'latex')
  assert r'\textbf{View Dist. $\downarrow$}' in latex
  assert r'\multirow{2}{*}{SimCLR} & SimCLR & ' in latex


def test_cluster_table_and_report():
  text = tables.cluster_table(RESULTS)
  assert text.splitlines()[3] == (
      '| CIFAR-10 | OTCLR | **0.0200 ± 0.0000** (n=2) | **0.5000 ± 0.0000** '
      '(n=2) | **0.1000 ± 0.0000** (n=2) | **1.1000 ± 0.0000** (n=2) |')
  report = tables.render_report(RESULTS)
  # Four tables, then the paired differences (OTCLR has two seeds).
  assert report.count('### ') == 5
  # Results without protocol.embedding predate it: they used h.
  assert report.count('embedding h, l2-normalised backbone features') == 2
  with_z = [{**r, 'protocol': {'embedding': 'z'}} for r in RESULTS]
  assert tables.render_report(with_z).count(
      'embedding z, l2-normalised projection output') == 2
  assert tables.render_report(RESULTS, 'latex').count(r'\begin{tabular}') == 5
  # Only the sections of the evaluators that ran: no empty tables.
  probe_only = [{k: v for k, v in r.items() if k not in ('views', 'clusters')}
                for r in RESULTS]
  assert tables.render_report(probe_only).count('### ') == 3


def test_complexity_table():
  rows = [
      {'stage': 'Pretraining', 'method': 'moco', 'params_m': 23.01,
       'gflops': 0.154, 'step_ms': 21.5, 'throughput': 11908},
      {'stage': 'Pretraining', 'method': 'otclr', 'params_m': 23.01,
       'gflops': 0.154, 'step_ms': 30.87, 'throughput': 8292},
      {'stage': 'Linear Eval.', 'method': 'otclr', 'params_m': 11.18,
       'gflops': 0.074, 'step_ms': 6.0},
  ]
  lines = tables.complexity_table(rows, 'latex').splitlines()
  assert lines[4:9] == [
      r'\multirow{2}{*}{Pretraining} & moco & 23.01 & 0.154 & 21.50 & '
      r'11,908 \\',
      r' & \cellcolor{oursrow}OTCLR & \cellcolor{oursrow}23.01 & '
      r'\cellcolor{oursrow}0.154 & \cellcolor{oursrow}30.87 & '
      r'\cellcolor{oursrow}8,292 \\',
      r'\midrule',
      r'Linear Eval. & \cellcolor{oursrow}OTCLR & \cellcolor{oursrow}11.18 & '
      r'\cellcolor{oursrow}0.074 & \cellcolor{oursrow}6.00 & '
      r'\cellcolor{oursrow}-- \\',
      r'\bottomrule']


def test_names_are_escaped():
  run = run_results('simclr', 0, 40.0, 10.0)
  run['linear'] = {'folder:/data/my_pets': {'top1': 1.0, 'top5': 2.0}}
  assert r'\textbf{my\_pets}' in tables.linear_table([run], 'latex')
  assert '| my_pets Top-1 |' in tables.linear_table([run])


def test_linear_table_labels_stored_and_clean_batchnorm_rows():
  run = run_results('otclr', 0, 46.5, floor=10.0)
  run['linear_clean_bn'] = {'cifar10': {'top1': 48.0, 'top5': 91.0}}
  lines = tables.linear_table([run, run_results('simclr', 0, 40.0, 10.0)],
                              datasets=['cifar10']).splitlines()
  assert lines[2:] == [
      '| SimCLR | 40.00 | 90.00 |',
      '| OTCLR (BN: stored) | 46.50 | 90.00 |',
      '| OTCLR (BN: clean train) | **48.00** | **91.00** |',
      '| Random init | 10.00 | 50.00 |']
  # Without the measurement the labels stay plain.
  assert '(BN:' not in tables.linear_table(RESULTS)


def test_paired_table_is_in_the_report_with_several_seeds_only():
  runs = paired_results([46.0, 47.5], [45.0, 46.0], [40, 41])
  for fmt in tables.FORMATS:
    table = tables.paired_table(runs, fmt)
    assert 'seed 0: +1.00, seed 1: +1.50' in table and '2/2' in table
    assert 'Paired differences' in tables.render_report(runs, fmt)
  markdown = tables.paired_table(runs)
  assert ('| CIFAR-10 | OTCLR − SimCLR | Probe top-1 | seed 0: +1.00, seed 1: '
          '+1.50 |') in markdown
  # A seed only one side has is named, not dropped silently.
  runs = paired_results([46.0, 47.5, 49.0], [45.0, 46.0], [40, 41, 42])
  assert ('seed 0: +1.00, seed 1: +1.50; without a pair: seed 2 |'
          in tables.paired_table(runs))
  # Equal differences: no spread, so no t statistic and no p-value.
  assert ('| CIFAR-10 | OTCLR − SimCLR | Probe top-5 | seed 0: +0.00, seed 1: '
          '+0.00 | '
          '0.00 ± 0.00 | – | – | 0/2 |') in markdown
  single = paired_results([46.0], [45.0], [40])
  assert tables.paired_table(single) == ''
  assert 'Paired differences' not in tables.render_report(single)


# ----------------------------------------------------------------------------
# Runs share a row only when their stored configs agree on all but the seed.


def test_runs_of_other_settings_are_other_rows_labelled_by_what_differs():
  results = [configured_results('otclr', 0, 94.7, 30.0, **{'ot.epsilon': 0.05}),
             configured_results('otclr', 0, 97.5, 30.0, **{'ot.epsilon': 0.5})]
  groups = aggregate.aggregate(results)
  assert [g['n'] for g in groups] == [1, 1]
  table = tables.linear_table(results, metrics=('top1',))
  assert '(n=2)' not in table and '±' not in table
  assert 'ot.epsilon=0.05' in table and 'ot.epsilon=0.5' in table
  # The floors follow the rows: one per setting, never pooled across them.
  assert table.count(tables.FLOOR_LABEL) == 2
  # Seeds of one setting still share a row, and then no label is needed.
  seeds = [configured_results('otclr', s, 90.0 + s, 30.0) for s in (0, 1)]
  (group,) = aggregate.aggregate(seeds)
  assert group['n'] == 2
  assert 'ot.epsilon' not in tables.linear_table(seeds)




def test_a_probe_that_stopped_short_is_called_out_above_the_tables():
  result = run_results('otclr', 0, 90.0, 30.0)
  done = run_results('simclr', 0, 80.0, 30.0)
  result['linear']['cifar10']['converged'] = False
  done['linear']['cifar10']['converged'] = True
  for fmt in ('markdown', 'latex'):
    report = tables.render_report([result, done], fmt)
    assert (report.index('OTCLR seed 0 (linear/cifar10)')
            < report.index('Linear probe and kNN')), fmt
    assert 'SimCLR seed 0' not in report
  assert 'Not at their optimum' not in tables.render_report([done])


def test_the_floor_row_is_labelled_by_its_setting_not_a_methods_block():
  results = [configured_results('byol', 0, 40.0, 10.0),
             configured_results('moco', 0, 44.0, 10.0,
                                **{'moco.queue_size': 1024}),
             configured_results('moco', 0, 45.0, 10.0,
                                **{'moco.queue_size': 4096})]
  table = tables.linear_table(results, metrics=('top1',),
                              datasets=['cifar10'])
  assert '| Random init | 10.00 |' in table
  assert '| moco (moco.queue_size=4096) | **45.00** |' in table
