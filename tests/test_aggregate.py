"""Tests of the grouping of runs into rows: statistics over seeds, paired
differences (otclr_jax/aggregate.py)."""

import numpy as np
import pytest

from otclr_jax import aggregate
from tests.helpers import EPS64
from tests.helpers import configured_results
from tests.helpers import mean_std_rtol
from tests.helpers import paired_results
from tests.helpers import rounding_tol
from tests.helpers import run_results

# Listed out of order on purpose: OTCLR before SimCLR.
RESULTS = [run_results('otclr', 0, 46.5, floor=10.0),
           run_results('simclr', 0, 40.0, 10.0),
           run_results('otclr', 1, 47.5, floor=12.0)]


class TestAggregate:
  """Rows of runs, statistics over seeds, paired differences."""

  def test_aggregate_matches_numpy(self):
    rng = np.random.default_rng(0)
    values = rng.uniform(20, 60, size=3)
    runs = [run_results('otclr', s, float(v), floor=1.0)
            for s, v in enumerate(values)]
    runs[2]['linear']['cifar10']['top5'] = None  # a missing value
    (group,) = aggregate.aggregate(runs)
    top1 = group['linear']['cifar10']['top1']
    rtol_mean, rtol_std = mean_std_rtol(values)
    np.testing.assert_allclose(top1['mean'], np.mean(values), rtol=rtol_mean)
    np.testing.assert_allclose(top1['std'], np.std(values, ddof=1),
                               rtol=rtol_std)
    assert top1['n'] == 3
    assert group['linear']['cifar10']['top5'] == {'mean': 90.0, 'std': 0.0,
                                                  'n': 2}
    assert (group['n'], group['seeds'], group['steps']) == (3, [0, 1, 2],
                                                            [100] * 3)
    # The mean of three equal values.
    assert group['views']['otclr']['pixel_l2']['mean'] == pytest.approx(
        0.17, rel=rounding_tol(3, stages=1, eps=EPS64))

  def test_aggregate_groups_and_orders(self):
    runs = RESULTS + [run_results('simclr', 0, 30.0, 5.0, batch_size=512),
                      run_results('otclr', 0, 30.0, 5.0,
                                  pretrain='imagenet300')]
    keys = [(g['pretrain_dataset'], g['batch_size'], g['method'], g['n'])
            for g in aggregate.aggregate(runs)]
    assert keys == [('cifar10', 512, 'simclr', 1),
                    ('cifar10', 256, 'simclr', 1),
                    ('cifar10', 256, 'otclr', 2),
                    ('imagenet300', 256, 'otclr', 1)]
    single = aggregate.aggregate(RESULTS[1:2])[0]['linear']['cifar10']['top1']
    assert single == {'mean': 40.0, 'std': None, 'n': 1}
    with pytest.raises(ValueError, match='lacks'):
      aggregate.aggregate([{'method': 'otclr'}])

  def test_paired_differences_match_the_t_test_by_hand(self):
    otclr, simclr, floors = [46.0, 47.5, 45.0], [45.0, 46.0, 45.5], [40, 41, 39]
    rows = aggregate.paired_differences(paired_results(otclr, simclr, floors))
    row = next(r for r in rows if (r['method'], r['baseline'], r['dataset'],
                                   r['metric']) == ('otclr', 'simclr',
                                                    'cifar10', 'top1'))
    diffs = np.subtract(otclr, simclr)
    # Differences of halves: exact.
    np.testing.assert_array_equal(row['differences'], diffs)
    t = diffs.mean() / (diffs.std(ddof=1) / np.sqrt(3))
    # float64: the mean's and deviation's errors, sqrt(3) and two divisions.
    rtol_mean, rtol_std = mean_std_rtol(diffs)
    rtol_t = rtol_mean + rtol_std + rounding_tol(stages=3, eps=EPS64)
    np.testing.assert_allclose(row['t'], t, rtol=rtol_t)
    # Student's t with 2 degrees of freedom: P(|T| > t) = 1 - t / sqrt(t^2 + 2).
    # t's error moves p by |dp/dt| t / p = 2 t / ((t^2 + 2)^1.5 p) relative;
    # the closed form and scipy's survival function (a special function)
    # round relative to 1, which 1 - ... cancels down to p (k = 1 / p).
    p = 1 - t / np.sqrt(t**2 + 2)
    rtol_p = (2 * t / ((t**2 + 2) ** 1.5 * p) * rtol_t
              + rounding_tol(stages=3, funcs=1, k=1 / p, eps=EPS64))
    np.testing.assert_allclose(row['p'], p, rtol=rtol_p)
    assert (row['seeds'], row['wins'], row['n']) == ([0, 1, 2], 2, 3)
    floor = next(r for r in rows if (r['method'], r['baseline'], r['metric'])
                 == ('simclr', 'random_init', 'top1'))
    # Halves minus integers: exact.
    np.testing.assert_array_equal(floor['differences'],
                                  np.subtract(simclr, floors))
    # Only seeds both sides have are paired; one common seed is no comparison.
    rows = aggregate.paired_differences(
        paired_results(otclr, simclr[:1], floors))
    assert not [r for r in rows if r['baseline'] == 'simclr']

  def test_only_fields_that_change_a_result_split_rows(self):
    results = [configured_results('otclr', 0, 94.7, 30.0, log_every_steps=5),
               configured_results('otclr', 1, 97.5, 30.0,
                                  **{'eval.probe_steps': 9})]
    (group,) = aggregate.aggregate(results)
    assert group['n'] == 2

  def test_other_evaluation_settings_or_probe_protocols_are_other_rows(self):
    # The cluster metrics of z and of h, or probes solved two ways, are not
    # seeds of one number.
    results = [configured_results('otclr', 0, 94.7, 30.0),
               configured_results('otclr', 1, 97.5, 30.0,
                                  **{'eval.embedding': 'h'})]
    rows = aggregate.aggregate(results)
    assert [(r['n'], r['label']) for r in rows] == [
        (1, 'eval.embedding=h'), (1, 'eval.embedding=z')]
    solved = configured_results('otclr', 1, 97.5, 30.0)
    results = [configured_results('otclr', 0, 94.7, 30.0), solved]
    for result, probe in zip(results, ('L-BFGS', 'Newton')):
      result['protocol'] = {'probe': probe}
    rows = aggregate.aggregate(results)
    assert sorted(r['label'] for r in rows) == ['protocol.probe=L-BFGS',
                                                'protocol.probe=Newton']
    # kNN with another k is another instrument too (its rows had been mixed).
    for result, k in zip(results, (200, 20)):
      result['protocol'] = {'knn_k': k}
    assert sorted(r['label'] for r in aggregate.aggregate(results)) == [
        'protocol.knn_k=20', 'protocol.knn_k=200']
    # A run scored by kNN alone beside one scored by both: the label says so
    # in words, not as the probe's protocol fields.
    results[0]['protocol'] = {'knn_k': 200, **{
        f: 0 for f in ('probe', 'probe_tolerance', 'l2_grid', 'holdout_seed')}}
    results[1]['protocol'] = {'knn_k': 200}
    assert sorted(r['label'] for r in aggregate.aggregate(results)) == [
        'evaluators: kNN', 'evaluators: probe, kNN']

  def test_a_field_one_config_lacks_labels_both_rows(self):
    results = [configured_results('otclr', 0, 94.7, 30.0),
               configured_results('otclr', 0, 70.0, 30.0)]
    del results[1]['config']['ot']['beta']
    rows = aggregate.aggregate(results)
    assert sorted(r['label'] for r in rows) == ['ot.beta=(absent)',
                                                'ot.beta=0.0']

  def test_other_methods_blocks_do_not_label_a_row(self):
    # A method reads its own block only: BYOL's fields are no difference of a
    # DINO row, present or not.
    results = [configured_results('byol', 0, 94.7, 30.0),
               configured_results('dino', 0, 70.0, 30.0)]
    assert [r['label'] for r in aggregate.aggregate(results)] == ['', '']

  def test_equal_gains_in_test_images_have_no_t_statistic(self):
    # +1 of 360 test images on every seed: the differences are equal in exact
    # arithmetic (5/18) but not in float64, where scipy's ttest_rel gives
    # t ~ 6e13.
    acc = lambda count: 100.0 * float(np.mean(np.arange(360) < count))
    results = []
    for seed, count in enumerate((344, 339, 349)):
      results += [run_results('otclr', seed, acc(count + 1), 10.0),
                  run_results('simclr', seed, acc(count), 10.0)]
    row, = [r for r in aggregate.paired_differences(results)
            if (r['baseline'], r['metric'], r['dataset'])
            == ('simclr', 'top1', 'cifar10')]
    assert np.isnan(row['t']) and np.isnan(row['p'])
    assert row['mean'] == pytest.approx(100 / 360)

  def test_a_seed_evaluated_twice_counts_once(self):
    results = [configured_results('otclr', seed, top1, 10.0,
                                  **{'eval.probe_steps': steps})
               for seed, top1 in ((0, 46.0), (1, 48.0))
               for steps in (500, 1000)]
    group, = aggregate.aggregate(results)
    assert (group['n'], group['seeds']) == (2, [0, 1])
    top1 = group['linear']['cifar10']['top1']
    assert top1['n'] == 2
    np.testing.assert_allclose([top1['mean'], top1['std']],
                               [47.0, np.std([46.0, 48.0], ddof=1)], rtol=1e-12)

  def test_the_floor_takes_each_seeds_datasets_from_all_its_runs(self):
    cifar_only = run_results('simclr', 0, 40.0, 10.0)
    with_svhn = [run_results('otclr', seed, 46.0, 10.0) for seed in (0, 1)]
    for result, value in zip(with_svhn, (20.0, 22.0)):
      result['random_init']['svhn_cropped'] = {'top1': value, 'top5': 60.0}
    for order in ([cifar_only, *with_svhn], [*with_svhn, cifar_only]):
      floor, = aggregate.floors(order).values()
      svhn = floor['svhn_cropped']['top1']
      assert svhn['n'] == 2
      np.testing.assert_allclose([svhn['mean'], svhn['std']],
                                 [21.0, np.std([20.0, 22.0], ddof=1)])

  def test_rows_keep_their_setting_together_in_method_order(self):
    # MoCo's own block must not split the rows of one setting.
    results = [configured_results(method, 0, 40.0, floor,
                                  **{'ot.epsilon': epsilon})
               for method in ('moco', 'simclr')
               for epsilon, floor in ((0.05, 10.0), (0.5, 20.0))]
    order = [(g['settings']['ot.epsilon'], g['method'])
             for g in aggregate.aggregate(results)]
    assert order == [(0.05, 'simclr'), (0.05, 'moco'), (0.5, 'simclr'),
                     (0.5, 'moco')]
    single = aggregate.aggregate([configured_results(m, 0, 40.0, 10.0) for m in
                                  ('dino', 'byol', 'moco', 'otclr', 'simclr')])
    assert [g['method'] for g in single] == ['simclr', 'otclr', 'moco', 'byol',
                                             'dino']

  def test_results_without_view_generator_take_the_views_of_their_config(self):
    augment = configured_results('moco', 0, 40.0, 10.0)
    ot_views = configured_results('moco', 1, 50.0, 10.0, views='ot')
    assert 'view_generator' not in ot_views
    rows = [(g['method'], g['n']) for g in aggregate.aggregate([augment,
                                                                ot_views])]
    assert rows == [('moco', 1), ('moco+ot', 1)]
