"""Tests of otclr_jax.input_pipeline: digits, tiny folders, tfds mocks."""

import hashlib
import io
import itertools
import os
import re
import struct
import subprocess
import sys
import textwrap
from unittest import mock
import zlib

import numpy as np
from PIL import Image
import pytest
from sklearn import datasets as sk_datasets

from otclr_jax import input_pipeline as ip

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = 16


def _run_python(code, tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO_ROOT)
  return subprocess.run([sys.executable, '-c', textwrap.dedent(code)],
                        cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=120, check=False)


def _make_tree(root):
  """A tiny root/<split>/<class>/ tree mixing PNG modes, JPEG and shapes."""
  rng = np.random.default_rng(0)

  def rgb(h, w):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)

  def gray(h, w):
    return rng.integers(0, 256, (h, w), dtype=np.uint8)

  def save(split, cls, fname, array, mode=None, **kwargs):
    directory = os.path.join(root, split, cls)
    os.makedirs(directory, exist_ok=True)
    image = Image.fromarray(array)
    if mode:
      image = image.convert(mode)
    image.save(os.path.join(directory, fname), **kwargs)

  exact = {}  # Path -> expected [S, S, 3] for images needing no resize.
  a = rgb(S, S)
  save('train', 'cat', 'b.png', a)
  exact[os.path.join(root, 'train', 'cat', 'b.png')] = a
  g = gray(S + 8, S)  # Non-square: centre crop rows 4..20.
  save('train', 'cat', 'a.PNG', g)
  exact[os.path.join(root, 'train', 'cat', 'a.PNG')] = np.repeat(
      g[4:4 + S, :, None], 3, axis=-1)
  save('train', 'cat', 'c.png', np.dstack([rgb(20, 20), gray(20, 20)]))  # RGBA
  save('train', 'dog', 'x.png', rgb(40, 28), mode='P')  # palette
  save('train', 'dog', 'y.jpg', rgb(30, 30), quality=90)  # 4:2:0 JPEG
  save('train', 'dog', 'z.jpeg', gray(25, 33), quality=75)  # gray JPEG
  save('train', 'zebra', 'q.png', rgb(9, 64))
  save('test', 'cat', 't.png', rgb(S, S))
  save('test', 'emu', 'u.jpg', rgb(50, 40))  # class only in test
  with open(os.path.join(root, 'train', 'dog', 'notes.txt'), 'w') as f:
    f.write('not an image')
  return exact


# ---------------------------------------------------------------------------
# Resizing.


def test_square_resize_identity_crop_and_gray():
  rng = np.random.default_rng(1)
  image = rng.integers(0, 256, (20, 12, 3), dtype=np.uint8)
  out = ip.square_resize(image, 12)
  np.testing.assert_array_equal(out, image[4:16])
  g = rng.integers(0, 256, (12, 15), dtype=np.uint8)
  out = ip.square_resize(g, 12)
  np.testing.assert_array_equal(out, np.repeat(g[:, 1:13, None], 3, axis=-1))
  assert out.dtype == np.uint8 and out.shape == (12, 12, 3)


def test_square_resize_is_antialiased():
  checker = ((np.indices((64, 64)).sum(0) % 2) * 255).astype(np.uint8)
  out = ip.square_resize(checker, 16).astype(np.float64)
  # Point sampling would return only 0 or 255; an antialiased filter averages.
  np.testing.assert_allclose(out, 127.5, atol=2.0)
  ramp = np.tile(np.arange(0, 256, 4, dtype=np.uint8)[None, :, None],
                 (64, 1, 3))
  out = ip.square_resize(ramp, 32).astype(np.float64)
  block_mean = ramp.reshape(32, 2, 32, 2, 3).mean(axis=(1, 3))
  np.testing.assert_allclose(out[:, 2:-2], block_mean[:, 2:-2], atol=1.0)
  constant = np.full((50, 70, 3), 77, np.uint8)
  np.testing.assert_array_equal(ip.square_resize(constant, 9), 77)


# ---------------------------------------------------------------------------
# digits.


def _digits_reference():
  digits = sk_datasets.load_digits()
  pixels = np.round(digits.images * 255.0 / 16.0).astype(np.uint8)
  rng = np.random.default_rng(0)
  test = np.zeros(len(pixels), bool)
  for c in range(10):
    members = rng.permutation(np.flatnonzero(digits.target == c))
    test[members[:int(round(0.2 * len(members)))]] = True
  return pixels, digits.target, test


def test_digits_shapes_labels_and_documented_split(tmp_path):
  train = ip.load_split('digits', 'train', 8, tmp_path)
  test = ip.load_split('digits', 'test', 8, tmp_path)
  pixels, targets, test_mask = _digits_reference()
  assert len(train.labels) + len(test.labels) == 1797
  for split, mask in ((train, ~test_mask), (test, test_mask)):
    assert split.images.dtype == np.uint8 and split.labels.dtype == np.int32
    assert split.images.shape == (mask.sum(), 8, 8, 3)
    assert split.num_classes == 10
    assert split.class_names == [str(i) for i in range(10)]
    np.testing.assert_array_equal(split.labels, targets[mask])
    for channel in range(3):
      np.testing.assert_array_equal(split.images[..., channel], pixels[mask])
  assert train.images.max() == 255 and train.images.min() == 0
  test_counts = np.bincount(test.labels, minlength=10)
  all_counts = np.bincount(targets, minlength=10)
  np.testing.assert_allclose(test_counts / all_counts, 0.2, atol=0.01)


def test_digits_resized_and_deterministic(tmp_path):
  a = ip.load_split('digits', 'train', 32, tmp_path / 'a')
  b = ip.load_split('digits', 'train', 32, tmp_path / 'b')
  assert a.images.shape == (1438, 32, 32, 3)
  np.testing.assert_array_equal(a.images, b.images)
  np.testing.assert_array_equal(a.labels, b.labels)
  np.testing.assert_array_equal(a.images[..., 0], a.images[..., 2])
  # Upsampling by 4 keeps the mean brightness of each digit.
  small = ip.load_split('digits', 'train', 8, tmp_path / 'a')
  np.testing.assert_allclose(
      a.images.mean(axis=(1, 2, 3)), small.images.mean(axis=(1, 2, 3)),
      atol=3.0)


# ---------------------------------------------------------------------------
# Cache.


def test_cache_written_once_and_reread(tmp_path, monkeypatch):
  first = ip.load_split('digits', 'test', 12, tmp_path)
  cache_dir = tmp_path / 'otclr_cache'
  assert os.listdir(cache_dir) == ['digits_test_12px_v1.npz']

  def fail(*args, **kwargs):
    raise AssertionError('prepared again instead of reading the cache')

  monkeypatch.setattr(ip, '_prepare', fail)
  second = ip.load_split('digits', 'test', 12, tmp_path)
  np.testing.assert_array_equal(first.images, second.images)
  np.testing.assert_array_equal(first.labels, second.labels)
  assert second.labels.dtype == np.int32
  assert (second.num_classes, second.class_names) == (10, first.class_names)
  with pytest.raises(AssertionError, match='prepared again'):
    ip.load_split('digits', 'test', 16, tmp_path)  # Other size: new key.


def test_cache_write_is_atomic(tmp_path, monkeypatch):
  def broken_savez(f, **arrays):
    f.write(b'PK partial')
    raise OSError('disk full')

  monkeypatch.setattr(np, 'savez', broken_savez)
  with pytest.raises(OSError, match='disk full'):
    ip.load_split('digits', 'test', 8, tmp_path)
  assert os.listdir(tmp_path / 'otclr_cache') == []


@pytest.mark.parametrize('damage', ['truncate', 'garbage', 'wrong_shape'])
def test_damaged_cache_is_rebuilt_with_a_warning(tmp_path, monkeypatch,
                                                 damage):
  first = ip.load_split('digits', 'test', 8, tmp_path)
  path = str(tmp_path / 'otclr_cache' / 'digits_test_8px_v1.npz')
  if damage == 'truncate':
    with open(path, 'r+b') as f:
      f.truncate(os.path.getsize(path) // 3)
  elif damage == 'garbage':
    with open(path, 'wb') as f:
      f.write(b'\x00' * 100)
  else:
    np.savez(path, images=first.images[:, :4], labels=first.labels,
             num_classes=10, class_names=np.asarray(first.class_names))
  warnings = []
  monkeypatch.setattr(ip.logging, 'warning',
                      lambda msg, *args: warnings.append(msg % args))
  again = ip.load_split('digits', 'test', 8, tmp_path)
  np.testing.assert_array_equal(again.images, first.images)
  np.testing.assert_array_equal(again.labels, first.labels)
  assert len(warnings) == 1 and path in warnings[0], warnings
  # Rewritten: the next load reads it without a warning.
  ip.load_split('digits', 'test', 8, tmp_path)
  assert len(warnings) == 1


# ---------------------------------------------------------------------------
# Batching.


def _indices(n):
  return np.arange(n, dtype=np.int64).reshape(n, 1, 1, 1)


@pytest.mark.parametrize('prefetch', [0, 2])
def test_train_batches_follow_epoch_permutations(prefetch):
  n, b, seed = 50, 8, 3
  spe = ip.steps_per_epoch(n, b)
  assert spe == 6
  it = ip.train_batches(_indices(n), b, seed, prefetch=prefetch)
  batches = [next(it)[:, 0, 0, 0] for _ in range(3 * spe)]
  for epoch in range(3):
    got = np.concatenate(batches[epoch * spe:(epoch + 1) * spe])
    expected = np.random.default_rng([seed, epoch]).permutation(n)[:spe * b]
    np.testing.assert_array_equal(got, expected)
    assert len(np.unique(got)) == spe * b  # No repeats within an epoch.
  assert all(batch.shape == (b,) for batch in batches)


def test_train_batches_deterministic_and_seed_dependent():
  images = np.random.default_rng(0).integers(0, 256, (40, 4, 4, 3), np.uint8)
  a = list(itertools.islice(ip.train_batches(images, 16, seed=7), 5))
  b = list(itertools.islice(ip.train_batches(images, 16, seed=7), 5))
  c = list(itertools.islice(ip.train_batches(images, 16, seed=8), 5))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert x.dtype == np.uint8 and x.shape == (16, 4, 4, 3)
  assert any(not np.array_equal(x, z) for x, z in zip(a, c))


@pytest.mark.parametrize('start_step', [0, 1, 5, 6, 7, 13])
@pytest.mark.parametrize('prefetch', [0, 2])
def test_train_batches_resume_exactly(start_step, prefetch):
  n, b = 50, 8
  full = list(itertools.islice(ip.train_batches(_indices(n), b, 11), 24))
  resumed = list(itertools.islice(
      ip.train_batches(_indices(n), b, 11, start_step, prefetch=prefetch), 8))
  for x, y in zip(resumed, full[start_step:start_step + 8]):
    np.testing.assert_array_equal(x, y)


def test_eval_batches_cover_all_in_order():
  images = _indices(23)
  batches = list(ip.eval_batches(images, 5))
  assert [len(x) for x in batches] == [5, 5, 5, 5, 3]
  np.testing.assert_array_equal(np.concatenate(batches), images)
  assert len(list(ip.eval_batches(images, 100))) == 1


def test_bad_arguments_raise_value_error(tmp_path):
  images = _indices(10)
  with pytest.raises(ValueError, match='larger than the dataset'):
    ip.train_batches(images, 11, 0)
  with pytest.raises(ValueError, match='larger than the dataset'):
    ip.steps_per_epoch(10, 11)
  with pytest.raises(ValueError, match='batch_size'):
    ip.eval_batches(images, 0)
  with pytest.raises(ValueError, match='seed'):
    ip.train_batches(images, 2, -1)
  with pytest.raises(ValueError, match='start_step'):
    ip.train_batches(images, 2, 0, start_step=-1)
  with pytest.raises(ValueError, match='unknown dataset'):
    ip.load_split('mnist_typo', 'train', 32, tmp_path)
  with pytest.raises(ValueError, match='unknown split'):
    ip.load_split('digits', 'validation', 32, tmp_path)
  with pytest.raises(ValueError, match='unknown split'):
    ip.load_split('cifar10', 'unlabelled', 32, tmp_path)
  with pytest.raises(ValueError, match='image_size'):
    ip.load_split('digits', 'train', 7, tmp_path)
  with pytest.raises(ValueError, match='not a directory'):
    ip.load_split('folder:' + str(tmp_path / 'missing'), 'train', 32,
                  tmp_path)
  with pytest.raises(ValueError, match='names no directory'):
    ip.load_split('folder:', 'train', 32, tmp_path)


def test_split_name_mapping():
  assert ip.TFDS_SPLITS['food101']['test'] == 'validation'
  assert ip.TFDS_SPLITS['imagenet2012']['test'] == 'validation'
  assert ip.TFDS_SPLITS['imagenet300']['test'] == 'validation'
  assert ip.TFDS_SPLITS['stl10']['unlabelled'] == 'unlabelled'
  for name, splits in ip.TFDS_SPLITS.items():
    assert splits['train'] == 'train', name


# ---------------------------------------------------------------------------
# Folder datasets.


def test_folder_pillow_matches_imagefolder(tmp_path):
  root = str(tmp_path / 'tree')
  exact = _make_tree(root)
  for split in ('train', 'test'):
    pil = ip._prepare_folder(root, split, S, backend='pillow')
    tfds_path = ip._prepare_folder(root, split, S, backend='tfds')
    np.testing.assert_array_equal(pil.images, tfds_path.images)
    np.testing.assert_array_equal(pil.labels, tfds_path.labels)
    assert pil.class_names == tfds_path.class_names == [
        'cat', 'dog', 'emu', 'zebra']
  train = ip._prepare_folder(root, 'train', S, backend='pillow')
  np.testing.assert_array_equal(train.labels, [0, 0, 0, 1, 1, 1, 3])
  # Files sort by name within a class: a.PNG, b.png, c.png.
  np.testing.assert_array_equal(
      train.images[0], exact[os.path.join(root, 'train', 'cat', 'a.PNG')])
  np.testing.assert_array_equal(
      train.images[1], exact[os.path.join(root, 'train', 'cat', 'b.png')])
  test = ip._prepare_folder(root, 'test', S, backend='pillow')
  np.testing.assert_array_equal(test.labels, [0, 2])


def test_folder_load_split_caches_by_path(tmp_path, monkeypatch):
  root = str(tmp_path / 'tree')
  _make_tree(root)
  data = tmp_path / 'data'
  first = ip.load_split('folder:' + root, 'train', S, data)
  assert first.images.shape == (7, S, S, 3) and first.num_classes == 4
  [name] = os.listdir(data / 'otclr_cache')
  digest = hashlib.sha256(root.encode()).hexdigest()[:16]
  assert name == f'folder-tree-{digest}_train_{S}px_v1.npz'
  monkeypatch.setattr(ip, '_prepare', mock.Mock(side_effect=AssertionError))
  again = ip.load_split('folder:' + root, 'train', S, data)
  np.testing.assert_array_equal(first.images, again.images)
  monkeypatch.undo()
  with pytest.raises(ValueError,
                     match=r"unknown split 'val'.*\['test', 'train'\]"):
    ip.load_split('folder:' + root, 'val', S, data)


def test_split_too_large_for_memory_is_refused(tmp_path, monkeypatch):
  root = str(tmp_path / 'tree')
  _make_tree(root)
  monkeypatch.setattr(ip, 'MAX_IN_MEMORY_BYTES', 6 * S * S * 3)
  with pytest.raises(ValueError, match='no streaming mode'):
    ip.load_split('folder:' + root, 'train', S, tmp_path / 'data')


# ---------------------------------------------------------------------------
# tensorflow-datasets.


def test_tfds_mock_cifar10_and_imagenet(tmp_path):
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=20):
    split = ip.load_split('cifar10', 'train', 32, tmp_path)
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
      imagenet = ip.load_split('imagenet2012', 'test', 16, tmp_path)
    assert requested == [('imagenet2012', 'validation')]
    assert imagenet.images.shape == (20, 16, 16, 3)
    assert imagenet.num_classes == 1000
  cached = ip.load_split('cifar10', 'train', 32, tmp_path)  # Outside the mock.
  np.testing.assert_array_equal(cached.images, split.images)
  np.testing.assert_array_equal(cached.labels, split.labels)


def test_absent_tfds_dataset_fails_with_instructions(tmp_path, monkeypatch):
  tfds = pytest.importorskip('tensorflow_datasets')
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(ip.DatasetUnavailableError) as info:
    ip.load_split('cifar10', 'train', 32, empty, download=False)
  message = str(info.value)
  for needle in ('download_and_prepare', 'manual', 'folder:', str(empty)):
    assert needle in message
  calls = []

  def offline(self, *args, **kwargs):
    calls.append(self.name)
    raise ConnectionError('network is unreachable')

  monkeypatch.setattr(tfds.core.DatasetBuilder, 'download_and_prepare',
                      offline)
  with pytest.raises(ip.DatasetUnavailableError,
                     match='could not be downloaded.*unreachable'):
    ip.load_split('imagenet300', 'train', 32, empty)
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
  chosen = ip.select_per_class(labels, keys, 3, 'salt')
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
  chosen2 = ip.select_per_class(labels2, keys2, 3, 'salt')
  assert {keys[i] for i in chosen} == {keys2[i] for i in chosen2}
  other = ip.select_per_class(labels, keys, 3, 'other salt')
  assert {keys[i] for i in chosen} != {keys[i] for i in other}
  with pytest.raises(ValueError, match='fewer than'):
    ip.select_per_class(labels, keys, 6, 'salt')
  with pytest.raises(ValueError, match='unique'):
    ip.select_per_class([0, 0], ['a', 'a'], 1, 'salt')
  assert (ip.IMAGENET300_PER_CLASS, ip.IMAGENET300_NUM_CLASSES) == (300, 1000)


def test_imagenet300_two_pass_preparation(tmp_path, monkeypatch):
  tf = pytest.importorskip('tensorflow')
  tfds = pytest.importorskip('tensorflow_datasets')
  monkeypatch.setattr(ip, 'IMAGENET300_NUM_CLASSES', 3)
  monkeypatch.setattr(ip, 'IMAGENET300_PER_CLASS', 2)
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
    split = ip.load_split('imagenet300', 'train', S, tmp_path)
  chosen = ip.select_per_class(labels, keys, 2, ip.IMAGENET300_SALT)
  np.testing.assert_array_equal(split.labels, np.asarray(labels)[chosen])
  np.testing.assert_array_equal(
      split.images, np.stack([ip.square_resize(pixels[i], S) for i in chosen]))
  assert split.num_classes == 1000


# ---------------------------------------------------------------------------
# Without TensorFlow.


def test_import_does_not_import_tensorflow(tmp_path):
  result = _run_python("""
      import sys
      import otclr_jax.input_pipeline
      loaded = [m for m in ('tensorflow', 'tensorflow_datasets')
                if m in sys.modules]
      assert not loaded, loaded
      """, tmp_path)
  assert result.returncode == 0, result.stderr


def test_digits_folder_and_cache_without_tensorflow(tmp_path):
  root = str(tmp_path / 'tree')
  _make_tree(root)
  data = str(tmp_path / 'data')
  # A cache for a tfds dataset, as if prepared on another machine.
  rng = np.random.default_rng(0)
  fake = ip.Split(rng.integers(0, 256, (6, 8, 8, 3), np.uint8),
                  np.arange(6, dtype=np.int32) % 3, 3, ['a', 'b', 'c'])
  ip._write_cache(ip._cache_path('cifar100', 'test', 8, data), fake)
  out = str(tmp_path / 'out.npz')
  result = _run_python(f"""
      import sys
      sys.modules['tensorflow'] = None
      sys.modules['tensorflow_datasets'] = None
      import numpy as np
      from otclr_jax import input_pipeline as ip
      digits = ip.load_split('digits', 'train', 8, {data!r})
      folder = ip.load_split('folder:' + {root!r}, 'train', {S}, {data!r})
      again = ip.load_split('folder:' + {root!r}, 'train', {S}, {data!r})
      assert np.array_equal(folder.images, again.images)
      cached = ip.load_split('cifar100', 'test', 8, {data!r})
      try:
        ip.load_split('cifar10', 'test', 8, {data!r})
      except ImportError as e:
        message = str(e)
      else:
        raise AssertionError('expected ImportError')
      assert "dataset='digits'" in message, message
      np.savez({out!r}, digits=digits.images, folder=folder.images,
               folder_labels=folder.labels, cached=cached.images,
               cached_labels=cached.labels)
      print(repr(cached.class_names))
      """, tmp_path)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "['a', 'b', 'c']"
  with np.load(out) as child:
    reference = ip._prepare_folder(root, 'train', S, backend='pillow')
    np.testing.assert_array_equal(child['folder'], reference.images)
    np.testing.assert_array_equal(child['folder_labels'], reference.labels)
    np.testing.assert_array_equal(child['cached'], fake.images)
    np.testing.assert_array_equal(child['cached_labels'], fake.labels)
    np.testing.assert_array_equal(child['digits'],
                                  ip.load_split('digits', 'train', 8,
                                                tmp_path / 'd').images)


# ---------------------------------------------------------------------------
# Damaged files and every image format, on both folder backends.


def _png16(path, array):
  """Writes uint16 [H, W, C] (C = 1, 2, 3, 4) as a 16-bit PNG (no encoder
  needed: Pillow cannot write 16-bit colour)."""
  height, width, channels = array.shape
  color_type = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
  raw = b''.join(b'\x00' + row.astype('>u2').tobytes() for row in array)

  def chunk(kind, data):
    return (struct.pack('>I', len(data)) + kind + data +
            struct.pack('>I', zlib.crc32(kind + data) & 0xFFFFFFFF))

  with open(path, 'wb') as f:
    f.write(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack(
        '>IIBBBBB', width, height, 16, color_type, 0, 0, 0)) +
            chunk(b'IDAT', zlib.compress(raw)) + chunk(b'IEND', b''))


def test_both_backends_decode_every_format_identically(tmp_path):
  rng = np.random.default_rng(0)
  root = tmp_path / 'tree'
  cls = root / 'train' / 'a'
  cls.mkdir(parents=True)
  rgb = rng.integers(0, 256, (S, S, 3), dtype=np.uint8)
  gray16 = rng.integers(0, 65536, (S, S), dtype=np.uint16)
  Image.fromarray(gray16).save(cls / '01_gray16_pillow.png')
  _png16(cls / '02_gray16.png', gray16[..., None])
  _png16(cls / '03_gray_alpha16.png',
         rng.integers(0, 65536, (S, S, 2), dtype=np.uint16))
  _png16(cls / '04_rgb16.png', rng.integers(0, 65536, (S, S, 3),
                                            dtype=np.uint16))
  _png16(cls / '05_rgba16.png', rng.integers(0, 65536, (S, S, 4),
                                             dtype=np.uint16))
  image = Image.fromarray(rgb)
  image.convert('1').save(cls / '06_bilevel.png')
  image.convert('LA').save(cls / '07_gray_alpha.png')
  image.convert('P').save(cls / '08_palette.png')
  image.convert('P').save(cls / '09_palette_transparent.png', transparency=0)
  Image.fromarray(np.dstack([rgb, rgb[..., 0]])).save(cls / '10_rgba.png')
  image.convert('CMYK').save(cls / '11_cmyk.jpg', quality=95)
  image.convert('L').save(cls / '12_gray.jpg', quality=90)
  pil = ip._prepare_folder(str(root), 'train', S, backend='pillow')
  tfds_path = ip._prepare_folder(str(root), 'train', S, backend='tfds')
  for index, name in enumerate(sorted(os.listdir(cls))):
    np.testing.assert_array_equal(pil.images[index], tfds_path.images[index],
                                  err_msg=name)
  # 16-bit gray keeps its high byte (Pillow's convert('RGB') clips to 255).
  expected = np.repeat((gray16 >> 8).astype(np.uint8)[..., None], 3, axis=-1)
  np.testing.assert_array_equal(pil.images[0], expected)
  np.testing.assert_array_equal(pil.images[1], expected)


@pytest.mark.parametrize('backend', ['pillow', 'tfds'])
@pytest.mark.parametrize('content', ['truncated', 'empty', 'text'])
def test_undecodable_folder_file_is_named(tmp_path, backend, content):
  root = str(tmp_path / 'tree')
  _make_tree(root)
  bad = os.path.join(root, 'train', 'dog', 'w.jpg')
  with open(os.path.join(root, 'train', 'dog', 'y.jpg'), 'rb') as f:
    jpeg = f.read()
  with open(bad, 'wb') as f:
    f.write({'truncated': jpeg[:len(jpeg) // 2], 'empty': b'',
             'text': b'<html>404 Not Found</html>'}[content])
  with pytest.raises(ValueError, match=re.escape(bad)):
    ip._prepare_folder(root, 'train', S, backend=backend)
  # The other split is unaffected.
  assert len(ip._prepare_folder(root, 'test', S, backend=backend).labels) == 2
