"""The paper's figure 5: linear pixel interpolation against OT displacement."""

from __future__ import annotations

import os
import pathlib
from typing import Sequence

import jax
import jax.numpy as jnp
from matplotlib import figure as mpl_figure
import numpy as np
from PIL import Image
from sklearn import datasets

from otclr_jax import augment
from otclr_jax import ot
from otclr_jax.figures import common

# Bundled with scikit-learn, so the figure needs no download.
DEFAULT_SAMPLE_IMAGE = 'flower.jpg'


def load_image(path: str | None, size: int) -> np.ndarray:
  """Centre-crops and resizes an image (None: scikit-learn's flower.jpg).

  Returns:
    float32 [size, size, 3] RGB in [0, 1].
  """
  if path is None:
    image = Image.fromarray(datasets.load_sample_image(DEFAULT_SAMPLE_IMAGE))
  else:
    if not pathlib.Path(path).is_file():
      raise ValueError(f'image path {path!r} is not a file.')
    try:
      with Image.open(path) as f:
        image = f.convert('RGB')
    except OSError as e:  # truncated, empty or not an image
      raise ValueError(f'image {path} cannot be decoded ({e}).') from None
  width, height = image.size
  side = min(width, height)
  left, top = (width - side) // 2, (height - side) // 2
  image = image.crop((left, top, left + side, top + side))
  image = image.resize((size, size), Image.Resampling.LANCZOS)
  return np.asarray(image, np.float32) / 255.0


def strong_view(image: np.ndarray, seed: int, kind: str = 'geometric'
                ) -> np.ndarray:
  """A deterministic strong augmentation of `image` [H, W, 3] in [0, 1].

  `kind` is 'geometric' (resized crop + flip) or 'simclr' (full augmentation).

  Returns:
    [H, W, 3] float32 in [0, 1].
  """
  overrides = (dict(jitter_prob=0.0, grayscale_prob=0.0, blur_prob=0.0)
               if kind == 'geometric' else {})
  out = augment.simclr_augment(jax.random.key(seed), jnp.asarray(image)[None],
                               **overrides)
  return np.asarray(out[0])


def interpolation_rows(x: np.ndarray, x_strong: np.ndarray,
                       alphas: Sequence[float], grid_size: int = 16,
                       epsilon: float = 0.05, num_iters: int = 20):
  """Both rows of the interpolation figure.

  Args:
    x, x_strong: source image and its strong view, [H, W, 3] in [0, 1].
    alphas: interpolation coefficients in [0, 1], one per column.
    grid_size, epsilon, num_iters: the `ot.ot_views` settings.

  Returns:
    `(linear, displaced)`, each [len(alphas), H, W, 3] float32:
    `(1 - a) x + a x_strong` and `ot.ot_views(x, x_strong, alpha=a)`.
  """
  x = jnp.asarray(x, jnp.float32)
  x_strong = jnp.asarray(x_strong, jnp.float32)
  alphas = jnp.asarray(alphas, jnp.float32)
  if alphas.ndim != 1 or alphas.size == 0:
    raise ValueError(f'alphas must be a non-empty list, got {alphas}.')
  linear = ((1.0 - alphas[:, None, None, None]) * x
            + alphas[:, None, None, None] * x_strong)
  displaced = jax.vmap(
      lambda a: ot.ot_views(x[None], x_strong[None], alpha=a,
                            grid_size=grid_size, epsilon=epsilon,
                            num_iters=num_iters)[0])(alphas)
  return np.asarray(linear), np.asarray(displaced)


def plot_interpolation(linear: np.ndarray, displaced: np.ndarray,
                       alphas: Sequence[float], title: str | None = None):
  """Two-row figure: linear interpolation above, OT displacement below.

  Args:
    linear, displaced: [n, H, W, 3] images.
    alphas: the n coefficients, as column titles.
  """
  n = len(alphas)
  fig = mpl_figure.Figure(figsize=(1.9 * n + 1.0, 4.4), layout='constrained')
  axes = fig.subplots(2, n, squeeze=False)
  labels = ('linear\n$(1-\\alpha)\\,x + \\alpha\\,x_s$',
            'OT displacement\n$D_\\alpha(x, x_s)$')
  for row, (images, label) in enumerate(zip((linear, displaced), labels)):
    for col, alpha in enumerate(alphas):
      ax = axes[row, col]
      ax.imshow(np.clip(images[col], 0.0, 1.0), interpolation='nearest')
      ax.set(xticks=[], yticks=[])
      if row == 0:
        ax.set_title(f'$\\alpha = {alpha:g}$')
      if col == 0:
        ax.set_ylabel(label)
  if title:
    fig.suptitle(title)
  return fig


def draw(out: str | os.PathLike[str], *, image: str | None, size: int,
         grid_size: int, epsilon: float, num_iters: int,
         alphas: Sequence[float], strong: str, seed: int) -> list[str]:
  """Writes the figure to the PNG `out` and a PDF; returns their paths.

  Args:
    image, size: image file (None: scikit-learn's flower.jpg), crop side.
    grid_size, epsilon, num_iters: the `ot.ot_views` settings, m in [2, size].
    alphas: interpolation coefficients in [0, 1].
    strong: 'geometric' (only OT can move objects) or 'simclr'.
    seed: of the strong view.
  """
  out = common.png_path(out)
  if not all(0.0 <= a <= 1.0 for a in alphas):
    raise ValueError(f'--alphas must lie in [0, 1], got {list(alphas)}.')
  if not 2 <= grid_size <= size:
    raise ValueError(f'--grid_size must lie in [2, --size={size}], got '
                     f'{grid_size}.')
  x = load_image(image, size)
  x_strong = strong_view(x, seed, strong)
  linear, displaced = interpolation_rows(x, x_strong, alphas, grid_size,
                                         epsilon, num_iters)
  title = (f'{strong} strong view (seed {seed}); OT: m = {grid_size}, '
           f'$\\varepsilon$ = {epsilon:g}, T = {num_iters}')
  return common.save_figure(
      plot_interpolation(linear, displaced, alphas, title), out)
