"""Host input pipeline: whole datasets as uint8 arrays, deterministic batches.

A split is prepared once into a uint8 array `[N, S, S, 3]` plus int32 labels,
written to a cache file under `data_dir`, and every later run reads the cache.
Batches are gathered on the host from that array and sent to the device as
uint8; augmentation and the cast to float happen on the accelerator.

Datasets (`name` argument of `load_split`):

* `cifar10`, `cifar100`, `svhn_cropped`, `stl10`, `food101`,
  `oxford_iiit_pet`, `imagenet2012`: tensorflow-datasets builders.
* `imagenet300`: a fixed subset of the imagenet2012 train split with 300
  images from each of the 1000 classes; its test split is the imagenet2012
  validation split. Within each class the images are ranked by
  `sha256(IMAGENET300_SALT + '/' + file_name)` (hex digest compared as a
  string, ties impossible because file names are unique) and the 300 lowest
  are kept; see `select_per_class`. The rule depends only on the set of
  (label, file_name) records, not on their order in the TFRecord shards.
* `folder:/path/to/root`: any `root/<split>/<class>/*.{jpg,jpeg,png}` tree,
  the layout read by `tfds.folder_dataset.ImageFolder`. Splits are the
  subdirectory names of `root`; class names are the sorted union of class
  directory names over all splits (as ImageFolder does), labels index them.
  Examples are ordered by (class name, file name). When TensorFlow and
  tensorflow-datasets are importable the images are decoded by ImageFolder,
  otherwise by Pillow. The ImageFolder path decodes JPEG with TF's
  INTEGER_ACCURATE DCT (libjpeg's default, which Pillow uses) instead of TF's
  INTEGER_FAST default, so both paths give identical arrays for PNG and JPEG
  (checked on the JPEG CIFAR-10 tree and in the tests).
* `digits` (default, needs no download): `sklearn.datasets.load_digits`,
  1797 8x8 grayscale images with values 0..16, scaled to uint8 by
  `round(v * 255 / 16)`, replicated to RGB and resized. Split: in each class
  the examples are permuted by `np.random.default_rng(DIGITS_SPLIT_SEED)`
  (one generator, classes in order 0..9) and the first
  `round(DIGITS_TEST_FRACTION * count)` go to test, so the split is a
  stratified 80/20 split that does not depend on the run seed. Each split
  keeps the original dataset order.

Split names: `train` and `test` map to each dataset's natural splits (see
`TFDS_SPLITS`; e.g. food101 and imagenet2012 `test` read `validation`);
stl10 also has `unlabelled` (labels -1) and svhn_cropped `extra`.

Images: grayscale is replicated to three channels and an alpha channel
dropped; a non-square image is centre-cropped to its shorter side, then
resized to `image_size` x `image_size` with Pillow's antialiased bicubic
filter (the filter support widens with the downscaling factor, so
downscaling averages rather than aliases). An image already of the target
size is copied unchanged. A 16-bit PNG keeps the high byte of each value on
both folder backends (`pillow_rgb`). An empty, truncated or non-image file in
a `folder:` tree stops preparation with a ValueError naming it (both
backends; nothing is skipped silently and no cache is written).

Cache: `<data_dir>/otclr_cache/<key>_<split>_<S>px_v1.npz` (uncompressed);
folder datasets use the key `folder-<basename>-<sha256 of the absolute path,
16 hex digits>`, so a changed tree needs its cache file deleted. Files are
written to a temporary name in the same directory and renamed, so a crashed or
concurrent preparation never leaves a half-written cache behind. A cache file
that cannot be read (damaged on disk) is prepared again and overwritten, with
a warning naming it.

Memory: there is no streaming mode. A split whose uint8 array would exceed
`MAX_IN_MEMORY_BYTES` (8 GiB, e.g. imagenet2012 train at 64 px) is refused
with a ValueError before anything is decoded; imagenet2012 at 32 px (3.9 GB)
and imagenet300 up to 96 px fit.

TensorFlow and tensorflow-datasets are imported only inside the functions that
prepare a tfds dataset or decode a folder through ImageFolder, and TF is told
not to use the accelerators (they belong to JAX). Reading a cache, `digits`,
and `folder:` datasets work without TensorFlow installed.

Batches: `train_batches` is endless; epoch e visits the examples in the order
`np.random.default_rng([seed, e]).permutation(N)` and drops the last partial
batch, so any step can be reproduced (resumption from `start_step`). A small
background thread gathers a few batches ahead. `eval_batches` yields every
example once in order; its last batch is smaller, not padded.

A tfds dataset that is not prepared under `data_dir` is downloaded with
`download_and_prepare` only when `download=True` (the default); if that fails
(offline machine, manual download needed) or `download=False`,
`DatasetUnavailableError` explains how to provide the data.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import os
import queue
import re
import threading
import time
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

from absl import logging
import numpy as np
from PIL import Image

from otclr_jax import fileio

# tfds split read for each of our split names.
TFDS_SPLITS = {
    'cifar10': {'train': 'train', 'test': 'test'},
    'cifar100': {'train': 'train', 'test': 'test'},
    'svhn_cropped': {'train': 'train', 'test': 'test', 'extra': 'extra'},
    'stl10': {'train': 'train', 'test': 'test', 'unlabelled': 'unlabelled'},
    'food101': {'train': 'train', 'test': 'validation'},
    'oxford_iiit_pet': {'train': 'train', 'test': 'test'},
    'imagenet2012': {'train': 'train', 'test': 'validation'},
    'imagenet300': {'train': 'train', 'test': 'validation'},
}
_TFDS_SOURCE = {'imagenet300': 'imagenet2012'}
_DIGITS_SPLITS = ('train', 'test')
FOLDER_PREFIX = 'folder:'

MIN_IMAGE_SIZE = 8
MAX_IN_MEMORY_BYTES = 8 * 2**30
IMAGENET300_PER_CLASS = 300
IMAGENET300_NUM_CLASSES = 1000
IMAGENET300_SALT = 'otclr_jax/imagenet300/v1'
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0

_CACHE_SUBDIR = 'otclr_cache'
_CACHE_VERSION = 'v1'
_IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png')
_LOG_EVERY = 10_000
_CHUNK = 1024
_SUBCHUNK = 64


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


class DatasetUnavailableError(RuntimeError):
  """A tfds dataset is neither prepared under data_dir nor downloadable."""


def known_datasets() -> list[str]:
  """Returns the accepted dataset names (`folder:/path` stands for any tree)."""
  return ['digits', *TFDS_SPLITS, FOLDER_PREFIX + '/path/to/root']


def load_split(name: str,
               split: str,
               image_size: int,
               data_dir: str | os.PathLike[str] | None = None,
               *,
               download: bool = True) -> Split:
  """Loads one split as uint8 arrays, preparing and caching it on first use.

  Args:
    name: dataset name, see `known_datasets()`; `folder:/path` for an image
      tree `path/<split>/<class>/*.jpg`.
    split: 'train' or 'test' (plus 'unlabelled' for stl10, 'extra' for
      svhn_cropped; any subdirectory name for folder datasets).
    image_size: side S of the square output images, at least 8.
    data_dir: tfds data directory, also holding the cache in
      `<data_dir>/otclr_cache`. None means $TFDS_DATA_DIR or
      ~/tensorflow_datasets.
    download: whether an unprepared tfds dataset may be downloaded. With False
      a missing dataset fails at once without touching the network.

  Returns:
    The split: images uint8 [N, S, S, 3], labels int32 [N].

  Raises:
    ValueError: unknown dataset or split, image_size < 8, a missing folder,
      or a split too large for host memory.
    DatasetUnavailableError: a tfds dataset that is absent and cannot be
      downloaded.
    ImportError: a tfds dataset must be prepared but TensorFlow or
      tensorflow-datasets is not installed.
  """
  image_size = _check_image_size(image_size)
  data_dir = _resolve_data_dir(data_dir)
  cache_path = _cache_path(name, split, image_size, data_dir)
  if os.path.exists(cache_path):
    logging.info('Loading %s/%s at %d px from cache %s', name, split,
                 image_size, cache_path)
    try:
      return _read_cache(cache_path, image_size)
    # A torn or corrupted .npz raises zipfile.BadZipFile, OSError, EOFError,
    # KeyError or ValueError depending on where it is damaged; the cache is
    # derived data, so it is prepared again and overwritten.
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('Data cache %s is unreadable (%s: %s); preparing %s/%s '
                      'again and rewriting it.', cache_path, type(e).__name__,
                      e, name, split)
  logging.info('Preparing %s/%s at %d px (cache %s)', name, split, image_size,
               cache_path)
  start = time.perf_counter()
  result = _prepare(name, split, image_size, data_dir, download)
  _write_cache(cache_path, result)
  logging.info('Prepared %s/%s: %d images in %.1f s', name, split,
               len(result.labels), time.perf_counter() - start)
  return result


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
  """Number of full batches in one epoch (the last partial batch is dropped).

  Args:
    num_examples: N, the number of training examples.
    batch_size: B, examples per batch, 1 <= B <= N.

  Returns:
    N // B.
  """
  num_examples = _check_int(num_examples, 'num_examples', 1)
  batch_size = _check_int(batch_size, 'batch_size', 1)
  if batch_size > num_examples:
    raise ValueError(
        f'batch_size={batch_size} is larger than the dataset '
        f'({num_examples} examples); use a smaller batch_size.')
  return num_examples // batch_size


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """Example order of one training epoch.

  Args:
    num_examples: N.
    seed: non-negative run seed.
    epoch: non-negative epoch index.

  Returns:
    int64 [N], `np.random.default_rng([seed, epoch]).permutation(N)`.
  """
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


def train_batches(images: np.ndarray,
                  batch_size: int,
                  seed: int,
                  start_step: int = 0,
                  *,
                  prefetch: int = 2) -> Iterator[np.ndarray]:
  """Endless training batches, deterministic given the seed.

  Epoch e visits the examples in the order `epoch_permutation(N, seed, e)`,
  cut into N // B batches; the last partial batch is dropped. Step t is batch
  t % (N // B) of epoch t // (N // B), so an iterator started at `start_step`
  yields exactly what an uninterrupted one yields from that step on.

  Args:
    images: [N, ...] array, normally uint8 [N, S, S, 3].
    batch_size: B, 1 <= B <= N.
    seed: non-negative integer.
    start_step: first global step to produce (e.g. the restored step).
    prefetch: number of batches a background thread gathers ahead; 0 gathers
      in the caller's thread. The batches are the same either way. The thread
      gathers while the caller waits on the device (GIL released); with no
      such wait it only adds queue overhead (0.38 vs 0.27 ms per 256 x 32 px
      batch on 2 CPU cores), with a 2 ms wait it saves ~0.1 ms at 32 px and
      ~0.8 ms at 96 px per step.

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
    return _Prefetcher(batches, prefetch)
  return batches


def eval_batches(images: np.ndarray,
                 batch_size: int) -> Iterator[np.ndarray]:
  """All examples once, in order, in batches of B.

  The last batch is smaller when B does not divide N (no padding): one extra
  compilation of a jitted evaluation function for that shape.

  Args:
    images: [N, ...] array.
    batch_size: B >= 1 (may exceed N: one batch of N).

  Returns:
    An iterator of views [B, ...] of `images`, the last [N % B, ...] if
    nonzero.
  """
  images = _check_images(images)
  batch_size = _check_int(batch_size, 'batch_size', 1)
  return (images[i:i + batch_size] for i in range(0, len(images), batch_size))


def select_per_class(labels: Sequence[int] | np.ndarray,
                     keys: Sequence[str],
                     per_class: int,
                     salt: str) -> np.ndarray:
  """Deterministic per-class subset: the records with the lowest salted hash.

  Within each class the records are ranked by
  `sha256((salt + '/' + key).encode()).hexdigest()` and the `per_class`
  lowest are kept. The result depends only on the set of (label, key) pairs,
  not on their order.

  Args:
    labels: [M] integer class of each record.
    keys: [M] unique string key of each record (imagenet2012: file_name).
    per_class: records kept per class.
    salt: string mixed into the hash; a different salt gives a different,
      equally uniform subset.

  Returns:
    int64 [num_present_classes * per_class], sorted indices into the records.

  Raises:
    ValueError: lengths differ, keys repeat, or a class has fewer than
      `per_class` records.
  """
  labels = np.asarray(labels)
  if labels.ndim != 1 or len(labels) != len(keys):
    raise ValueError(
        f'labels {labels.shape} and keys ({len(keys)}) must be 1-D of equal '
        'length.')
  per_class = _check_int(per_class, 'per_class', 1)
  if len(set(keys)) != len(keys):
    raise ValueError('keys must be unique for the selection to be well '
                     'defined.')
  digests = [hashlib.sha256(f'{salt}/{k}'.encode()).hexdigest() for k in keys]
  selected = []
  for label in np.unique(labels):
    members = np.flatnonzero(labels == label)
    if len(members) < per_class:
      raise ValueError(
          f'class {label} has {len(members)} records, fewer than '
          f'per_class={per_class}.')
    ranked = sorted(members, key=lambda i: digests[i])
    selected.extend(ranked[:per_class])
  return np.sort(np.asarray(selected, dtype=np.int64))


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


# ---------------------------------------------------------------------------
# Validation and cache.


def _check_int(value: Any, what: str, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f'{what} must be an integer, got {value!r}.')
  if value < minimum:
    raise ValueError(f'{what} must be >= {minimum}, got {value}.')
  return int(value)


def _check_image_size(image_size: Any) -> int:
  if isinstance(image_size, bool) or not isinstance(image_size,
                                                    (int, np.integer)):
    raise ValueError(f'image_size must be an integer, got {image_size!r}.')
  if image_size < MIN_IMAGE_SIZE:
    raise ValueError(
        f'image_size={image_size} is too small; use at least '
        f'{MIN_IMAGE_SIZE} (e.g. 32 for CIFAR-sized images).')
  return int(image_size)


def _check_images(images: Any) -> np.ndarray:
  if not isinstance(images, np.ndarray) or images.ndim < 1:
    raise ValueError(
        'images must be a NumPy array [N, ...] (e.g. Split.images), got '
        f'{type(images).__name__}.')
  return images


def _resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> str:
  if data_dir is None:
    data_dir = os.environ.get('TFDS_DATA_DIR', '~/tensorflow_datasets')
  return os.path.abspath(os.path.expanduser(os.fspath(data_dir)))


def _folder_root(name: str) -> str:
  root = name[len(FOLDER_PREFIX):]
  if not root:
    raise ValueError(
        f"dataset {name!r} names no directory; use 'folder:/path/to/root' "
        'with images in root/<split>/<class>/*.jpg.')
  return os.path.abspath(os.path.expanduser(root))


def _dataset_cache_key(name: str, split: str) -> str:
  """Validates name and split; returns the dataset part of the cache key."""
  if not isinstance(name, str):
    raise ValueError(f'dataset name must be a string, got {name!r}.')
  if not isinstance(split, str) or not split:
    raise ValueError(f'split must be a non-empty string, got {split!r}.')
  if name.startswith(FOLDER_PREFIX):
    root = _folder_root(name)
    if os.sep in split or split in ('.', '..'):
      raise ValueError(
          f'split {split!r} must be a subdirectory name of {root}.')
    digest = hashlib.sha256(root.encode()).hexdigest()[:16]
    base = re.sub(r'[^A-Za-z0-9_.-]', '_', os.path.basename(root)) or 'root'
    return f'folder-{base}-{digest}'
  if name == 'digits':
    allowed = _DIGITS_SPLITS
  elif name in TFDS_SPLITS:
    allowed = tuple(TFDS_SPLITS[name])
  else:
    raise ValueError(
        f'unknown dataset {name!r}; expected one of {known_datasets()}.')
  if split not in allowed:
    raise ValueError(
        f'unknown split {split!r} for dataset {name!r}; expected one of '
        f'{list(allowed)}.')
  return name


def _cache_path(name: str, split: str, image_size: int, data_dir: str) -> str:
  return os.path.join(
      data_dir, _CACHE_SUBDIR,
      f'{_dataset_cache_key(name, split)}_{split}_{image_size}px_'
      f'{_CACHE_VERSION}.npz')


def _read_cache(path: str, image_size: int) -> Split:
  """Reads a cache file; any damage raises (ValueError names the file)."""
  with np.load(path, allow_pickle=False) as data:
    images = data['images']
    labels = data['labels']
    num_classes = int(data['num_classes'])
    class_names = [str(c) for c in data['class_names']]
  if (images.dtype != np.uint8 or images.ndim != 4 or
      images.shape[1:] != (image_size, image_size, 3) or
      labels.shape != (len(images),)):
    raise ValueError(
        f'cache file {path} holds images {images.shape} {images.dtype} and '
        f'labels {labels.shape}; expected [N, {image_size}, {image_size}, 3] '
        'uint8.')
  return Split(images, labels.astype(np.int32, copy=False), num_classes,
               class_names)


def _write_cache(path: str, split: Split) -> None:
  fileio.atomic_write(path, lambda f: np.savez(
      f, images=split.images, labels=split.labels,
      num_classes=np.int64(split.num_classes),
      class_names=np.asarray(split.class_names, dtype=np.str_)))


def _check_fits(num_examples: int | None, image_size: int, what: str) -> None:
  if num_examples is None:
    return
  needed = num_examples * image_size * image_size * 3
  if needed > MAX_IN_MEMORY_BYTES:
    raise ValueError(
        f'{what} at image_size={image_size} needs {needed / 2**30:.1f} GiB of '
        f'host memory as uint8, more than MAX_IN_MEMORY_BYTES='
        f'{MAX_IN_MEMORY_BYTES / 2**30:.1f} GiB. This input pipeline keeps '
        'whole splits in memory and has no streaming mode: use a smaller '
        'image_size or a subset (e.g. imagenet300), or raise '
        'otclr_jax.input_pipeline.MAX_IN_MEMORY_BYTES if the host has the '
        'memory.')


# ---------------------------------------------------------------------------
# Preparation.


def _prepare(name: str, split: str, image_size: int, data_dir: str,
             download: bool) -> Split:
  if name == 'digits':
    return _prepare_digits(split, image_size)
  if name.startswith(FOLDER_PREFIX):
    return _prepare_folder(_folder_root(name), split, image_size)
  return _prepare_tfds(name, split, image_size, data_dir, download)


def _map_images(fn: Callable[[Any], np.ndarray],
                items: Iterable[Any],
                num_items: int | None,
                image_size: int,
                what: str) -> np.ndarray:
  """Applies `fn` (-> uint8 [S, S, 3]) to items in a thread pool, in order.

  Pillow releases the GIL while decoding and resizing, so threads use all
  cores. Items are consumed in chunks so that a large stream of decoded
  full-size images never sits in memory at once.
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


def _digits_test_mask(targets: np.ndarray) -> np.ndarray:
  rng = np.random.default_rng(DIGITS_SPLIT_SEED)
  mask = np.zeros(len(targets), dtype=bool)
  for label in range(10):
    members = rng.permutation(np.flatnonzero(targets == label))
    mask[members[:int(round(DIGITS_TEST_FRACTION * len(members)))]] = True
  return mask


def _prepare_digits(split: str, image_size: int) -> Split:
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  digits = datasets.load_digits()
  pixels = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
  test = _digits_test_mask(digits.target)
  keep = test if split == 'test' else ~test
  images = np.stack([square_resize(p, image_size) for p in pixels[keep]])
  labels = digits.target[keep].astype(np.int32)
  return Split(images, labels, 10, [str(i) for i in range(10)])


def _scan_folder(root: str,
                 split: str) -> tuple[list[str], list[tuple[str, int]]]:
  """Lists a root/<split>/<class>/<image> tree like tfds ImageFolder does.

  Returns:
    (class_names, [(path, label)] ordered by (class name, file name)); class
    names are the sorted union of class directories over all splits.
  """
  if not os.path.isdir(root):
    raise ValueError(
        f'folder dataset root {root} is not a directory; expected images in '
        'root/<split>/<class>/*.jpg (tfds.folder_dataset.ImageFolder layout).')
  splits = sorted(d for d in os.listdir(root)
                  if os.path.isdir(os.path.join(root, d)))
  if split not in splits:
    raise ValueError(
        f'unknown split {split!r} for folder dataset {root}; its splits '
        f'(subdirectories) are {splits}.')
  classes = set()
  for s in splits:
    split_dir = os.path.join(root, s)
    classes.update(d for d in os.listdir(split_dir)
                   if os.path.isdir(os.path.join(split_dir, d)))
  class_names = sorted(classes)
  label_of = {c: i for i, c in enumerate(class_names)}
  split_dir = os.path.join(root, split)
  files = []
  for c in sorted(d for d in os.listdir(split_dir)
                  if os.path.isdir(os.path.join(split_dir, d))):
    class_dir = os.path.join(split_dir, c)
    files.extend((os.path.join(class_dir, f), label_of[c])
                 for f in sorted(os.listdir(class_dir))
                 if f.lower().endswith(_IMAGE_EXTENSIONS))
  if not files:
    raise ValueError(
        f'no .jpg/.jpeg/.png images under {split_dir}/<class>/.')
  return class_names, files


def _tensorflow_available() -> bool:
  try:
    import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    # pylint: disable=g-import-not-at-top,unused-import
    import tensorflow_datasets
  except ImportError:
    return False
  return True


def _prepare_folder(root: str,
                    split: str,
                    image_size: int,
                    backend: str = 'auto') -> Split:
  """Decodes a folder split with ImageFolder ('tfds') or Pillow ('pillow')."""
  class_names, files = _scan_folder(root, split)
  what = f'folder {root} split {split}'
  _check_fits(len(files), image_size, what)
  if backend == 'auto':
    backend = 'tfds' if _tensorflow_available() else 'pillow'
  labels = np.asarray([label for _, label in files], dtype=np.int32)
  if backend == 'pillow':

    def decode(path):
      try:
        return square_resize(pillow_rgb(path), image_size)
      except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(
            f'{what}: cannot decode {path} ({type(e).__name__}: {e}). Remove '
            'or replace the file; an empty or truncated download is the '
            'usual cause.') from e

    images = _map_images(decode, (p for p, _ in files), len(files),
                         image_size, what)
  elif backend == 'tfds':
    images = _prepare_folder_tfds(root, split, image_size, class_names, files,
                                  what)
  else:
    raise ValueError(f"backend must be 'auto', 'pillow' or 'tfds', got "
                     f'{backend!r}.')
  return Split(images, labels, len(class_names), class_names)


def pillow_rgb(path: str) -> np.ndarray:
  """Decodes an image file to uint8 RGB [H, W, 3] exactly as TF does.

  Pillow's `convert('RGB')` clips a 16-bit grayscale PNG (mode 'I;16' or
  'I') to 255, turning it almost white; TF keeps the high byte
  (`value >> 8`), as Pillow itself does for 16-bit RGB. Every other mode
  (1, L, LA, P with or without transparency, RGB, RGBA, CMYK JPEG) already
  decodes identically: alpha is dropped, never composited.

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


def _prepare_folder_tfds(root: str, split: str, image_size: int,
                         class_names: list[str],
                         files: list[tuple[str, int]], what: str) -> np.ndarray:
  """ImageFolder decoding, reordered to the (class, file name) order."""
  tf, tfds = _import_tensorflow(what)
  builder = tfds.folder_dataset.ImageFolder(root)
  if list(builder.info.features['label'].names) != class_names:
    raise RuntimeError(
        f'{what}: ImageFolder classes {builder.info.features["label"].names} '
        f'differ from the directory listing {class_names}.')
  position = {os.path.normpath(p): i for i, (p, _) in enumerate(files)}
  order = []  # order[k]: index in `files` of the k-th image ImageFolder yields.
  ds = builder.as_dataset(split=split, shuffle_files=False,
                          decoders={'image': tfds.decode.SkipDecoding()})
  ds = ds.map(
      lambda ex: {**ex, 'image': _tf_decode_image(tf, ex['image'])},
      num_parallel_calls=tf.data.AUTOTUNE)
  # TF's decode error names no file: drop the examples that fail, and name
  # the files that never came out once the stream ends.
  ds = ds.apply(tf.data.experimental.ignore_errors())
  stream = _with_positions(tfds.as_numpy(ds), position, files, order, what)
  images = _map_images(lambda ex: square_resize(ex['image'], image_size),
                       stream, len(files), image_size, what)
  if sorted(order) != list(range(len(files))):
    raise RuntimeError(f'{what}: ImageFolder did not yield every file once.')
  result = np.empty_like(images)
  result[np.asarray(order, dtype=np.int64)] = images
  return result


def _tf_decode_image(tf, encoded):
  """Decodes like Pillow: JPEG with the accurate integer DCT, to RGB uint8.

  TF's default JPEG method (INTEGER_FAST) differs from Pillow by a few levels;
  INTEGER_ACCURATE matches libjpeg's default that Pillow uses.
  """
  return tf.cond(
      tf.io.is_jpeg(encoded),
      lambda: tf.io.decode_jpeg(encoded, channels=3,
                                dct_method='INTEGER_ACCURATE'),
      lambda: tf.io.decode_image(encoded, channels=3, dtype=tf.uint8,
                                 expand_animations=False))


def _with_positions(stream: Iterable[dict[str, Any]], position: dict[str, int],
                    files: list[tuple[str, int]], order: list[int],
                    what: str) -> Iterator[dict[str, Any]]:
  """Records each example's canonical index (in stream order) as it passes."""
  for example in stream:
    path = os.path.normpath(example['image/filename'].decode())
    index = position.get(path)
    if index is None or example['label'] != files[index][1]:
      raise RuntimeError(
          f'{what}: ImageFolder yielded {path} with label {example["label"]}, '
          'which the directory listing does not have.')
    order.append(index)
    yield example
  missing = sorted(set(range(len(files))) - set(order))
  if missing:
    names = [files[i][0] for i in missing]
    raise ValueError(
        f'{what}: {len(names)} file(s) cannot be decoded as images (empty, '
        f'truncated or not an image): {", ".join(names[:20])}'
        f'{", ..." if len(names) > 20 else ""}. Remove or replace them.')


def _import_tensorflow(what: str):
  """Imports TF and tfds (lazily: only preparation needs them)."""
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        f'preparing {what} needs tensorflow and tensorflow-datasets '
        f'({e}). Install them (pip install tensorflow-cpu '
        'tensorflow-datasets), or prepare the cache on a machine that has '
        "them, or use dataset='digits' or 'folder:/path'.") from e
  try:
    # The accelerators belong to JAX; TF only decodes on the host.
    tf.config.set_visible_devices([], 'GPU')
    tf.config.set_visible_devices([], 'TPU')
  except (RuntimeError, ValueError):
    pass  # Devices already initialised or no such device type.
  return tf, tfds


def _how_to_provide(name: str, data_dir: str) -> str:
  manual_dir = os.path.join(data_dir, 'downloads', 'manual')
  command = (f'import tensorflow_datasets as tfds; tfds.builder({name!r}, '
             f'data_dir={data_dir!r}).download_and_prepare()')
  return (
      'To provide it:\n'
      f'  (1) on a machine with internet access run\n'
      f'        python -c "{command}"\n'
      f'      and copy {os.path.join(data_dir, name)} to this machine '
      '(data_dir comes from config.data_dir);\n'
      '  (2) for datasets that need a manual download (imagenet2012), put '
      f'the archives in the tfds manual_dir {manual_dir} and run '
      'download_and_prepare as in (1);\n'
      '  (3) or lay the images out as root/<split>/<class>/*.jpg '
      '(tfds.folder_dataset.ImageFolder layout) and use '
      "dataset='folder:/root'.")


def _tfds_builder(tfds, name: str, data_dir: str, download: bool):
  """A prepared builder for `name`, or a DatasetUnavailableError."""
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # pylint: disable=broad-except
    raise DatasetUnavailableError(
        f'tensorflow-datasets cannot build {name!r} under data_dir={data_dir}: '
        f'{type(e).__name__}: {e}\n' + _how_to_provide(name, data_dir)) from e
  if builder.is_prepared():
    return builder
  if not download:
    raise DatasetUnavailableError(
        f'dataset {name!r} is not prepared under data_dir={data_dir} and '
        'download=False.\n' + _how_to_provide(name, data_dir))
  logging.info('%s is not prepared under %s; trying download_and_prepare.',
               name, data_dir)
  try:
    builder.download_and_prepare()
  except Exception as e:  # pylint: disable=broad-except
    hint = ''
    if isinstance(e, ModuleNotFoundError) and e.name:
      # tensorflow-datasets 4.9.x needs importlib_resources to download but
      # declares it only for Python < 3.9 (tensorflow/datasets#11212).
      hint = f' Install the missing module: pip install {e.name}.'
    raise DatasetUnavailableError(
        f'dataset {name!r} is not prepared under data_dir={data_dir} and '
        f'could not be downloaded ({type(e).__name__}: {e}).{hint}\n' +
        _how_to_provide(name, data_dir)) from e
  return builder


def _num_examples(builder, tfds_split: str, ds) -> int | None:
  try:
    return int(builder.info.splits[tfds_split].num_examples)
  except (KeyError, ValueError, TypeError):
    cardinality = int(ds.cardinality())
    return cardinality if cardinality >= 0 else None


def _prepare_tfds(name: str, split: str, image_size: int, data_dir: str,
                  download: bool) -> Split:
  """Decodes a tfds split (imagenet300: the subset) into uint8 arrays."""
  source = _TFDS_SOURCE.get(name, name)
  tfds_split = TFDS_SPLITS[name][split]
  what = f'{name}/{split} (tfds {source}/{tfds_split})'
  tf, tfds = _import_tensorflow(what)
  builder = _tfds_builder(tfds, source, data_dir, download)
  label_feature = builder.info.features['label']
  class_names = [str(c) for c in label_feature.names]
  if name == 'imagenet300' and split == 'train':
    images, labels = _prepare_imagenet300_train(tf, tfds, builder, image_size,
                                                what)
  else:
    # Parse only image and label (oxford_iiit_pet also has masks and boxes).
    ds = builder.as_dataset(
        split=tfds_split, shuffle_files=False,
        decoders=tfds.decode.PartialDecoding({'image': True, 'label': True}))
    num_examples = _num_examples(builder, tfds_split, ds)
    _check_fits(num_examples, image_size, what)
    labels = []

    def take(example):
      labels.append(example['label'])
      return example['image']

    stream = (take(ex) for ex in tfds.as_numpy(ds))
    images = _map_images(lambda im: square_resize(im, image_size), stream,
                         num_examples, image_size, what)
    labels = np.asarray(labels, dtype=np.int32)
  return Split(images, labels, int(label_feature.num_classes), class_names)


def _prepare_imagenet300_train(tf, tfds, builder, image_size: int,
                               what: str) -> tuple[np.ndarray, np.ndarray]:
  """Two passes over imagenet2012 train: choose by file name, then decode."""
  num_selected = IMAGENET300_PER_CLASS * IMAGENET300_NUM_CLASSES
  _check_fits(num_selected, image_size, what)
  names_ds = builder.as_dataset(
      split='train', shuffle_files=False,
      decoders=tfds.decode.PartialDecoding({'file_name': True, 'label': True}))
  logging.info('%s: reading file names and labels of every image.', what)
  keys, labels = [], []
  for file_name, label in tfds.as_numpy(
      names_ds.map(lambda ex: (ex['file_name'], ex['label']))):
    keys.append(file_name.decode())
    labels.append(int(label))
  labels = np.asarray(labels, dtype=np.int32)
  if len(np.unique(labels)) != IMAGENET300_NUM_CLASSES:
    raise RuntimeError(
        f'{what}: expected {IMAGENET300_NUM_CLASSES} classes, found '
        f'{len(np.unique(labels))}.')
  chosen = select_per_class(labels, keys, IMAGENET300_PER_CLASS,
                            IMAGENET300_SALT)
  chosen_keys = [keys[i] for i in chosen]
  table = tf.lookup.StaticHashTable(
      tf.lookup.KeyValueTensorInitializer(
          tf.constant(chosen_keys), tf.ones(len(chosen_keys), tf.int32)),
      default_value=0)
  image_feature = builder.info.features['image']
  ds = builder.as_dataset(
      split='train', shuffle_files=False,
      decoders=tfds.decode.PartialDecoding(
          {'image': True, 'file_name': True},
          decoders={'image': tfds.decode.SkipDecoding()}))
  selected = ds.filter(lambda ex: table.lookup(ex['file_name']) > 0).map(
      lambda ex: {'image': image_feature.decode_example(ex['image']),
                  'file_name': ex['file_name']},
      num_parallel_calls=tf.data.AUTOTUNE)
  seen = []

  def take(example):
    seen.append(example['file_name'].decode())
    return example['image']

  stream = (take(ex) for ex in tfds.as_numpy(selected))
  images = _map_images(lambda im: square_resize(im, image_size), stream,
                       len(chosen), image_size, what)
  if seen != chosen_keys:
    raise RuntimeError(f'{what}: the second pass read a different order.')
  return images, labels[chosen]


# ---------------------------------------------------------------------------
# Batching.


def _train_batch_generator(images: np.ndarray, batch_size: int, seed: int,
                           start_step: int, spe: int) -> Iterator[np.ndarray]:
  epoch, first = divmod(start_step, spe)
  while True:
    order = epoch_permutation(len(images), seed, epoch)
    for i in range(first, spe):
      yield images[order[i * batch_size:(i + 1) * batch_size]]
    first = 0
    epoch += 1


class _Prefetcher:
  """Runs an iterator in a daemon thread, `size` items ahead of the reader.

  The thread holds no reference to this object, so dropping the iterator
  (or calling `close`) stops the thread.
  """

  _DONE = object()

  def __init__(self, iterator: Iterator[Any], size: int):
    self._queue = queue.Queue(maxsize=size)
    self._stop = threading.Event()
    self._thread = threading.Thread(
        target=_Prefetcher._fill, args=(iterator, self._queue, self._stop),
        daemon=True)
    self._thread.start()

  @staticmethod
  def _fill(iterator: Iterator[Any], q: queue.Queue,
            stop: threading.Event) -> None:
    def put(entry) -> bool:
      while not stop.is_set():
        try:
          q.put(entry, timeout=0.1)
          return True
        except queue.Full:
          continue
      return False

    try:
      for item in iterator:
        if not put((item, None)):
          return
      put((_Prefetcher._DONE, None))
    except Exception as e:  # pylint: disable=broad-except
      put((_Prefetcher._DONE, e))

  def __iter__(self) -> '_Prefetcher':
    return self

  def __next__(self) -> Any:
    item, error = self._queue.get()
    if item is _Prefetcher._DONE:
      self._stop.set()
      if error is not None:
        raise error
      raise StopIteration
    return item

  def close(self) -> None:
    self._stop.set()

  def __del__(self):
    self._stop.set()
