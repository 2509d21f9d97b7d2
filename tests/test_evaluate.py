"""Tests of `evaluation.evaluate` on a tiny run: restore, cache, results."""

import functools
import json
import os
import pathlib
import shutil
import types

import flax.linen as nn
import jax
import numpy as np
import pytest

from otclr_jax import checkpoint
from otclr_jax import cli
from otclr_jax import experiment
from otclr_jax import main
from otclr_jax.evaluation import clusters
from otclr_jax.evaluation import evaluate
from otclr_jax.evaluation import features
from otclr_jax.evaluation import monitor
from otclr_jax.evaluation import view_quality
from otclr_jax import models
from otclr_jax import rundir
from otclr_jax import train
from tests import helpers
from tests.folder_trees import save_image


def _evaluate(config, workdir, step=None):
  return evaluate.evaluate_run(config, workdir, step).results


# ----------------------------------------------------------------------------
# End to end.


def test_dataset_keys_are_file_names():
  key = features.dataset_key('folder:/data/my pets:v2/')
  assert key.startswith('folder-my_pets_v2-') and '/' not in key
  assert key != features.dataset_key('folder:/other/my pets:v2')
  assert features.dataset_key('cifar10') == 'cifar10'
  with pytest.raises(ValueError, match='unknown evaluation dataset'):
    features.dataset_key('mnist')


def test_evaluate_end_to_end(evaluated_run, tmp_path, monkeypatch, capsys):
  config, evaluated = evaluated_run
  empty = str(tmp_path / 'empty')
  with pytest.raises(FileNotFoundError, match='pretrain first'):
    _evaluate(config, empty)
  assert not os.path.exists(os.path.join(empty, 'checkpoints'))
  os.makedirs(os.path.join(empty, 'checkpoints'))
  with pytest.raises(FileNotFoundError, match='No complete checkpoint'):
    _evaluate(config, empty)
  workdir = helpers.copy_run(evaluated, tmp_path)
  with pytest.raises(ValueError, match=r'available steps: \[2, 4\]'):
    _evaluate(config, workdir, step=3)
  first = rundir.read_results(workdir)  # the fixture's evaluation

  def fail(*args, **kwargs):
    raise AssertionError('features were recomputed instead of read')

  helpers.small_digits(monkeypatch)
  monkeypatch.setattr(features, 'extract_features', fail)
  results = _evaluate(config, workdir)
  for section in ('linear', 'random_init', 'clusters', 'views',
                  'linear_clean_bn'):
    assert results[section] == first[section]
  with open(os.path.join(workdir, 'eval', 'results.json')) as f:
    assert json.load(f) == results
  assert os.path.exists(os.path.join(workdir, 'eval', 'results_step4.json'))
  for name in ('tables.md', 'tables.tex'):
    assert os.path.getsize(os.path.join(workdir, 'eval', name)) > 0
  assert results['step'] == 4
  assert results['checkpoint'].endswith(os.path.join('checkpoints', '4'))
  assert (results['method'], results['seed'], results['batch_size'],
          results['pretrain_dataset'], results['image_size']) == (
              'otclr', 0, 16, 'digits', 8)
  for section in ('linear', 'random_init', 'linear_clean_bn'):
    row = results[section]['digits']
    assert set(row) >= {'top1', 'top5', 'knn_top1', 'weight_decay',
                        'num_train', 'num_test'}
    for key in ('top1', 'top5', 'knn_top1'):
      assert 0.0 <= row[key] <= 100.0
    assert row['top5'] >= row['top1']
    assert (row['num_train'], row['num_test']) == tuple(
        10 * n for n in helpers.SMALL_DIGITS)
    # Fewer train images than the protocol's k = 200: all of them vote.
    assert row['knn_k'] == 10 * helpers.SMALL_DIGITS[0]
  assert results['random_init']['digits'] != results['linear']['digits']
  protocol = results['protocol']
  assert (protocol['embedding'], protocol['recompute_bn'],
          protocol['bn_images']) == ('z', True,
                                     10 * helpers.SMALL_DIGITS[0])
  cluster_keys = {'silhouette', 'compactness', 'centroid_margin',
                  'inter_intra_ratio'}
  assert set(results['clusters']['digits']) >= cluster_keys
  for generator in ('simclr', 'otclr'):
    views = results['views'][generator]
    assert set(views) == cluster_keys | {'view_distance', 'view_cosine',
                                         'anchor_distance', 'pixel_l2',
                                         'pixel_rms'}
    assert 0.0 <= views['view_distance'] <= 2.0
    assert -1.0 <= views['view_cosine'] <= 1.0
  assert results['views']['simclr']['pixel_l2'] == 0.0
  assert results['views']['otclr']['pixel_l2'] > 0.0
  # Plain norm vs RMS of the same 8 x 8 x 3 differences: at least RMS, at
  # most sqrt(192) times it (equal per image).
  otclr = results['views']['otclr']
  assert otclr['pixel_rms'] <= otclr['pixel_l2'] <= (
      np.sqrt(192) * otclr['pixel_rms'] * (1 + 1e-5))
  printed = capsys.readouterr().out
  assert '| Random init |' in printed
  assert '"Random init" is the untrained encoder, the floor' in printed
  assert printed.index('Digits kNN') < printed.index('Digits Top-1'), printed
  assert '| OTCLR (BN: stored) |' in printed
  assert '| OTCLR (BN: clean train) |' in printed
  with open(os.path.join(workdir, 'eval', 'tables.md')) as f:
    assert 'embedding z, l2-normalised projection output' in f.read()
  feature_dir = os.path.join(workdir, 'eval', 'features')
  for tag in ('step4', 'step4_cleanbn'):
    assert sorted(os.listdir(os.path.join(feature_dir, tag))) == [
        'digits_test.npz', 'digits_train.npz']


# ----------------------------------------------------------------------------
# Embeddings and BatchNorm statistics.


_TINY_STAGES = (1, 1, 1, 1)


def _encoder_chain() -> int:
  """`helpers.network_chain` of the tiny encoder's features, batch 8."""
  return helpers.network_chain(
      models.ResNet(stage_sizes=_TINY_STAGES, stem='cifar'), (8, 8, 8, 3),
      train=True)


def _float(images):
  return images.astype(np.float32) / 255.0


@pytest.fixture(scope='module')
def net():
  """A cifar-stem SimCLRNet of `_TINY_STAGES` with a small head, 50 images of
  8 px, its jitted eval-mode `apply`, and its `initial` variables and
  `shifted` ones: BatchNorm statistics moved off (0, 1), so that a result
  that ignored the recomputation (or kept the stored values) would show."""
  model = models.SimCLRNet(models.ResNet(_TINY_STAGES, stem='cifar'),
                           proj_hidden_dim=8, proj_dim=4)
  images = np.random.default_rng(0).integers(0, 256, (50, 8, 8, 3), np.uint8)
  initial = jax.jit(functools.partial(model.init, train=False))(
      jax.random.key(0), np.zeros((2, 8, 8, 3), np.float32))
  shifted = {'params': initial['params'], 'batch_stats': jax.tree.map(
      lambda x: np.asarray(x) + 0.5, initial['batch_stats'])}
  return types.SimpleNamespace(
      model=model, images=images, initial=initial, shifted=shifted,
      apply=jax.jit(functools.partial(model.apply, train=False)))


def _head_atol(variables, h):
  """How far two float32 evaluations of the projection head on h may differ.

  The hidden Dense sums 512 products, rounding relative to |h| |W1|; eval
  BatchNorm (subtract, divide by sqrt(var + eps), scale, shift: 6) scales
  that by g = |scale| / sqrt(var + eps) and rounds relative to its own
  terms; the output Dense sums `hidden` products and the bias, relative to
  |a| |W2| + |b|, and carries the hidden layer's error through |W2|.
  """
  head = jax.tree.map(lambda t: np.asarray(t, np.float64),
                      variables['params']['head'])
  stats = jax.tree.map(lambda t: np.asarray(t, np.float64),
                       variables['batch_stats']['head']['bn'])
  h = np.asarray(h, np.float64)
  w1, w2 = head['hidden']['kernel'], head['out']['kernel']
  g = head['bn']['scale'] / np.sqrt(stats['var'] + 1e-5)
  pre = h @ w1
  a = np.maximum(0.0, (pre - stats['mean']) * g + head['bn']['bias'])
  err_a = helpers.rounding_tol(512 + 6) * (
      np.abs(g) * (np.abs(h) @ np.abs(w1) + np.abs(stats['mean']))
      + np.abs(head['bn']['bias']))
  err_z = err_a @ np.abs(w2) + helpers.rounding_tol(w1.shape[1] + 1) * (
      a @ np.abs(w2) + np.abs(head['out']['bias']))
  return float(np.max(err_z))


def _bn_inputs(model, variables, images):
  """{BatchNorm path: float64 input [N, ..., C]} of one training-mode pass.

  Recorded by intercepting every BatchNorm call, independently of
  `clusters.recompute_batch_stats`.
  """
  seen = {}

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, nn.BatchNorm) and context.method_name == (
        '__call__'):
      seen[context.module.path] = args[0]
    return next_fun(*args, **kwargs)

  @jax.jit
  def forward(variables, x):
    with nn.intercept_methods(record):
      model.apply(variables, x, train=True, mutable=['batch_stats'])
    return seen

  inputs = forward(variables, _float(images))
  return {path: np.asarray(x, np.float64) for path, x in inputs.items()}


def _stats_at(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def test_recomputed_batch_stats_are_exact_moments_of_clean_activations(net):
  model, variables, images = net.model, net.shifted, net.images
  inputs = _bn_inputs(model, variables, images)
  # Stem 1 + 4 blocks x 2 + 3 shortcuts = 12; the head 1.
  assert len(inputs) == 13
  # One batch holding every image: every layer's statistics are exact.
  stats = clusters.recompute_batch_stats(model, variables, images,
                                         batch_size=len(images))
  for path, x in inputs.items():
    flat = x.reshape(-1, x.shape[-1])
    got = _stats_at(stats, path)
    np.testing.assert_allclose(got['mean'], flat.mean(0), rtol=1e-4,
                               atol=1e-5, err_msg=str(path))
    np.testing.assert_allclose(got['var'], flat.var(0), rtol=1e-4, atol=1e-5,
                               err_msg=str(path))
  # Flax's own update from zero running statistics, momentum 0.9 (models.py):
  # new = 0.1 * batch statistic, for one batch holding every image.
  _, updated = jax.jit(functools.partial(
      model.apply, train=True, mutable=['batch_stats']))(
          {'params': variables['params'],
           'batch_stats': jax.tree.map(np.zeros_like,
                                       variables['batch_stats'])},
          _float(images))
  jax.tree.map(
      lambda ours, flax_new: np.testing.assert_allclose(
          ours, np.asarray(flax_new) / 0.1, rtol=1e-3, atol=1e-4),
      stats, updated['batch_stats'])
  # Uneven batches (16, 16, 16, 2): the first BatchNorm's input does not
  # depend on other BatchNorm layers, so pooling must still be exact there.
  pooled = clusters.recompute_batch_stats(model, variables, images,
                                          batch_size=16)
  first = ('encoder', 'stem_bn')
  flat = inputs[first].reshape(-1, inputs[first].shape[-1])
  np.testing.assert_allclose(_stats_at(pooled, first)['mean'], flat.mean(0),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(_stats_at(pooled, first)['var'], flat.var(0),
                             rtol=1e-4, atol=1e-5)


def test_project_equals_the_networks_z(net):
  h, z = net.apply(net.shifted, _float(net.images))
  # Two programs (batches of 5 against the whole network) of the head on the
  # same h.
  np.testing.assert_allclose(
      clusters.project(net.model, net.shifted, np.asarray(h), batch_size=5),
      np.asarray(z), rtol=0, atol=_head_atol(net.shifted, h))


def test_embedding_config_is_checked():
  config = helpers.tiny_config('/nonexistent')
  assert clusters.embedding_of(config) == 'z'  # the paper's default
  config.eval.embedding = 'x'
  with pytest.raises(ValueError, match='config.eval.embedding'):
    clusters.embedding_of(config)


@pytest.mark.parametrize('field, value, match', [
    ('datasets', ('digits', 'digits'), 'config.eval.datasets repeats a name'),
    ('datasets', ('digits', 'mnist'), "unknown evaluation dataset 'mnist'"),
    ('evaluators', ('probe', 'x'), 'config.eval.evaluators must name'),
    ('evaluators', (), 'config.eval.evaluators must name'),
    ('embedding', 'x', 'config.eval.embedding must be one of'),
    ('views_dataset', 'mnist', "unknown evaluation dataset 'mnist'"),
])
def test_evaluation_fields_are_checked_as_config_errors(field, value, match):
  config = helpers.tiny_config('/nonexistent')
  config.eval[field] = value
  with pytest.raises(experiment.ConfigError, match=match):
    evaluate.validate(config)


# ----------------------------------------------------------------------------
# Results that cannot be silently wrong.


def test_retrained_workdir_recomputes_cached_features(evaluated_run,
                                                      simclr_run, tmp_path,
                                                      monkeypatch):
  # Run A is evaluated; its training is then thrown away (as after deleting a
  # diverged run's checkpoints) and run B, another seed and method, is trained
  # into the same workdir to the same step: `simclr_run`'s files beside A's
  # eval/. B's numbers must be B's.
  config_b, trained_b = simclr_run
  workdir = str(tmp_path / 'run')
  shutil.copytree(trained_b, workdir, ignore=shutil.ignore_patterns('eval'))
  shutil.copytree(os.path.join(evaluated_run[1], 'eval'),
                  os.path.join(workdir, 'eval'))
  helpers.small_digits(monkeypatch)
  first = rundir.read_results(workdir)
  features_a = features.load_features(workdir, 4, 'digits', 'test', 8)[0]
  warnings = []
  monkeypatch.setattr(evaluate.logging, 'warning',
                      lambda msg, *args: warnings.append(msg % args))
  second = _evaluate(config_b, workdir)
  features_b = features.load_features(workdir, 4, 'digits', 'test', 8)[0]
  assert second['step'] == first['step'] == 4
  assert (second['method'], second['seed']) == ('simclr', 1)
  assert not np.array_equal(features_a, features_b)
  for section in ('linear', 'random_init'):
    assert second[section] != first[section], section
  # One line per recomputed file, saying why.
  stale = [w for w in warnings if 'Recomputing feature cache' in w]
  assert len(stale) == 4, warnings  # {step4, init} x {train, test}
  assert all('other weights' in w for w in stale)


def test_changed_settings_or_damaged_feature_cache_is_recomputed(
    evaluated_run, tmp_path, monkeypatch):
  config, evaluated = evaluated_run
  workdir = helpers.copy_run(evaluated, tmp_path)
  helpers.small_digits(monkeypatch)
  first = rundir.read_results(workdir)
  feature_dir = os.path.join(workdir, 'eval', 'features')
  # Same weights, other recorded model settings: must not be trusted.
  changed = os.path.join(feature_dir, 'step4', 'digits_test.npz')
  with np.load(changed) as f:
    stored = {k: f[k] for k in f.files}
  stored['settings'] = stored['settings'].item().replace('"model"', '"x"')
  np.savez(changed, **stored)
  # A torn write.
  torn = os.path.join(feature_dir, 'init', 'digits_train.npz')
  with open(torn, 'r+b') as f:
    f.truncate(os.path.getsize(torn) // 2)
  calls, warnings = [], []
  extract = features.extract_features
  monkeypatch.setattr(
      features, 'extract_features',
      lambda *a, **k: calls.append(k['what']) or extract(*a, **k))
  monkeypatch.setattr(evaluate.logging, 'warning',
                      lambda msg, *args: warnings.append(msg % args))
  again = _evaluate(config, workdir)
  assert sorted(calls) == ['init features digits/train',
                           'step4 features digits/test']
  assert any(changed in w and 'other model settings' in w for w in warnings)
  assert any(torn in w and 'unreadable' in w for w in warnings), warnings
  for section in ('linear', 'random_init'):
    assert again[section] == first[section]
  with np.load(torn) as f:
    assert f['features'].shape == (10 * helpers.SMALL_DIGITS[0], 512)


def test_feature_cache_is_bound_to_the_folder_tree(tmp_path):
  root = str(tmp_path / 'tree')
  pixels = np.zeros((8, 8, 3), np.uint8)
  for split in ('train', 'test'):
    for cls in ('bee', 'cow'):
      save_image(root, split, cls, '0.png', pixels)
  config = helpers.eval_config(str(tmp_path / 'data'))
  before = features.cache_settings(config, 'folder:' + root, 1)
  assert features.cache_settings(config, 'folder:' + root, 1) == before
  # Another extraction batch or device count rounds the features otherwise.
  other = helpers.eval_config(str(tmp_path / 'data'), **{
      'eval.batch_size': config.eval.batch_size + 1})
  assert features.cache_settings(other, 'folder:' + root, 1) != before
  assert features.cache_settings(config, 'folder:' + root, 2) != before
  # bfloat16 activations give other features from the same weights.
  bf16 = helpers.eval_config(str(tmp_path / 'data'), dtype='bfloat16')
  assert features.cache_settings(bf16, 'folder:' + root, 1) != before
  # 'ant' sorts first and shifts every label: cached features must not be
  # reused with their old labels.
  save_image(root, 'test', 'ant', '0.png', pixels)
  assert features.cache_settings(config, 'folder:' + root, 1) != before


def test_a_checkpoint_never_restores_into_another_network(finished_run):
  config, workdir, _ = finished_run
  template = jax.eval_shape(lambda: experiment.initial_variables(config))
  item = {'params': {'net': template['params']},
          'batch_stats': template['batch_stats']}
  # A network with a part fewer than the checkpoint's, as a smaller
  # model.stage_sizes builds: partial restore would fill it silently.
  smaller = jax.tree_util.tree_map(lambda x: x, item)
  dropped = sorted(set(smaller['params']['net']['encoder'])
                   & set(smaller['batch_stats']['encoder']))[-1]
  del smaller['params']['net']['encoder'][dropped]
  del smaller['batch_stats']['encoder'][dropped]
  with pytest.raises(checkpoint.NetworkMismatchError,
                     match=r'another network .*entries missing.*more saved'):
    checkpoint.restore_part(workdir, 4, smaller)
  # More blocks, or another head width, likewise.
  for field, value in (('model.stage_sizes', (2, 1, 1, 1)),
                       ('model.proj_dim', 8)):
    other = config.copy_and_resolve_references()
    other.update_from_flattened_dict({field: value})
    with pytest.raises(checkpoint.NetworkMismatchError):
      experiment.restore_variables(other, workdir, 4)
  # The run's own network restores; the optimiser's state is skipped.
  assert set(experiment.restore_variables(config, workdir, 4)) == {
      'params', 'batch_stats'}


def test_non_finite_checkpoint_is_refused(finished_run, tmp_path, monkeypatch):
  workdir = helpers.copy_run(finished_run[1], tmp_path)
  data_dir = finished_run[0].data_dir
  helpers.small_digits(monkeypatch)
  restore = checkpoint.restore_part

  def poisoned(workdir, step, item):
    part = restore(workdir, step, item)
    part['batch_stats'] = jax.tree_util.tree_map(
        lambda v: np.full_like(np.asarray(v), np.nan), part['batch_stats'])
    return part

  monkeypatch.setattr(checkpoint, 'restore_part', poisoned)
  with pytest.raises(features.NonFiniteError,
                     match=f'{workdir}: checkpoint step 4 .*non-finite'):
    _evaluate(helpers.eval_config(data_dir), workdir)
  assert not os.path.exists(os.path.join(workdir, 'eval', 'results.json'))
  # The command line ends in one error line and the data-error status.
  config = helpers.eval_config(data_dir)
  config.mode = 'eval'
  assert main.run(config, workdir) == cli.EXIT_DIVERGED
  assert not os.path.exists(os.path.join(workdir, 'eval', 'results.json'))


def test_non_finite_features_are_refused(finished_run, tmp_path, monkeypatch):
  workdir = helpers.copy_run(finished_run[1], tmp_path)
  helpers.small_digits(monkeypatch)
  extract = features.extract_features

  def nan_features(*args, **kwargs):
    feats = extract(*args, **kwargs)
    if kwargs['what'].startswith('step'):
      feats[3, 7] = np.nan
    return feats

  monkeypatch.setattr(features, 'extract_features', nan_features)
  with pytest.raises(features.NonFiniteError,
                     match=f'{workdir}: the step4 encoder .* on digits/train'):
    _evaluate(helpers.eval_config(finished_run[0].data_dir), workdir)
  assert not os.path.exists(os.path.join(workdir, 'eval', 'results.json'))


def test_restore_falls_back_past_a_truncated_newest_checkpoint(
    finished_run, tmp_path, caplog):
  config, finished, _ = finished_run
  # Checkpoints 2 and 4.
  workdir = pathlib.Path(helpers.copy_run(finished, tmp_path))
  _, expected, _ = evaluate.restore(config, str(workdir), step=2)
  helpers.truncate_checkpoint(workdir, 4)  # as a crash mid-write leaves it
  caplog.set_level('WARNING')
  _, state, step = evaluate.restore(config, str(workdir))
  assert step == 2
  helpers.assert_trees_equal(expected, state)
  skipped = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith('Skipping checkpoint')]
  assert len(skipped) == 1 and os.path.join('checkpoints', '4') in skipped[0]
  # Read-only: the damaged checkpoint is left where it is.
  assert (workdir / 'checkpoints' / '4').is_dir()
  # An explicit step is never replaced by another one.
  with pytest.raises(Exception):
    evaluate.restore(config, str(workdir), step=4)


def test_checkpoint_rotated_away_while_read_is_replaced_by_the_newest(
    finished_run, tmp_path, monkeypatch, caplog):
  # A run still training with keep_checkpoints=1: evaluation lists [2], and
  # while it reads 2 the run saves 4 and deletes 2.
  config, finished, _ = finished_run
  # Checkpoints 2 and 4.
  workdir = pathlib.Path(helpers.copy_run(finished, tmp_path))
  _, expected, _ = evaluate.restore(config, str(workdir), step=4)
  aside = tmp_path / 'newer'
  (workdir / 'checkpoints' / '4').rename(aside)
  read = experiment.restore_variables
  calls = []

  def rotating(config, workdir_, step):
    calls.append(step)
    if step == 2:
      aside.rename(workdir / 'checkpoints' / '4')
      shutil.rmtree(workdir / 'checkpoints' / '2')
    return read(config, workdir_, step)

  monkeypatch.setattr(experiment, 'restore_variables', rotating)
  caplog.set_level('INFO')
  _, restored, step = evaluate.restore(config, str(workdir))
  assert (step, calls) == (4, [2, 4])
  helpers.assert_trees_equal(expected, restored)
  assert any('deleted while being read' in r.getMessage()
             for r in caplog.records)
  # An explicit step that is gone stays an error.
  with pytest.raises(ValueError, match=r'available steps: \[4\]'):
    evaluate.restore(config, str(workdir), step=2)


@pytest.mark.slow
@pytest.mark.parametrize('method', ['moco', 'byol', 'dino'])
def test_every_method_with_ot_views_evaluates(tmp_path, data_dir, monkeypatch,
                                              method):
  helpers.small_digits(monkeypatch)
  config = helpers.eval_config(
      data_dir, method=method, views='ot', total_steps=2,
                        **{'moco.queue_size': 32, 'byol.pred_hidden_dim': 16,
                           'dino.hidden_dim': 16, 'dino.bottleneck_dim': 8,
                           'dino.num_prototypes': 32})
  workdir = str(tmp_path / 'run')
  train.train(config, workdir)
  results = _evaluate(config, workdir)
  title = {'moco': 'MoCo', 'byol': 'BYOL', 'dino': 'DINO'}[method]
  assert results['title'] == f'{title} + OT views'
  assert results['view_generator'] == 'ot'
  assert 0.0 <= results['linear']['digits']['top1'] <= 100.0
  assert set(results['views']) == {'simclr', 'otclr'}


def test_checkpoint_without_extra_state_still_evaluates(finished_run,
                                                        tmp_path):
  # Evaluation reads params and batch_stats only: a checkpoint whose other
  # parts (here: no `extra`, as before methods were plug-ins, and another
  # optimiser's state) differ from today's TrainState still restores.
  config, finished, _ = finished_run
  workdir = helpers.copy_run(finished, tmp_path)
  _, expected, step = evaluate.restore(config, workdir)
  ckpt = checkpoint.Checkpointer(workdir)
  ckpt.save(5, {'step': np.int32(5), 'params': {'net': expected['params']},
                'batch_stats': expected['batch_stats'],
                'opt_state': {'other_optimiser': np.zeros(3, np.float32)}})
  ckpt.close()
  _, restored, step = evaluate.restore(config, workdir)
  assert step == 5
  helpers.assert_trees_equal(expected, restored)


def test_splits_smaller_than_the_batch_share_one_compiled_encoder(net):
  # The compiled encoder is shared per network and process: start this
  # test's from nothing, whatever other tests compiled.
  features._compiled_apply.cache_clear()
  encoder = features.Encoder(net.model)
  h = np.asarray(net.apply(net.shifted, _float(net.images))[0])
  # A 12-image split, a 5-image split and a 3-image one, batch 8: every call
  # is [8, ...] (the smaller splits padded), the features those of the
  # unpadded network. Two programs (padded batches of 8 against one of 50)
  # of the encoder, whose chain `_encoder_chain` counts, on features of the
  # scale of the largest.
  rtol = helpers.rounding_tol(_encoder_chain())
  atol = rtol * float(np.max(np.abs(h)))
  with helpers.traces() as traced:
    for rows in (slice(0, 12), slice(0, 5), slice(7, 10)):
      np.testing.assert_allclose(features.extract_features(
          encoder, net.shifted, net.images[rows], 8, log_progress=False),
                                 h[rows], rtol=rtol, atol=atol)
  assert traced.count('apply') == 1, traced


def test_view_embeddings_use_the_features_compiled_encoder(net, data_dir,
                                                           monkeypatch):
  config = helpers.tiny_config(data_dir, **{'model.stem': 'cifar'})
  # Initial statistics: shifted means silence this tiny network.
  model, variables, images = net.model, net.initial, net.images
  features._compiled_apply.cache_clear()
  encoder = features.Encoder(model)
  features.extract_features(encoder, variables, images, 8, log_progress=False)
  calls = []
  embed = features.Encoder.embed
  monkeypatch.setattr(features.Encoder, 'embed', lambda self, v, x: (
      calls.append(x.shape), embed(self, v, x))[1])
  # 10 images in batches of 8 and 2, every set padded to the features' 8 rows.
  with helpers.traces() as traced:
    views = view_quality.view_embeddings(config, model, variables, images,
                                         num_images=10, batch_size=8)
  assert calls == [(8, 8, 8, 3)] * 10  # 5 sets x 2 batches
  assert 'apply' not in traced, traced
  h, z = (np.asarray(t, np.float64)[views.indices]
          for t in net.apply(variables, _float(images))[:2])
  # Two programs (the compiled, padded encoder against the whole network):
  # the encoder's chain relative to z, the head's bound, then normalising
  # (4 squares' sum, sqrt and division: 7), which turns an error of z into
  # one of the unit rows at most twice as large relative to |z|.
  z_norm = np.linalg.norm(z, axis=1, keepdims=True)
  err = (helpers.rounding_tol(_encoder_chain()) * np.abs(z)
         + _head_atol(variables, h))
  np.testing.assert_allclose(
      views.anchors, z / z_norm, rtol=0,
      atol=float(np.max(2 * err / z_norm)) + helpers.rounding_tol(7))
  for pair in (views.simclr, views.otclr):
    for z_view in pair:
      assert z_view.shape == (10, 4)
      # Unit rows in float32 (7), whose norm NumPy takes in float32 (5).
      np.testing.assert_allclose(np.linalg.norm(z_view, axis=1), 1.0,
                                 rtol=helpers.rounding_tol(12))
  assert not np.allclose(views.simclr[0], views.otclr[0])
  # The view metrics do not depend on the evaluation batch size, a
  # throughput setting: the same views, embedded in other row counts.
  large = view_quality.view_embeddings(config, model, variables, images,
                                       num_images=10, batch_size=16)
  np.testing.assert_allclose(views.pixel_l2, large.pixel_l2, rtol=1e-5)
  np.testing.assert_allclose(views.pixel_rms, large.pixel_rms, rtol=1e-5)
  for a, b in ((views.simclr, large.simclr), (views.otclr, large.otclr)):
    for za, zb in zip(a, b):
      np.testing.assert_allclose(za, zb, rtol=1e-4, atol=1e-5)


def test_the_monitor_reuses_the_evaluation_encoder(data_dir):
  config = helpers.tiny_config(data_dir)
  monitor_ = monitor.KnnMonitor(config, experiment.create_model(config))
  # Equal networks built apart (training's and evaluation's) share one jit,
  # and the monitor calls it at the evaluation's batch size.
  assert (monitor_._encoder._apply
          is features.Encoder(experiment.create_model(config))._apply)
  assert monitor_._batch_size == config.eval.batch_size
