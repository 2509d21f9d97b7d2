"""The dataset registry: tfds (`tfds_sources`), `folder:/root` and `digits`.

`digits` is sklearn's, split 80/20 per class by `DIGITS_SPLIT_SEED`.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import numpy as np

from otclr_jax.data import folder
from otclr_jax.data import images as images_lib
from otclr_jax.data import tfds_sources
from otclr_jax.data import types

FOLDER_PREFIX = 'folder:'
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0
_DIGITS_SPLITS = ('train', 'test')
_DIGITS_SOURCE = {'kind': 'digits', 'test_fraction': DIGITS_TEST_FRACTION,
                  'split_seed': DIGITS_SPLIT_SEED}


def known_datasets() -> list[str]:
  """Returns the accepted dataset names (`folder:/path` stands for any tree)."""
  return ['digits', *tfds_sources.TFDS_SPLITS, FOLDER_PREFIX + '/path/to/root']


def folder_root(name: str) -> str:
  """The absolute root of a `folder:` dataset name (`~` expanded)."""
  root = name[len(FOLDER_PREFIX):]
  if not root:
    raise types.DataError(
        f"dataset {name!r} names no directory; use 'folder:/path/to/root' "
        'with images in root/<split>/<class>/*.jpg.')
  return os.path.abspath(os.path.expanduser(root))


def dataset_key(name: str, split: str) -> str:
  """The cache key's dataset part; DataError for an unknown name or split."""
  if name.startswith(FOLDER_PREFIX):
    root = folder_root(name)
    if os.sep in split or split in ('.', '..'):
      raise types.SplitNotFoundError(
          f'split {split!r} must be a subdirectory name of {root}.')
    digest = hashlib.sha256(root.encode()).hexdigest()[:16]
    base = re.sub(r'[^A-Za-z0-9_.-]', '_', os.path.basename(root)) or 'root'
    return f'folder-{base}-{digest}'
  if name == 'digits':
    allowed = _DIGITS_SPLITS
  elif name in tfds_sources.TFDS_SPLITS:
    allowed = tuple(tfds_sources.TFDS_SPLITS[name])
  else:
    raise types.DataError(
        f'unknown dataset {name!r}; expected one of {known_datasets()}.')
  if split not in allowed:
    raise types.SplitNotFoundError(
        f'unknown split {split!r} for dataset {name!r}; expected one of '
        f'{list(allowed)}.')
  return name


def describe(name: str, split: str) -> dict[str, Any]:
  """What the split is made from now (a cache storing another is stale)."""
  dataset_key(name, split)
  if name == 'digits':
    return _DIGITS_SOURCE
  if name.startswith(FOLDER_PREFIX):
    root = folder_root(name)
    return folder.describe(root, folder.scan(root, split))
  return tfds_sources.describe(name, split)


def prepare(name: str, split: str, image_size: int, data_dir: str,
            download: bool) -> tuple[types.Split, dict[str, Any]]:
  """Decodes one split; returns it and what it was made from (`describe`)."""
  if name == 'digits':
    return _prepare_digits(split, image_size), _DIGITS_SOURCE
  if name.startswith(FOLDER_PREFIX):
    root = folder_root(name)
    tree = folder.scan(root, split)
    return (folder.prepare(root, split, image_size, tree=tree),
            folder.describe(root, tree))
  return (tfds_sources.prepare(name, split, image_size, data_dir, download),
          tfds_sources.describe(name, split))


def _digits_test_mask(targets: np.ndarray) -> np.ndarray:
  rng = np.random.default_rng(DIGITS_SPLIT_SEED)
  mask = np.zeros(len(targets), dtype=bool)
  for label in range(10):
    members = rng.permutation(np.flatnonzero(targets == label))
    mask[members[:int(round(DIGITS_TEST_FRACTION * len(members)))]] = True
  return mask


def _prepare_digits(split: str, image_size: int) -> types.Split:
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  digits = datasets.load_digits()
  pixels = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
  test = _digits_test_mask(digits.target)
  keep = test if split == 'test' else ~test
  images = np.stack([images_lib.square_resize(p, image_size)
                     for p in pixels[keep]])
  labels = digits.target[keep].astype(np.int32)
  return types.Split(images, labels, 10, [str(i) for i in range(10)])
