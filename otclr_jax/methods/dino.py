"""DINO (Caron et al. 2021) with a ResNet-18 and two global views.

DINO's own code for everything DINO-specific (head, teacher EMA with its own
BatchNorm statistics, centring, frozen prototypes, clipping), solo-learn's
CIFAR recipe for the optimiser; both views in one forward pass, as DINO's
multi-crop wrapper. The recipe and its sources, with file and line:
docs/methods.md.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from otclr_jax import losses
from otclr_jax import models
from otclr_jax.methods import base


class DINOHead(nn.Module):
  """DINO's head: 3-layer MLP, l2 norm, unit-norm prototypes (norm_last_layer).

  Attributes:
    hidden_dim: width of the two hidden layers.
    bottleneck_dim: dimension of the l2-normalised bottleneck.
    num_prototypes: output dimension K (the softmax is over K).
    use_bn: BatchNorm after each hidden Dense.
    dtype: computation dtype; parameters stay float32.
  """
  hidden_dim: int = 2048
  bottleneck_dim: int = 256
  num_prototypes: int = 4096
  use_bn: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, h: jnp.ndarray, train: bool = False
               ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Features [B, D] -> ``(y, logits)``, float32.

    y [B, bottleneck_dim] is the bottleneck before normalisation, logits
    [B, num_prototypes] the prototype cosines, in [-1, 1]; `train` matters
    only with `use_bn`.
    """
    if h.ndim != 2:
      raise ValueError(f'Expected features of shape [B, D], got {h.shape}.')
    dense = lambda f, name: nn.Dense(
        f, dtype=self.dtype, param_dtype=jnp.float32,
        kernel_init=nn.initializers.truncated_normal(0.02),
        bias_init=nn.initializers.zeros, name=name)
    def hidden(y, name):
      y = dense(self.hidden_dim, name)(y)
      if self.use_bn:
        y = models.batch_norm(train, self.dtype, f'{name}_bn')(y)
      return nn.gelu(y, approximate=False)
    y = hidden(hidden(h, 'hidden1'), 'hidden2')
    y = dense(self.bottleneck_dim, 'bottleneck')(y).astype(jnp.float32)
    u = losses.l2_normalise(y)
    # torch.nn.Linear's default init, as DINO (created after its trunc-normal).
    v = self.param('prototypes',
                   nn.initializers.variance_scaling(1 / 3, 'fan_in', 'uniform'),
                   (self.bottleneck_dim, self.num_prototypes), jnp.float32)
    w = losses.l2_normalise(v, axis=0)
    logits = jnp.dot(u.astype(self.dtype), w.astype(self.dtype))
    return y, logits.astype(jnp.float32)


class DINONet(nn.Module):
  """DINO's student (and teacher) network: ResNet encoder and DINO head."""
  encoder: models.ResNet = models.ResNet()
  head: DINOHead = DINOHead()

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool
               ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Images [B, H, W, C] -> ``(h [B, 512],) + head(h)``, all float32."""
    h = self.encoder(x, train)
    return (h, *self.head(h, train))


def default_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.hidden_dim = 2048  # DINO head MLP width (solo-learn CIFAR).
  config.bottleneck_dim = 256
  config.num_prototypes = 4096
  # Off, as DINO's and solo-learn's `use_bn_in_head`.
  config.use_bn_in_head = False
  config.student_temp = 0.1
  config.teacher_temp = 0.04  # DINO: constant 0.04 (no warm-up).
  config.warmup_teacher_temp = 0.04
  config.warmup_teacher_temp_epochs = 0.0
  config.centre_momentum = 0.9
  # Epochs during which the prototypes get no gradient (DINO).
  config.freeze_last_layer = 1.0
  # Teacher momentum, cosine to final_tau (DINO's advice at batch 256).
  config.base_tau = 0.9995
  config.final_tau = 1.0
  # Largest share of the teacher's initialisation left at the end.
  config.max_init_share = 0.01
  # solo-learn cifar/dino.yaml; gradients clipped per parameter, as DINO.
  config.optim = base.lars(base_lr=0.3, weight_decay=1e-6, clip_grad=3.0)
  return config


def create_model(config: ml_collections.ConfigDict) -> DINONet:
  encoder = base.encoder(config)
  settings = config.dino
  return DINONet(encoder=encoder, head=DINOHead(
      hidden_dim=settings.hidden_dim, bottleneck_dim=settings.bottleneck_dim,
      num_prototypes=settings.num_prototypes, use_bn=settings.use_bn_in_head,
      dtype=encoder.dtype))


def embed(model: DINONet, variables, h: jax.Array) -> jax.Array:
  """The head's bottleneck [N, bottleneck_dim] of features h [N, 512]."""
  head_variables = {'params': variables['params']['head']}
  if model.head.use_bn:
    head_variables['batch_stats'] = variables['batch_stats']['head']
  return model.head.apply(head_variables, h)[0]


def freeze_prototypes(config: ml_collections.ConfigDict, params,
                      progress: base.Progress):
  """`params` with the prototypes frozen while epoch < freeze_last_layer."""
  frozen = progress.step < (config.dino.freeze_last_layer
                            * progress.steps_per_epoch)
  prototypes = params['head']['prototypes']
  prototypes = jnp.where(frozen, jax.lax.stop_gradient(prototypes),
                         prototypes)
  return dict(params, head=dict(params['head'], prototypes=prototypes))


def teacher_temperature(config: ml_collections.ConfigDict,
                        progress: base.Progress) -> jax.Array:
  """Linear warm-up ``warmup_teacher_temp -> teacher_temp``, then constant."""
  settings = config.dino
  warmup_steps = settings.warmup_teacher_temp_epochs * progress.steps_per_epoch
  if warmup_steps <= 0:
    return jnp.float32(settings.teacher_temp)
  frac = jnp.minimum(jnp.asarray(progress.step, jnp.float32) / warmup_steps,
                     1.0)
  return jnp.float32(settings.warmup_teacher_temp) + jnp.float32(
      settings.teacher_temp - settings.warmup_teacher_temp) * frac


def dino_loss(student: jax.Array, teacher: jax.Array, centre: jax.Array,
              student_temp: float, teacher_temp: jax.Array | float
              ) -> jax.Array:
  """DINO's cross-view cross-entropy for two crops.

  Args:
    student: student prototype scores [2B, K], rows [view 1; view 2].
    teacher: teacher prototype scores [2B, K], same order (constants).
    centre: [K].
    student_temp: student softmax temperature.
    teacher_temp: teacher softmax temperature.

  Returns:
    Scalar float32: ``1/2 sum_{v != w} mean_b -sum_k P_t(w)_bk log P_s(v)_bk``.
  """
  log_p_s = jax.nn.log_softmax(student.astype(jnp.float32) / student_temp,
                               axis=-1)
  p_t = jax.nn.softmax((teacher.astype(jnp.float32) - centre) / teacher_temp,
                       axis=-1)
  s1, s2 = jnp.split(log_p_s, 2)
  t1, t2 = jnp.split(p_t, 2)
  return (jnp.mean(jnp.sum(-t2 * s1, axis=-1))
          + jnp.mean(jnp.sum(-t1 * s2, axis=-1))) / 2


def teacher_entropy(teacher: jax.Array, centre: jax.Array,
                    teacher_temp: jax.Array | float) -> jax.Array:
  """Mean entropy of the teacher's centred, sharpened softmax, rows [2B, K]."""
  log_p_t = jax.nn.log_softmax(
      (teacher.astype(jnp.float32) - centre) / teacher_temp, axis=-1)
  return jnp.mean(jnp.sum(-jnp.exp(log_p_t) * log_p_t, axis=-1))


def update_centre(centre: jax.Array, teacher: jax.Array,
                  momentum: float) -> jax.Array:
  """``momentum * centre + (1 - momentum) * mean over rows of teacher`` [K]."""
  return momentum * centre + (1.0 - momentum) * jnp.mean(
      teacher.astype(jnp.float32), axis=0)


def init_extra(config, variables, key):
  """Teacher = copy of the student; centre 0 (as DINO)."""
  del key
  return {**base.copy_targets(variables),
          'centre': jnp.zeros((config.dino.num_prototypes,), jnp.float32)}


def loss(config, model, params, batch_stats, extra, v1, v2, progress):
  """DINO loss and the centre update; see `base.Method.loss`."""
  views = jnp.concatenate([v1, v2])
  (_, _, student), updates = model.apply(
      {'params': freeze_prototypes(config, params, progress),
       'batch_stats': batch_stats}, views, train=True,
      mutable=['batch_stats'])
  (_, _, teacher), target_updates = model.apply(
      {'params': extra['target_params'],
       'batch_stats': extra['target_batch_stats']}, views, train=True,
      mutable=['batch_stats'])
  teacher = jax.lax.stop_gradient(teacher)
  temp = teacher_temperature(config, progress)
  value = dino_loss(student, teacher, extra['centre'],
                    config.dino.student_temp, temp)
  new_extra = dict(
      extra, target_batch_stats=target_updates['batch_stats'],
      centre=update_centre(extra['centre'], teacher,
                           config.dino.centre_momentum))
  # Loss = H(P_t) + KL(P_t || P_s); DINO section 5.3 monitors both.
  metrics = {'dino': value, 'teacher_temp': temp,
             'teacher_entropy': teacher_entropy(teacher, extra['centre'],
                                                temp)}
  return value, metrics, updates['batch_stats'], new_extra


# Teacher parameters follow the student by EMA.
post_update = base.ema_targets('dino')


METHOD = base.Method(
    name='dino', title='DINO', create_model=create_model,
    init_extra=init_extra, loss=loss, post_update=post_update,
    default_config=default_config, network=DINONet, embed=embed)
