"""Every objective with both view generators on digits: 4 methods x 2 views.

Eight runs of the embedded default (`configs/digits.py`: 12 epochs at batch
128 on the 1,437 training digits), each evaluated like the README's first
command, so the table's rows compare with its random-init floor. About two
minutes per run on an idle 2-core AVX-512 CPU (docs/results.md has the
table).

    python -m launch.sweep --config=launch/sweeps/digits_methods.py \
        --workdir=runs/digits_methods
"""

from configs import digits


def get_config():
  return digits.get_config()


def get_hyper(hyper):
  return hyper.product([
      hyper.sweep('config.method', ['simclr', 'moco', 'byol', 'dino']),
      hyper.sweep('config.views', ['augment', 'ot']),
  ])
