"""A tiny but complete run config shared by the end-to-end tests."""

import logging
import re

import numpy as np

from configs import default
from otclr_jax import config_files
from otclr_jax import data


def tiny_config(data_dir, **overrides):
  """8 px digits, batch 16, 4 steps, a small head and a 4 x 4 OT grid.

  Args:
    data_dir: where the digits cache goes (a tmp dir).
    **overrides: dotted config fields, e.g. `**{'ot.beta': 1.0}`.

  Returns:
    The ConfigDict.
  """
  config = default.get_config()
  config.dataset = 'digits'
  config.data_dir = data_dir
  config.image_size = 8
  config.batch_size = 16
  config.total_steps = 4
  config.log_every_steps = 2
  config.checkpoint_every_steps = 2
  config.model.proj_hidden_dim = 32
  config.model.proj_dim = 16
  config.ot.grid_size = 4
  config.eval.datasets = ('digits',)
  for key, value in overrides.items():
    config_files.set_field(config, key, value)
  return config


def shrink_digits(monkeypatch, train_per_class: int, test_per_class: int):
  """Makes `data.load_split` return the first images of each class."""
  load = data.load_split

  def small(name, split, image_size, data_dir=None, **kwargs):
    full = load(name, split, image_size, data_dir, **kwargs)
    per_class = train_per_class if split == 'train' else test_per_class
    keep = np.sort(np.concatenate([np.flatnonzero(full.labels == c)[:per_class]
                                   for c in range(full.num_classes)]))
    return full._replace(images=full.images[keep], labels=full.labels[keep])

  monkeypatch.setattr(data, 'load_split', small)


def assert_usage_error(caplog, match: str, run) -> None:
  """`run()` returns the usage status 2 and logs one error matching `match`."""
  caplog.clear()
  with caplog.at_level(logging.ERROR):
    assert run() == 2
  errors = [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR]
  assert len(errors) == 1, errors
  assert re.search(match, errors[0]), errors[0]
