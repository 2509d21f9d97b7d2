"""The paper's hyperparameters (docs/method.md sections 1, 6, 8 and 9).

Every other config imports this one and overrides a few fields. Any field can
be overridden on the command line, e.g. `--config.ot.epsilon=0.1`.
"""

import ml_collections

from otclr_jax import methods


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.mode = 'train'  # 'train' pretrains; 'eval' probes the latest checkpoint.
  config.seed = 0
  # The objective: 'simclr', 'moco', 'byol' or 'dino' (docs/methods.md), or
  # 'otclr', the paper's method: SimCLR with OT views.
  config.method = 'otclr'
  # The view generator: 'augment' (two SimCLR strong augmentations) or 'ot'
  # (OT displacement views); '' = 'ot' for 'otclr', 'augment' otherwise.
  config.views = ''

  config.dataset = 'imagenet300'  # see otclr_jax/data/ for names.
  config.data_dir = ''  # '' = $TFDS_DATA_DIR or ~/tensorflow_datasets.
  # XLA's persistent compilation cache: a run reads the programs an earlier
  # run of the same shapes compiled (main.use_compilation_cache).
  # '' leaves JAX's own setting ($JAX_COMPILATION_CACHE_DIR, which also wins
  # when set; off by default).
  config.compilation_cache_dir = '~/.cache/otclr_jax/xla'
  config.image_size = 32
  config.batch_size = 256
  config.num_epochs = 20
  config.total_steps = 0  # > 0 overrides num_epochs.

  config.log_every_steps = 50
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 3
  config.dtype = 'float32'  # activations; 'bfloat16' for mixed precision.

  config.model = ml_collections.ConfigDict()
  config.model.stem = 'imagenet'  # 7x7/2 conv + max-pool, as in the paper.
  config.model.stage_sizes = (2, 2, 2, 2)  # BasicBlocks per stage: ResNet-18.
  # Convolutions: 'xla' (lax.conv), 'matmul' (shifts + one GEMM, fast on
  # small maps on CPU) or 'auto' (per layer on CPU, XLA's on GPU/TPU); the
  # parameters are the same, so checkpoints load under any (models.py).
  config.model.conv_impl = 'auto'
  # 512-512-128: the paper's 23.01M MoCo pretraining parameters are two
  # copies of (ResNet-18 11,176,512 + this head 328,832) = 23,010,688; the head
  # is 512*512 (no bias) + 2*512 (BatchNorm) + 512*128 + 128 = 328,832.
  config.model.proj_hidden_dim = 512
  config.model.proj_dim = 128

  # SimCLR's strong augmentation (fields of otclr_jax.augment.AugmentParams);
  # its defaults are torchvision's SimCLR recipe at SimCLR's CIFAR strength.
  config.augment = ml_collections.ConfigDict()
  config.augment.crop_scale = (0.08, 1.0)
  config.augment.flip_prob = 0.5
  config.augment.jitter_prob = 0.8
  config.augment.brightness = 0.4
  config.augment.contrast = 0.4
  config.augment.saturation = 0.4
  config.augment.hue = 0.1
  config.augment.grayscale_prob = 0.2
  config.augment.blur_prob = 0.5

  config.loss = ml_collections.ConfigDict()
  config.loss.temperature = 0.5

  # The paper's optimiser (SGD, momentum 0.9, weight decay 1e-4), used by
  # SimCLR/OTCLR and MoCo. BYOL and DINO train with their upstream recipes,
  # config.byol.optim and config.dino.optim (same fields); warmup_epochs is
  # this block's for every method.
  config.optim = ml_collections.ConfigDict()
  config.optim.name = 'sgd'  # or 'lars' (solo-learn's, optim.lars).
  # [decision] The paper gives no learning rate: SimCLR's linear scaling,
  # lr = base_lr * batch_size / 256, linear warmup then cosine decay to 0.
  config.optim.base_lr = 0.3
  config.optim.momentum = 0.9
  config.optim.weight_decay = 1e-4
  config.optim.warmup_epochs = 2.0
  config.optim.eta = 0.02  # LARS trust coefficient (name='lars' only).
  config.optim.clip_lr = True  # LARS: adapted rate at most the global one.
  config.optim.clip_grad = 0.0  # per-parameter gradient-norm clip; 0: off.

  config.ot = ml_collections.ConfigDict()
  config.ot.grid_size = 16
  config.ot.epsilon = 0.05
  config.ot.num_iters = 20
  config.ot.core = 'separable'  # Sinkhorn: fused 'separable' loop or 'ott'.
  config.ot.alpha = 0.5
  config.ot.beta = 0.0
  # Train alpha = sigmoid(logit), initialised at ot.alpha; only then does the
  # Sinkhorn regulariser reach any parameter (docs/method.md section 6).
  config.ot.learn_alpha = False
  # How OT views are made, each a [decision] (docs/method.md section 1, "OT
  # view options"); the defaults are the paper's view, and each option
  # separates one suspected cause of easy or unnatural positives.
  # The source each view is transported from: 'image' (the stored image,
  # shared by both views), 'strong' (the view's own strong augmentation,
  # D(x_s, x_s)) or 'weak' (its own crop and flip of the image).
  config.ot.source = 'image'
  # 'residual' adds back the strong view's detail that the grid and the
  # entropic blur remove, x_s - D(x_s, x_s); 'none' adds nothing.
  config.ot.detail = 'none'
  # Colour jitter, grayscale and blur 'before' the transport (part of x_s) or
  # 'after' it (OT between uncoloured crops, then the same colour draws).
  config.ot.colour = 'before'

  # kNN monitor during pretraining (otclr_jax/evaluation/monitor.py): every
  # every_steps optimiser steps (0: off; a multiple of log_every_steps), kNN
  # top-1 of num_test test images against num_train labelled train images,
  # logged as monitor_knn_top1. Never changes the run's result.
  config.monitor = ml_collections.ConfigDict()
  config.monitor.every_steps = 500  # 10 x log_every_steps
  config.monitor.num_train = 1000
  config.monitor.num_test = 500

  config.eval = ml_collections.ConfigDict()
  config.eval.datasets = ('cifar10',)
  config.eval.at_end = False  # evaluate right after pretraining.
  config.eval.batch_size = 512  # images per feature-extraction batch.
  config.eval.probe_steps = 500  # max Newton iterations per linear-probe fit.
  config.eval.num_view_images = 500  # test images for the view metrics (paper).
  # Embedding of the cluster / view metrics and t-SNE: 'z' (the paper's
  # l2-normalised projection output) or 'h' (backbone features).
  config.eval.embedding = 'z'
  # Also probe with BatchNorm statistics re-estimated on clean train images.
  config.eval.recompute_bn = False
  config.eval.views_dataset = ''  # '' = the first of eval.datasets.
  # What evaluation measures, in this order (otclr_jax/evaluation/evaluate.py).
  config.eval.evaluators = ('probe', 'knn', 'clusters', 'views')
  config.eval.figures = True  # t-SNE and training curves after evaluating.
  # Where runs share their random-init floor (otclr_jax/evaluation/floor.py):
  # '' fits it in every evaluation; launch.sweep sets <sweep dir>/floors.
  config.eval.floor_dir = ''
  # Each method's own settings block (config.moco, config.byol, config.dino;
  # defaults and their sources in otclr_jax/methods/<name>.py).
  methods.add_defaults(config)
  # A config file builds on these fields: a misspelt one fails with "Did you
  # mean", as on the command line, instead of being added and ignored.
  config.lock()
  return config
