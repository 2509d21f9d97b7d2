"""The split type and the errors of the data package."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from otclr_jax import cli


class Split(NamedTuple):
  """One split of a dataset, held in host memory.

  Attributes:
    images: uint8 [N, S, S, 3].
    labels: int32 [N]; -1 for unlabelled examples (stl10 `unlabelled`).
    num_classes: number of classes of the dataset.
    class_names: [num_classes] names; label i is class_names[i].
  """
  images: np.ndarray
  labels: np.ndarray
  num_classes: int
  class_names: list[str]


class DataError(cli.UsageError):
  """A dataset, split or batch size that cannot work; exit status 2."""


class SplitNotFoundError(DataError):
  """The dataset has no split of that name (the message lists those it has)."""


class BatchSizeError(DataError):
  """The batch is larger than the split it is drawn from."""


class NotEvaluableError(DataError):
  """An evaluation dataset that evaluation could not use (`check_evaluable`)."""


class MissingExtraError(DataError):
  """Preparing a dataset needs an optional package that is not installed."""


class DatasetUnavailableError(DataError):
  """A tfds dataset is neither prepared under data_dir nor downloadable."""
