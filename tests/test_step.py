"""Tests of the generic train step (otclr_jax/step.py) on tiny digits configs."""

import os
import subprocess
import sys
import textwrap

import flax.serialization
import jax
import numpy as np
import pytest

from otclr_jax import input_pipeline
from otclr_jax import methods
from otclr_jax import step as step_lib
from otclr_jax import train
from tests.tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMBINATIONS = [(m, v) for m in methods.NAMES for v in ('augment', 'ot')]


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('data'))


@pytest.fixture(scope='module')
def images(data_dir):
  return input_pipeline.load_split('digits', 'train', 8, data_dir).images


def method_config(data_dir, method, views, **overrides):
  """`tiny_config` with small method-specific widths (queue 64, DINO 32-16-64)."""
  config = methods.add_defaults(tiny_config(data_dir, method=method,
                                            **overrides))
  config.views = views
  config.moco.queue_size = 64
  config.byol.pred_hidden_dim = 32
  config.dino.hidden_dim = 32
  config.dino.bottleneck_dim = 16
  config.dino.num_prototypes = 64
  config.dino.warmup_teacher_temp_epochs = 1.0
  return config


def build(config, total_steps=4, steps_per_epoch=2, mesh=None):
  """(method, state, jitted step) for `config`, as training will build them."""
  method = methods.get(step_lib.views.resolve(config)[0])
  model = method.create_model(config)
  schedule = train.learning_rate_schedule(config, steps_per_epoch, total_steps)
  tx = train.create_optimizer(config, schedule)
  mesh = train.make_mesh() if mesh is None else mesh
  state = step_lib.init_state(config, method, model, tx, jax.random.key(0))
  step = step_lib.jit_train_step(method, config, model, tx, schedule, mesh,
                                 total_steps=total_steps,
                                 steps_per_epoch=steps_per_epoch)
  return method, state, step, mesh


def leaves(tree):
  return jax.tree_util.tree_leaves(jax.device_get(tree))


@pytest.mark.parametrize('old_method, views, overrides', [
    ('simclr', 'augment', {}),
    ('otclr', 'ot', {}),
    ('otclr', 'ot', {'ot.learn_alpha': True, 'ot.beta': 1.0}),
])
def test_simclr_reproduces_train_step_exactly(data_dir, images, old_method,
                                              views, overrides):
  old_config = tiny_config(data_dir, method=old_method, **overrides)
  mesh = train.make_mesh()
  model = train.create_model(old_config)
  schedule = train.learning_rate_schedule(old_config, 2, 4)
  tx = train.create_optimizer(old_config, schedule)
  old_state = train.init_state(old_config, model, tx, jax.random.key(0))
  old_step = train.jit_train_step(old_config, model, tx, schedule, mesh)

  config = method_config(data_dir, 'simclr', views, **overrides)
  _, state, new_step, _ = build(config, mesh=mesh)
  batch = train.global_batch(images[:16], mesh)
  for _ in range(2):
    old_state, old_metrics = old_step(old_state, batch, jax.random.key(1))
    state, metrics = new_step(state, batch, jax.random.key(1))
    for name, value in old_metrics.items():
      np.testing.assert_array_equal(np.asarray(metrics[name]),
                                    np.asarray(value), err_msg=name)
  assert float(metrics['state_finite']) == 1.0
  for old, new in zip(leaves((old_state.params, old_state.batch_stats,
                              old_state.opt_state)),
                      leaves((state.params, state.batch_stats,
                              state.opt_state))):
    np.testing.assert_array_equal(new, old)
  assert state.extra == {}


def test_otclr_alias_equals_simclr_with_ot_views(data_dir):
  alias = methods.add_defaults(tiny_config(data_dir, method='otclr'))
  assert step_lib.views.resolve(alias) == ('simclr', 'ot')
  alias.views = 'augment'
  with pytest.raises(ValueError, match='otclr'):
    step_lib.views.resolve(alias)
