"""Shared test set-up: the digits cache, the tiny run config, the slow tier."""

import logging
import os
import re

import numpy as np
import pytest

# POT probes every installed array backend at import; TensorFlow's import alone
# costs seconds and the tests only use POT's NumPy path.
for _backend in ('TENSORFLOW', 'PYTORCH', 'CUPY', 'JAX'):
  os.environ.setdefault(f'POT_BACKEND_DISABLE_{_backend}', '1')

# Several tests build the same tiny training step in fresh closures; the
# persistent cache turns their repeated XLA compilations into disk reads.
os.environ.setdefault(
    'JAX_COMPILATION_CACHE_DIR',
    os.path.join(os.path.expanduser('~'), '.cache', 'otclr_jax_test_xla'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')


def pytest_addoption(parser):
  parser.addoption(
      '--runslow', action='store_true', default=False,
      help='also run the end-to-end tests marked slow (the whole suite then '
      'takes ~6.5 min with -n 2 on a 2-core CPU): every method x views '
      'training and resuming, 4 devices against 1, the complexity-table '
      'benchmark, seeded sweeps end to end')


def pytest_collection_modifyitems(config, items):
  # The pattern of pytest's documentation: slow tests are reported as skipped
  # (so a plain run says how many did not run), not silently deselected.
  if config.getoption('--runslow'):
    return
  skip = pytest.mark.skip(reason='slow end-to-end test: pass --runslow')
  for item in items:
    if 'slow' in item.keywords:
      item.add_marker(skip)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
  """One digits cache for the session (each xdist worker has its own)."""
  return str(tmp_path_factory.mktemp('data'))


def tiny_config(data_dir, **overrides):
  """8 px digits, batch 16, 4 steps, small heads and a 4 x 4 OT grid.

  Every method's block is small too (MoCo queue 64, BYOL predictor 32, DINO
  32-16-64 with a one-epoch teacher warm-up), so any `method=` trains fast.

  Args:
    data_dir: where the digits cache goes (the `data_dir` fixture).
    **overrides: dotted config fields, e.g. `**{'ot.beta': 1.0}`.

  Returns:
    The ConfigDict.
  """
  # Imported here: the environment above must be set before JAX loads.
  from configs import default  # pylint: disable=g-import-not-at-top
  from otclr_jax import config_files  # pylint: disable=g-import-not-at-top
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
  config.moco.queue_size = 64
  config.byol.pred_hidden_dim = 32
  config.dino.hidden_dim = 32
  config.dino.bottleneck_dim = 16
  config.dino.num_prototypes = 64
  config.dino.warmup_teacher_temp_epochs = 1.0
  for key, value in overrides.items():
    config_files.set_field(config, key, value)
  return config


def shrink_digits(monkeypatch, train_per_class: int, test_per_class: int):
  """Makes `data.load_split` return the first images of each class."""
  from otclr_jax import data  # pylint: disable=g-import-not-at-top
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


class SignalsInAFinaliser:
  """Sends `signum` to this process from `__del__`, where a raise is dropped.

  Create one and drop it at once: Python runs the signal's handler inside the
  finaliser, which prints and discards what the handler raises, as when a
  signal lands in JAX's garbage-collection callback.
  """

  def __init__(self, signum):
    self.signum = signum

  def __del__(self):
    os.kill(os.getpid(), self.signum)
    for _ in range(10_000):  # The handler runs in here.
      pass
