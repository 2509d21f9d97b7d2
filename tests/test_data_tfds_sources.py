"""Tests of otclr_jax.data.tfds_sources: tfds mocks, imagenet300, no TF."""

import hashlib
import io
import os
from unittest import mock

import numpy as np
from PIL import Image
import pytest

from otclr_jax import data
from otclr_jax.data import cache
from otclr_jax.data import folder
from otclr_jax.data import images
from otclr_jax.data import sources
from otclr_jax.data import tfds_sources
from tests.folder_trees import make_tree
from tests.folder_trees import run_python
from tests.folder_trees import S


def test_split_name_mapping():
  assert data.TFDS_SPLITS['food101']['test'] == 'validation'
  assert data.TFDS_SPLITS['imagenet2012']['test'] == 'validation'
  assert data.TFDS_SPLITS['imagenet300']['test'] == 'validation'
  assert data.TFDS_SPLITS['stl10']['unlabelled'] == 'unlabelled'
  for name, splits in data.TFDS_SPLITS.items():
    assert splits['train'] == 'train', name


def test_tfds_mock_cifar10_and_imagenet(tmp_path):
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=20):
    split = data.load_split('cifar10', 'train', 32, tmp_path)
    assert split.images.shape == (20, 32, 32, 3)
    assert split.images.dtype == np.uint8 and split.labels.dtype == np.int32
    # Without the prepared dataset_info.json the mock names classes '0'..'9'.
    assert split.num_classes == 10 and len(split.class_names) == 10
    assert ((split.labels >= 0) & (split.labels < 10)).all()
    assert split.images.std() > 10  # Random mock pixels, not a constant.
    requested = []
    original = tfds.core.DatasetBuilder.as_dataset

    def spy(self, *args, split=None, **kwargs):
      requested.append((self.name, split))
      return original(self, *args, split=split, **kwargs)

    with mock.patch.object(tfds.core.DatasetBuilder, 'as_dataset', spy):
      # Mock images have random, non-square shapes.
      imagenet = data.load_split('imagenet2012', 'test', 16, tmp_path)
    assert requested == [('imagenet2012', 'validation')]
    assert imagenet.images.shape == (20, 16, 16, 3)
    assert imagenet.num_classes == 1000
  cached = data.load_split('cifar10', 'train', 32, tmp_path)  # Outside mock.
  np.testing.assert_array_equal(cached.images, split.images)
  np.testing.assert_array_equal(cached.labels, split.labels)


def test_absent_tfds_dataset_fails_with_instructions(tmp_path, monkeypatch):
  tfds = pytest.importorskip('tensorflow_datasets')
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(data.DatasetUnavailableError) as info:
    data.load_split('cifar10', 'train', 32, empty, download=False)
  message = str(info.value)
  for needle in ('download_and_prepare', 'manual', 'folder:', str(empty)):
    assert needle in message
  calls = []

  def offline(self, *args, **kwargs):
    calls.append(self.name)
    raise ConnectionError('network is unreachable')

  monkeypatch.setattr(tfds.core.DatasetBuilder, 'download_and_prepare',
                      offline)
  with pytest.raises(data.DatasetUnavailableError,
                     match='could not be downloaded.*unreachable'):
    data.load_split('imagenet300', 'train', 32, empty)
  assert calls == ['imagenet2012']
  assert not os.path.exists(empty / 'otclr_cache') or not os.listdir(
      empty / 'otclr_cache')


def _synthetic_records(sizes, seed=0):
  labels, keys = [], []
  for label, size in enumerate(sizes):
    for i in range(size):
      labels.append(label)
      keys.append(f'n{label:08d}_{i}.JPEG')
  order = np.random.default_rng(seed).permutation(len(keys))
  return [labels[i] for i in order], [keys[i] for i in order]


def test_imagenet300_selection_rule():
  labels, keys = _synthetic_records([5, 6, 9, 12])
  select = tfds_sources.select_per_class
  chosen = select(labels, keys, 3, 'salt')
  assert np.all(np.diff(chosen) > 0)
  np.testing.assert_array_equal(np.bincount(np.asarray(labels)[chosen]), 3)
  for label in range(4):
    members = [k for l, k in zip(labels, keys) if l == label]
    expected = sorted(
        members,
        key=lambda k: hashlib.sha256(f'salt/{k}'.encode()).hexdigest())[:3]
    got = [keys[i] for i in chosen if labels[i] == label]
    assert sorted(got) == sorted(expected)
  # Depends on the set of records only, not their order.
  labels2, keys2 = _synthetic_records([5, 6, 9, 12], seed=1)
  chosen2 = select(labels2, keys2, 3, 'salt')
  assert {keys[i] for i in chosen} == {keys2[i] for i in chosen2}
  other = select(labels, keys, 3, 'other salt')
  assert {keys[i] for i in chosen} != {keys[i] for i in other}
  with pytest.raises(ValueError, match='fewer than'):
    select(labels, keys, 6, 'salt')
  with pytest.raises(ValueError, match='unique'):
    select([0, 0], ['a', 'a'], 1, 'salt')
  assert (tfds_sources.IMAGENET300_PER_CLASS,
          tfds_sources.IMAGENET300_NUM_CLASSES) == (300, 1000)


def test_imagenet300_two_pass_preparation(tmp_path, monkeypatch):
  tf = pytest.importorskip('tensorflow')
  tfds = pytest.importorskip('tensorflow_datasets')
  monkeypatch.setattr(tfds_sources, 'IMAGENET300_NUM_CLASSES', 3)
  monkeypatch.setattr(tfds_sources, 'IMAGENET300_PER_CLASS', 2)
  rng = np.random.default_rng(5)
  labels, keys = _synthetic_records([4, 3, 5], seed=2)
  pixels = [rng.integers(0, 256, (20, 24, 3), np.uint8) for _ in keys]
  encoded = []
  for p in pixels:
    buffer = io.BytesIO()
    Image.fromarray(p).save(buffer, format='PNG')
    encoded.append(buffer.getvalue())

  def as_dataset_fn(self, split, decoders=None, **kwargs):
    del self, kwargs
    assert split == 'train'
    ds = tf.data.Dataset.from_tensor_slices({
        'image': encoded, 'label': np.asarray(labels, np.int64),
        'file_name': keys})
    skip = isinstance(decoders, tfds.decode.PartialDecoding) and 'image' in (
        decoders.decoders or {})
    if not skip:
      ds = ds.map(lambda ex: {**ex, 'image': tf.io.decode_png(ex['image'], 3)})
    return ds

  with tfds.testing.mock_data(as_dataset_fn=as_dataset_fn):
    split = data.load_split('imagenet300', 'train', S, tmp_path)
  chosen = tfds_sources.select_per_class(labels, keys, 2,
                                         tfds_sources.IMAGENET300_SALT)
  np.testing.assert_array_equal(split.labels, np.asarray(labels)[chosen])
  np.testing.assert_array_equal(
      split.images,
      np.stack([images.square_resize(pixels[i], S) for i in chosen]))
  assert split.num_classes == 1000


# ---------------------------------------------------------------------------
# Without TensorFlow.


def test_import_does_not_import_tensorflow(tmp_path):
  result = run_python("""
      import sys
      import otclr_jax.data
      loaded = [m for m in ('tensorflow', 'tensorflow_datasets')
                if m in sys.modules]
      assert not loaded, loaded
      """, tmp_path)
  assert result.returncode == 0, result.stderr


def test_digits_folder_and_cache_without_tensorflow(tmp_path):
  root = str(tmp_path / 'tree')
  make_tree(root)
  data_dir = str(tmp_path / 'data')
  # A cache for a tfds dataset, as if prepared on another machine.
  rng = np.random.default_rng(0)
  fake = data.Split(rng.integers(0, 256, (6, 8, 8, 3), np.uint8),
                    np.arange(6, dtype=np.int32) % 3, 3, ['a', 'b', 'c'])
  cache.write(cache.cache_path('cifar100', 'test', 8, data_dir), fake,
              sources.describe('cifar100', 'test'))
  out = str(tmp_path / 'out.npz')
  result = run_python(f"""
      import sys
      sys.modules['tensorflow'] = None
      sys.modules['tensorflow_datasets'] = None
      import numpy as np
      from otclr_jax import cli, data
      digits = data.load_split('digits', 'train', 8, {data_dir!r})
      folder = data.load_split('folder:' + {root!r}, 'train', {S}, {data_dir!r})
      again = data.load_split('folder:' + {root!r}, 'train', {S}, {data_dir!r})
      assert np.array_equal(folder.images, again.images)
      cached = data.load_split('cifar100', 'test', 8, {data_dir!r})
      try:
        data.load_split('cifar10', 'test', 8, {data_dir!r})
      except data.MissingExtraError as e:
        message, status = str(e), cli.status_of(e)[0]
      else:
        raise AssertionError('expected MissingExtraError')
      # One line, a usage error, naming the pinned extra to install.
      assert status == cli.EXIT_USAGE and '\\n' not in message
      assert 'pip install -r requirements-tfds.txt' in message, message
      assert "dataset='digits'" in message, message
      np.savez({out!r}, digits=digits.images, folder=folder.images,
               folder_labels=folder.labels, cached=cached.images,
               cached_labels=cached.labels)
      print(repr(cached.class_names))
      """, tmp_path)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "['a', 'b', 'c']"
  with np.load(out) as child:
    reference = folder.prepare(root, 'train', S, backend='pillow')
    np.testing.assert_array_equal(child['folder'], reference.images)
    np.testing.assert_array_equal(child['folder_labels'], reference.labels)
    np.testing.assert_array_equal(child['cached'], fake.images)
    np.testing.assert_array_equal(child['cached_labels'], fake.labels)
    np.testing.assert_array_equal(child['digits'],
                                  data.load_split('digits', 'train', 8,
                                                  tmp_path / 'd').images)
