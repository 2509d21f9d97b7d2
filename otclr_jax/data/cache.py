"""Splits prepared once and cached on disk, bound to what they were made from.

Cache: `<data_dir>/otclr_cache/<key>_<split>_<S>px_v1.npz`; a stale or
unreadable one is prepared again and overwritten.
"""

from __future__ import annotations

import errno
import json
import os
import time
from typing import Any, Sequence

from absl import logging
import numpy as np

from otclr_jax import fileio
from otclr_jax.data import images as images_lib
from otclr_jax.data import sources
from otclr_jax.data import types

_CACHE_SUBDIR = 'otclr_cache'
_CACHE_VERSION = 'v1'
# Kept in memory on these; other write failures (a full disk) stop the run.
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def cache_path(name: str, split: str, image_size: int, data_dir: str) -> str:
  """The cache file of one split at one image size."""
  return os.path.join(
      data_dir, _CACHE_SUBDIR,
      f'{sources.dataset_key(name, split)}_{split}_{image_size}px_'
      f'{_CACHE_VERSION}.npz')


def load_split(name: str, split: str, image_size: int,
               data_dir: str | os.PathLike[str] | None = None, *,
               download: bool = True) -> types.Split:
  """Loads one split as uint8 arrays, preparing and caching it on first use.

  Args:
    name: dataset name, see `sources.known_datasets()`.
    split: 'train', 'test' or another the dataset has.
    image_size: side S of the square output images, at least 8.
    data_dir: tfds data directory, also holding `otclr_cache/`. None means
      $TFDS_DATA_DIR or ~/tensorflow_datasets.
    download: whether an unprepared tfds dataset may be downloaded.

  Returns:
    The split: images uint8 [N, S, S, 3], labels int32 [N].

  Raises:
    DataError: a bad dataset, split or size, or an undecodable file.
    SplitNotFoundError: the dataset has no such split.
    DatasetUnavailableError: a tfds dataset absent and not downloadable.
    ImportError: preparing a tfds dataset without TensorFlow.
  """
  image_size = images_lib.check_image_size(image_size)
  if data_dir is None:
    data_dir = os.environ.get('TFDS_DATA_DIR', '~/tensorflow_datasets')
  data_dir = os.path.abspath(os.path.expanduser(os.fspath(data_dir)))
  path = cache_path(name, split, image_size, data_dir)
  source = sources.describe(name, split)
  if os.path.exists(path):
    logging.info('Loading %s/%s at %d px from cache %s', name, split,
                 image_size, path)
    cached = _read_if_current(path, image_size, source, f'{name}/{split}')
    if cached is not None:
      return cached
  logging.info('Preparing %s/%s at %d px (cache %s)', name, split, image_size,
               path)
  start = time.perf_counter()
  result, made_from = sources.prepare(name, split, image_size, data_dir,
                                      download)
  try:
    write(path, result, made_from)
  except OSError as e:
    if e.errno not in _NOT_WRITABLE:
      raise
    logging.warning(
        'Cannot write the data cache %s (%s); using %s/%s from memory, so '
        'every run prepares it again (set config.data_dir to a writable '
        'directory to keep it).', path, e.strerror or e, name, split)
  logging.info('Prepared %s/%s: %d images in %.1f s', name, split,
               len(result.labels), time.perf_counter() - start)
  return result


def load_splits(name: str, splits: Sequence[str], image_size: int,
                data_dir: str | os.PathLike[str] | None = None, *,
                download: bool = True) -> dict[str, types.Split]:
  """{split: Split} of one dataset's `splits`, checked to share one class list.

  Raises:
    DataError: the class lists differ, or as `load_split`.
  """
  for _ in range(2):
    out = {s: load_split(name, s, image_size, data_dir, download=download)
           for s in splits}
    differences = _class_list_differences(out)
    if not differences:
      return out
    logging.warning('%s: the splits have different class lists (%s); '
                    'loading them again.', name, differences)
  raise types.DataError(
      f'{name}: the splits have different class lists ({differences}); the '
      'dataset changed while it was read.')


def _class_list_differences(loaded: dict[str, types.Split]) -> str:
  """'' when every split has the first split's class list, else how not."""
  (first, reference), *others = loaded.items()
  out = []
  for split, other in others:
    if list(other.class_names) != list(reference.class_names):
      added = sorted(set(other.class_names) - set(reference.class_names))
      lacks = sorted(set(reference.class_names) - set(other.class_names))
      out.append(f'{split} has {len(other.class_names)} classes to {first}\'s '
                 f'{len(reference.class_names)}, adding {added[:5]} and '
                 f'lacking {lacks[:5]}')
  return '; '.join(out)


def read(path: str, image_size: int) -> tuple[types.Split, Any]:
  """A cache file's split and recorded source (or None); raises if damaged."""
  with np.load(path, allow_pickle=False) as data:
    images = data['images']
    labels = data['labels']
    num_classes = int(data['num_classes'])
    class_names = [str(c) for c in data['class_names']]
    source = json.loads(str(data['source'])) if 'source' in data else None
  if (images.dtype != np.uint8 or images.ndim != 4 or
      images.shape[1:] != (image_size, image_size, 3) or
      labels.shape != (len(images),)):
    raise ValueError(
        f'cache file {path} holds images {images.shape} {images.dtype} and '
        f'labels {labels.shape}; expected [N, {image_size}, {image_size}, 3] '
        'uint8.')
  return (types.Split(images, labels.astype(np.int32, copy=False),
                      num_classes, class_names), source)


def write(path: str, split: types.Split, source: dict[str, Any]) -> None:
  """Writes a cache file atomically, with what the split was made from."""
  fileio.atomic_write(path, lambda f: np.savez(
      f, images=split.images, labels=split.labels,
      num_classes=np.int64(split.num_classes),
      class_names=np.asarray(split.class_names, dtype=np.str_),
      source=np.asarray(json.dumps(source, sort_keys=True))))


def _read_if_current(path: str, image_size: int, source: dict[str, Any],
                     what: str) -> types.Split | None:
  """The cached split, or None (one warning) when unreadable or stale."""
  try:
    split, stored = read(path, image_size)
  # Damage raises many types; the cache is derived data, so prepare it again.
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('Data cache %s is unreadable (%s: %s); preparing %s '
                    'again and rewriting it.', path, type(e).__name__, e, what)
    return None
  if stored != source:
    logging.warning('Data cache %s is stale: %s; preparing %s again and '
                    'rewriting it.', path, _why_stale(stored, source), what)
    return None
  return split


def _why_stale(stored: Any, now: dict[str, Any]) -> str:
  """One phrase saying how a cache's recorded source differs from `now`."""
  if not isinstance(stored, dict):
    return 'it does not record what it was made from'
  if stored.get('classes') != now.get('classes') and 'classes' in now:
    before, after = stored.get('classes') or [], now['classes']
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    return (f'the class list changed (added {added[:10]}, removed '
            f'{removed[:10]}; {len(before)} -> {len(after)} classes)')
  if stored.get('digest') != now.get('digest') and 'digest' in now:
    return (f'the files of the split changed ({stored.get("files")} -> '
            f'{now["files"]} files, or their sizes or modification times)')
  return f'it was made from {stored}, not {now}'
