"""Entry point: `python -m otclr_jax.main --config=configs/X.py --workdir=DIR`.

`--config.mode=train` (default) pretrains, resuming from DIR if it holds a
checkpoint; `--config.mode=eval` evaluates DIR's latest checkpoint. Any config
field can be overridden, e.g. `--config.ot.epsilon=0.1`.
"""

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from otclr_jax import checkpoint
from otclr_jax import train

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Training configuration file.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, '
                               'logs and results.')
_DISTRIBUTED = flags.DEFINE_bool(
    'distributed', False, 'Call jax.distributed.initialize() first (one '
    'process per host; coordinator from the cluster environment).')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  checkpoint.quiet_logs()
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  logging.info('JAX process %d/%d, local devices %s', jax.process_index(),
               jax.process_count(), jax.local_devices())
  config = _CONFIG.value
  if config.mode not in ('train', 'eval'):
    raise app.UsageError(f"config.mode must be 'train' or 'eval', got "
                         f'{config.mode!r}.')
  if config.mode == 'train':
    train.train_and_evaluate(config, _WORKDIR.value)
  else:
    from otclr_jax import evaluate  # pylint: disable=g-import-not-at-top
    evaluate.evaluate(config, _WORKDIR.value)


if __name__ == '__main__':
  app.run(main)
