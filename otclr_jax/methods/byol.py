"""BYOL (Grill et al. 2020): an online network predicts an EMA target's projection.

Decisions and sources (docs/methods.md has the full table):

* Networks: online = ResNet-18 + projector (the paper's 512-512-128 head of
  `config.model`) + predictor of the projector's shape (Dense -> BatchNorm ->
  ReLU -> Dense, hidden width `config.byol.pred_hidden_dim` = 512, so
  projector and predictor are alike as in BYOL, whose both are 4096-256;
  solo-learn's CIFAR config uses 4096-256 too: ``scripts/pretrain/cifar/
  byol.yaml``). `models.BYOLNet`.
* Target: encoder + projector (no predictor), initialised equal to the
  online ones, updated after every step by ``tau * target + (1 - tau) *
  online`` over all their parameters. Its BatchNorm runs in training mode with
  its own running averages (``extra['target_batch_stats']``), as in BYOL's
  and solo-learn's code.
* Momentum: cosine from ``base_tau`` = 0.99 to ``final_tau`` = 1.0 over the
  run (solo-learn CIFAR; BYOL's ImageNet value is 0.996).
* Loss: symmetric normalised MSE, ``||p/|p| - z'/|z'| ||^2 = 2 - 2 cos``,
  ``L = mean_b (2 - 2 cos(p1, z'2)) + mean_b (2 - 2 cos(p2, z'1))`` (BYOL
  eq. 2 and its symmetrisation; solo-learn ``solo/losses/byol.py``), target
  projections ``z'`` under stop-gradient. The loss lies in [0, 8].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from otclr_jax import models
from otclr_jax.methods import base
from otclr_jax.methods import simclr


def default_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.pred_hidden_dim = 512  # predictor hidden width (projector's: 512).
  config.base_tau = 0.99  # target momentum, cosine to final_tau (solo-learn).
  config.final_tau = 1.0
  return config


def create_model(config: ml_collections.ConfigDict) -> models.BYOLNet:
  return models.BYOLNet(
      stem=config.model.stem,
      proj_hidden_dim=config.model.proj_hidden_dim,
      proj_dim=config.model.proj_dim,
      pred_hidden_dim=config.byol.pred_hidden_dim,
      dtype=base.dtype_of(config))


def _without_predictor(tree):
  return {name: tree[name] for name in ('encoder', 'head')}


def regression_loss(p: jax.Array, z: jax.Array) -> jax.Array:
  """BYOL's ``mean_b ||p_b/|p_b| - z_b/|z_b| ||^2 = mean_b (2 - 2 cos)``.

  Args:
    p: online predictions [B, D].
    z: target projections [B, D] (constants).

  Returns:
    Scalar float32 in [0, 4].
  """
  p = base.l2_normalise(p.astype(jnp.float32))
  z = base.l2_normalise(z.astype(jnp.float32))
  return jnp.mean(2.0 - 2.0 * jnp.sum(p * z, axis=-1))


def init_extra(config, variables, key):
  """Target = copy of the online encoder and projector."""
  del key
  base.check_momentum('byol', config.byol.base_tau, config.byol.final_tau)
  return {'target_params': base.copy_tree(
              _without_predictor(variables['params'])),
          'target_batch_stats': base.copy_tree(
              _without_predictor(variables['batch_stats']))}


def loss(config, model, params, batch_stats, extra, v1, v2, progress):
  """Symmetric BYOL loss; see `base.Method.loss`."""
  del progress
  views = jnp.concatenate([v1, v2])
  (_, _, p), updates = model.apply(
      {'params': params, 'batch_stats': batch_stats}, views, train=True,
      mutable=['batch_stats'])
  (_, z), target_updates = simclr.create_model(config).apply(
      {'params': extra['target_params'],
       'batch_stats': extra['target_batch_stats']}, views, train=True,
      mutable=['batch_stats'])
  z = jax.lax.stop_gradient(z)
  p1, p2 = jnp.split(p, 2)
  z1, z2 = jnp.split(z, 2)
  value = regression_loss(p1, z2) + regression_loss(p2, z1)
  new_extra = dict(extra, target_batch_stats=target_updates['batch_stats'])
  return value, {'byol': value}, updates['batch_stats'], new_extra


# Target encoder and projector follow the online ones by EMA.
post_update = base.ema_targets('byol', _without_predictor)


METHOD = base.Method(
    name='byol', title='BYOL', create_model=create_model,
    init_extra=init_extra, loss=loss, post_update=post_update,
    default_config=default_config)
