"""DINO (Caron et al. 2021) with a ResNet-18 and two global views, no multi-crop.

Decisions and sources (docs/methods.md has the full table):

* Networks: student = ResNet-18 + DINO head (3-layer MLP 512 -> 2048 -> 2048
  -> 256 with GELU and no BatchNorm, l2 normalisation, weight-normalised
  bias-free prototypes 256 -> 4096 with their norm fixed to 1); `models.
  DINONet`. Widths are `config.dino.hidden_dim / bottleneck_dim /
  num_prototypes`, defaults from solo-learn ``scripts/pretrain/cifar/
  dino.yaml`` (DINO's ImageNet head has 65536 prototypes).
* Teacher: a copy of the student updated by EMA of all parameters after every
  step, momentum on a cosine from 0.996 to 1.0 (DINO's defaults;
  solo-learn's CIFAR 0.9995 is tuned for 1000 epochs, far longer than the
  paper's 20). Its BatchNorm (in the encoder) keeps its own running
  averages in training mode, as in DINO's code.
* Loss: cross-entropy between the teacher's centred, sharpened softmax and the
  student's softmax on the other view, ``L = 1/2 [H(P_t(x2), P_s(x1)) +
  H(P_t(x1), P_s(x2))]`` averaged over the batch (DINO Algorithm 1 with two
  crops), student temperature 0.1, teacher temperature warmed up linearly
  from 0.04 to 0.07 over `config.dino.warmup_teacher_temp_epochs` = 5 epochs
  (DINO: 30 of 100-300 epochs; solo-learn 50 of 1000; 5 is a quarter of the
  paper's 20-epoch runs). DINO steps the temperature once per epoch; here it
  moves every step.
* Centre: ``c <- 0.9 c + 0.1 mean(teacher logits over both views of the
  global batch)``, after the loss, in ``extra['centre']``.
* Left out: multi-crop (its small crops need a second input size), DINO's
  freezing of the prototypes in the first epoch, gradient clipping and its
  weight-decay schedule (the project's optimiser is shared by all methods).
  DINOv3 needs a ViT and Gram anchoring: not implemented.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from otclr_jax import models
from otclr_jax.methods import base


def default_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.hidden_dim = 2048  # DINO head MLP width (solo-learn CIFAR).
  config.bottleneck_dim = 256
  config.num_prototypes = 4096
  config.student_temp = 0.1
  config.teacher_temp = 0.07
  config.warmup_teacher_temp = 0.04
  config.warmup_teacher_temp_epochs = 5.0
  config.centre_momentum = 0.9
  config.base_tau = 0.996  # teacher momentum, cosine to final_tau (DINO).
  config.final_tau = 1.0
  return config


def create_model(config: ml_collections.ConfigDict) -> models.DINONet:
  return models.DINONet(
      stem=config.model.stem, hidden_dim=config.dino.hidden_dim,
      bottleneck_dim=config.dino.bottleneck_dim,
      num_prototypes=config.dino.num_prototypes,
      dtype=base.dtype_of(config))


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
  """Mean entropy of the teacher's centred, sharpened softmax over [2B, K] rows."""
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
  base.check_momentum('dino', config.dino.base_tau, config.dino.final_tau)
  return {'target_params': base.copy_tree(variables['params']),
          'target_batch_stats': base.copy_tree(variables['batch_stats']),
          'centre': jnp.zeros((config.dino.num_prototypes,), jnp.float32)}


def loss(config, model, params, batch_stats, extra, v1, v2, progress):
  """DINO loss and the centre update; see `base.Method.loss`."""
  views = jnp.concatenate([v1, v2])
  (_, _, student), updates = model.apply(
      {'params': params, 'batch_stats': batch_stats}, views, train=True,
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
  # The loss is H(P_t) + KL(P_t || P_s): logging the teacher's entropy separates
  # the part the student can lower from the part the temperature and centre
  # set (DINO, section 5.3, monitors both against collapse).
  metrics = {'dino': value, 'teacher_temp': temp,
             'teacher_entropy': teacher_entropy(teacher, extra['centre'],
                                                temp)}
  return value, metrics, updates['batch_stats'], new_extra


# Teacher parameters follow the student by EMA.
post_update = base.ema_targets('dino')


METHOD = base.Method(
    name='dino', title='DINO', create_model=create_model,
    init_extra=init_extra, loss=loss, post_update=post_update,
    default_config=default_config)
