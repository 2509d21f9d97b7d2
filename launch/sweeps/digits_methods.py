"""Every objective with both view generators on digits: 4 methods x 2 views.

Eight runs of 20 steps on 8 x 8 digits with small heads, queue and OT grid;
minutes on a CPU. The numbers only show that every combination trains,
evaluates and lands in the table under its paper name ('MoCo + OT views').

    python -m launch.sweep digits_methods --workdir=/tmp/digits_methods
"""


def get_sweep():
  return {
      'config': 'configs/digits.py',
      'grid': {
          'method': ['simclr', 'moco', 'byol', 'dino'],
          'views': ['augment', 'ot'],
          'batch_size': [64],
          'seed': [0],
          'dataset': ['digits'],
      },
      'overrides': {
          'total_steps': 20,
          'log_every_steps': 5,
          'checkpoint_every_steps': 10,
          'model.proj_hidden_dim': 64,
          'model.proj_dim': 32,
          'ot.grid_size': 4,
          'moco.queue_size': 256,
          'byol.pred_hidden_dim': 64,
          'dino.hidden_dim': 64,
          'dino.bottleneck_dim': 32,
          'dino.num_prototypes': 256,
      },
  }
