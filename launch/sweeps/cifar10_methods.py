"""The paper's CIFAR-10 comparison: 4 methods x with and without OT views.

    python -m launch.sweep --config=launch/sweeps/cifar10_methods.py \
        --workdir=runs/cifar10_methods
"""

from configs import cifar10

get_config = cifar10.get_config


def get_hyper(hyper):
  return hyper.product([
      hyper.sweep('config.method', ['simclr', 'moco', 'byol', 'dino']),
      hyper.sweep('config.views', ['augment', 'ot']),
  ])
