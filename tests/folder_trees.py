"""Tiny image trees and a clean-interpreter runner shared by the data tests."""

import os
import subprocess
import sys
import textwrap

import numpy as np
from PIL import Image

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = 16


def run_python(code, cwd, env=None):
  """Runs `code` in a fresh interpreter with the repository importable.

  Args:
    code: the program (dedented).
    cwd: where it runs.
    env: variables to set on top of this process's environment; a value of
      None removes that variable.
  """
  changes = dict(env or {}, PYTHONPATH=REPO_ROOT)
  env = {k: v for k, v in dict(os.environ, **changes).items() if v is not None}
  return subprocess.run([sys.executable, '-c', textwrap.dedent(code)],
                        cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=120, check=False)


def save_image(root, split, cls, fname, array, mode=None, **kwargs):
  """Writes `array` as root/split/cls/fname (format from the extension)."""
  directory = os.path.join(root, split, cls)
  os.makedirs(directory, exist_ok=True)
  image = Image.fromarray(array)
  if mode:
    image = image.convert(mode)
  path = os.path.join(directory, fname)
  image.save(path, **kwargs)
  return path


def random_tree(root, layout, size=S, seed=0):
  """Random RGB PNGs root/<split>/<class>/<i>.png, `layout` {split: {class:
  number of images}}, `size` px square."""
  rng = np.random.default_rng(seed)
  for split, classes in layout.items():
    for cls, count in classes.items():
      for i in range(count):
        save_image(root, split, cls, f'{i}.png',
                   rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def make_tree(root):
  """A tiny root/<split>/<class>/ tree mixing PNG modes, JPEG and shapes.

  Returns:
    {path: expected [S, S, 3]} for the images that need no resize.
  """
  rng = np.random.default_rng(0)

  def rgb(h, w):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)

  def gray(h, w):
    return rng.integers(0, 256, (h, w), dtype=np.uint8)

  save = lambda *args, **kwargs: save_image(root, *args, **kwargs)
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
