"""launch/gpu_check.sh's cifar stage at TINY=1 on the CPU: every seed's pair
of runs trained, evaluated with one floor per seed, and tabulated."""

import glob
import json
import os
import subprocess
import sys
import tarfile
import textwrap

import numpy as np

from tests.folder_trees import REPO_ROOT
from tests.folder_trees import save_image

CLASSES = ('ant', 'bee', 'cat', 'dog')


def _tarball(tmp_path):
  """A JPEG tree as the CIFAR-10 tarball lays it out: train/ and test/."""
  rng = np.random.default_rng(0)
  root = tmp_path / 'tree'
  for split, count in (('train', 8), ('test', 4)):
    for label, name in enumerate(CLASSES):
      for n in range(count):
        image = rng.integers(0, 256, (16, 16, 3)) // (label + 1)
        save_image(str(root), split, name, f'{n:04d}.jpg',
                   image.astype(np.uint8))
  path = tmp_path / 'tiny.tar.gz'
  with tarfile.open(path, 'w:gz') as tar:
    for split in ('train', 'test'):
      tar.add(root / split, arcname=split)
  return str(path)


def _sweep_file(tmp_path):
  path = tmp_path / 'tiny_paper.py'
  path.write_text(textwrap.dedent('''
      from configs import cifar10

      def get_config():
        config = cifar10.get_config()
        config.image_size = 8
        config.model.stage_sizes = (1, 1, 1, 1)
        config.model.proj_hidden_dim = 32
        config.model.proj_dim = 16
        config.ot.grid_size = 4
        config.eval.batch_size = 64
        return config

      def get_hyper(hyper):
        return hyper.product([
            hyper.sweep('config.seed', [0, 1, 2]),
            hyper.sweep('config.batch_size', [16, 32]),
            hyper.sweep('config.method', ['simclr', 'otclr']),
        ])
      '''))
  return str(path)


def test_the_cifar_stage_runs_the_seeds_asked_for_and_tabulates_them(
    tmp_path):
  out = tmp_path / 'out'
  # Two of the sweep's three seeds.
  env = dict(os.environ, TINY='1', PY=sys.executable, PARALLEL='2',
             SWEEP=_sweep_file(tmp_path), BATCH='16', SEEDS='0 1',
             WORK=str(tmp_path / 'work'), PYTHONPATH=REPO_ROOT)
  done = subprocess.run(
      ['bash', 'launch/gpu_check.sh', str(out), '900', _tarball(tmp_path),
       'cifar'], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
      timeout=1200, check=False)
  log = (out / 'cifar10.log').read_text()
  assert done.returncode == 0, done.stderr + log
  assert 'runs 0 1 4 5, 2 at once' in log
  assert log.count('rc 0 after') == 5, log  # the data, then four runs
  results = [json.load(open(p)) for p in sorted(glob.glob(str(
      tmp_path / 'work' / 'tiny_paper' / '*' / 'eval' / 'results.json')))]
  assert sorted((r['seed'], r['method'], r['batch_size']) for r in results) == [
      (s, m, 16) for s in (0, 1) for m in ('otclr', 'simclr')]
  for r in results:
    assert set(r) >= {'linear', 'random_init'} and 'clusters' not in r
  # One floor per seed, fitted by one run of the pair and read by the other.
  floors = {r['seed']: r['protocol']['floor'] for r in results}
  assert len({f['file'] for f in floors.values()}) == 2
  for seed in (0, 1):
    pair = [r for r in results if r['seed'] == seed]
    assert sorted(r['protocol']['floor']['fitted_here'] for r in pair) == [
        False, True]
    assert pair[0]['random_init'] == pair[1]['random_init']
  table = (out / 'cifar10_table.txt').read_text()
  assert '±' in table and 'OTCLR' in table and 'SimCLR' in table, table
  assert '2 finished runs' in table or 'seeds' in table, table
  assert (out / 'env.txt').exists()
  with tarfile.open(out / 'cifar10_results.tar.gz') as tar:
    names = tar.getnames()
  assert sum(n.endswith('eval/results.json') for n in names) == 4
  assert sum('/floors/floor_' in n for n in names) == 2
