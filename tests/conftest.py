"""Shared test set-up."""

import os

# POT probes every installed array backend at import; TensorFlow's import alone
# costs seconds and the tests only use POT's NumPy path.
for _backend in ('TENSORFLOW', 'PYTORCH', 'CUPY', 'JAX'):
  os.environ.setdefault(f'POT_BACKEND_DISABLE_{_backend}', '1')

# Several tests build the same tiny training step in fresh closures; the
# persistent cache turns their repeated XLA compilations into disk reads.
os.environ.setdefault(
    'JAX_COMPILATION_CACHE_DIR',
    os.path.join(os.path.expanduser('~'), '.cache', 'otclr_jax_test_xla'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
