"""A kNN monitor of representation quality in pretraining (`config.monitor`).

Every `config.monitor.every_steps` optimiser steps (0 disables it; a multiple
of `config.log_every_steps`), training embeds a fixed held-out subset with the
current network in inference mode (BatchNorm running statistics, no
augmentation): `num_train` images of the pretraining dataset's train split
(with their labels) as the memory bank and `num_test` images of its test split
as the queries, both drawn once with the fixed seed `SEED`. It logs their
weighted kNN top-1 in percent (`knn.knn_top1`, the final evaluation's kNN,
on a subset) as `monitor_knn_top1` (`train.MONITOR_METRIC`) in metrics.jsonl,
TensorBoard and the progress line.

The monitor only reads the state: it draws no JAX random numbers and writes
nothing back, so a run's parameters are bit-identical with and without it.
Its cost, one forward pass over `num_train + num_test` images plus the kNN,
is printed by `python -m otclr_jax.bench train`.
"""

from __future__ import annotations

from typing import Any

import ml_collections
import numpy as np

from otclr_jax import data
from otclr_jax.evaluation import features
from otclr_jax.evaluation import knn

# Picks the held-out images; fixed so curves of different runs compare.
SEED = 0


def _subset(split: data.Split, num: int,
            rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  keep = np.sort(rng.choice(len(split.images), min(num, len(split.images)),
                            replace=False))
  return split.images[keep], np.asarray(split.labels[keep], np.int32)


class KnnMonitor:
  """Weighted kNN top-1 of the current encoder on a fixed held-out subset.

  Call it as `monitor(state)` with a `step.TrainState`; returns the top-1 in
  percent (a Python float).
  """

  def __init__(self, config: ml_collections.ConfigDict, model,
               train_split: data.Split | None = None,
               test_split: data.Split | None = None):
    """Draws the subset and builds the jitted encoder.

    Args:
      config: the run's config (`monitor.num_train`, `monitor.num_test`,
        `eval.batch_size`, `dataset`, `image_size`, `data_dir`).
      model: the run's network (`experiment.create_model`).
      train_split: the already loaded train split of `config.dataset`, to
        avoid reading it twice; loaded here when None.
      test_split: its test split; loaded here when None.
    """
    load = lambda split: data.load_split(
        config.dataset, split, config.image_size, config.data_dir or None)
    train_split = load('train') if train_split is None else train_split
    test_split = load('test') if test_split is None else test_split
    rng = np.random.default_rng(SEED)
    self.train_images, self.train_labels = _subset(
        train_split, config.monitor.num_train, rng)
    self.test_images, self.test_labels = _subset(
        test_split, config.monitor.num_test, rng)
    self.num_classes = train_split.num_classes
    self._encoder = features.Encoder(model)
    # The evaluation's batch: the same shapes reuse its compiled encoder.
    self._batch_size = config.eval.batch_size

  def features(self, variables: Any, images: np.ndarray) -> np.ndarray:
    """float32 [N, 512] features of uint8 images [N, S, S, 3]."""
    return features.extract_features(self._encoder, variables, images,
                                     self._batch_size, log_progress=False)

  def __call__(self, state) -> float:
    variables = {'params': state.params['net'],
                 'batch_stats': state.batch_stats}
    train_x = self.features(variables, self.train_images)
    test_x = self.features(variables, self.test_images)
    return knn.knn_top1(train_x, self.train_labels, test_x,
                        self.test_labels, self.num_classes)
