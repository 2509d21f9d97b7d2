# `python -m launch.<tool>`: a stop during start-up exits 75 (otclr_jax/cli.py).
import otclr_jax  # pylint: disable=unused-import
