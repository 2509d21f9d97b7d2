"""CIFAR-10 pretraining sized for a 2-core CPU: the paper's setting, 1 epoch.

Everything is configs/cifar10.py (ResNet-18 with the imagenet stem at 32 x 32,
SGD momentum 0.9, tau = 0.5, the paper's OT settings) except the length and
the batch: 1 epoch at batch 128 (390 steps) instead of 20 epochs at 256, so
one method pretrains in about 15 minutes on an idle 2-core CPU. At a fixed
budget of images, a smaller batch gives twice the updates, which is what a
short run needs; the warmup is a tenth of the epoch. It exists to show, on a machine
without an accelerator, that pretraining learns (beats the random-init
encoder); it is not the paper's protocol (launch/sweeps/cifar10_paper.py).
"""

from configs import cifar10


def get_config():
  config = cifar10.get_config()
  config.batch_size = 128
  config.num_epochs = 1
  config.optim.warmup_epochs = 0.1
  config.log_every_steps = 10
  config.checkpoint_every_steps = 50
  return config
