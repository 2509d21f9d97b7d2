"""OTCLR in JAX: contrastive learning with optimal-transport positive views."""

import sys as _sys

# `python -m otclr_jax.<tool>` imports this first (argv[0] still '-m'): a stop
# during start-up exits with 75 (otclr_jax/cli.py); a library import doesn't.
if _sys.argv[:1] == ['-m']:
  from otclr_jax import cli as _cli
  _cli.install_early_stop()
