"""BYOL (Grill et al. 2020): an online network predicts an EMA target's output.

The target is an EMA of the online encoder and projector with its own
BatchNorm statistics; BatchNorm per view (`base.apply_per_view`), as BYOL and
solo-learn. The recipe and its sources, with file and line: docs/methods.md.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from otclr_jax import losses
from otclr_jax import models
from otclr_jax.methods import base
from otclr_jax.methods import simclr


class BYOLNet(models.SimCLRNet):
  """BYOL's online network: `SimCLRNet` (f, projector g) and a predictor q.

  q is shaped as g (BYOL section 3.3); the ``{'encoder', 'head'}`` params form
  the target's ``SimCLRNet`` tree.

  Attributes:
    pred_hidden_dim: hidden width of the predictor.
  """
  proj_hidden_dim: int = 4096
  proj_dim: int = 256
  pred_hidden_dim: int = 4096

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool
               ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """`SimCLRNet`'s ``(h, z)`` and predictions p [B, proj_dim], float32."""
    h, z = super().__call__(x, train)
    p = models.ProjectionHead(hidden_dim=self.pred_hidden_dim,
                              out_dim=self.proj_dim, dtype=self.encoder.dtype,
                              name='predictor')(z, train)
    return h, z, p


def default_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # BYOL's projector and predictor widths (solo-learn cifar/byol.yaml).
  config.proj_hidden_dim = 4096
  config.proj_dim = 256
  config.pred_hidden_dim = 4096
  config.base_tau = 0.99  # target momentum, cosine to final_tau (solo-learn).
  config.final_tau = 1.0
  # Largest share of the target's initialisation left at the end.
  config.max_init_share = 0.01
  # solo-learn cifar/byol.yaml.
  config.optim = base.lars(base_lr=1.0, weight_decay=1e-5, clip_grad=0.0)
  return config


def target_model(config: ml_collections.ConfigDict) -> models.SimCLRNet:
  """The target network: encoder and projector of the online network."""
  return models.SimCLRNet(encoder=base.encoder(config),
                          proj_hidden_dim=config.byol.proj_hidden_dim,
                          proj_dim=config.byol.proj_dim)


def create_model(config: ml_collections.ConfigDict) -> BYOLNet:
  return BYOLNet(encoder=base.encoder(config),
                 proj_hidden_dim=config.byol.proj_hidden_dim,
                 proj_dim=config.byol.proj_dim,
                 pred_hidden_dim=config.byol.pred_hidden_dim)


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
  p = losses.l2_normalise(p.astype(jnp.float32))
  z = losses.l2_normalise(z.astype(jnp.float32))
  return jnp.mean(2.0 - 2.0 * jnp.sum(p * z, axis=-1))


def init_extra(config, variables, key):
  """Target = copy of the online encoder and projector."""
  del config, key
  return base.copy_targets(variables, _without_predictor)


def loss(config, model, params, batch_stats, extra, v1, v2, progress):
  """Symmetric BYOL loss, BatchNorm per view; see `base.Method.loss`."""
  del progress
  (_, _, p), batch_stats = base.apply_per_view(model, params, batch_stats, v1,
                                               v2)
  (_, z), target_stats = base.apply_per_view(
      target_model(config), extra['target_params'],
      extra['target_batch_stats'], v1, v2)
  z = jax.lax.stop_gradient(z)
  p1, p2 = jnp.split(p, 2)
  z1, z2 = jnp.split(z, 2)
  value = regression_loss(p1, z2) + regression_loss(p2, z1)
  return (value, {'byol': value}, batch_stats,
          dict(extra, target_batch_stats=target_stats))


# Target encoder and projector follow the online ones by EMA.
post_update = base.ema_targets('byol', _without_predictor)


METHOD = base.Method(
    name='byol', title='BYOL', create_model=create_model,
    init_extra=init_extra, loss=loss, post_update=post_update,
    default_config=default_config, network=BYOLNet, embed=simclr.embed)
