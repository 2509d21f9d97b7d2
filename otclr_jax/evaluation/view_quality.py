"""View quality: both generators' pairs, same images, keys and network."""

from __future__ import annotations

import math
import time
from typing import Any, Iterator, NamedTuple

from absl import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from otclr_jax import data
from otclr_jax import experiment
from otclr_jax import views as views_lib
from otclr_jax.evaluation import clusters
from otclr_jax.evaluation import features
from otclr_jax.evaluation import metrics

VIEWS_SEED = 0


class ViewEmbeddings(NamedTuple):
  """Encoder embeddings of test images and of both generators' views.

  Attributes:
    indices: int [n], the rows of the test split that were used (sorted).
    anchors: float32 [n, D], l2-normalised clean-image embeddings.
    simclr: (z1, z2), each [n, D], of the SimCLR pair (xs1, xs2).
    otclr: (z1, z2), each [n, D], of the OTCLR pair.
    pixel_l2: `metrics.pixel_l2` of the OT views, mean over the 2n views.
    pixel_rms: the same as per-image RMS (`metrics.pixel_rms`).
    embedding: 'z' or 'h', the embedding the arrays hold.
  """
  indices: np.ndarray
  anchors: np.ndarray
  simclr: tuple[np.ndarray, np.ndarray]
  otclr: tuple[np.ndarray, np.ndarray]
  pixel_l2: float
  pixel_rms: float = math.nan
  embedding: str = 'z'


def choose_images(images: np.ndarray, num_images: int,
                  seed: int = VIEWS_SEED) -> tuple[np.ndarray, np.ndarray]:
  """`(rows, images[rows])`: min(num_images, N) rows of [N, ...], sorted."""
  n = min(num_images, len(images))
  chosen = np.sort(np.random.default_rng(seed).choice(len(images), n,
                                                      replace=False))
  return chosen, images[chosen]


def paired_views(config: ml_collections.ConfigDict, images: np.ndarray, *,
                 batch_size: int, seed: int = VIEWS_SEED,
                 alpha: Any = None) -> Iterator[tuple[Any, tuple, int]]:
  """`config`'s positive pairs of images, one key per image.

  Image i's views come from `fold_in(key(seed), i)`, so they do not depend
  on `batch_size`.

  Args:
    config: a config (`views.make_views`).
    images: uint8 [n, S, S, 3].
    batch_size: images per device call; the last batch is padded.
    seed: the views' key.
    alpha: the interpolation coefficient; None means `config.ot.alpha`.

  Yields:
    `(x, (v1, v2, strong1, strong2), real)` per batch: float32
    [batch_size, S, S, 3] arrays whose first `real` rows are images.
  """

  def one_image(x, key):
    return tuple(v[0] for v in views_lib.make_views(config, x[None], key,
                                                    alpha))

  batch_views = jax.jit(jax.vmap(one_image))
  key = jax.random.key(seed)
  start = 0
  for batch in data.eval_batches(images, batch_size):
    real = len(batch)
    x = features.to_unit(features.pad_rows(batch, batch_size))
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(
        jnp.arange(start, start + batch_size, dtype=jnp.uint32))
    start += real
    yield x, batch_views(x, keys), real


def view_embeddings(config: ml_collections.ConfigDict, model,
                    variables: dict[str, Any], images: np.ndarray, *,
                    num_images: int, batch_size: int) -> ViewEmbeddings:
  """Both generators' positive pairs of test images, embedded by one encoder.

  SimCLR pair (xs1, xs2), OTCLR pair (ot_views(x, xs1), ot_views(x, xs2))
  with the run's `config.ot` and alpha, embedded as `config.eval.embedding`.

  Args:
    config: the run's config.
    model: the run's network.
    variables: its {'params', 'batch_stats'} (and 'alpha_logit').
    images: uint8 [N, S, S, 3] test images.
    num_images: n, at most N.
    batch_size: images per device call.

  Returns:
    The embeddings of `VIEWS_SEED`'s images and views.
  """
  chosen, images = choose_images(images, num_images)
  n = len(chosen)
  both = config.copy_and_resolve_references()
  # 'ot' views: make_views returns the OT and the strong pairs.
  both.views = 'ot'
  if both.method == views_lib.OTCLR_ALIAS:
    both.method = 'simclr'
  alpha = experiment.alpha_of(config, variables)
  embedding = clusters.embedding_of(config)
  # These rows reuse the features' compiled encoder.
  encoder = features.Encoder(model)
  variables = encoder.place({'params': variables['params'],
                             'batch_stats': variables['batch_stats']})
  rows = -(-batch_size // encoder.num_devices) * encoder.num_devices

  def embed(x, real):
    h, z = encoder.embed(variables, features.pad_rows(x[:real], rows))
    return features.l2_normalise(np.asarray(z if embedding == 'z' else h)
                                 [:real])

  parts, l2_sum, rms_sum = [], 0.0, 0.0
  for x, (o1, o2, s1, s2), real in paired_views(
      both, images, batch_size=min(batch_size, n), alpha=alpha):
    parts.append([embed(v, real) for v in (x, s1, s2, o1, o2)])
    # The paper's (1 / 2n) sum_i sum_k: both views of every image.
    l2_sum += real * 0.5 * float(metrics.pixel_l2(o1[:real], s1[:real]) +
                                 metrics.pixel_l2(o2[:real], s2[:real]))
    rms_sum += real * 0.5 * float(metrics.pixel_rms(o1[:real], s1[:real]) +
                                  metrics.pixel_rms(o2[:real], s2[:real]))
  za, zs1, zs2, zo1, zo2 = (np.concatenate(p) for p in zip(*parts))
  return ViewEmbeddings(indices=chosen, anchors=za, simclr=(zs1, zs2),
                        otclr=(zo1, zo2), pixel_l2=l2_sum / n,
                        pixel_rms=rms_sum / n, embedding=embedding)


def summarise_views(views: ViewEmbeddings,
                    num_classes: int) -> dict[str, Any]:
  """The view-quality metrics of `view_embeddings`, per generator.

  Returns:
    {'simclr': {...}, 'otclr': {...}}: view_distance, view_cosine,
    anchor_distance, pixel_l2, pixel_rms, cluster metrics of [z1; z2].
  """
  out = {}
  # The SimCLR views are their strong endpoints: pixel L2 exactly 0.
  for generator, (z1, z2), pix, rms in (
      ('simclr', views.simclr, 0.0, 0.0),
      ('otclr', views.otclr, views.pixel_l2, views.pixel_rms)):
    row = {'view_distance': float(metrics.view_distance(z1, z2)),
           'view_cosine': float(metrics.view_cosine(z1, z2)),
           'anchor_distance': float(metrics.anchor_distance(z1, z2,
                                                            views.anchors)),
           'pixel_l2': float(pix), 'pixel_rms': float(rms)}
    row.update(clusters.safe_cluster_metrics(
        np.concatenate([z1, z2]), num_classes))
    out[generator] = row
  return out


def evaluate(ctx) -> Iterator[tuple[tuple[str, ...], Any]]:
  """The views evaluator: both generators' view quality, one network.

  Args:
    ctx: the evaluation's `evaluate.Context`.

  Yields:
    `(('views',), {'simclr': {...}, 'otclr': {...}})` (`summarise_views`)
    and the views' settings under `('protocol', ...)`.
  """
  start = time.perf_counter()
  views, test = ctx.view_embeddings()
  yield ('views',), summarise_views(views, test.num_classes)
  logging.info('views %s: %d images [%.1f s]', ctx.views_dataset,
               len(views.indices), time.perf_counter() - start)
  yield ('protocol', 'views_dataset'), ctx.views_dataset
  yield ('protocol', 'views_num_images'), len(views.indices)
  yield ('protocol', 'views_seed'), VIEWS_SEED
