"""Smoke tests of `python -m otclr_jax.bench`: tiny sizes, no timings."""

import os
import re

from absl import app
from absl import flags
import jax
import numpy as np
import pytest

from otclr_jax.bench import __main__ as bench
from otclr_jax.bench import common
from otclr_jax.bench import ot_views
from otclr_jax import ot
from otclr_jax.evaluation.probe import linear_probe
from tests import helpers

TINY = ['ot', '--batch_sizes=2,3', '--repeats=1', '--image_size=8',
        '--grid_size=4', '--num_iters=3', '--min_time_s=0']


def _parse(argv):
  """The bench's flags parsed from `argv` (without the program name)."""
  argv = ['bench'] + list(argv)
  flag_values = flags.FlagValues()
  bench.define_flags(flag_values, argv)
  return flag_values(argv), flag_values


def _bench(argv):
  """`python -m otclr_jax.bench *argv`, in this process; its exit status."""
  return bench.main(['bench', *argv])

EXPECTED_ROWS = (
    '(a) ott dense Geometry lse + dense splat',
    '(b) POT loop + NumPy splat',
    '(c) otclr_jax ot.ot_views',
    '(d) measure (resize x, x_s)',
    '(d) Sinkhorn (T iters)',
    '(d) displacement splat',
    '(d) reconstruct (upsample, clip)',
    '(d) sum of stages',
    f'ot.ot_views core={common.other_core()}',
    'ratio (a)/(c)',
    'ratio (b)/(c)',
    f'ratio core={common.other_core()}/(c)',
    '(c) ms per 64 images',
)


def _cells(out, label):
  """The text after `label` on its (unique) table row."""
  lines = [line.strip() for line in out.splitlines()
           if line.strip().startswith(label)]
  assert len(lines) == 1, (label, out)
  return lines[0][len(label):]


def test_ot_bench_prints_every_row(capsys):
  assert _bench(TINY) == 0
  out = capsys.readouterr().out
  header = [line for line in out.splitlines()
            if 'B=2' in line and 'B=3' in line]
  assert len(header) == 1, out
  for label in EXPECTED_ROWS:
    cells = re.findall(r'(\d+\.\d+)x?(?: \((\d+\.\d+)\))?',
                       _cells(out, label))
    assert len(cells) == 2, (label, cells)
    assert all(float(median) > 0 for median, _ in cells)
  # Ratios only: the benchmark judges nothing against targets.
  assert not re.search(r'\b(MET|MISSED|met|target)\b', out), out
  # The numerical check ran for both batch sizes and found like with like.
  checks = re.findall(r'check B=\d+: .*', out)
  assert len(checks) == 2
  for line in checks:
    diffs = dict(re.findall(r'\b(a|b|core): ([\d.e+-]+)', line))
    assert set(diffs) == {'a', 'b', 'core'}, line
    assert all(float(d) < 1e-5 for d in diffs.values()), line
  assert 'MISMATCH' not in out


def test_ot_bench_without_pot_skips_row_b(monkeypatch, capsys):
  monkeypatch.setattr(ot_views, 'import_pot', lambda: None)
  assert _bench(['ot', '--batch_sizes=1'] + TINY[2:]) == 0
  out = capsys.readouterr().out
  assert 'POT is not installed' in out
  assert '(b) POT loop' not in out
  assert 'ratio (b)/(c)' not in out
  assert re.search(r'\d+\.\d+', _cells(out, '(c) otclr_jax ot.ot_views'))


def test_numpy_splat_tables_match_dense_displace():
  m, alpha = 5, 0.3
  rng = np.random.default_rng(0)
  plan = rng.random((m * m, m * m))
  index, weight = ot_views.numpy_splat_tables(m, alpha)
  got = np.bincount(index.ravel(), (weight * plan).ravel(), minlength=m * m)
  expected = jax.jit(ot.dense_displace)(plan.astype(np.float32), alpha)
  # float64 tables against dense_displace in float32: the plan's rounding
  # (1), each packet's weight (positions, their scaling by m - 1, the
  # fraction, the weights' product: 8, in grid units up to m - 1 = 4) and
  # product (1), and up to all 25 x 25 x 4 packets scattered into one
  # vertex (tests/test_ot.py's dense splat).
  np.testing.assert_allclose(got.reshape(m, m), expected,
                             rtol=helpers.rounding_tol(1 + 8 + 1 + 2500, k=4),
                             atol=0)
  # A packet's four weights: 1 - t and t per axis (2), their four products
  # (4) and sum (3), the fractions (3): float64, relative to 1.
  np.testing.assert_allclose(weight.sum(0), 1.0, rtol=0,
                             atol=helpers.rounding_tol(12, eps=helpers.EPS64))


@pytest.mark.parametrize('flag, value', [('--repeats', '0'),
                                         ('--min_time_s', '-1'),
                                         ('--grid_size', '9')])
def test_ot_bench_rejects_bad_flags(flag, value):
  with pytest.raises(ValueError, match=flag.lstrip('-')):
    _bench(TINY + [f'{flag}={value}'])


@pytest.mark.parametrize('argv', [[], ['trian'], ['train'],
                                  ['ot', 'train']])
def test_bench_needs_one_known_subcommand_and_a_config(argv):
  with pytest.raises(app.UsageError):
    _bench(argv)


@pytest.mark.slow
def test_train_bench_prints_complexity_table(tmp_path, capsys):
  code = _bench([
      'train', '--config=configs/digits.py', '--repeats=1',
      f'--config.data_dir={tmp_path}', '--config.image_size=8',
      '--config.batch_size=16',
      # The paper's 11.18M backbone has the imagenet stem (digits uses cifar).
      '--config.model.stem=imagenet', '--config.ot.grid_size=4',
      '--config.model.proj_hidden_dim=32',
      '--config.model.proj_dim=16'])
  assert code == 0
  out = capsys.readouterr().out
  assert re.search(r'\| Pretraining \| SimCLR \| 11\.\d\d \|', out)
  # The whole OTCLR step once per Sinkhorn core.
  for core in ot.CORES:
    assert re.search(rf'\| Pretraining \| OTCLR core={core} \| 11\.\d\d \|',
                     out)
    assert re.search(rf'OT views core={core} .*% of the OTCLR step', out)
    assert re.search(rf'  OTCLR core={core}: [\d.]+ GFLOP/s = [\d.]+ x peak',
                     out)
  assert re.search(r'float32 matmul peak \(2048\^2, same run\): [\d.]+ '
                   r'GFLOP/s', out)
  # Every method with both view generators; MoCo and BYOL count their
  # targets (two encoders): MoCo 22.39M, twice SimCLR's network with this
  # 32-16 head; BYOL 30.77M with its 4096-wide projector and predictor;
  # DINO its teacher (and its larger head).
  for title, params in (('MoCo', '22'), ('BYOL', '30'), ('DINO', '\\d+')):
    for label in (title, f'{title} \\+ OT views'):
      assert re.search(rf'\| Pretraining \| {label} \| {params}\.\d\d \|',
                       out), label
    assert re.search(rf'{title} \+ OT views / {title} step time: '
                     r'\d+\.\d{3}', out)
  for method in ('SimCLR', 'MoCo', 'BYOL', 'DINO'):
    assert re.search(rf'\| Linear eval\. \| {method} \| 11\.1\d \|', out)
  assert re.search(r'OTCLR / SimCLR step time: \d+\.\d{3}', out)
  assert re.search(r'OTCLR step core=\w+ / core=\w+: \d+\.\d{3}', out)
  assert re.search(r'Input pipeline \(digits\): [\d,]+ batches/s', out)
  # digits: monitor every 50 steps, on 1000 train / all 359 test images.
  assert re.search(r'kNN monitor \(1000 train / 359 test images of digits\): '
                   r'[\d.]+ ms per call; every 50 steps: [\d.]+ ms = '
                   r'[\d.]+% of 50 OTCLR steps', out)
  assert not re.search(r'\b(MET|MISSED|met|target)\b', out), out


TINY_TRAIN = ['train', '--config=configs/digits.py', '--repeats=1',
              '--config.image_size=8', '--config.batch_size=16',
              '--config.ot.grid_size=4', '--config.model.proj_hidden_dim=32',
              '--config.model.proj_dim=16']


@pytest.mark.slow
def test_train_bench_of_simclr_alone_breaks_its_steps_into_stages(tmp_path,
                                                                  capsys):
  assert _bench(TINY_TRAIN + [f'--config.data_dir={tmp_path}',
                              '--methods=simclr']) == 0
  out = capsys.readouterr().out
  assert 'MoCo' not in out and 'DINO' not in out
  for title in ('SimCLR', 'OTCLR'):
    match = re.search(
        rf'{title} step ([\d.]+) ms by stage: views ([\d.]+) ms \([\d.]+%\), '
        r'network forward \+ backward on 2 x 16 views ([\d.]+) ms '
        r'\([\d.]+%\), the rest \(loss, update, metrics\) (-?[\d.]+) ms',
        out)
    assert match, out
    step, views, network, rest = map(float, match.groups())
    assert step == pytest.approx(views + network + rest, abs=0.2)


def test_train_bench_refuses_an_unknown_method(tmp_path):
  with pytest.raises(ValueError, match=r"--methods: unknown \['mocco'\]"):
    _bench(TINY_TRAIN + [f'--config.data_dir={tmp_path}',
                         '--methods=simclr,mocco'])


def test_resnet_bench_times_every_conv_impl(capsys):
  code = _bench(['resnet', '--config=configs/cifar10.py', '--repeats=1',
                 '--config.batch_size=2', '--config.image_size=8',
                 '--per_layer'])
  assert code == 0
  out = capsys.readouterr().out
  for impl in ('xla', 'matmul', 'auto'):
    assert re.search(rf'conv_impl={impl}: [\d.]+ ms \([\d.]+\), [\d.]+ '
                     r'GFLOP/s = [\d.]+ x peak, [\d.]+ x xla', out), impl
  # The 11 distinct convolutions of ResNet-18 with the imagenet stem: 20 in
  # all (the stem, 16 3x3 and 3 1x1 shortcuts).
  counts = re.findall(r'^\| \[2, [\d, ]+\] \| \[[\d, ]+\] \| [12] \| (\d+) '
                      r'\|.* \| (?:xla|matmul) \|$', out, re.M)
  assert len(counts) == 11, out
  assert sum(map(int, counts)) == 20, out


def test_config_overrides_reach_the_locked_config():
  _, flag_values = _parse(['train', '--config=configs/cifar10.py',
                           '--config.batch_size=512',
                           '--config.ot.epsilon=0.1',
                           '--config.dtype=bfloat16',
                           '--config.ot.learn_alpha=true',
                           '--config.model.conv_impl=matmul'])
  config = flag_values.config
  assert config.batch_size == 512
  assert config.ot.epsilon == 0.1
  assert config.dtype == 'bfloat16'
  assert config.ot.learn_alpha is True
  assert config.model.conv_impl == 'matmul'


def test_train_bench_refuses_typos():
  # config_flags on the locked config: an unknown field, with a suggestion.
  with pytest.raises(AttributeError, match='Did you mean "epsilon"'):
    _parse(['train', '--config=configs/digits.py', '--config.ot.epsilonn=0.1'])


def test_probe_bench_fits_an_evaluations_feature_cache(evaluated_run,
                                                       monkeypatch, capsys):
  _, workdir = evaluated_run
  monkeypatch.setenv('HOME', os.path.dirname(workdir))  # ~ expands
  assert _bench(['probe', f'--workdir=~/{os.path.basename(workdir)}',
                 '--tag=step4', '--repeats=1']) == 0
  out = capsys.readouterr().out
  # The same probe on the same arrays, read without the bench.
  prefix = f'{workdir}/eval/features/step4/digits'
  split = {s: np.load(f'{prefix}_{s}.npz') for s in ('train', 'test')}
  row = linear_probe(split['train']['features'], split['train']['labels'],
                     split['test']['features'], split['test']['labels'], 10)
  assert f"top-1 {row['top1']:.2f}%, top-5 {row['top5']:.2f}%" in out, out
  fits = re.findall(r'^\| (held-out selection|refit \(all train\)) \| '
                    r'[\d.e-]+ \| (?:[\d.]+|-) \| \d+ \| [\d.e+-]+ \| True \|$',
                    out, re.M)
  assert fits == ['held-out selection'] * 5 + ['refit (all train)'], out


def test_probe_bench_runs_the_jax_solver_to_the_same_probe(evaluated_run,
                                                           capsys):
  _, workdir = evaluated_run
  outs = []
  for backend in ('numpy', 'jax'):
    assert _bench(['probe', f'--workdir={workdir}', '--tag=step4',
                   '--repeats=1', f'--backend={backend}']) == 0
    outs.append(capsys.readouterr().out)
    assert f'backend {backend},' in outs[-1], outs[-1]
  # Both solvers reach the same optimum: the same lambda, top-1 and top-5.
  numpy_top1, jax_top1 = (re.search(r'^top-1 .*lambda \S+', out, re.M)[0]
                          for out in outs)
  assert numpy_top1 == jax_top1, outs


def test_probe_bench_names_a_missing_or_foreign_cache(evaluated_run,
                                                      tmp_path):
  with pytest.raises(app.UsageError, match='--workdir'):
    _bench(['probe', '--tag=init'])
  _, evaluated = evaluated_run
  workdir = helpers.copy_run(evaluated, tmp_path)
  missing = os.path.join(workdir, 'eval', 'features', 'step2', 'digits_train')
  with pytest.raises(FileNotFoundError, match=f'digits/train .* {missing}'):
    _bench(['probe', f'--workdir={workdir}', '--tag=step2'])
  test_file = os.path.join(workdir, 'eval', 'features', 'init',
                           'digits_test.npz')
  for damage in (b'not an archive', None):
    if damage is None:  # an archive without the cache's fields
      np.savez(test_file, labels=np.zeros(3))
    else:
      with open(test_file, 'wb') as f:
        f.write(damage)
    with pytest.raises(FileNotFoundError, match='digits/test'):
      _bench(['probe', f'--workdir={workdir}', '--tag=init'])


def _views_row(out):
  """The numbers of the views bench's Markdown row."""
  row = [line for line in out.splitlines()
         if line.startswith('| ') and 'HF power' not in line]
  assert len(row) == 1, out
  return [float(c.strip().rstrip('%'))
          for c in row[0].strip('|').split('|')[1:]]


def test_views_bench_prints_the_pairs_statistics(data_dir, capsys):
  # `tiny_config`'s network: its init and, on 64 images (the evaluation's
  # batch), its encoder are the programs training and evaluation compile.
  tiny = ['views', '--config=configs/digits.py', '--dataset=digits',
          '--num_images=64', f'--config.data_dir={data_dir}',
          '--config.model.stem=imagenet', '--config.ot.grid_size=4',
          '--config.model.stage_sizes=(1, 1, 1, 1)',
          '--config.model.proj_hidden_dim=32', '--config.model.proj_dim=16']
  assert _bench(tiny) == 0
  out = capsys.readouterr().out
  assert 'OT views (source=image, detail=none, colour=before' in out
  (high_freq, pair, ring, ring_strong, *retrieval) = _views_row(out)
  # The paper's views share their source and are blurred.
  assert 0 < high_freq < 1 and 0 < pair < 1
  assert ring > 0 and ring_strong > 0
  assert all(0 <= r <= 100 for r in retrieval)
  # SimCLR's views are the strong views: every ratio is 1.
  assert _bench(tiny + ['--config.method=simclr']) == 0
  out = capsys.readouterr().out
  assert 'simclr with strong augmentations' in out
  high_freq, pair, ring, ring_strong, enc, enc_s, pix, pix_s = _views_row(out)
  assert (high_freq, pair, ring, enc, pix) == (1.0, 1.0, ring_strong, enc_s,
                                               pix_s)


def test_views_bench_refuses_an_unknown_option(data_dir):
  with pytest.raises(ValueError, match=r"config\.ot\.source must be one of"):
    _bench(['views', '--config=configs/digits.py', '--dataset=digits',
            f'--config.data_dir={data_dir}', '--config.ot.source=x'])
