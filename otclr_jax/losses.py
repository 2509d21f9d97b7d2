"""Pretraining losses: NT-Xent and the Sinkhorn regulariser.

docs/method.md section 6; ``L_Sinkhorn`` acts only through a learnt ``alpha``.
"""

import jax
import jax.numpy as jnp
import numpy as np

from otclr_jax import ot

# Finite, so masked entries give exp(.) = 0 and a zero gradient; -inf would turn
# into NaN through 0 * inf in the backward pass. Logits are bounded by 1 / tau.
_MASK_VALUE = -1e9


def l2_normalise(z: jnp.ndarray, axis: int = -1) -> jnp.ndarray:
  """`z` scaled to unit norm along `axis` (an all-zero vector stays zero)."""
  sq_norm = jnp.sum(jnp.square(z), axis=axis, keepdims=True)
  return z * jax.lax.rsqrt(jnp.maximum(sq_norm, 1e-24))


def nt_xent(z1: jnp.ndarray, z2: jnp.ndarray,
            temperature: float = 0.5) -> tuple[jnp.ndarray, jnp.ndarray]:
  """NT-Xent (InfoNCE) loss of SimCLR and its contrastive top-1 accuracy.

  Anchor ``i`` of ``z = normalise(concat(z1, z2))`` has its positive at
  ``i + B`` (mod 2B) and the other 2B - 2 embeddings as negatives.

  Args:
    z1: projections of the first views [B, D] (raw, not normalised).
    z2: projections of the second views [B, D]; row b pairs with ``z1[b]``.
    temperature: softmax temperature tau > 0.

  Returns:
    loss: scalar mean over the 2B anchors, float32.
    top1: fraction of anchors whose positive strictly beats every negative.

  Raises:
    ValueError: if the shapes differ or are not [B, D], or temperature <= 0.
  """
  if z1.ndim != 2 or z1.shape != z2.shape:
    raise ValueError(
        f'z1 and z2 must both be [B, D] with equal shapes, got {z1.shape} and '
        f'{z2.shape}.')
  if isinstance(temperature, (int, float)) and not temperature > 0:
    raise ValueError(f'temperature must be > 0, got {temperature}.')
  batch = z1.shape[0]
  dtype = jnp.promote_types(jnp.result_type(z1, z2), jnp.float32)
  z = l2_normalise(jnp.concatenate([z1, z2], axis=0).astype(dtype))
  logits = (z @ z.T) / temperature

  index = jnp.arange(2 * batch)
  positive = (index + batch) % (2 * batch)
  is_self = index[:, None] == index[None, :]
  is_positive = index[None, :] == positive[:, None]
  pos_logits = logits[index, positive]

  logits_no_self = jnp.where(is_self, _MASK_VALUE, logits)
  loss = jnp.mean(jax.nn.logsumexp(logits_no_self, axis=1) - pos_logits)

  negatives = jnp.where(is_positive, _MASK_VALUE, logits_no_self)
  top1 = jnp.mean((pos_logits > jnp.max(negatives, axis=1)).astype(dtype))
  return loss, top1


def sinkhorn_regulariser(x: jnp.ndarray, xs1: jnp.ndarray, xs2: jnp.ndarray,
                         xh1: jnp.ndarray, xh2: jnp.ndarray, *,
                         grid_size: int, epsilon: float,
                         num_iters: int) -> jnp.ndarray:
  """``L_Sinkhorn`` of docs/method.md section 6, averaged over the batch.

  ``1/2 [S(xh1, x) + S(xh2, x) + S(xh1, xs1) + S(xh2, xs2)]``, generated views
  as source; ``S`` has the entropy term, so the loss can be negative.

  Args:
    x: source images [B, H, W, C] in [0, 1].
    xs1, xs2: the strong views [B, H, W, C].
    xh1, xh2: the generated views ``D(x, xs1)``, ``D(x, xs2)`` [B, H, W, C].
    grid_size, epsilon, num_iters: OT grid side m, entropic regularisation,
      exact number of Sinkhorn iterations.

  Returns:
    Scalar float32, differentiable in all images.

  Raises:
    ValueError: if the five batches are not [B, H, W, C] of one shape.
  """
  shapes = {name: a.shape for name, a in
            (('x', x), ('xs1', xs1), ('xs2', xs2), ('xh1', xh1), ('xh2', xh2))}
  if x.ndim != 4 or len(set(shapes.values())) != 1:
    raise ValueError(
        f'All images must be [B, H, W, C] of one shape, got {shapes}.')
  # One call over the 4 pairs keeps a single vmapped Sinkhorn loop.
  sources = jnp.concatenate([xh1, xh2, xh1, xh2], axis=0)
  targets = jnp.concatenate([x, x, xs1, xs2], axis=0)
  costs = ot.image_sinkhorn_cost(sources, targets, grid_size=grid_size,
                                 epsilon=epsilon, num_iters=num_iters)
  per_image = jnp.sum(costs.reshape(4, x.shape[0]), axis=0)
  return 0.5 * jnp.mean(per_image)


def alpha_from_logit(logit: jnp.ndarray) -> jnp.ndarray:
  """The learnt interpolation coefficient ``alpha = sigmoid(logit)``."""
  return jax.nn.sigmoid(logit)


def alpha_to_logit(alpha: float) -> float:
  """``log(alpha / (1 - alpha))``: the logit of an initial `alpha` in (0, 1),
  as a Python float (the inverse of `alpha_from_logit`)."""
  if not 0.0 < alpha < 1.0:
    raise ValueError(
        f'A learnt alpha is a sigmoid: its initial value must lie strictly in '
        f'(0, 1), got {alpha}.')
  return float(np.log(alpha) - np.log1p(-alpha))
