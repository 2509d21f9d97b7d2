"""The package installs as a wheel and `otclr_jax.ot` works from it alone."""

import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run from outside the repository, against the installed copy only: the
# check fails if the import resolves anywhere but the install target, or if
# the OT module pulls in TensorFlow, Orbax or the training code.
_SCRIPT = r'''
import os, sys
import jax
import jax.numpy as jnp
from otclr_jax import ot
assert ot.__file__.startswith(os.environ['TARGET']), ot.__file__
views = jax.jit(ot.ot_views, static_argnames=('grid_size', 'num_iters', 'core'))
x = jnp.full((2, 8, 8, 3), 0.5)
out = views(x, x[::-1], 0.5, grid_size=4, num_iters=3, core='ott')
assert out.shape == (2, 8, 8, 3), out.shape
heavy = [m for m in ('tensorflow', 'orbax', 'otclr_jax.train', 'sklearn')
         if m in sys.modules]
assert not heavy, heavy
print('ok', float(out.mean()))
'''


@pytest.fixture(scope='module')
def wheel(tmp_path_factory):
  out = tmp_path_factory.mktemp('wheel')
  # Build from a copy, so setuptools' build/ and egg-info stay out of the
  # repository; --no-build-isolation: offline, with this environment's
  # setuptools.
  src = out / 'src'
  for name in ('otclr_jax', 'configs', 'launch'):
    shutil.copytree(os.path.join(REPO, name), src / name,
                    ignore=shutil.ignore_patterns('__pycache__'))
  for name in ('pyproject.toml', 'README.md'):
    shutil.copy(os.path.join(REPO, name), src / name)
  subprocess.run(
      [sys.executable, '-m', 'pip', 'wheel', str(src), '--no-deps',
       '--no-build-isolation', '--quiet', '--wheel-dir', str(out)],
      check=True, cwd=str(out), timeout=120)
  wheels = list(out.glob('otclr_jax-*.whl'))
  assert len(wheels) == 1, wheels
  return wheels[0]


def test_wheel_holds_the_package_only(wheel):
  names = zipfile.ZipFile(wheel).namelist()
  tops = {name.split('/')[0] for name in names}
  assert 'otclr_jax' in tops
  assert not tops & {'configs', 'launch', 'tests'}, tops
  assert 'otclr_jax/ot.py' in names and 'otclr_jax/export.py' in names
  # Every subpackage ships, or `otclr_jax.train` cannot import from a wheel.
  for package in ('data', 'evaluation', 'methods'):
    assert f'otclr_jax/{package}/__init__.py' in names, package
  metadata = zipfile.ZipFile(wheel).read(
      next(n for n in names if n.endswith('METADATA'))).decode()
  for requirement in ('jax<0.13,>=0.10.2', 'ott-jax', 'numpy'):
    assert f'Requires-Dist: {requirement}' in metadata, metadata
  assert "Provides-Extra: train" in metadata


def test_installed_wheel_runs_ot_views_outside_the_repo(wheel, tmp_path):
  target = tmp_path / 'site'
  subprocess.run(
      [sys.executable, '-m', 'pip', 'install', '--no-deps', '--quiet',
       '--target', str(target), str(wheel)], check=True, timeout=120)
  env = dict(os.environ, PYTHONPATH=str(target), TARGET=str(target))
  result = subprocess.run([sys.executable, '-c', _SCRIPT], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith('ok'), result.stdout


def _readme_snippets():
  with open(os.path.join(REPO, 'README.md')) as f:
    text = f.read()
  return re.findall(r'```python\n(.*?)```', text, re.S)


def test_the_readme_snippets_run_as_pasted_from_another_directory(
    finished_run, tmp_path):
  # The README's install is editable (requirements.txt): the package imports
  # from anywhere. The encoder snippet reads the first command's output.
  _, workdir, _ = finished_run
  encoder = tmp_path / 'runs' / 'digits' / 'encoder'
  encoder.mkdir(parents=True)
  shutil.copy(os.path.join(workdir, 'encoder', 'encoder.msgpack'), encoder)
  snippets = _readme_snippets()
  assert len(snippets) == 2
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  for code in snippets:
    result = subprocess.run([sys.executable, '-c', code], cwd=str(tmp_path),
                            env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, code + result.stderr[-3000:]
