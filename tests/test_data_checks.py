"""Tests of otclr_jax.data.checks: evaluation datasets checked up front."""

import pytest

from otclr_jax import data
from otclr_jax.data import cache
from tests.folder_trees import make_tree
from tests.folder_trees import random_tree
from tests.folder_trees import S


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
  random_tree(root, {'train': {'a': 2, 'b': 3}, 'test': {'a': 1, 'b': 1}})
  assert data.check_evaluable('folder:' + root, S, tmp_path) == (
      data.Evaluable('folder:' + root, 5, 2, 2, (2, 3)))


@pytest.mark.parametrize('layout, needles', [
    ('mnist_typo', ['unknown dataset']),
    ('missing', ['not a directory']),
    ({'train': {'a': 2, 'b': 2}},
     ['lacks a split', "unknown split 'test'", "['train']"]),
    ({'train': {'a': 3}, 'test': {'a': 1}},
     ["1 class(es) with train examples (['a'])"]),
    # make_tree's 'emu' is a test class with no train images.
    ('make_tree', ["test classes ['emu'] have no train examples"]),
])
def test_datasets_that_cannot_be_evaluated_are_refused(tmp_path, layout,
                                                       needles):
  root = str(tmp_path / 'tree')
  if layout == 'make_tree':
    make_tree(root)
  elif isinstance(layout, dict):
    random_tree(root, layout)
  name = 'mnist_typo' if layout == 'mnist_typo' else 'folder:' + root
  message = _refusal(name, tmp_path)
  for needle in needles:
    assert needle in message, message


def test_absent_tfds_dataset_is_refused_in_one_line(tmp_path):
  pytest.importorskip('tensorflow_datasets')
  with pytest.raises(data.NotEvaluableError) as info:
    data.check_evaluable('cifar10', 32, tmp_path, download=False)
  assert 'not prepared' in str(info.value)
  assert '\n' not in str(info.value)


def test_train_classes_absent_from_test_are_accepted(tmp_path):
  root = str(tmp_path / 'tree')
  random_tree(root, {'train': {'a': 2, 'b': 2, 'c': 2},
                     'test': {'a': 1, 'b': 1}})
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
