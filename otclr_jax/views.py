"""Positive views: augmentations or OT views (docs/method.md sections 1-5)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from otclr_jax import augment
from otclr_jax import losses
from otclr_jax import methods
from otclr_jax import ot

VIEWS = ('augment', 'ot')
# The paper's name of SimCLR + OT views.
OTCLR_ALIAS = 'otclr'

# OT view options (docs/method.md section 1, "OT view options"); the first
# of each is the paper's view.
SOURCES = ('image', 'strong', 'weak')
DETAILS = ('none', 'residual')
COLOURS = ('before', 'after')
# `fold_in` datum of the 'weak' sources' keys, apart from the strong views'.
_WEAK_KEY = 1


class ViewOptions(NamedTuple):
  """How OT views are made (`config.ot.source`, `.detail`, `.colour`)."""
  source: str = SOURCES[0]
  detail: str = DETAILS[0]
  colour: str = COLOURS[0]


class Recipe(NamedTuple):
  """What a config trains on: its objective and its positive views."""
  method: methods.base.Method  # 'otclr' resolves to SimCLR
  views: str  # 'augment' or 'ot'
  options: ViewOptions
  augment: augment.AugmentParams

  @property
  def title(self) -> str:
    """The run's row name as the paper writes it ('MoCo + OT views')."""
    return methods.title(self.method.name, self.views)


def recipe(config: ml_collections.ConfigDict) -> Recipe:
  """The run's objective and views, resolved and checked: the one place
  that reads `config.method`, `.views`, `.ot.source/detail/colour` and
  `.augment`.

  Raises:
    ValueError: naming the field, e.g. "config.ot.source must be one of
      ('image', 'strong', 'weak'), got 'x'."
  """
  views = config.get('views', None) or None
  if views is not None and views not in VIEWS:
    raise ValueError(f'config.views must be one of {VIEWS}, got {views!r}.')
  name = config.method
  if name == OTCLR_ALIAS:
    if views not in (None, 'ot'):
      raise ValueError(
          "config.method='otclr' is SimCLR with OT views (config.views='ot'); "
          f'got config.views={views!r}. Use config.method=simclr with '
          "config.views='augment' for the baseline.")
    name, views = 'simclr', 'ot'
  options = {}
  for field, choices in (('source', SOURCES), ('detail', DETAILS),
                         ('colour', COLOURS)):
    options[field] = config.ot[field]
    if options[field] not in choices:
      raise ValueError(f'config.ot.{field} must be one of {choices}, got '
                       f'{options[field]!r}.')
  fields = dict(config.augment) if 'augment' in config else {}
  if 'crop_scale' in fields:
    fields['crop_scale'] = tuple(float(v) for v in fields['crop_scale'])
  try:
    params = augment.AugmentParams(**fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f'config.augment: {e}') from e
  return Recipe(methods.get(name), views or 'augment', ViewOptions(**options),
                params)


def current_alpha(config: ml_collections.ConfigDict, params) -> jax.Array:
  """The interpolation coefficient: learnt (`params['alpha_logit']`) or fixed.

  Args:
    config: the run's config (`config.ot.learn_alpha`, `config.ot.alpha`).
    params: TrainState.params.

  Returns:
    Scalar float32 in [0, 1], differentiable in the logit when learnt.
  """
  if config.ot.learn_alpha:
    return losses.alpha_from_logit(params['alpha_logit'])
  return jnp.asarray(config.ot.alpha, jnp.float32)


def make_views(config: ml_collections.ConfigDict, images: jax.Array,
               key: jax.Array, alpha: jax.Array | float | None = None):
  """Both positive views of a batch, as the training step sees them.

  Args:
    config: the run's config (`recipe`, `config.ot`).
    images: source images float32 [B, H, W, 3] in [0, 1].
    key: PRNG key for the two strong augmentations (split once, as always).
    alpha: scalar interpolation coefficient for ``'ot'`` views (may be
      traced); None means `config.ot.alpha`.

  Returns:
    `(v1, v2, strong1, strong2)`, each [B, H, W, 3] float32: the encoder's
    views and the strong augmentations of the same keys (what the OT views
    were generated from unless `config.ot.colour='after'`).
  """
  views, options, params_aug = recipe(config)[1:]
  k1, k2 = jax.random.split(key)
  if views == 'ot' and options != ViewOptions():
    generate = _generator(config, alpha)
    kw1, kw2 = jax.random.split(jax.random.fold_in(key, _WEAK_KEY))
    (v1, xs1), (v2, xs2) = (
        _option_view(generate, options, images, k, kw, params_aug)
        for k, kw in ((k1, kw1), (k2, kw2)))
    return v1, v2, xs1, xs2
  xs1 = augment.simclr_augment(k1, images, params_aug)
  xs2 = augment.simclr_augment(k2, images, params_aug)
  if views == 'augment':
    return xs1, xs2, xs1, xs2
  generate = _generator(config, alpha)
  return generate(images, xs1), generate(images, xs2), xs1, xs2


def _generator(config: ml_collections.ConfigDict, alpha):
  """`ot.ot_views` with `config.ot`'s settings and `alpha` (None: the
  config's) bound."""
  if alpha is None:
    alpha = jnp.asarray(config.ot.alpha, jnp.float32)
  return functools.partial(
      ot.ot_views, alpha=alpha, grid_size=config.ot.grid_size,
      epsilon=config.ot.epsilon, num_iters=config.ot.num_iters,
      core=config.ot.core)


def _option_view(generate, options: ViewOptions, images: jax.Array,
                 key: jax.Array, weak_key: jax.Array,
                 params: augment.AugmentParams):
  """One OT view under non-default `options`, and its strong augmentation.

  Args:
    generate: `ot.ot_views` with the run's settings bound.
    options: the view options.
    images: source images float32 [B, H, W, 3] in [0, 1].
    key: this view's strong-augmentation key.
    weak_key: this view's key for a 'weak' source.
    params: the strong augmentation's settings.

  Returns:
    `(view, strong)`, each [B, H, W, 3] float32 in [0, 1].
  """
  if options.colour == 'after':
    # Transport between uncoloured images; the colour draws of `key` follow.
    target = augment.geometric_batch(key, images, params)
    strong = augment.photometric_batch(key, target, params)
  else:
    target = strong = augment.simclr_augment(key, images, params)
  if options.source == 'image':
    source = images
  elif options.source == 'strong':
    source = target
  else:
    source = augment.geometric_batch(weak_key, images, params)
  if options.detail == 'residual':
    # What the grid and the blur remove from the target, added back before
    # the one clip: a clip in between would cut it where views overshoot.
    detail = target - generate(target, target, clip=False)
    view = jnp.clip(generate(source, target, clip=False) + detail, 0.0, 1.0)
  else:
    view = generate(source, target)
  if options.colour == 'after':
    view = augment.photometric_batch(key, view, params)
  return view, strong


def regulariser_in_loss(config: ml_collections.ConfigDict) -> bool:
  """Whether `beta * L_Sinkhorn` is in the loss (else only logged)."""
  return config.ot.beta != 0
