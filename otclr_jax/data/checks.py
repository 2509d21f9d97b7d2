"""Checks, before anything is trained, that a dataset can be evaluated on."""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from otclr_jax.data import cache
from otclr_jax.data import types

_SPLITS = ('train', 'test')


class Evaluable(NamedTuple):
  """What `check_evaluable` found: split sizes, classes, train rows per class."""
  name: str
  num_train: int
  num_test: int
  num_classes: int
  train_counts: tuple[int, ...] = ()


def check_evaluable(name: str, image_size: int,
                    data_dir: str | os.PathLike[str] | None = None, *,
                    download: bool = True) -> Evaluable:
  """Checks that evaluation (a probe and kNN on train, scored on test) can run.

  Args:
    name, data_dir, download: as in `load_split`.
    image_size: the run's image size (the caches prepared are this size).

  Raises:
    NotEvaluableError: no train or test split, or unusable classes.
  """
  try:
    loaded = cache.load_splits(name, _SPLITS, image_size, data_dir,
                               download=download)
  except types.SplitNotFoundError as e:
    _refuse(name, f'lacks a split evaluation needs (train and test): {e}', e)
  except (types.DataError, ImportError) as e:
    _refuse(name, f'cannot be loaded: {str(e).splitlines()[0]}', e)
  train, test = loaded['train'], loaded['test']
  names = train.class_names
  train_classes = np.unique(train.labels[train.labels >= 0])
  if len(train_classes) < 2:
    _refuse(name, f'has {len(train_classes)} class(es) with train examples '
            f'({[names[i] for i in train_classes]}); a probe needs at least 2')
  test_classes = np.unique(test.labels[test.labels >= 0])
  unseen = np.setdiff1d(test_classes, train_classes)
  if len(unseen):
    _refuse(name, f'test classes {[names[i] for i in unseen]} have no train '
            'examples; its test classes must be among its train classes')
  counts = np.bincount(train.labels[train.labels >= 0],
                       minlength=train.num_classes)
  return Evaluable(name, len(train.labels), len(test.labels),
                   train.num_classes, tuple(int(c) for c in counts))


def _refuse(name: str, why: str, cause: Exception | None = None):
  raise types.NotEvaluableError(
      f"evaluation dataset {name!r} {why.rstrip('.')}.") from cause
