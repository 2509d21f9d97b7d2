"""Tests of otclr_jax.data.cache: reuse, damage, staleness, read-only dirs."""

import errno
import hashlib
import os
import shutil
from unittest import mock

import numpy as np
from PIL import Image
import pytest

from otclr_jax import data
from otclr_jax import fileio
from otclr_jax.data import cache
from otclr_jax.data import folder
from otclr_jax.data import sources
from tests.folder_trees import make_tree
from tests.folder_trees import random_tree
from tests.folder_trees import S


@pytest.fixture
def warnings(monkeypatch):
  """The data cache's warnings, formatted, in order."""
  logged = []
  monkeypatch.setattr(cache.logging, 'warning',
                      lambda msg, *args: logged.append(msg % args))
  return logged


def test_cache_written_once_and_reread(tmp_path, monkeypatch):
  first = data.load_split('digits', 'test', 12, tmp_path)
  cache_dir = tmp_path / 'otclr_cache'
  assert os.listdir(cache_dir) == ['digits_test_12px_v1.npz']

  def fail(*args, **kwargs):
    raise AssertionError('prepared again instead of reading the cache')

  monkeypatch.setattr(sources, 'prepare', fail)
  second = data.load_split('digits', 'test', 12, tmp_path)
  np.testing.assert_array_equal(first.images, second.images)
  np.testing.assert_array_equal(first.labels, second.labels)
  assert second.labels.dtype == np.int32
  assert (second.num_classes, second.class_names) == (10, first.class_names)
  with pytest.raises(AssertionError, match='prepared again'):
    data.load_split('digits', 'test', 16, tmp_path)  # Other size: new key.


def test_cache_write_is_atomic(tmp_path, monkeypatch):
  def broken_savez(f, **arrays):
    f.write(b'PK partial')
    raise OSError('disk full')

  monkeypatch.setattr(np, 'savez', broken_savez)
  with pytest.raises(OSError, match='disk full'):
    data.load_split('digits', 'test', 8, tmp_path)
  assert os.listdir(tmp_path / 'otclr_cache') == []


def test_a_full_disk_names_the_file_it_could_not_write(tmp_path):
  # Writes to an open file raise OSError without a path (np.savez's).
  def full(f):
    raise OSError(errno.ENOSPC, 'No space left on device')

  path = str(tmp_path / 'features.npz')
  with pytest.raises(OSError) as info:
    fileio.atomic_write(path, full)
  assert (info.value.errno, info.value.filename) == (errno.ENOSPC, path)
  assert os.listdir(tmp_path) == []
  from otclr_jax import cli  # pylint: disable=g-import-not-at-top
  assert cli.status_of(info.value)[1].startswith(
      f'Disk full: could not write {path}')


@pytest.mark.parametrize('damage', ['truncate', 'garbage', 'wrong_shape',
                                    'no_source'])
def test_damaged_cache_is_rebuilt_with_a_warning(tmp_path, warnings, damage):
  first = data.load_split('digits', 'test', 8, tmp_path)
  path = cache.cache_path('digits', 'test', 8, str(tmp_path))
  assert path == str(tmp_path / 'otclr_cache' / 'digits_test_8px_v1.npz')
  if damage == 'truncate':
    with open(path, 'r+b') as f:
      f.truncate(os.path.getsize(path) // 3)
  elif damage == 'garbage':
    with open(path, 'wb') as f:
      f.write(b'\x00' * 100)
  else:  # without the source it was made from, or of another shape
    np.savez(path, labels=first.labels, num_classes=10,
             class_names=np.asarray(first.class_names),
             images=first.images[:, :4] if damage == 'wrong_shape'
             else first.images)
  again = data.load_split('digits', 'test', 8, tmp_path)
  np.testing.assert_array_equal(again.images, first.images)
  np.testing.assert_array_equal(again.labels, first.labels)
  assert len(warnings) == 1 and path in warnings[0], warnings
  if damage == 'no_source':
    assert 'does not record' in warnings[0]
  # Rewritten: the next load reads it without a warning.
  data.load_split('digits', 'test', 8, tmp_path)
  assert len(warnings) == 1
  assert cache.read(path, 8)[1] == sources.describe('digits', 'test')


def test_folder_load_split_caches_by_path(tmp_path, monkeypatch):
  root = str(tmp_path / 'tree')
  make_tree(root)
  data_dir = tmp_path / 'data'
  first = data.load_split('folder:' + root, 'train', S, data_dir)
  assert first.images.shape == (7, S, S, 3) and first.num_classes == 4
  [name] = os.listdir(data_dir / 'otclr_cache')
  digest = hashlib.sha256(root.encode()).hexdigest()[:16]
  assert name == f'folder-tree-{digest}_train_{S}px_v1.npz'
  monkeypatch.setattr(sources, 'prepare', mock.Mock(side_effect=AssertionError))
  again = data.load_split('folder:' + root, 'train', S, data_dir)
  np.testing.assert_array_equal(first.images, again.images)
  monkeypatch.undo()
  with pytest.raises(ValueError,
                     match=r"unknown split 'val'.*\['test', 'train'\]"):
    data.load_split('folder:' + root, 'val', S, data_dir)


# ---------------------------------------------------------------------------
# A cache is bound to what it was made from.


def _two_class_tree(root):
  random_tree(root, {'train': {'bee': 3, 'cow': 3},
                     'test': {'bee': 2, 'cow': 2}}, seed=3)


def _assert_fresh(split, root, name):
  fresh = folder.prepare(root, name, S, backend='pillow')
  np.testing.assert_array_equal(split.images, fresh.images)
  np.testing.assert_array_equal(split.labels, fresh.labels)
  assert split.class_names == fresh.class_names


def test_class_added_after_train_was_cached_keeps_labels_consistent(
    tmp_path, warnings):
  root = str(tmp_path / 'tree')
  _two_class_tree(root)
  name, data_dir = 'folder:' + root, tmp_path / 'data'
  before = data.load_split(name, 'train', S, data_dir)
  assert before.class_names == ['bee', 'cow']
  # 'ant' sorts first: every existing class id shifts by one.
  random_tree(root, {'train': {'ant': 1}, 'test': {'ant': 1}}, seed=4)
  train = data.load_split(name, 'train', S, data_dir)
  test = data.load_split(name, 'test', S, data_dir)
  assert train.class_names == test.class_names == ['ant', 'bee', 'cow']
  assert train.num_classes == test.num_classes == 3
  _assert_fresh(train, root, 'train')
  _assert_fresh(test, root, 'test')
  # 'bee' has the same id in both splits.
  np.testing.assert_array_equal(train.labels, [0, 1, 1, 1, 2, 2, 2])
  np.testing.assert_array_equal(test.labels, [0, 1, 1, 2, 2])
  [warning] = warnings
  assert 'class list changed' in warning and "added ['ant']" in warning
  assert '_train_' in warning and '\n' not in warning
  # Rewritten: reading it again neither warns nor prepares.
  data.load_split(name, 'train', S, data_dir)
  assert len(warnings) == 1


def test_changed_file_is_prepared_again(tmp_path, warnings):
  root = str(tmp_path / 'tree')
  _two_class_tree(root)
  name, data_dir = 'folder:' + root, tmp_path / 'data'
  before = data.load_split(name, 'train', S, data_dir)
  data.load_split(name, 'test', S, data_dir)
  # Same name, other pixels and size.
  path = os.path.join(root, 'train', 'cow', '1.png')
  Image.fromarray(np.full((S + 4, S + 4, 3), 200, np.uint8)).save(path)
  train = data.load_split(name, 'train', S, data_dir)
  _assert_fresh(train, root, 'train')
  assert not np.array_equal(train.images, before.images)
  np.testing.assert_array_equal(train.images[4], 200)
  [warning] = warnings
  assert 'files of the split changed' in warning and '_train_' in warning
  # The test split did not change: its cache is read as it is.
  data.load_split(name, 'test', S, data_dir)
  assert len(warnings) == 1


def test_load_splits_refuses_splits_with_different_class_lists(
    tmp_path, monkeypatch):
  root = str(tmp_path / 'tree')
  _two_class_tree(root)
  splits = data.load_splits('folder:' + root, ('train', 'test'), S,
                            tmp_path / 'data')
  assert splits['train'].class_names == splits['test'].class_names
  calls = []

  def drifting(name, split, *args, **kwargs):
    calls.append(split)
    names = ['a', 'b'] if split == 'train' else ['a', 'b', 'c']
    return data.Split(np.zeros((1, S, S, 3), np.uint8),
                      np.zeros(1, np.int32), len(names), names)

  monkeypatch.setattr(cache, 'load_split', drifting)
  with pytest.raises(data.DataError, match='different class lists'):
    data.load_splits('folder:' + root, ('train', 'test'), S, tmp_path)
  assert calls == ['train', 'test', 'train', 'test']  # Tried twice.


# ---------------------------------------------------------------------------
# Where the cache cannot be written.


@pytest.mark.parametrize('error', [
    PermissionError(errno.EACCES, 'Permission denied'),
    OSError(errno.EROFS, 'Read-only file system')])
def test_unwritable_cache_falls_back_to_memory(tmp_path, monkeypatch,
                                               warnings, error):
  reference = data.load_split('digits', 'train', 8, tmp_path / 'writable')

  def refuse(path, write):
    raise error

  monkeypatch.setattr(fileio, 'atomic_write', refuse)
  data_dir = tmp_path / 'readonly'
  got = data.load_split('digits', 'train', 8, data_dir)
  np.testing.assert_array_equal(got.images, reference.images)
  np.testing.assert_array_equal(got.labels, reference.labels)
  [warning] = warnings
  assert 'Cannot write the data cache' in warning and str(data_dir) in warning
  assert 'from memory' in warning and '\n' not in warning
  assert not data_dir.exists()


def test_read_only_data_dir_still_trains_digits(tmp_path, warnings):
  data_dir = tmp_path / 'readonly'
  data_dir.mkdir()
  os.chmod(data_dir, 0o555)
  try:
    if os.access(data_dir, os.W_OK):
      pytest.skip('chmod does not stop this user (root) writing; the '
                  'fallback is tested with a patched write above')
    train = data.load_split('digits', 'train', 8, data_dir)
    assert train.images.shape == (1438, 8, 8, 3)
    assert len(warnings) == 1 and str(data_dir) in warnings[0]
    assert os.listdir(data_dir) == []
  finally:
    os.chmod(data_dir, 0o755)


# ---------------------------------------------------------------------------
# Paths.


def test_user_home_is_expanded_in_data_dir_and_folder_root(tmp_path,
                                                           monkeypatch):
  monkeypatch.setenv('HOME', str(tmp_path))
  root = str(tmp_path / 'tree')
  make_tree(root)
  data.load_split('digits', 'test', 8, '~/cachedir')
  assert os.listdir(tmp_path / 'cachedir' / 'otclr_cache') == [
      'digits_test_8px_v1.npz']
  tilde = data.load_split('folder:~/tree', 'test', S, '~/cachedir')
  absolute = data.load_split('folder:' + root, 'test', S, '~/cachedir')
  np.testing.assert_array_equal(tilde.images, absolute.images)
  assert not os.path.exists('~')
  digest = hashlib.sha256(root.encode()).hexdigest()[:16]
  assert f'folder-tree-{digest}_test_{S}px_v1.npz' in os.listdir(
      tmp_path / 'cachedir' / 'otclr_cache')
  assert len(os.listdir(tmp_path / 'cachedir' / 'otclr_cache')) == 2
  shutil.rmtree(tmp_path / 'cachedir')
