"""Tests of otclr_jax.data.checks: evaluation datasets checked up front."""

import numpy as np
import pytest

from otclr_jax import data
from otclr_jax.data import cache
from tests.folder_trees import make_tree
from tests.folder_trees import S
from tests.folder_trees import save_image


def _tree(root, layout):
  """layout: {split: {class: number of images}}."""
  rng = np.random.default_rng(0)
  for split, classes in layout.items():
    for cls, count in classes.items():
      for i in range(count):
        save_image(root, split, cls, f'{i}.png',
                   rng.integers(0, 256, (S, S, 3), dtype=np.uint8))


def _refusal(name, data_dir):
  with pytest.raises(data.NotEvaluableError) as info:
    data.check_evaluable(name, S, data_dir)
  message = str(info.value)
  assert isinstance(info.value, data.DataError)
  assert '\n' not in message and repr(name) in message, message
  return message


def test_evaluable_datasets_pass_with_their_sizes(tmp_path):
  digits = data.check_evaluable('digits', 8, tmp_path)
  assert digits[:4] == ('digits', 1438, 359, 10)
  assert sum(digits.train_counts) == 1438 and len(digits.train_counts) == 10
  root = str(tmp_path / 'tree')
  _tree(root, {'train': {'a': 2, 'b': 3}, 'test': {'a': 1, 'b': 1}})
  assert data.check_evaluable('folder:' + root, S, tmp_path) == (
      data.Evaluable('folder:' + root, 5, 2, 2, (2, 3)))


def test_missing_dataset_is_refused(tmp_path):
  assert 'unknown dataset' in _refusal('mnist_typo', tmp_path)
  missing = 'folder:' + str(tmp_path / 'nowhere')
  assert 'not a directory' in _refusal(missing, tmp_path)


def test_absent_tfds_dataset_is_refused_in_one_line(tmp_path):
  pytest.importorskip('tensorflow_datasets')
  with pytest.raises(data.NotEvaluableError) as info:
    data.check_evaluable('cifar10', 32, tmp_path, download=False)
  assert 'not prepared' in str(info.value)
  assert '\n' not in str(info.value)


def test_dataset_without_test_split_is_refused(tmp_path):
  root = str(tmp_path / 'tree')
  _tree(root, {'train': {'a': 2, 'b': 2}})
  message = _refusal('folder:' + root, tmp_path)
  assert "lacks a split" in message and "unknown split 'test'" in message
  assert "['train']" in message


def test_one_class_dataset_is_refused(tmp_path):
  root = str(tmp_path / 'tree')
  _tree(root, {'train': {'a': 3}, 'test': {'a': 1}})
  message = _refusal('folder:' + root, tmp_path)
  assert "1 class(es) with train examples (['a'])" in message


def test_test_classes_not_in_train_are_refused(tmp_path):
  root = str(tmp_path / 'tree')
  make_tree(root)  # 'emu' is a test class with no train images.
  message = _refusal('folder:' + root, tmp_path)
  assert "test classes ['emu'] have no train examples" in message


def test_train_classes_absent_from_test_are_accepted(tmp_path):
  root = str(tmp_path / 'tree')
  _tree(root, {'train': {'a': 2, 'b': 2, 'c': 2}, 'test': {'a': 1, 'b': 1}})
  assert data.check_evaluable('folder:' + root, S, tmp_path).num_classes == 3


def test_splits_with_different_class_lists_are_refused(tmp_path, monkeypatch):
  load = data.load_split

  def renamed(name, split, *args, **kwargs):
    loaded = load(name, split, *args, **kwargs)
    if split == 'test':
      loaded = loaded._replace(class_names=[f'x{c}' for c in
                                            loaded.class_names])
    return loaded

  monkeypatch.setattr(cache, 'load_split', renamed)
  message = _refusal('digits', tmp_path)
  assert 'different class lists' in message and "'x0'" in message
