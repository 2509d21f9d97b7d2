"""A tiny but complete run config shared by the end-to-end tests."""

from configs import default


def tiny_config(data_dir, **overrides):
  """8 px digits, batch 16, 4 steps, a small head and a 4 x 4 OT grid.

  Args:
    data_dir: where the digits cache goes (a tmp dir).
    **overrides: dotted config fields, e.g. `**{'ot.beta': 1.0}`.

  Returns:
    The ConfigDict.
  """
  config = default.get_config()
  config.dataset = 'digits'
  config.data_dir = data_dir
  config.image_size = 8
  config.batch_size = 16
  config.total_steps = 4
  config.log_every_steps = 2
  config.checkpoint_every_steps = 2
  config.model.proj_hidden_dim = 32
  config.model.proj_dim = 16
  config.ot.grid_size = 4
  config.eval.datasets = ('digits',)
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split('.')
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return config
