"""A kNN monitor of representation quality in pretraining (`config.monitor`).

Logs `knn.knn_top1` of a fixed, seeded subset as `monitor_knn_top1`; it only
reads the state, so parameters are bit-identical with and without it.
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
  """`monitor(state)`: kNN top-1 (percent) of a `step.TrainState`."""

  def __init__(self, config: ml_collections.ConfigDict, model,
               train_split: data.Split | None = None,
               test_split: data.Split | None = None):
    """Draws the subset and builds the jitted encoder.

    Args:
      config: the run's config.
      model: the run's network.
      train_split: the train split of `config.dataset`; loaded when None.
      test_split: its test split; loaded when None.
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
    # Same shapes as the evaluation: reuses its compiled encoder.
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
