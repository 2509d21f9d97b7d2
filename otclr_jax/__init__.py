"""OTCLR in JAX: contrastive learning with optimal-transport positive views."""

import sys as _sys

# `python -m otclr_jax.<tool>` imports this package first, while argv[0] is
# still '-m': a stop during the tool's imports and start-up then exits with
# 75, like a stop later on (otclr_jax/cli.py). A library import installs
# nothing.
if _sys.argv[:1] == ['-m']:
  from otclr_jax import cli as _cli
  _cli.install_early_stop()
