"""Benchmarks: `python -m otclr_jax.bench <ot|train|resnet|probe|views> [flags]`.

  ot   ms per batch of the OT view generator (docs/method.md sections 2-5)
       against ott-jax, POT (skipped if absent) and its other Sinkhorn core.
  train --config=configs/X.py [--methods=moco,...]
       complexity table of every method with both view generators.
  resnet --config=configs/X.py [--conv_impls=xla,matmul,auto] [--per_layer]
       ResNet-18 forward + backward per `model.conv_impl`.
  probe --workdir=<run> --tag=<step<N>|init> [--dataset=digits]
        [--backend=auto|numpy|jax]
       seconds of the linear probe on one evaluation's cached features.
  views --config=configs/X.py --dataset=<name> [--num_images=500]
       pixel and untrained-encoder statistics of the configured positive
       views on test images, against the strong augmentations.

Override config fields as `--config.a.b=v`.
"""

from __future__ import annotations

import importlib
from typing import Sequence

from absl import app
from absl import flags
from ml_collections import config_flags

from otclr_jax import config_files

# Each command's module, imported alone: `ot`'s needs ott-jax, whose import
# is slow. Its `run(flag_values)` runs the command.
COMMANDS = {'ot': 'ot_views', 'train': 'train_step', 'resnet': 'resnet',
            'probe': 'probe', 'views': 'views'}


def define_flags(flag_values: flags.FlagValues, argv: list[str]) -> None:
  """Defines the flags on `flag_values`; `argv` holds --config overrides."""
  fv = dict(flag_values=flag_values)
  config_flags.DEFINE_config_file(
      'config', None, 'Config file (train, resnet, views); override fields '
      'as --config.a.b=v.', lock_config=True, sys_argv=argv, **fv)
  flags.DEFINE_integer('repeats', 5, 'Timed calls per row (ot: at least); '
                       'the median is printed.', **fv)
  flags.DEFINE_integer('seed', 0, 'Seed of the images (views: also of '
                       'their augmentations).', **fv)
  flags.DEFINE_list('batch_sizes', ['64', '256'], 'ot: images per batch '
                    '(each has 3 channels).', **fv)
  flags.DEFINE_float('min_time_s', 2.0, 'ot: fast rows repeat until this '
                     'many seconds have passed.', **fv)
  flags.DEFINE_integer('image_size', 32, 'ot: H = W in pixels.', **fv)
  flags.DEFINE_integer('grid_size', 16, 'ot: grid side m.', **fv)
  flags.DEFINE_integer('num_iters', 20, 'ot: Sinkhorn iterations T.', **fv)
  flags.DEFINE_float('epsilon', 0.05, 'ot: entropic regularisation.', **fv)
  flags.DEFINE_float('alpha', 0.5, 'ot: interpolation weight.', **fv)
  flags.DEFINE_list('methods', None, 'train: methods to time besides SimCLR '
                    '(default: all).', **fv)
  flags.DEFINE_list('conv_impls', ['xla', 'matmul', 'auto'], 'resnet: '
                    'model.conv_impl values to time; ratios are to the '
                    'first.', **fv)
  flags.DEFINE_bool('per_layer', False, 'resnet: also time every '
                    'convolution under xla and matmul.', **fv)
  flags.DEFINE_string('workdir', None, 'probe: the evaluated run.', **fv)
  flags.DEFINE_string('tag', None, 'probe: the encoder whose cached features '
                      'to fit, step<N> or init (random init).', **fv)
  flags.DEFINE_string('dataset', 'digits', 'probe: the dataset, as in '
                      'config.eval.datasets; views: whose test split to '
                      'use.', **fv)
  flags.DEFINE_integer('num_images', 500, 'views: test images (the '
                       'retrieval picks each partner among this many).',
                       **fv)
  flags.DEFINE_enum('backend', 'auto', ['auto', 'numpy', 'jax'], 'probe: '
                    "where the solver's arithmetic runs (auto: JAX on an "
                    'accelerator, NumPy on a CPU).', **fv)


def main(argv: Sequence[str]) -> int:
  """Runs the subcommand `argv[1]` (module docstring)."""
  parsed = config_files.parse_flags(argv, define_flags, __doc__)
  if parsed is None:
    return 0
  flag_values, rest = parsed
  if len(rest) != 1 or rest[0] not in COMMANDS:
    raise app.UsageError(
        f'Expected one subcommand of {tuple(COMMANDS)}, got {rest}.')
  command = rest[0]
  if command not in ('ot', 'probe') and flag_values.config is None:
    raise app.UsageError(f'{command} needs --config=configs/X.py.')
  module = importlib.import_module(f'otclr_jax.bench.{COMMANDS[command]}')
  return module.run(flag_values)


if __name__ == '__main__':
  # Its ValueErrors all describe its flags.
  config_files.run(main, (ValueError,))
