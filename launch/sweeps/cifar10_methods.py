"""The paper's model comparison on CIFAR-10: every method, with and without OT views.

SimCLR, MoCo v2, BYOL and DINO (docs/methods.md), each with the SimCLR strong
augmentations and with the OT views of those augmentations, at the paper's
setting of configs/cifar10.py (20 epochs, batch 256); 8 runs of one seed.
Rows are named as the paper names them ("BYOL", "BYOL + OT views", "OTCLR").

    python -m launch.sweep cifar10_methods --workdir=runs/cifar10_methods
"""


def get_sweep():
  return {
      'config': 'configs/cifar10.py',
      'grid': {
          'method': ['simclr', 'moco', 'byol', 'dino'],
          'views': ['augment', 'ot'],
          'batch_size': [256],
          'seed': [0],
          'dataset': ['cifar10'],
      },
  }
