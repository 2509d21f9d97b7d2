"""A smoke test of the whole pipeline on a CPU: both methods x 2 seeds on digits.

Four runs of 20 steps on 8 x 8 digits with a small head and OT grid; minutes
in all. The numbers only show that everything runs end to end.

    python -m launch.sweep digits_smoke --workdir=/tmp/digits_smoke
"""


def get_sweep():
  return {
      'config': 'configs/digits.py',
      'grid': {
          'method': ['simclr', 'otclr'],
          'batch_size': [64],
          'seed': [0, 1],
          'dataset': ['digits'],
      },
      'overrides': {
          'image_size': 8,
          'total_steps': 20,
          'log_every_steps': 5,
          'checkpoint_every_steps': 10,
          'model.proj_hidden_dim': 64,
          'model.proj_dim': 32,
          'ot.grid_size': 4,
      },
  }
