"""Every objective with both view generators on digits: 4 methods x 2 views.

Eight runs of the embedded default (`configs/digits.py`: 12 epochs at batch
128 on the 1,437 training digits), each evaluated like the README's first
command, so the table's rows compare with its random-init floor. About five
minutes per run on an idle 2-core CPU.

    python -m launch.sweep digits_methods --workdir=runs/digits_methods
"""


def get_sweep():
  return {
      'config': 'configs/digits.py',
      'grid': {
          'method': ['simclr', 'moco', 'byol', 'dino'],
          'views': ['augment', 'ot'],
          'batch_size': [128],
          'seed': [0],
          'dataset': ['digits'],
      },
      'overrides': {},
  }
