"""The CIFAR-10 reproduction: SimCLR vs OTCLR x batch 256/512 x 3 seeds.

    python -m launch.sweep --config=launch/sweeps/cifar10_paper.py \
        --workdir=runs/cifar10_paper
"""

from configs import cifar10

get_config = cifar10.get_config


def get_hyper(hyper):
  return hyper.product([
      hyper.sweep('config.seed', [0, 1, 2]),
      hyper.sweep('config.batch_size', [256, 512]),
      hyper.sweep('config.method', ['simclr', 'otclr']),
  ])
