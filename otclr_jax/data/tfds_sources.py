"""tensorflow-datasets builders decoded into uint8 arrays, and imagenet300."""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

from absl import logging
import numpy as np

from otclr_jax.data import images as images_lib
from otclr_jax.data import types

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

IMAGENET300_PER_CLASS = 300
IMAGENET300_NUM_CLASSES = 1000
IMAGENET300_SALT = 'otclr_jax/imagenet300/v1'


def describe(name: str, split: str) -> dict[str, Any]:
  """What a cached tfds split is made from (no TF needed to say it)."""
  source = {'kind': 'tfds', 'builder': _TFDS_SOURCE.get(name, name),
            'split': TFDS_SPLITS[name][split]}
  if name == 'imagenet300' and split == 'train':
    source.update(salt=IMAGENET300_SALT, per_class=IMAGENET300_PER_CLASS,
                  num_classes=IMAGENET300_NUM_CLASSES)
  return source


def import_tensorflow(what: str):
  """Imports TF and tfds (lazily: only preparation needs them)."""
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise types.MissingExtraError(
        f'preparing {what} needs TensorFlow ({e}): install the pinned extra '
        'with `pip install -r requirements-tfds.txt`, or prepare the cache '
        "on a machine that has it, or use dataset='digits' or "
        "'folder:/path' (README, \"Data\").") from None
  try:
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
    raise types.DatasetUnavailableError(
        f'tensorflow-datasets cannot build {name!r} under data_dir={data_dir}: '
        f'{type(e).__name__}: {e}\n' + _how_to_provide(name, data_dir)) from e
  if builder.is_prepared():
    return builder
  if not download:
    raise types.DatasetUnavailableError(
        f'dataset {name!r} is not prepared under data_dir={data_dir} and '
        'download=False.\n' + _how_to_provide(name, data_dir))
  logging.info('%s is not prepared under %s; trying download_and_prepare.',
               name, data_dir)
  try:
    builder.download_and_prepare()
  except Exception as e:  # pylint: disable=broad-except
    hint = ''
    if isinstance(e, ModuleNotFoundError) and e.name:
      # tfds 4.9 lacks a download dependency (tensorflow/datasets#11212).
      hint = f' Install the missing module: pip install {e.name}.'
    raise types.DatasetUnavailableError(
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


def prepare(name: str, split: str, image_size: int, data_dir: str,
            download: bool) -> types.Split:
  """Decodes a tfds split (imagenet300: the subset) into uint8 arrays."""
  source = _TFDS_SOURCE.get(name, name)
  tfds_split = TFDS_SPLITS[name][split]
  what = f'{name}/{split} (tfds {source}/{tfds_split})'
  tf, tfds = import_tensorflow(what)
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
    images_lib.check_fits(num_examples, image_size, what)
    labels = []

    def take(example):
      labels.append(example['label'])
      return example['image']

    stream = (take(ex) for ex in tfds.as_numpy(ds))
    images = images_lib.map_images(
        lambda im: images_lib.square_resize(im, image_size), stream,
        num_examples, image_size, what)
    labels = np.asarray(labels, dtype=np.int32)
  return types.Split(images, labels, int(label_feature.num_classes),
                     class_names)


def select_per_class(labels: Sequence[int] | np.ndarray, keys: Sequence[str],
                     per_class: int, salt: str) -> np.ndarray:
  """Per class, the `per_class` records lowest by `sha256(salt + '/' + key)`.

  Args:
    labels: [M] integer class of each record.
    keys: [M] unique string key of each record (imagenet2012: file_name).
    per_class, salt: records kept per class (>= 1); string mixed into the hash.

  Returns:
    int64 [num_present_classes * per_class], sorted indices into the records.

  Raises:
    ValueError: keys repeat, or a class is too small.
  """
  labels = np.asarray(labels)
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


def _prepare_imagenet300_train(tf, tfds, builder, image_size: int,
                               what: str) -> tuple[np.ndarray, np.ndarray]:
  """Two passes over imagenet2012 train: choose by file name, then decode."""
  num_selected = IMAGENET300_PER_CLASS * IMAGENET300_NUM_CLASSES
  images_lib.check_fits(num_selected, image_size, what)
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
  images = images_lib.map_images(
      lambda im: images_lib.square_resize(im, image_size), stream,
      len(chosen), image_size, what)
  if seen != chosen_keys:
    raise RuntimeError(f'{what}: the second pass read a different order.')
  return images, labels[chosen]
