"""The whole pipeline in minutes on a CPU: 2 methods x 2 seeds on 8x8 digits.

    python -m launch.sweep --config=launch/sweeps/digits_smoke.py \
        --workdir=/tmp/digits_smoke
"""

from configs import digits


def get_config():
  config = digits.get_config()
  config.batch_size = 64
  config.image_size = 8
  config.total_steps = 20
  config.log_every_steps = 5
  config.checkpoint_every_steps = 10
  config.model.proj_hidden_dim = 64
  config.model.proj_dim = 32
  config.ot.grid_size = 4
  # Its schedule within its 20 steps: warm-up 4 steps, the monitor twice.
  config.optim.warmup_epochs = 0.2
  config.monitor.every_steps = 10
  return config


def get_hyper(hyper):
  return hyper.product([
      hyper.sweep('config.seed', [0, 1]),
      hyper.sweep('config.method', ['simclr', 'otclr']),
  ])
