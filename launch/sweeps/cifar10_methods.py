"""The paper's model comparison on CIFAR-10: every method, with and without OT views.

SimCLR, MoCo v2, BYOL and DINO (docs/methods.md), each with the SimCLR strong
augmentations and with the OT views of those augmentations, at the paper's
setting of configs/cifar10.py (20 epochs, batch 256); 8 runs of one seed.
Rows are named as the paper names them ("BYOL", "BYOL + OT views", "OTCLR").

    python -m launch.sweep --config=launch/sweeps/cifar10_methods.py \
        --workdir=runs/cifar10_methods
"""

from configs import cifar10


def get_config():
  return cifar10.get_config()


def get_hyper(hyper):
  return hyper.product([
      hyper.sweep('config.method', ['simclr', 'moco', 'byol', 'dino']),
      hyper.sweep('config.views', ['augment', 'ot']),
  ])
