"""Every objective with both view generators on digits: 4 methods x 2 views x 3 seeds.

24 runs of the embedded default (`configs/digits.py`: 12 epochs at batch
128 on the 1,437 training digits), each evaluated like the README's first
command with its own random-init floor; the summary gives mean +- std over
seeds 0, 1 and 2. About two minutes per run on an idle 2-core AVX-512 CPU,
50 minutes in all; 3-5 minutes per run on an AVX2 one, 80 minutes
(docs/results.md has the table).

    python -m launch.sweep --config=launch/sweeps/digits_methods.py \\
        --workdir=runs/digits_methods
"""

from configs import digits


def get_config():
  return digits.get_config()


def get_hyper(hyper):
  return hyper.product([
      hyper.sweep('config.method', ['simclr', 'moco', 'byol', 'dino']),
      hyper.sweep('config.views', ['augment', 'ot']),
      hyper.sweep('config.seed', [0, 1, 2]),
  ])
