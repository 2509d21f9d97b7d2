"""Weighted kNN top-1 on l2-normalised features (InstDisc / solo-learn)."""

from __future__ import annotations

import functools
import time
from typing import Any, Iterator

from absl import logging

import jax
import jax.numpy as jnp
import numpy as np

from otclr_jax.evaluation import features

KNN_K = 200
KNN_TEMPERATURE = 0.07
# kNN's part of `rundir.PROTOCOL_FIELDS`, as results.json records it.
PROTOCOL = {'knn_k': KNN_K, 'knn_temperature': KNN_TEMPERATURE}
# Bound on the [rows, N_train] similarity slab of one kNN chunk.
KNN_MAX_SLAB = 2**26


@functools.partial(jax.jit, static_argnames=('k', 'num_classes'))
def _knn_predict(train_z, train_y, test_chunks, temperature, *, k,
                 num_classes):
  def chunk(rows):
    # TF32 noise would change the ranking.
    sim, idx = jax.lax.top_k(
        jnp.matmul(rows, train_z.T, precision=jax.lax.Precision.HIGHEST), k)
    # Scaled by the row's largest weight: exp(cos / T) overflows float32 for
    # T below ~0.0113, and the vote's argmax is scale-free.
    top = jnp.max(sim, axis=1, keepdims=True)  # sim[:, :1] is 20x slower
    weights = jnp.exp((sim - top) / temperature)
    votes = jax.vmap(lambda l, w: jnp.zeros(num_classes).at[l].add(w))(
        train_y[idx], weights)
    return jnp.argmax(votes, axis=1)
  return jax.lax.map(chunk, test_chunks)


def knn_top1(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray,
             test_y: np.ndarray, num_classes: int, *, k: int = KNN_K,
             temperature: float = KNN_TEMPERATURE) -> float:
  """Weighted kNN (InstDisc): the k nearest vote with exp(cos / temperature).

  Args:
    train_x: float [N, D].
    train_y: int [N] in [0, num_classes).
    test_x: float [M, D].
    test_y: int [M].
    num_classes: C.
    k: neighbours.
    temperature: > 0.

  Returns:
    Top-1 accuracy on the test rows, percent (ties: smallest class).
  """
  if k < 1 or temperature <= 0:
    raise ValueError(f'need k >= 1 and temperature > 0, got {k}, '
                     f'{temperature}.')
  if not (np.isfinite(train_x).all() and np.isfinite(test_x).all()):
    raise ValueError('kNN features must be finite (NaN or inf would vote).')
  train_z = features.l2_normalise(train_x)
  test_z = features.l2_normalise(test_x)
  num_test = len(test_z)
  if num_test == 0 or len(train_z) == 0:
    raise ValueError('kNN needs at least one train and one test row.')
  # Out of range, a train label's votes would be dropped silently.
  features.check_labels(num_classes, train=train_y, test=test_y)
  rows = int(max(1, min(256, KNN_MAX_SLAB // len(train_z), num_test)))
  num_chunks = -(-num_test // rows)
  chunks = features.pad_rows(
      test_z, num_chunks * rows).reshape(num_chunks, rows, -1)
  pred = _knn_predict(jnp.asarray(train_z), jnp.asarray(train_y, jnp.int32),
                      jnp.asarray(chunks), jnp.float32(temperature),
                      k=min(k, len(train_z)), num_classes=num_classes)
  pred = np.asarray(pred).reshape(-1)[:num_test]
  return 100.0 * float(np.mean(pred == np.asarray(test_y)))


def evaluate(ctx) -> Iterator[tuple[tuple[str, ...], Any]]:
  """The kNN evaluator: weighted kNN top-1 of every encoder on every dataset.

  Args:
    ctx: the evaluation's `evaluate.Context`.

  Yields:
    `((row, dataset, 'knn_top1'), percent)` for the rows of `ctx.encoders`,
    and the kNN settings under `('protocol', ...)`.
  """
  for name in ctx.datasets:
    feats, num_classes = ctx.features(name)
    for row_name, by_split in feats.items():
      start = time.perf_counter()
      top1 = knn_top1(*by_split['train'], *by_split['test'], num_classes)
      logging.info('%s %s: kNN top-1 %.2f%% [%.1f s]', row_name, name, top1,
                   time.perf_counter() - start)
      yield (row_name, name, 'knn_top1'), top1
      # The protocol's k, or every train image where there are fewer.
      yield (row_name, name, 'knn_k'), min(KNN_K, len(by_split['train'][1]))
  for field, value in PROTOCOL.items():
    yield ('protocol', field), value
