"""SimCLR against OTCLR on CIFAR-10 at the CPU scale, seeds 0, 1 and 2.

configs/cifar10_cpu.py (the paper's setting for 3 epochs at batch 256) for
both methods; the summary gives mean +- std over seeds of the linear probe,
kNN and the view metrics, with each run's random-init floor. The method is
the outer axis, so every SimCLR run comes before the OTCLR runs. The data is
given on the command line (docs/results.md has the full command), e.g. JPEG
CIFAR-10 unpacked in DATA:

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
