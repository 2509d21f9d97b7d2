"""Cluster metrics of embeddings, the head that makes z, clean-BN statistics."""

from __future__ import annotations

import functools
import time
from typing import Any, Iterator

from absl import logging
from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from otclr_jax import data
from otclr_jax import methods
from otclr_jax.evaluation import features
from otclr_jax.evaluation import metrics

MAX_CLUSTER_POINTS = 10_000
CLUSTER_SEED = 0
# `config.eval.embedding` for cluster and view metrics and t-SNE.
EMBEDDINGS = {'z': 'z, l2-normalised projection-head output',
              'h': 'h, l2-normalised backbone features'}
# `config.eval.recompute_bn`: clean train images, seeded, per BN estimate.
MAX_BN_IMAGES = 50_000
BN_SEED = 0


_CLUSTER_KEYS = ('silhouette', 'compactness', 'centroid_margin',
                 'inter_intra_ratio')


def safe_cluster_metrics(z: np.ndarray, num_classes: int) -> dict[str, Any]:
  """`metrics.cluster_metrics`, None where undefined (a collapsed encoder)."""
  if len(z) <= num_classes:
    logging.warning('Cluster metrics need more than K = %d points, got %d.',
                    num_classes, len(z))
    return dict.fromkeys(_CLUSTER_KEYS)
  try:
    result = metrics.cluster_metrics(z, num_classes, CLUSTER_SEED)
  except ValueError as e:
    logging.warning('Cluster metrics undefined: %s', e)
    return dict.fromkeys(_CLUSTER_KEYS)
  return {k: float(result[k]) for k in _CLUSTER_KEYS}


def feature_cluster_metrics(test_x: np.ndarray,
                            num_classes: int) -> dict[str, Any]:
  """`metrics.cluster_metrics` of l2-normalised features, K = num_classes.

  Above `MAX_CLUSTER_POINTS` rows, a seeded subsample (silhouette is O(n^2)).

  Returns:
    The four metrics (None where undefined) and 'num_points'.
  """
  z = features.l2_normalise(test_x)
  if len(z) > MAX_CLUSTER_POINTS:
    keep = np.sort(np.random.default_rng(CLUSTER_SEED).choice(
        len(z), MAX_CLUSTER_POINTS, replace=False))
    logging.info('Cluster metrics on %d of %d test points (seed %d).',
                 MAX_CLUSTER_POINTS, len(z), CLUSTER_SEED)
    z = z[keep]
  out = safe_cluster_metrics(z, num_classes)
  out['num_points'] = int(len(z))
  return out


def evaluate(ctx) -> Iterator[tuple[tuple[str, ...], Any]]:
  """The clusters evaluator: cluster metrics of the test embeddings.

  Args:
    ctx: the evaluation's `evaluate.Context`.

  Yields:
    `(('clusters', dataset), metrics)` (`feature_cluster_metrics`) for every
    dataset, and the seed under `('protocol', 'cluster_seed')`.
  """
  embedding = embedding_of(ctx.config)
  trained = ctx.encoders['linear'][1]
  for name in ctx.datasets:
    start = time.perf_counter()
    feats, num_classes = ctx.features(name)
    test_h = feats['linear']['test'][0]
    z = project(ctx.model, trained, test_h) if embedding == 'z' else test_h
    yield ('clusters', name), feature_cluster_metrics(z, num_classes)
    logging.info('clusters %s: %s embedding [%.1f s]', name, embedding,
                 time.perf_counter() - start)
  yield ('protocol', 'cluster_seed'), CLUSTER_SEED


def embedding_of(config: ml_collections.ConfigDict) -> str:
  """`config.eval.embedding`, checked against `EMBEDDINGS`."""
  embedding = config.eval.embedding
  if embedding not in EMBEDDINGS:
    raise ValueError(f'config.eval.embedding must be one of '
                     f'{tuple(EMBEDDINGS)}, got {embedding!r}.')
  return embedding


def project(model, variables: dict[str, Any], features: np.ndarray,
            batch_size: int = 4096) -> np.ndarray:
  """Embeddings z (not normalised) of cached features h: z = g(h).

  Args:
    model: the run's network (`experiment.create_model`).
    variables: its {'params', 'batch_stats'}.
    features: float32 [N, 512] backbone features h.
    batch_size: rows per call.

  Returns:
    float32 [N, D], D the embedding width of the method's network.
  """
  apply = jax.jit(functools.partial(methods.for_model(model).embed, model))
  return np.concatenate([
      np.asarray(apply(variables, jnp.asarray(features[i:i + batch_size])))
      for i in range(0, len(features), batch_size)]).astype(np.float32)


def recompute_batch_stats(model, variables: dict[str, Any],
                          images: np.ndarray,
                          batch_size: int) -> dict[str, Any]:
  """BatchNorm statistics re-estimated on clean images (precise BN).

  Each batch runs in training mode; every BatchNorm input's per-channel
  mean mu_b and biased variance var_b are pooled with weights n_b:
  mean = sum_b n_b mu_b / N, var = sum_b n_b (var_b + mu_b^2) / N - mean^2.
  Batches are not padded, which would weight repeated images.

  Args:
    model: the run's network.
    variables: {'params', 'batch_stats'}; batch_stats give the structure.
    images: uint8 [N, S, S, 3] clean images (no augmentation).
    batch_size: images per call.

  Returns:
    A batch_stats tree like `variables['batch_stats']`, float32 [C] leaves.

  Raises:
    ValueError: no images, or a BatchNorm the forward pass did not reach.
  """
  if len(images) == 0:
    raise ValueError('recompute_batch_stats: no images.')

  @jax.jit
  def moments(variables, batch):
    found = {}

    def record(next_fun, args, kwargs, context):
      if (isinstance(context.module, nn.BatchNorm)
          and context.method_name == '__call__'):
        x = jnp.asarray(args[0], jnp.float32)
        axes = tuple(range(x.ndim - 1))
        mean = jnp.mean(x, axes)
        found['/'.join(context.module.path)] = (
            mean, jnp.mean(jnp.square(x - mean), axes))
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
      model.apply(variables, batch.astype(jnp.float32) / 255.0, train=True,
                  mutable=['batch_stats'])
    return found

  sums: dict[str, list[np.ndarray]] = {}
  for batch in data.eval_batches(images, batch_size):
    n = float(len(batch))
    for path, (mean, var) in jax.device_get(
        moments(variables, jnp.asarray(batch))).items():
      # Host float64: var = E[x^2] - mean^2 cancels badly in float32.
      mean = np.asarray(mean, np.float64)
      pooled = sums.setdefault(path, [0.0, 0.0])
      pooled[0] = pooled[0] + n * mean
      pooled[1] = pooled[1] + n * (np.asarray(var, np.float64) + mean**2)

  total = float(len(images))
  stats = {}
  for key in traverse_util.flatten_dict(variables['batch_stats']):
    path = '/'.join(key[:-1])  # key: the BatchNorm's path, then mean or var
    if path not in sums:
      raise ValueError(f'BatchNorm {path} was not reached by the forward '
                       'pass; its statistics cannot be re-estimated.')
    mean = sums[path][0] / total
    var = np.maximum(sums[path][1] / total - mean**2, 0.0)
    stats[key] = (mean if key[-1] == 'mean' else var).astype(np.float32)
  return traverse_util.unflatten_dict(stats)
