"""The CIFAR-10 reproduction: SimCLR vs OTCLR x batch 256/512 x 3 seeds.

Every run uses the paper's setting of configs/cifar10.py unchanged; 12 runs.

    python -m launch.sweep cifar10_paper --workdir=runs/cifar10_paper
"""


def get_sweep():
  return {
      'config': 'configs/cifar10.py',
      'grid': {
          'method': ['simclr', 'otclr'],
          'batch_size': [256, 512],
          'seed': [0, 1, 2],
          'dataset': ['cifar10'],
      },
  }
