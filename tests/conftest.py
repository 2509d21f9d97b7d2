"""Shared test set-up."""

import os

# POT probes every installed array backend at import; TensorFlow's import alone
# costs seconds and the tests only use POT's NumPy path.
for _backend in ('TENSORFLOW', 'PYTORCH', 'CUPY', 'JAX'):
  os.environ.setdefault(f'POT_BACKEND_DISABLE_{_backend}', '1')
