"""SimCLR against OTCLR on CIFAR-10 at the CPU scale, seeds 0, 1 and 2.

With JPEG CIFAR-10 unpacked in DATA (docs/results.md has the full command):

    python -m launch.sweep --config=launch/sweeps/cifar10_seeds.py \
        --workdir=runs/cifar10_seeds \
        --config.dataset=folder:DATA --config.eval.datasets='("folder:DATA",)'
"""

from configs import cifar10_cpu


def get_config():
  config = cifar10_cpu.get_config()
  config.eval.at_end = True
  return config


def get_hyper(hyper):
  return hyper.product([
      hyper.sweep('config.method', ['simclr', 'otclr']),
      hyper.sweep('config.seed', [0, 1, 2]),
  ])
