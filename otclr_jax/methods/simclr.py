"""SimCLR (Chen et al. 2020): NT-Xent over the 2B projections of a batch.

One forward pass of both views (BatchNorm over 2B), the paper's temperature
0.5 and 512-512-128 head (docs/method.md sections 6, 8, 9). With OT views:
OTCLR.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from otclr_jax import losses
from otclr_jax import models
from otclr_jax.methods import base


def create_model(config: ml_collections.ConfigDict) -> models.SimCLRNet:
  return models.SimCLRNet(
      encoder=base.encoder(config),
      proj_hidden_dim=config.model.proj_hidden_dim,
      proj_dim=config.model.proj_dim)


def embed(model, variables, h: jax.Array) -> jax.Array:
  """The projection z = g(h) [N, proj_dim] of features h [N, 512]."""
  head = models.ProjectionHead(hidden_dim=model.proj_hidden_dim,
                               out_dim=model.proj_dim,
                               dtype=model.encoder.dtype)
  return head.apply({'params': variables['params']['head'],
                     'batch_stats': variables['batch_stats']['head']}, h,
                    train=False)


def loss(config, model, params, batch_stats, extra, v1, v2, progress):
  """NT-Xent of the two views' projections; see `base.Method.loss`."""
  del progress
  (_, z), updates = model.apply(
      {'params': params, 'batch_stats': batch_stats},
      jnp.concatenate([v1, v2]), train=True, mutable=['batch_stats'])
  z1, z2 = jnp.split(z, 2)
  nce, top1 = losses.nt_xent(z1, z2, config.loss.temperature)
  return nce, {'nce': nce, 'top1': top1}, updates['batch_stats'], extra


METHOD = base.Method(
    name='simclr', title='SimCLR', create_model=create_model, loss=loss,
    network=models.SimCLRNet, embed=embed)
