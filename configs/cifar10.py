"""CIFAR-10 pretraining at the paper's setting (32 x 32, imagenet stem, batch 256)."""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = 'cifar10'
  config.eval.datasets = ('cifar10',)
  return config
