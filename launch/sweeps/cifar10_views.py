"""Which ingredient of the OT view decides (docs/method.md, "OT view options"):
SimCLR, OTCLR and OTCLR with each option, at the paper's batch 256 x 3 seeds,
probed with stored and with clean-image BatchNorm statistics.

    python -m launch.sweep --config=launch/sweeps/cifar10_views.py \
        --workdir=runs/cifar10_views
"""

from configs import cifar10


def get_config():
  config = cifar10.get_config()
  # The BatchNorm statistics of blurred, framed training views against those
  # of clean images: the second row of every run.
  config.eval.recompute_bn = True
  return config


def get_hyper(hyper):
  arms = hyper.zipit([
      hyper.sweep('config.method', ['simclr', 'otclr', 'otclr', 'otclr',
                                    'otclr']),
      hyper.sweep('config.ot.source', ['image', 'image', 'strong', 'image',
                                       'image']),
      hyper.sweep('config.ot.detail', ['none', 'none', 'none', 'residual',
                                       'none']),
      hyper.sweep('config.ot.colour', ['before', 'before', 'before', 'before',
                                       'after']),
  ])
  return hyper.product([
      hyper.sweep('config.seed', [0, 1, 2]),
      hyper.sweep('config.batch_size', [256]),
      arms,
  ])
