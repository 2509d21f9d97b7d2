"""A sweep's summary (launch/summary.py through `--aggregate_only`): means
and spreads over seeds, one row per setting, every run not averaged listed."""

import json
import os

import numpy as np
import pytest

from launch import sweep as sweep_lib
from tests import helpers


def test_aggregation_gives_mean_and_std_over_seeds(tmp_path, capsys):
  top1 = {('otclr', 256): [50.0, 52.0, 57.0], ('simclr', 256): [40.0, 44.0],
          ('otclr', 512): [61.5]}
  for (method, batch), values in top1.items():
    for seed, value in enumerate(values):
      name = f'method={method},batch_size={batch},seed={seed}'
      fake = {'step': 10, 'method': method, 'seed': seed, 'batch_size': batch,
              'pretrain_dataset': 'cifar10',
              'config': helpers.stored_config(method, seed, batch, 'cifar10'),
              'linear': {'cifar10': {'top1': value, 'top5': 90.0 + seed}},
              'random_init': {'cifar10': {'top1': 20.0 + seed,
                                          'top5': 50.0}}}
      os.makedirs(tmp_path / name / 'eval')
      (tmp_path / name / 'eval' / 'results.json').write_text(json.dumps(fake))
      (tmp_path / name / 'status.json').write_text(json.dumps(
          {'state': 'finished', 'step': 10, 'total_steps': 10}))
  # Not a run: no eval/results.json.
  os.makedirs(tmp_path / 'slurm')
  assert helpers.aggregate_only(tmp_path) == 0

  rows = json.load(open(tmp_path / 'summary.json'))['rows']
  by_key = {(r['method'], r['batch_size']): r for r in rows}
  assert set(by_key) == set(top1)
  for key, values in top1.items():
    got = by_key[key]['linear']['cifar10']['top1']
    assert got['n'] == len(values)
    rtol_mean, rtol_std = helpers.mean_std_rtol(values)
    np.testing.assert_allclose(got['mean'], np.mean(values), rtol=rtol_mean)
    if len(values) > 1:
      np.testing.assert_allclose(got['std'], np.std(values, ddof=1),
                                 rtol=rtol_std)
  markdown = open(tmp_path / 'summary.md').read()
  assert '53.00 ± 3.61' in markdown
  assert '42.00 ± 2.83 (n=2)' in markdown
  assert r'\pm' in open(tmp_path / 'summary.tex').read()
  assert markdown in capsys.readouterr().out


def test_aggregation_of_an_empty_sweep_writes_nothing(tmp_path):
  assert helpers.aggregate_only(tmp_path) == 0
  assert os.listdir(tmp_path) == []


FINISHED = {'state': 'finished', 'step': 100, 'total_steps': 100}


def _results_run(root, name, top1, status=FINISHED, config=True,
                 converged=True):
  os.makedirs(root / name / 'eval')
  results = {
      'step': status['step'], 'method': 'otclr', 'seed': 0, 'batch_size': 16,
      'pretrain_dataset': 'digits',
      'linear': {'digits': {'top1': top1, 'top5': 99.0,
                            'converged': converged}}}
  if config:
    results['config'] = helpers.stored_config('otclr', 0, 16, 'digits')
  (root / name / 'eval' / 'results.json').write_text(json.dumps(results))
  (root / name / 'status.json').write_text(json.dumps(status))


def test_diverged_and_unfinished_runs_are_never_averaged(tmp_path, capsys):
  _results_run(tmp_path, 'digits_otclr_b16_s0', 84.7)
  _results_run(tmp_path, 'digits_otclr_b16_s1', 10.0,
               {'state': 'diverged', 'step': 6, 'total_steps': 100})
  _results_run(tmp_path, 'digits_otclr_b16_s2', 30.0,
               {'state': 'stopped', 'step': 50, 'total_steps': 100})
  assert helpers.aggregate_only(tmp_path) == 0
  (row,) = json.load(open(tmp_path / 'summary.json'))['rows']
  assert row['linear']['digits']['top1']['n'] == 1
  assert row['linear']['digits']['top1']['mean'] == 84.7
  markdown = open(tmp_path / 'summary.md').read()
  assert '## Not averaged' in markdown
  assert 'digits_otclr_b16_s1`: training diverged at step 6 of 100' in markdown
  assert 'digits_otclr_b16_s2`: training stopped at step 50 of 100' in markdown
  assert '47.35' not in markdown and '±' not in markdown.split('## Not')[0]
  assert 'Not averaged' in open(tmp_path / 'summary.tex').read()


def test_only_the_sweeps_own_runs_are_averaged(tmp_path):
  for name, top1 in (('seed=0,method=otclr', 84.7), ('old_name_s0', 10.0)):
    _results_run(tmp_path, name, top1)
  (tmp_path / 'runs.json').write_text(json.dumps(
      {'runs': [{'name': 'seed=0,method=otclr'}]}))
  assert helpers.aggregate_only(tmp_path) == 0
  (row,) = json.load(open(tmp_path / 'summary.json'))['rows']
  assert row['linear']['digits']['top1']['n'] == 1
  assert row['linear']['digits']['top1']['mean'] == 84.7
  assert 'old_name_s0`: not a run of this sweep' in open(
      tmp_path / 'summary.md').read()


def test_results_that_cannot_be_told_apart_or_did_not_converge_are_listed(
    tmp_path):
  _results_run(tmp_path, 's0', 84.7)
  # Without a stored config its row is unknown (it might be any setting).
  _results_run(tmp_path, 's1', 10.0, config=False)
  # A probe stopped by eval.probe_steps is not the protocol's number.
  _results_run(tmp_path, 's2', 30.0, converged=False)
  assert helpers.aggregate_only(tmp_path) == 0
  summary = json.load(open(tmp_path / 'summary.json'))
  (row,) = summary['rows']
  assert row['linear']['digits']['top1'] == {'mean': 84.7, 'std': None,
                                             'n': 1}
  why = {e['run']: e['why'] for e in summary['not_averaged']}
  assert set(why) == {'s1', 's2'}
  assert 'records the config' in why['s1']
  assert 'did not reach its optimum (linear/digits' in why['s2']


@pytest.mark.parametrize('field, value, named', [
    ('batch_size', 'big', "batch_size='big'"),
    ('seed', float('nan'), 'seed=nan'),
    ('linear', [1, 2], 'linear is not'),
    ('linear', {'digits': {'top1': '84.7'}}, "linear.digits.top1='84.7'"),
    (None, None, ''),  # torn: its first 40 characters
])
def test_a_broken_results_file_is_named_and_left_out(tmp_path, capsys, field,
                                                     value, named):
  _results_run(tmp_path, 's0', 84.7)
  _results_run(tmp_path, 's1', 80.0)
  path = tmp_path / 's1' / 'eval' / 'results.json'
  if field is None:
    path.write_text(path.read_text()[:40])
  else:
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                field: value}))
  assert helpers.aggregate_only(tmp_path) == 1
  err = capsys.readouterr().err
  assert str(path) in err and named in err, err
  if field is not None:
    assert f'{path} not the results of an evaluation' in err
  (row,) = json.load(open(tmp_path / 'summary.json'))['rows']
  assert row['linear']['digits']['top1']['n'] == 1
  assert row['linear']['digits']['top1']['mean'] == 84.7
  assert str(path) in open(tmp_path / 'summary.md').read()


@pytest.mark.parametrize('in_results', [True, False])
def test_results_of_an_earlier_run_in_the_directory_are_not_averaged(
    tmp_path, in_results):
  # The directory was trained afresh with seed 1; eval/ is still seed 0's,
  # whose config is in results.json or only in eval/config.json.
  _results_run(tmp_path, 's0', 84.7)
  _results_run(tmp_path, 's1', 80.0, config=in_results)
  (tmp_path / 's1' / 'eval' / 'config.json').write_text(json.dumps(
      helpers.stored_config('otclr', 0, 16, 'digits')))
  (tmp_path / 's1' / 'config.json').write_text(json.dumps(
      helpers.stored_config('otclr', 1, 16, 'digits')))
  assert helpers.aggregate_only(tmp_path) == 0
  summary = json.load(open(tmp_path / 'summary.json'))
  (excluded,) = summary['not_averaged']
  assert excluded['run'] == 's1'
  assert 'belong to another run' in excluded['why']
  assert 'seed: 0 -> 1' in excluded['why']


def test_a_sweep_over_a_setting_tabulates_one_row_per_value(tmp_path):
  # The example of launch/sweep.py's docstring: seeds x ot.epsilon. Results
  # written before they carried their config are identified by
  # eval/config.json.
  path = helpers.write_sweep(tmp_path / 's.py', {'ot.epsilon': [0.05, 0.5]})
  sweep = sweep_lib.load_sweep(path)
  workdir = tmp_path / 'out'
  for run, top1 in zip(sweep.runs(str(workdir)), (94.7, 97.5)):
    config = sweep.run_config(run)
    _results_run(workdir, run.name, top1, {'state': 'finished', 'step': 2,
                                           'total_steps': 2}, config=False)
    (workdir / run.name / 'eval' / 'config.json').write_text(
        json.dumps({**config.to_dict(), 'mode': 'eval'}))
  assert helpers.aggregate_only(workdir) == 0
  rows = json.load(open(workdir / 'summary.json'))['rows']
  assert [r['n'] for r in rows] == [1, 1]
  assert [r['label'] for r in rows] == ['ot.epsilon=0.05', 'ot.epsilon=0.5']
  markdown = open(workdir / 'summary.md').read()
  assert '(n=2)' not in markdown and 'ot.epsilon=0.5' in markdown


def test_every_run_of_the_sweep_that_is_not_averaged_is_listed(tmp_path):
  names = ['seed=0', 'seed=1', 'seed=2', 'seed=3']
  (tmp_path / 'runs.json').write_text(json.dumps(
      {'runs': [{'name': n} for n in names]}))
  _results_run(tmp_path, names[0], 84.7)
  # Diverged before any evaluation; failed at start; never started.
  os.makedirs(tmp_path / names[1])
  (tmp_path / names[1] / 'status.json').write_text(json.dumps(
      {'state': 'diverged', 'step': 6, 'total_steps': 100}))
  os.makedirs(tmp_path / names[2])
  (tmp_path / names[2] / 'status.json').write_text(json.dumps(
      {'state': 'failed', 'step': 0, 'total_steps': 100}))
  assert helpers.aggregate_only(tmp_path) == 0
  summary = json.load(open(tmp_path / 'summary.json'))
  assert [r['n'] for r in summary['rows']] == [1]
  why = {e['run']: e['why'] for e in summary['not_averaged']}
  assert set(why) == set(names[1:])
  assert 'diverged at step 6 of 100' in why[names[1]]
  assert 'failed at step 0 of 100' in why[names[2]]
  assert 'not started' in why[names[3]]
  for ext in ('md', 'tex'):
    text = open(tmp_path / f'summary.{ext}').read()
    assert all(n in text for n in names[1:]), ext


def test_aggregate_only_on_one_run_says_it_is_one(tmp_path, capsys):
  # It had said only "nothing to tabulate", as for an empty directory.
  helpers.fake_results(str(tmp_path), 4)
  assert helpers.aggregate_only(tmp_path) == 0
  assert f'{tmp_path} is itself a run' in capsys.readouterr().out


def test_a_seed_counted_twice_in_a_row_is_listed_not_dropped(tmp_path,
                                                             capsys):
  # Two finished runs of one seed, evaluated on other eval.datasets: one row
  # counts the seed once; the other run is listed with its reason.
  for name, top1, datasets in (('b', 80.0, ['digits']),
                               ('a', 70.0, ['digits', 'cifar10'])):
    _results_run(tmp_path, name, top1)
    path = tmp_path / name / 'eval' / 'results.json'
    results = json.loads(path.read_text())
    results['config']['eval']['datasets'] = datasets
    path.write_text(json.dumps(results))
  assert helpers.aggregate_only(tmp_path) == 0
  summary = json.load(open(tmp_path / 'summary.json'))
  assert [r['n'] for r in summary['rows']] == [1]
  (listed,) = summary['not_averaged']
  assert listed['run'] == 'b'
  assert 'seed 0 of its row is counted from a' in listed['why']
  assert '1 finished runs tabulated (1 not averaged)' in capsys.readouterr(
  ).out
