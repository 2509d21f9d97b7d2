"""Embedded default: scikit-learn's bundled digits, pretraining on a CPU in minutes.

No download: the images ship inside scikit-learn. 16 x 16 images, a smaller
projection head and few epochs keep the run short; the encoder (ResNet-18,
imagenet stem), loss and OT views are the paper's.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = 'digits'
  config.image_size = 16
  config.batch_size = 128
  config.num_epochs = 12
  config.log_every_steps = 10
  config.checkpoint_every_steps = 50
  config.model.proj_hidden_dim = 512
  config.optim.warmup_epochs = 1.0
  config.ot.grid_size = 8
  config.monitor.every_steps = 50  # steps 50 and 100 of the ~130
  config.eval.datasets = ('digits',)
  config.eval.at_end = True
  return config
