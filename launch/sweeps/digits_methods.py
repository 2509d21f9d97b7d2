"""Every method with both view generators on digits: 4 x 2 views x 3 seeds.

    python -m launch.sweep --config=launch/sweeps/digits_methods.py \\
        --workdir=runs/digits_methods
"""

from configs import digits

get_config = digits.get_config


def get_hyper(hyper):
  return hyper.product([
      hyper.sweep('config.method', ['simclr', 'moco', 'byol', 'dino']),
      hyper.sweep('config.views', ['augment', 'ot']),
      hyper.sweep('config.seed', [0, 1, 2]),
  ])
