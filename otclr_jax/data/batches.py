"""Deterministic batches of a split held in host memory."""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Iterator

import numpy as np

from otclr_jax.data import types

# Ends the prefetch queue.
_DONE = object()


def steps_per_epoch(num_examples: int, batch_size: int,
                    what: str = 'the dataset') -> int:
  """N // B, the full batches in one epoch (the last partial one is dropped).

  Args:
    num_examples: N >= 1.
    batch_size: B, 1 <= B <= N.
    what: names the split in the error, e.g. 'digits/train'.

  Raises:
    BatchSizeError: B > N.
  """
  num_examples = _check_int(num_examples, 'num_examples', 1)
  batch_size = _check_int(batch_size, 'batch_size', 1)
  if batch_size > num_examples:
    raise types.BatchSizeError(
        f'batch_size={batch_size} is larger than {what} '
        f'({num_examples} examples); use a smaller batch_size.')
  return num_examples // batch_size


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """int64 [N] order of an epoch: `default_rng([seed, epoch])`, both >= 0."""
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


def train_batches(images: np.ndarray, batch_size: int, seed: int,
                  start_step: int = 0, *,
                  prefetch: int = 2) -> Iterator[np.ndarray]:
  """Endless training batches, deterministic given the seed.

  Step t is batch t % (N // B) of epoch t // (N // B) (`epoch_permutation`),
  so starting at `start_step` resumes an uninterrupted run exactly.

  Args:
    images: [N, ...] array, normally uint8 [N, S, S, 3].
    batch_size: B, 1 <= B <= N.
    seed: non-negative integer.
    start_step: first global step to produce (e.g. the restored step).
    prefetch: batches a thread gathers ahead (0: none); same batches.

  Returns:
    An iterator of arrays [B, ...] with the dtype of `images`.
  """
  images = _check_images(images)
  spe = steps_per_epoch(len(images), batch_size)
  seed = _check_int(seed, 'seed', 0)
  start_step = _check_int(start_step, 'start_step', 0)
  prefetch = _check_int(prefetch, 'prefetch', 0)
  batches = _train_batch_generator(images, batch_size, seed, start_step, spe)
  if prefetch:
    return _prefetch(batches, prefetch)
  return batches


def eval_batches(images: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
  """All examples once, in order, in batches of B; the last is not padded.

  Args:
    images: [N, ...] array.
    batch_size: B >= 1 (may exceed N: one batch of N).

  Returns:
    An iterator of views [B, ...] of `images`, the last maybe [N % B, ...].
  """
  images = _check_images(images)
  batch_size = _check_int(batch_size, 'batch_size', 1)
  return (images[i:i + batch_size] for i in range(0, len(images), batch_size))


def _check_int(value: Any, what: str, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f'{what} must be an integer, got {value!r}.')
  if value < minimum:
    raise ValueError(f'{what} must be >= {minimum}, got {value}.')
  return int(value)


def _check_images(images: Any) -> np.ndarray:
  if not isinstance(images, np.ndarray) or images.ndim < 1:
    raise ValueError(
        'images must be a NumPy array [N, ...] (e.g. Split.images), got '
        f'{type(images).__name__}.')
  return images


def _train_batch_generator(images: np.ndarray, batch_size: int, seed: int,
                           start_step: int, spe: int) -> Iterator[np.ndarray]:
  epoch, first = divmod(start_step, spe)
  while True:
    order = epoch_permutation(len(images), seed, epoch)
    for i in range(first, spe):
      yield images[order[i * batch_size:(i + 1) * batch_size]]
    first = 0
    epoch += 1


def _prefetch(iterator: Iterator[Any], size: int) -> Iterator[Any]:
  """`iterator` run `size` items ahead in a daemon thread, which stops once
  the returned iterator is dropped."""
  q = queue.Queue(maxsize=size)
  stop = threading.Event()

  def put(entry) -> bool:
    while not stop.is_set():
      try:
        q.put(entry, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def fill() -> None:
    try:
      for item in iterator:
        if not put((item, None)):
          return
      put((_DONE, None))
    except Exception as e:  # pylint: disable=broad-except
      put((_DONE, e))

  def drain() -> Iterator[Any]:
    while (entry := q.get())[0] is not _DONE:
      yield entry[0]
    if entry[1] is not None:
      raise entry[1]

  threading.Thread(target=fill, daemon=True).start()
  items = drain()
  weakref.finalize(items, stop.set)
  return items
