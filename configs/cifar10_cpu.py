"""CIFAR-10 pretraining sized for a 2-core CPU: the paper's setting, 2 epochs.

Everything is configs/cifar10.py (ResNet-18 with the imagenet stem at 32 x 32,
batch 256, SGD momentum 0.9, tau = 0.5, the paper's OT settings) except the
length: 2 epochs (390 steps) instead of 20, so one method pretrains in about
half an hour on an idle 2-core CPU, with a warmup of a quarter epoch so that
most steps run near the peak learning rate. It exists to show, on a machine
without an accelerator, that pretraining learns (beats the random-init
encoder); it is not the paper's protocol (launch/sweeps/cifar10_paper.py).
"""

from configs import cifar10


def get_config():
  config = cifar10.get_config()
  config.num_epochs = 2
  config.optim.warmup_epochs = 0.25
  config.log_every_steps = 10
  config.checkpoint_every_steps = 50
  return config
