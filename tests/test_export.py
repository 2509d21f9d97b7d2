"""Tests of otclr_jax.export: the encoder alone round-trips exactly."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from otclr_jax import cli
from otclr_jax import data
from otclr_jax.evaluation import evaluate
from otclr_jax.evaluation import features
from otclr_jax import export
from otclr_jax.methods import base
from otclr_jax import models
from otclr_jax import rundir
from tests.helpers import copy_run


@pytest.fixture(scope='module')
def trained():
  """A tiny SimCLRNet (one block per stage) whose BatchNorm statistics moved
  off their init."""
  config = default.get_config()
  config.model.stem = 'cifar'
  config.model.stage_sizes = (1, 1, 1, 1)
  config.image_size = 8
  config.dataset = 'digits'
  model = models.SimCLRNet(base.encoder(config), proj_hidden_dim=32,
                           proj_dim=16)
  x = np.random.default_rng(0).random((4, 8, 8, 3), np.float32)
  variables = jax.jit(functools.partial(model.init, train=False))(
      jax.random.key(1), x)
  apply = functools.partial(model.apply, train=True, mutable=['batch_stats'])
  _, updates = jax.jit(apply)(variables, x * 0.5 + 0.2)
  variables = {'params': variables['params'],
               'batch_stats': updates['batch_stats']}
  return config, model, variables, x


def test_round_trip_equals_full_model_features(tmp_path, trained):
  config, model, variables, x = trained
  path = str(tmp_path / 'encoder.msgpack')
  export.export_encoder(path, variables, config)
  apply_fn, loaded = export.load_encoder(path)
  expected, _ = jax.jit(functools.partial(model.apply, train=False))(
      variables, x)
  got = apply_fn(loaded, x)
  assert got.shape == (4, 512) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, expected, rtol=0, atol=0)
  # The backbone alone: no projection head, no optimiser state.
  assert set(loaded) == {'params', 'batch_stats'}
  assert 'head' not in loaded['params'] and 'encoder' not in loaded['params']
  assert set(loaded['params']) == set(variables['params']['encoder'])
  meta = export.load_encoder_config(path)
  assert (meta['stem'], meta['stage_sizes'], meta['image_size'],
          meta['dtype'], meta['feature_dim']) == ('cifar', [1, 1, 1, 1], 8,
                                                  'float32', 512)


def test_bad_inputs(tmp_path, trained):
  from otclr_jax import ot  # pylint: disable=g-import-not-at-top
  config, _, variables, x = trained
  path = str(tmp_path / 'encoder.msgpack')
  export.export_encoder(path, variables, config.to_dict())
  apply_fn, loaded = export.load_encoder(path)
  with pytest.raises(ValueError, match='divide uint8'):
    apply_fn(loaded, np.zeros((1, 8, 8, 3), np.uint8))
  with pytest.raises(ValueError, match=r'\[B, H, W, 3\]'):
    apply_fn(loaded, x[0])
  with pytest.raises(ValueError, match='image_size 8'):
    apply_fn(loaded, np.zeros((2, 16, 16, 3), np.float32))
  # One input contract with the OT functions: images in [0, 1].
  bytes_as_float = x * 255
  with pytest.raises(ValueError, match=r'\[0, 1\]'):
    ot.ot_views(bytes_as_float, bytes_as_float, grid_size=4)
  with pytest.raises(ValueError, match=r'\[0, 1\]'):
    apply_fn(loaded, bytes_as_float)
  with pytest.raises(ValueError, match='NaN'):
    apply_fn(loaded, np.full((1, 8, 8, 3), np.nan, np.float32))
  # Traced images cannot raise: out-of-range ones give NaN features, as OT
  # views give NaN views.
  poisoned = jax.jit(apply_fn)(loaded, bytes_as_float)
  assert np.isnan(np.asarray(poisoned)).all()
  np.testing.assert_array_equal(jax.jit(apply_fn)(loaded, x),
                                apply_fn(loaded, x))
  with pytest.raises(ValueError, match="need 'batch_stats'"):
    export.export_encoder(path, {'params': variables['params']}, config)
  junk = tmp_path / 'junk.msgpack'
  junk.write_bytes(b'not msgpack at all')
  with pytest.raises(ValueError, match='junk.msgpack'):
    export.load_encoder(str(junk))
  with pytest.raises(FileNotFoundError):
    export.load_encoder(str(tmp_path / 'nope.msgpack'))


# ----------------------------------------------------------------------------
# Wiring: training exports its encoder; any checkpoint exports on demand.


def _evaluate_features(config, workdir, step, images):
  model, restored, _ = evaluate.restore(config, workdir, step)
  variables = {'params': restored['params'],
               'batch_stats': restored['batch_stats']}
  return features.Encoder(model)(variables, images)


def _test_images(config):
  test = data.load_split('digits', 'test', config.image_size,
                         config.data_dir)
  return test.images[:16]  # uint8 [16, 8, 8, 3]


@jax.jit
def _as_float(images):
  # As evaluation's encoder converts uint8 inside its jit: XLA computes x / 255
  # as x * (1 / 255), which differs from NumPy's division in the last bit.
  return images.astype(jnp.float32) / 255.0


def test_a_finished_run_exports_its_encoder(finished_run, stopped_run):
  assert not os.path.exists(export.encoder_path(stopped_run[1]))
  config, workdir, _ = finished_run
  path = export.encoder_path(workdir)
  assert path == os.path.join(workdir, 'encoder', 'encoder.msgpack')
  images = _test_images(config)
  apply_fn, variables = export.load_encoder(path)
  got = np.asarray(apply_fn(variables, _as_float(images)))
  np.testing.assert_allclose(got, _evaluate_features(config, workdir, 4,
                                                     images), rtol=0, atol=0)
  meta = export.load_encoder_config(path)
  assert (meta['step'], meta['method'], meta['image_size']) == (4, 'otclr', 8)
  # SimCLR with OT views (OTCLR) had been recorded as plain SimCLR.
  spelled = dict(config.to_dict(), method='simclr', views='ot')
  export.export_encoder(path + '.ot', variables, spelled)
  assert export.load_encoder_config(path + '.ot')['views'] == 'ot'


def test_command_line_exports_an_older_step(finished_run, tmp_path, capsys):
  config, finished, _ = finished_run
  workdir = copy_run(finished, tmp_path)  # the export writes into the run
  assert export.main(['export', f'--workdir={workdir}', '--step=2']) == 0
  path = export.encoder_path(workdir, 2)
  assert path in capsys.readouterr().out
  images = _test_images(config)
  apply_fn, variables = export.load_encoder(path)
  got = np.asarray(apply_fn(variables, _as_float(images)))
  step2 = _evaluate_features(config, workdir, 2, images)
  np.testing.assert_allclose(got, step2, rtol=0, atol=0)
  assert not np.array_equal(step2, _evaluate_features(config, workdir, 4,
                                                      images))
  assert export.load_encoder_config(path)['step'] == 2
  out = str(tmp_path / 'mine.msgpack')
  assert export.main(['export', f'--workdir={workdir}', f'--out={out}']) == 0
  assert export.load_encoder_config(out)['step'] == 4
  assert export.main(['export', f'--workdir={workdir}', '--step=3']) == 2
  assert 'No checkpoint for step 3' in capsys.readouterr().err
  assert export.main(['export', f'--workdir={tmp_path}']) == 2
  assert 'config.json does not exist' in capsys.readouterr().err
  assert export.main(['export', '--workdir']) == 2
  assert export.main(['export', f'--workdir={workdir}', '--out=a', 'b']) == 2
  assert 'Traceback' not in capsys.readouterr().err


@pytest.mark.parametrize('text, message', [
    ('[1, 2]', 'config.json is corrupt: expected a JSON object'),
    ('{"seed": 0}', 'disagrees with the config stored in checkpoint'),
])
def test_a_stored_config_that_is_not_a_runs_fails_in_one_line(
    finished_run, tmp_path, capsys, text, message):
  _, workdir, _ = finished_run
  workdir = copy_run(workdir, tmp_path)
  with open(os.path.join(workdir, rundir.CONFIG_FILE), 'w') as f:
    f.write(text)
  out = str(tmp_path / 'e.msgpack')
  assert export.main(['export', f'--workdir={workdir}', f'--out={out}']) == 2
  err = capsys.readouterr().err
  assert message in err and err.count('\n') == 1, err
  assert not os.path.exists(out)
  # Without config.json, the config each checkpoint holds rebuilds it.
  os.remove(os.path.join(workdir, rundir.CONFIG_FILE))
  assert export.main(['export', f'--workdir={workdir}', f'--out={out}']) == 0
  assert export.load_encoder_config(out)['step'] == 4


def test_tilde_in_paths_is_the_home_directory(finished_run, tmp_path,
                                              monkeypatch, capsys):
  _, workdir, _ = finished_run
  monkeypatch.setenv('HOME', str(tmp_path))
  monkeypatch.chdir(tmp_path)
  os.symlink(workdir, tmp_path / 'run')
  assert export.main(['export', '--workdir=~/run', '--out=~/e.msgpack']) == 0
  assert export.load_encoder_config(str(tmp_path / 'e.msgpack'))['step'] == 4
  assert not (tmp_path / '~').exists()


def test_a_read_only_output_path_fails_in_one_line(finished_run, tmp_path,
                                                   capsys):
  _, workdir, _ = finished_run
  locked = tmp_path / 'ro'
  locked.mkdir()
  locked.chmod(0o555)
  # Root writes through file modes; sysfs refuses it too.
  out = ('/sys/otclr_export_test' if os.geteuid() == 0 else str(locked))
  try:
    code = export.main(['export', f'--workdir={workdir}',
                        f'--out={out}/e.msgpack'])
  finally:
    locked.chmod(0o755)
  err = capsys.readouterr().err
  assert code == cli.EXIT_CANT_CREATE, err
  assert err.count('\n') == 1 and out in err
  assert 'Traceback' not in err and os.listdir(locked) == []


def test_an_architecture_that_does_not_match_the_weights_fails_at_load(
    tmp_path, trained):
  config, _, variables, _ = trained
  path = str(tmp_path / 'encoder.msgpack')
  wrong = config.copy_and_resolve_references()
  wrong.model.stem = 'imagenet'  # the weights are the cifar stem's
  export.export_encoder(path, variables, wrong)
  with pytest.raises(ValueError, match='encoder.msgpack.*stem'):
    export.load_encoder(path)
  wrong = config.copy_and_resolve_references()
  wrong.model.stage_sizes = (2, 2, 2, 2)  # the weights have 1 block each
  export.export_encoder(path, variables, wrong)
  with pytest.raises(ValueError, match=r'stage_sizes \[2, 2, 2, 2\]'):
    export.load_encoder(path)
