"""Test set-up: the environment, the slow tier and the session fixtures.

Helpers that tests import live in tests/helpers.py."""

import atexit
import fcntl
import os
import shutil
import sys

import pytest
import threadpoolctl

# POT probes every installed array backend at import; TensorFlow's import alone
# costs seconds and the tests only use POT's NumPy path.
for _backend in ('TENSORFLOW', 'PYTORCH', 'CUPY', 'JAX'):
  os.environ.setdefault(f'POT_BACKEND_DISABLE_{_backend}', '1')

# Under pytest-xdist each worker gets its share of the cores for BLAS and
# OpenMP (scikit-learn's t-SNE): their threads spin while they wait, so a
# full pool per worker takes the cores the other workers need
# (docs/results.md, the suite's row). XLA keeps its threads, which block
# instead. NumPy is loaded before this file, so its pool is resized in
# place (threadpoolctl, a scikit-learn dependency); the variables reach the
# libraries loaded later and the subprocesses tests start.
_workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
if _workers > 1:
  _threads = str(max(1, (os.cpu_count() or 1) // _workers))
  for _variable in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS'):
    os.environ.setdefault(_variable, _threads)
  threadpoolctl.threadpool_limits(int(_threads))

# Several tests build the same tiny training step in fresh closures; the
# persistent cache turns their repeated XLA compilations into disk reads.
os.environ.setdefault(
    'JAX_COMPILATION_CACHE_DIR',
    os.path.join(os.path.expanduser('~'), '.cache', 'otclr_jax_test_xla'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')


def pytest_addoption(parser):
  parser.addoption(
      '--runslow', action='store_true', default=False,
      help='also run the end-to-end tests marked slow: every method x views '
      'training and resuming, 4 devices against 1, the complexity-table '
      'benchmark, seeded sweeps end to end')


def pytest_collection_modifyitems(config, items):
  # The pattern of pytest's documentation: slow tests are reported as skipped
  # (so a plain run says how many did not run), not silently deselected.
  if config.getoption('--runslow'):
    return
  skip = pytest.mark.skip(reason='slow end-to-end test: pass --runslow')
  for item in items:
    if 'slow' in item.keywords:
      item.add_marker(skip)


def pytest_unconfigure(config):
  if hasattr(config, 'workerinput'):
    # An xdist worker has sent all its reports by now, and the whole run
    # waits for it to exit. A normal exit first runs JAX's atexit clean-up,
    # which frees the hundreds of executables the worker built one by one,
    # then tears every module down: seconds for nothing. atexit handlers run
    # last-registered first, so this one ends the process before those.
    atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush(),
                             os._exit(0)))


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
  """One digits cache for the session (each xdist worker has its own)."""
  return str(tmp_path_factory.mktemp('data'))


@pytest.fixture
def fresh_steps():
  """For a test that patches a function the train step traces: it starts
  without the process's jitted steps (`step.build` shares them by config),
  and the steps it built are dropped after it, so neither it nor a later
  test runs a stale step. The steps built before it, traced unpatched, are
  put back: later tests of their configs need not trace them again."""
  from otclr_jax import step  # pylint: disable=g-import-not-at-top
  kept = dict(step._STEPS)  # pylint: disable=protected-access
  step.clear_compiled_steps()
  yield
  step.clear_compiled_steps()
  step._STEPS.update(kept)  # pylint: disable=protected-access


@pytest.fixture
def four_runs(tmp_path):
  """(sweep, workdir, run names) of a 2 methods x 2 seeds tiny sweep."""
  from launch import sweep as sweep_lib  # pylint: disable=g-import-not-at-top
  from tests.helpers import tiny_grid, write_sweep  # pylint: disable=g-import-not-at-top
  path = write_sweep(tmp_path / 's.py', tiny_grid(('simclr', 'otclr'), (0, 1)))
  sweep = sweep_lib.load_sweep(path)
  workdir = str(tmp_path / 'out')
  return sweep, workdir, [r.name for r in sweep.runs(workdir)]


@pytest.fixture(scope='session')
def shared_dir(tmp_path_factory):
  """A folder every xdist worker of this test session sees."""
  base = tmp_path_factory.getbasetemp()  # .../pytest-N/popen-gw0 in a worker
  return base.parent if 'PYTEST_XDIST_WORKER' in os.environ else base


def _build_once(shared_dir, name, build):
  """(`shared_dir / name`, `build(that folder)` or None).

  The first worker that needs `name` builds it under a file lock; the others
  wait, then use its folder and get None. Each tiny run is trained once per
  session, not once per worker.
  """
  folder = shared_dir / name
  with open(shared_dir / f'{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if (folder / 'built').exists():
      return folder, None
    shutil.rmtree(folder, ignore_errors=True)  # a worker failed building it
    folder.mkdir()
    value = build(folder)
    (folder / 'built').touch()
  return folder, value


@pytest.fixture(scope='session')
def finished_run(shared_dir, data_dir):
  """(config, workdir, final state) of `tiny_config` trained to its end.

  One run in one go (4 steps, checkpoints 2 and 4, the encoder exported)
  for every test that reads a finished run; a test that changes the run
  works on a copy. A worker that did not train it restores the state.
  """
  from otclr_jax import checkpoint, experiment, step, train  # pylint: disable=g-import-not-at-top
  from tests.helpers import tiny_config  # pylint: disable=g-import-not-at-top
  config = tiny_config(data_dir)
  folder, state = _build_once(
      shared_dir, 'finished',
      lambda folder: train.train(config, str(folder / 'run')).state)
  workdir = str(folder / 'run')
  if state is None:
    template = step.initial_state(config, step.setup(config, 1),
                                  experiment.make_mesh())
    ckpt = checkpoint.Checkpointer(workdir)
    state = ckpt.restore(template, config.total_steps)
    ckpt.close()
  return config, workdir, state


@pytest.fixture(scope='session')
def stopped_run(shared_dir, data_dir):
  """(config, workdir) of `tiny_config` stopped after its step 2.

  Checkpoint 2, status 'stopped', no encoder exported: the run a preemption
  leaves; tests that resume or change it work on a copy.
  """
  from otclr_jax import train  # pylint: disable=g-import-not-at-top
  from tests.helpers import tiny_config  # pylint: disable=g-import-not-at-top
  config = tiny_config(data_dir)

  def build(folder):
    result = train.train(config, str(folder / 'run'), stop_after_steps=2)
    assert result.status == 'stopped'
  return config, str(_build_once(shared_dir, 'stopped', build)[0] / 'run')


@pytest.fixture(scope='session')
def evaluated_run(finished_run, shared_dir):
  """(config, workdir) of a copy of `finished_run` evaluated at its step 4.

  `eval_config` with BatchNorm statistics recomputed, on `small_digits`,
  figures drawn (`main.evaluate_and_draw`), as `python -m otclr_jax.main`
  evaluates; tests copy it to change it.
  """
  from otclr_jax import main  # pylint: disable=g-import-not-at-top
  from tests import helpers  # pylint: disable=g-import-not-at-top
  config, finished, _ = finished_run
  config = helpers.eval_config(config.data_dir, **{'eval.recompute_bn': True})

  def build(folder):
    workdir = helpers.copy_run(finished, folder)
    with pytest.MonkeyPatch.context() as monkeypatch:
      helpers.small_digits(monkeypatch)
      main.evaluate_and_draw(config, workdir)
  return config, str(_build_once(shared_dir, 'evaluated', build)[0] / 'run')


@pytest.fixture(scope='session')
def simclr_run(shared_dir, data_dir):
  """(config, workdir) of `eval_config` SimCLR, seed 1, trained and evaluated.

  Another method, seed and temperature than `finished_run`'s and the config
  files'; evaluated on `small_digits` without figures. Tests copy it to
  change it.
  """
  from otclr_jax import main, train  # pylint: disable=g-import-not-at-top
  from tests import helpers  # pylint: disable=g-import-not-at-top
  config = helpers.eval_config(data_dir, method='simclr', seed=1, **{
      'loss.temperature': 0.2, 'eval.figures': False})

  def build(folder):
    workdir = str(folder / 'run')
    train.train(config, workdir)
    with pytest.MonkeyPatch.context() as monkeypatch:
      helpers.small_digits(monkeypatch)
      main.evaluate_and_draw(config, workdir)
  return config, str(_build_once(shared_dir, 'simclr', build)[0] / 'run')
