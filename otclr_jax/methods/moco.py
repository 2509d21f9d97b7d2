"""MoCo v2 (He et al. 2020; Chen et al. 2020, "Improved baselines"), symmetric.

The key encoder is an EMA copy of the SimCLR query network; BatchNorm per view
(`base.apply_per_view`), in place of MoCo's shuffled BatchNorm, so a query and
its key never share batch statistics. The recipe and its sources, with file
and line: docs/methods.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from otclr_jax import losses
from otclr_jax import models
from otclr_jax.methods import base
from otclr_jax.methods import simclr


def default_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.queue_size = 32768  # keys per view; solo-learn cifar/mocov2plus.yaml.
  config.temperature = 0.2  # MoCo v2.
  config.base_tau = 0.99  # key-encoder momentum, cosine to final_tau.
  config.final_tau = 0.999
  # Largest share of the key encoder's initialisation left at the end.
  config.max_init_share = 0.01
  return config


def infonce(q: jax.Array, k: jax.Array, queue: jax.Array,
            temperature: float) -> tuple[jax.Array, jax.Array]:
  """MoCo's InfoNCE: each query against its key and the queued negatives.

  Args:
    q: queries [B, D] (normalised here).
    k: positive keys [B, D] (normalised here), constants.
    queue: negatives [K, D], unit rows.
    temperature: t > 0.

  Returns:
    loss: scalar float32.
    top1: fraction of queries whose key beats every negative.
  """
  q = losses.l2_normalise(q.astype(jnp.float32))
  k = losses.l2_normalise(k.astype(jnp.float32))
  pos = jnp.sum(q * k, axis=-1) / temperature
  neg = (q @ queue.T) / temperature
  logits = jnp.concatenate([pos[:, None], neg], axis=1)
  loss = jnp.mean(jax.nn.logsumexp(logits, axis=1) - pos)
  top1 = jnp.mean((pos > jnp.max(neg, axis=1)).astype(jnp.float32))
  return loss, top1


def enqueue(queue: jax.Array, ptr: jax.Array,
            keys: jax.Array) -> tuple[jax.Array, jax.Array]:
  """First in, first out: `keys` replace the oldest entries of `queue`.

  Args:
    queue: [K, D].
    ptr: int32 scalar, index of the oldest entry.
    keys: [B, D] with B <= K; row b lands at ``(ptr + b) mod K``.

  Returns:
    `(queue, ptr)` after the update, ``ptr`` advanced by B modulo K.
  """
  size, batch = queue.shape[0], keys.shape[0]
  if batch > size:
    raise ValueError(f'A queue of {size} keys cannot take a batch of {batch}; '
                     'raise config.moco.queue_size.')
  index = (ptr + jnp.arange(batch, dtype=jnp.int32)) % size
  return (queue.at[index].set(keys.astype(queue.dtype)),
          (ptr + batch) % size)


def init_extra(config, variables, key):
  """Key encoder = copy of the query encoder; two random unit-vector queues."""
  settings = config.moco
  queue = losses.l2_normalise(jax.random.normal(
      key, (2, settings.queue_size, config.model.proj_dim), jnp.float32))
  return {**base.copy_targets(variables), 'queue': queue,
          'queue_ptr': jnp.zeros((), jnp.int32)}


def loss(config, model, params, batch_stats, extra, v1, v2, progress):
  """Symmetric MoCo v2 loss and the queue update; see `base.Method.loss`."""
  del progress
  (_, q), batch_stats = base.apply_per_view(model, params, batch_stats, v1, v2)
  (_, k), target_stats = base.apply_per_view(
      model, extra['target_params'], extra['target_batch_stats'], v1, v2)
  k = jax.lax.stop_gradient(losses.l2_normalise(k))
  q1, q2 = jnp.split(q, 2)
  k1, k2 = jnp.split(k, 2)
  temperature = config.moco.temperature
  queue = extra['queue']
  loss_1, top1_1 = infonce(q1, k2, queue[1], temperature)
  loss_2, top1_2 = infonce(q2, k1, queue[0], temperature)
  nce = (loss_1 + loss_2) / 2
  queue_1, ptr = enqueue(queue[0], extra['queue_ptr'], k1)
  queue_2, _ = enqueue(queue[1], extra['queue_ptr'], k2)
  new_extra = dict(extra, target_batch_stats=target_stats,
                   queue=jnp.stack([queue_1, queue_2]), queue_ptr=ptr)
  metrics = {'nce': nce, 'top1': (top1_1 + top1_2) / 2}
  return nce, metrics, batch_stats, new_extra


# Key encoder parameters follow the query encoder by EMA.
post_update = base.ema_targets('moco')


METHOD = base.Method(
    name='moco', title='MoCo', create_model=simclr.create_model,
    init_extra=init_extra, loss=loss, post_update=post_update,
    default_config=default_config, network=models.SimCLRNet,
    embed=simclr.embed)
