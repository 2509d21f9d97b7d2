"""`folder:/root` datasets: trees `root/<split>/<class>/*.{jpg,jpeg,png}`."""

from __future__ import annotations

import hashlib
import os
from typing import Any, Iterable, Iterator, NamedTuple

import numpy as np
from PIL import Image

from otclr_jax.data import images as images_lib
from otclr_jax.data import tfds_sources
from otclr_jax.data import types

_IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png')


class Tree(NamedTuple):
  """One split of a folder tree as listed on disk.

  Attributes:
    class_names: sorted union of the class directories over all splits.
    files: [(path, label)] ordered by (class name, file name).
    digest: sha256 (hex) of every file's relative path, size and mtime.
  """
  class_names: list[str]
  files: list[tuple[str, int]]
  digest: str


def _subdirs(path: str) -> list[str]:
  return sorted(e.name for e in os.scandir(path) if e.is_dir())


def scan(root: str, split: str) -> Tree:
  """Lists a root/<split>/<class>/<image> tree as ImageFolder; or DataError."""
  if not os.path.isdir(root):
    raise types.DataError(
        f'folder dataset root {root} is not a directory; expected images in '
        'root/<split>/<class>/*.jpg (tfds.folder_dataset.ImageFolder layout).')
  splits = _subdirs(root)
  if split not in splits:
    raise types.SplitNotFoundError(
        f'unknown split {split!r} for folder dataset {root}; its splits '
        f'(subdirectories) are {splits}.')
  class_names = sorted({c for s in splits
                        for c in _subdirs(os.path.join(root, s))})
  label_of = {c: i for i, c in enumerate(class_names)}
  split_dir = os.path.join(root, split)
  files = []
  digest = hashlib.sha256()
  for c in _subdirs(split_dir):
    entries = sorted((e for e in os.scandir(os.path.join(split_dir, c))
                      if e.name.lower().endswith(_IMAGE_EXTENSIONS)),
                     key=lambda e: e.name)
    for entry in entries:
      try:
        stat = entry.stat()
      except OSError as e:  # a dangling symlink, a file gone meanwhile
        raise types.DataError(
            f'folder dataset image {entry.path} cannot be read '
            f'({e.strerror}); remove or fix it.') from None
      files.append((entry.path, label_of[c]))
      digest.update(f'{c}/{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n'
                    .encode('utf-8', 'surrogateescape'))
  if not files:
    raise types.DataError(
        f'no .jpg/.jpeg/.png images under {split_dir}/<class>/.')
  return Tree(class_names, files, digest.hexdigest())


def describe(root: str, tree: Tree) -> dict[str, Any]:
  """What a split made from `tree` depends on: class list and files."""
  return {'kind': 'folder', 'root': root, 'classes': tree.class_names,
          'files': len(tree.files), 'digest': tree.digest}


def prepare(root: str, split: str, image_size: int, backend: str = 'pillow',
            tree: Tree | None = None) -> types.Split:
  """Decodes a folder split with Pillow ('pillow') or ImageFolder ('tfds').

  Args:
    root, split: the tree's absolute root and a subdirectory of it.
    image_size: S.
    backend: 'pillow', or 'tfds' (ImageFolder: the same arrays, tested,
      but only after importing TensorFlow).
    tree: `scan(root, split)` when the caller already has it.

  Returns:
    The split: uint8 [N, S, S, 3], int32 [N], the tree's class list.
  """
  tree = scan(root, split) if tree is None else tree
  class_names, files = tree.class_names, tree.files
  what = f'folder {root} split {split}'
  images_lib.check_fits(len(files), image_size, what)
  labels = np.asarray([label for _, label in files], dtype=np.int32)
  if backend == 'pillow':

    def decode(path):
      try:
        return images_lib.square_resize(images_lib.pillow_rgb(path),
                                        image_size)
      except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise types.DataError(
            f'{what}: cannot decode {path} ({type(e).__name__}: {e}). Remove '
            'or replace the file; an empty or truncated download is the '
            'usual cause.') from e

    images = images_lib.map_images(decode, (p for p, _ in files), len(files),
                                   image_size, what)
  elif backend == 'tfds':
    images = _decode_with_imagefolder(root, split, image_size, class_names,
                                      files, what)
  else:
    raise ValueError(f"backend must be 'pillow' or 'tfds', got "
                     f'{backend!r}.')
  return types.Split(images, labels, len(class_names), class_names)


def _decode_with_imagefolder(root: str, split: str, image_size: int,
                             class_names: list[str],
                             files: list[tuple[str, int]],
                             what: str) -> np.ndarray:
  """ImageFolder decoding, reordered to the (class, file name) order."""
  tf, tfds = tfds_sources.import_tensorflow(what)
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
  # TF's decode error names no file: `_with_positions` names the missing.
  ds = ds.apply(tf.data.experimental.ignore_errors())
  stream = _with_positions(tfds.as_numpy(ds), position, files, order, what)
  images = images_lib.map_images(
      lambda ex: images_lib.square_resize(ex['image'], image_size), stream,
      len(files), image_size, what)
  result = np.empty_like(images)
  result[np.asarray(order, dtype=np.int64)] = images
  return result


def _tf_decode_image(tf, encoded):
  """Decodes like Pillow (libjpeg's accurate integer DCT) to RGB uint8."""
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
    raise types.DataError(
        f'{what}: {len(names)} file(s) cannot be decoded as images (empty, '
        f'truncated or not an image): {", ".join(names[:20])}'
        f'{", ..." if len(names) > 20 else ""}. Remove or replace them.')
