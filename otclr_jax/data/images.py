"""Image decoding and resizing on the host, and the host-memory limit."""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import time
from typing import Any, Callable, Iterable

from absl import logging
import numpy as np
from PIL import Image

from otclr_jax.data import types

MIN_IMAGE_SIZE = 8
MAX_IN_MEMORY_BYTES = 8 * 2**30

_LOG_EVERY = 10_000
_CHUNK = 1024
_SUBCHUNK = 64


def check_image_size(image_size: Any) -> int:
  """Returns `image_size` as an int, or raises DataError."""
  if isinstance(image_size, bool) or not isinstance(image_size,
                                                    (int, np.integer)):
    raise types.DataError(
        f'image_size must be an integer, got {image_size!r}.')
  if image_size < MIN_IMAGE_SIZE:
    raise types.DataError(
        f'image_size={image_size} is too small; use at least '
        f'{MIN_IMAGE_SIZE} (e.g. 32 for CIFAR-sized images).')
  return int(image_size)


def check_fits(num_examples: int | None, image_size: int, what: str) -> None:
  """Refuses a split whose uint8 array would exceed `MAX_IN_MEMORY_BYTES`."""
  if num_examples is None:
    return
  needed = num_examples * image_size * image_size * 3
  if needed > MAX_IN_MEMORY_BYTES:
    raise types.DataError(
        f'{what} at image_size={image_size} needs {needed / 2**30:.1f} GiB of '
        f'host memory as uint8, more than MAX_IN_MEMORY_BYTES='
        f'{MAX_IN_MEMORY_BYTES / 2**30:.1f} GiB. This input pipeline keeps '
        'whole splits in memory and has no streaming mode: use a smaller '
        'image_size or a subset (e.g. imagenet300), or raise '
        'otclr_jax.data.images.MAX_IN_MEMORY_BYTES if the host has the '
        'memory.')


def square_resize(image: np.ndarray, image_size: int) -> np.ndarray:
  """Centre-crops an image to a square and resizes it with antialiasing.

  Args:
    image: uint8 [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] (alpha dropped).
    image_size: output side S.

  Returns:
    uint8 [S, S, 3].
  """
  image = np.asarray(image)
  if image.dtype != np.uint8:
    raise ValueError(f'expected a uint8 image, got {image.dtype}.')
  if image.ndim == 2:
    image = image[..., None]
  if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
    raise ValueError(f'expected an image [H, W, 1|3|4], got {image.shape}.')
  if image.shape[-1] == 1:
    image = np.repeat(image, 3, axis=-1)
  elif image.shape[-1] == 4:
    image = image[..., :3]
  height, width = image.shape[:2]
  side = min(height, width)
  top, left = (height - side) // 2, (width - side) // 2
  image = image[top:top + side, left:left + side]
  if side == image_size:
    return np.array(image)
  resized = Image.fromarray(np.ascontiguousarray(image)).resize(
      (image_size, image_size), Image.Resampling.BICUBIC)
  return np.asarray(resized)


def pillow_rgb(path: str) -> np.ndarray:
  """Decodes an image file to uint8 RGB [H, W, 3] exactly as TF does.

  Raises:
    OSError, ValueError: the file is empty, truncated or not an image.
  """
  with Image.open(path) as image:
    image.load()
    if image.mode == 'I' or image.mode.startswith('I;16'):
      gray = np.asarray(image).astype(np.int64)
      if gray.min(initial=0) < 0 or gray.max(initial=0) > 0xFFFF:
        raise ValueError(f'{path}: mode {image.mode} values outside the '
                         '16-bit range.')
      return np.repeat((gray >> 8).astype(np.uint8)[..., None], 3, axis=-1)
    return np.asarray(image.convert('RGB'))


def map_images(fn: Callable[[Any], np.ndarray], items: Iterable[Any],
               num_items: int | None, image_size: int, what: str) -> np.ndarray:
  """Applies `fn` (-> uint8 [S, S, 3]) to items in a thread pool, in order.

  Args:
    fn: decodes and resizes one item (paths, images, tfds examples).
    items, num_items: the items and how many (None: unknown).
    image_size: S.
    what: names the split in progress lines and errors.

  Returns:
    uint8 [num_items, S, S, 3].
  """
  workers = max(1, min(16, len(os.sched_getaffinity(0))))
  shape = (image_size, image_size, 3)
  out = None if num_items is None else np.empty((num_items, *shape), np.uint8)
  parts = []
  done = 0
  start = time.perf_counter()
  next_log = _LOG_EVERY

  def run_subchunk(sub):
    return [fn(item) for item in sub]

  iterator = iter(items)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    while chunk := list(itertools.islice(iterator, _CHUNK)):
      subs = [chunk[i:i + _SUBCHUNK] for i in range(0, len(chunk), _SUBCHUNK)]
      results = np.stack([r for rs in pool.map(run_subchunk, subs) for r in rs])
      if out is None:
        parts.append(results)
      elif done + len(results) > num_items:
        raise RuntimeError(
            f'{what}: more than the expected {num_items} images.')
      else:
        out[done:done + len(results)] = results
      done += len(results)
      if done >= next_log:
        rate = done / max(time.perf_counter() - start, 1e-9)
        logging.info('%s: %d/%s images (%.0f images/s)', what, done,
                     num_items if num_items is not None else '?', rate)
        next_log += _LOG_EVERY
  if out is None:
    return (np.concatenate(parts) if parts else np.empty((0, *shape),
                                                         np.uint8))
  if done != num_items:
    raise RuntimeError(f'{what}: got {done} images, expected {num_items}.')
  return out
