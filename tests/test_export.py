"""Tests of otclr_jax.export: the encoder alone round-trips exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from otclr_jax import export
from otclr_jax import models


@pytest.fixture(scope='module')
def trained():
  """A tiny SimCLRNet whose BatchNorm statistics moved off their init."""
  config = default.get_config()
  config.model.stem = 'cifar'
  config.image_size = 8
  config.dataset = 'digits'
  model = models.SimCLRNet(stem='cifar', proj_hidden_dim=32, proj_dim=16)
  x = jax.random.uniform(jax.random.key(0), (4, 8, 8, 3))
  variables = model.init(jax.random.key(1), x, train=False)
  _, updates = model.apply(variables, x * 0.5 + 0.2, train=True,
                           mutable=['batch_stats'])
  variables = {'params': variables['params'],
               'batch_stats': updates['batch_stats']}
  return config, model, variables, x


def test_round_trip_equals_full_model_features(tmp_path, trained):
  config, model, variables, x = trained
  path = str(tmp_path / 'encoder.msgpack')
  export.export_encoder(path, variables, config)
  apply_fn, loaded = export.load_encoder(path)
  expected, _ = model.apply(variables, x, train=False)
  got = apply_fn(loaded, x)
  assert got.shape == (4, 512) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, expected, rtol=0, atol=0)
  # The backbone alone: no projection head, no optimiser state.
  assert set(loaded) == {'params', 'batch_stats'}
  assert 'head' not in loaded['params'] and 'encoder' not in loaded['params']
  assert set(loaded['params']) == set(variables['params']['encoder'])
  meta = export.load_encoder_config(path)
  assert (meta['stem'], meta['image_size'], meta['dtype'],
          meta['feature_dim']) == ('cifar', 8, 'float32', 512)


def test_bad_inputs(tmp_path, trained):
  config, _, variables, x = trained
  path = str(tmp_path / 'encoder.msgpack')
  export.export_encoder(path, variables, config.to_dict())
  apply_fn, loaded = export.load_encoder(path)
  with pytest.raises(ValueError, match='divide uint8'):
    apply_fn(loaded, np.zeros((1, 8, 8, 3), np.uint8))
  with pytest.raises(ValueError, match=r'\[B, H, W, 3\]'):
    apply_fn(loaded, x[0])
  with pytest.raises(ValueError, match="need 'batch_stats'"):
    export.export_encoder(path, {'params': variables['params']}, config)
  junk = tmp_path / 'junk.msgpack'
  junk.write_bytes(b'not msgpack at all')
  with pytest.raises(ValueError, match='junk.msgpack'):
    export.load_encoder(str(junk))
  with pytest.raises(FileNotFoundError):
    export.load_encoder(str(tmp_path / 'nope.msgpack'))
