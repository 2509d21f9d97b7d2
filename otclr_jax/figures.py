"""Figures: `python -m otclr_jax.figures <subcommand> [flags]`.

Subcommands:
  interpolation   The paper's figure 4: linear pixel interpolation
                  `(1 - a) x + a x_s` against the OT displacement view
                  `ot.ot_views(x, x_s, alpha=a)` for a few `a`, between an image
                  and a strong augmentation of it. Writes a PNG and a PDF.

Each subcommand registers its own argparse sub-parser in `build_parser`; a new
figure adds an `_add_<name>_parser` function there.

The strong view defaults to the geometric part of the SimCLR augmentation
(random resized crop and horizontal flip, `augment.simclr_augment` with colour
jitter, grayscale and blur switched off): moving objects is what displacement
interpolation does and linear interpolation cannot, so that is what the figure
shows. `--strong simclr` uses the full augmentation.

What to expect with the method's settings (m = 16, eps = 0.05): the OT row at
`a = 0` and `a = 1` is the source and the strong view seen through the 16 x 16
grid (bilinearly upsampled); in between, one object moves and rescales, with
no double exposure, but blurred: the kernel `exp(-C / eps)` on the max-1 cost
has a standard deviation of `sqrt(eps)`, about a fifth of the image side, so
each source cell spreads its mass over a wide patch of the target. Smaller
`--epsilon` (e.g. 0.01, with `--grid_size 32`) gives sharper intermediates.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
from matplotlib import figure as mpl_figure
import numpy as np
from PIL import Image
from sklearn import datasets

from otclr_jax import augment
from otclr_jax import ot

DEFAULT_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
# Bundled with scikit-learn, so the figure needs no download.
DEFAULT_SAMPLE_IMAGE = 'flower.jpg'


def load_image(path: str | None, size: int) -> np.ndarray:
  """Reads an image, centre-crops it to a square and resizes it.

  Args:
    path: image file readable by Pillow; None loads scikit-learn's bundled
      sample image `flower.jpg`.
    size: output side in pixels.

  Returns:
    float32 `[size, size, 3]` RGB in `[0, 1]`.
  """
  if size < 2:
    raise ValueError(f'size must be >= 2 pixels, got {size}.')
  if path is None:
    image = Image.fromarray(datasets.load_sample_image(DEFAULT_SAMPLE_IMAGE))
  else:
    if not pathlib.Path(path).is_file():
      raise ValueError(f'image path {path!r} is not a file.')
    with Image.open(path) as f:
      image = f.convert('RGB')
  width, height = image.size
  side = min(width, height)
  left, top = (width - side) // 2, (height - side) // 2
  image = image.crop((left, top, left + side, top + side))
  image = image.resize((size, size), Image.Resampling.LANCZOS)
  return np.asarray(image, np.float32) / 255.0


def strong_view(image: np.ndarray, seed: int, kind: str = 'geometric'
                ) -> np.ndarray:
  """A deterministic strong augmentation of one image.

  Args:
    image: `[H, W, 3]` in `[0, 1]`.
    seed: PRNG seed of the augmentation.
    kind: 'geometric' (random resized crop + flip) or 'simclr' (the full
      SimCLR augmentation, colour included).

  Returns:
    `[H, W, 3]` float32 in `[0, 1]`.
  """
  if kind == 'geometric':
    overrides = dict(jitter_prob=0.0, grayscale_prob=0.0, blur_prob=0.0)
  elif kind == 'simclr':
    overrides = {}
  else:
    raise ValueError(f"kind must be 'geometric' or 'simclr', got {kind!r}.")
  out = augment.simclr_augment(jax.random.key(seed), jnp.asarray(image)[None],
                               **overrides)
  return np.asarray(out[0])


def interpolation_rows(x: np.ndarray, x_strong: np.ndarray,
                       alphas: Sequence[float], grid_size: int = 16,
                       epsilon: float = 0.05, num_iters: int = 20):
  """Both rows of the interpolation figure.

  Args:
    x: source image `[H, W, 3]` in `[0, 1]`.
    x_strong: strong view `[H, W, 3]`.
    alphas: interpolation coefficients in `[0, 1]`, one per column.
    grid_size: OT grid side `m`.
    epsilon: entropic regularisation.
    num_iters: Sinkhorn iterations.

  Returns:
    `(linear, displaced)`, each `[len(alphas), H, W, 3]` float32:
    `(1 - a) x + a x_strong` and `ot.ot_views(x, x_strong, alpha=a)`.
  """
  x = jnp.asarray(x, jnp.float32)
  x_strong = jnp.asarray(x_strong, jnp.float32)
  if x.ndim != 3 or x.shape != x_strong.shape:
    raise ValueError(
        f'x and x_strong must be [H, W, C] of equal shape, got {x.shape} and '
        f'{x_strong.shape}.')
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
    linear: `[n, H, W, 3]` images.
    displaced: `[n, H, W, 3]` images.
    alphas: the `n` coefficients, used as column titles.
    title: optional figure title.

  Returns:
    A `matplotlib.figure.Figure` (not attached to pyplot).
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
      ax.set_xticks([])
      ax.set_yticks([])
      if row == 0:
        ax.set_title(f'$\\alpha = {alpha:g}$')
      if col == 0:
        ax.set_ylabel(label)
  if title:
    fig.suptitle(title)
  return fig


def run_interpolation(args: argparse.Namespace) -> int:
  """The `interpolation` subcommand: writes `--out` (PNG) and a PDF too."""
  out = pathlib.Path(args.out)
  if out.suffix.lower() != '.png':
    raise ValueError(f'--out must end in .png, got {args.out!r}.')
  if not all(0.0 <= a <= 1.0 for a in args.alphas):
    raise ValueError(f'--alphas must lie in [0, 1], got {args.alphas}.')
  if not 2 <= args.grid_size <= args.size:
    raise ValueError(
        f'--grid_size must lie in [2, --size={args.size}], got '
        f'{args.grid_size}.')
  x = load_image(args.image, args.size)
  x_strong = strong_view(x, args.seed, args.strong)
  linear, displaced = interpolation_rows(
      x, x_strong, args.alphas, args.grid_size, args.epsilon, args.num_iters)
  title = (f'{args.strong} strong view (seed {args.seed}); OT: m = '
           f'{args.grid_size}, $\\varepsilon$ = {args.epsilon:g}, '
           f'T = {args.num_iters}')
  fig = plot_interpolation(linear, displaced, args.alphas, title)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=150)
  fig.savefig(out.with_suffix('.pdf'))
  print(f'wrote {out} and {out.with_suffix(".pdf")}')
  return 0


def _add_interpolation_parser(subparsers) -> None:
  p = subparsers.add_parser(
      'interpolation', help='linear vs OT displacement interpolation (fig. 4)')
  p.add_argument('--image', default=None,
                 help="image file; default scikit-learn's flower.jpg")
  p.add_argument('--out', required=True, help='output .png (a .pdf is '
                 'written beside it)')
  p.add_argument('--size', type=int, default=128,
                 help='side of the square centre crop, in pixels')
  p.add_argument('--grid_size', type=int, default=16, help='OT grid side m')
  p.add_argument('--epsilon', type=float, default=0.05)
  p.add_argument('--num_iters', type=int, default=20)
  p.add_argument('--alphas', type=float, nargs='+',
                 default=list(DEFAULT_ALPHAS))
  p.add_argument('--strong', choices=('geometric', 'simclr'),
                 default='geometric', help='strong augmentation of the image')
  # Seed 1 moves the flower of the default image up-left and enlarges it.
  p.add_argument('--seed', type=int, default=1,
                 help='seed of the strong augmentation')
  p.set_defaults(func=run_interpolation)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m otclr_jax.figures', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  subparsers = parser.add_subparsers(dest='command', required=True)
  _add_interpolation_parser(subparsers)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  return args.func(args)


if __name__ == '__main__':
  sys.exit(main())
