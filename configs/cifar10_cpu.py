"""CIFAR-10 pretraining sized for a 2-core CPU: the paper's setting, 3 epochs.

Everything is configs/cifar10.py (ResNet-18 with the imagenet stem at 32 x 32,
batch 256, SGD momentum 0.9, tau = 0.5, the 512-512-128 head, the paper's OT
settings m = 16, eps = 0.05, T = 20) except the length: 3 epochs (585 steps)
instead of 20, with the warm-up kept at a tenth of the run. One method
pretrains in about 11 minutes on an idle 2-core AVX-512 CPU (docs/results.md
gives the measured times). It is the CPU stand-in for the paper's protocol
(launch/sweeps/cifar10_paper.py), not that protocol:
launch/sweeps/cifar10_seeds.py runs it for SimCLR and OTCLR over 3 seeds.
"""

from configs import cifar10


def get_config():
  config = cifar10.get_config()
  config.num_epochs = 3
  config.optim.warmup_epochs = 0.3
  config.log_every_steps = 10
  config.checkpoint_every_steps = 50
  return config
