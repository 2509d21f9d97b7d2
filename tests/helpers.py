"""Helpers shared by test modules: the tiny run config, rounding tolerances,
usage-error and lock checks; fixtures live in conftest.py."""

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import re
import shutil
import signal
import textwrap
import threading
import time

import flax
from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from launch import sweep as sweep_lib
from otclr_jax import config_files
from otclr_jax import rundir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_TRACE_EVENT = '/jax/core/compile/jaxpr_trace_duration'


@contextlib.contextmanager
def traces():
  """The names of the functions `jax.jit` traces inside the block, in order.

  A jitted call that reuses its compilation traces nothing, so a name that
  is absent (or present once, from a cleared cache) means no recompilation:
  the check `chex.assert_max_traces` makes, from outside the function.
  """
  names = []

  def listener(event, duration, **kwargs):
    del duration
    if event == _TRACE_EVENT:
      names.append(kwargs.get('fun_name'))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def is_locked(workdir: str, name: str = rundir.LOCK_FILE) -> bool:
  """Whether an open file holds the flock of `workdir/name`; creates nothing.

  flock conflicts between two open files even within one process, so this
  sees this process's own locks too.
  """
  try:
    fd = os.open(os.path.join(workdir, name), os.O_RDONLY)
  except FileNotFoundError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      return True
    raise
  finally:
    os.close(fd)
  return False


def assert_trees_equal(a, b) -> None:
  """Trees of one structure whose arrays are equal bit for bit."""
  a, b = jax.device_get((a, b))
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(x, y)


def truncate_checkpoint(workdir, step) -> list[str]:
  """Cuts the data files of checkpoint `step` to 10 bytes, as a crash
  mid-write leaves them; their sorted names."""
  folder = os.path.join(str(workdir), 'checkpoints', str(step), 'default',
                        'ocdbt.process_0', 'd')
  names = sorted(os.listdir(folder))
  for name in names:
    os.truncate(os.path.join(folder, name), 10)
  return names


def tiny_config(data_dir, **overrides):
  """8 px digits, batch 16, 4 steps, a ResNet of one block per stage (as
  flax's examples/imagenet tests use `_ResNet1`), small heads and a 4 x 4 OT
  grid.

  Every method's block is small too (MoCo queue 64, BYOL predictor 32, DINO
  32-16-64 with a one-epoch teacher warm-up), so any `method=` trains fast.

  Args:
    data_dir: where the digits cache goes (the `data_dir` fixture).
    **overrides: dotted config fields, e.g. `**{'ot.beta': 1.0}`.

  Returns:
    The ConfigDict.
  """
  # Imported here: the environment above must be set before JAX loads.
  from configs import default  # pylint: disable=g-import-not-at-top
  config = default.get_config()
  config.dataset = 'digits'
  config.data_dir = data_dir
  config.image_size = 8
  config.batch_size = 16
  config.total_steps = 4
  config.log_every_steps = 2
  config.checkpoint_every_steps = 2
  config.model.stage_sizes = (1, 1, 1, 1)
  config.model.proj_hidden_dim = 32
  config.model.proj_dim = 16
  config.ot.grid_size = 4
  config.eval.datasets = ('digits',)
  config.moco.queue_size = 64
  config.byol.pred_hidden_dim = 32
  config.dino.hidden_dim = 32
  config.dino.bottleneck_dim = 16
  config.dino.num_prototypes = 64
  config.dino.warmup_teacher_temp_epochs = 1.0
  config.lock()  # an unknown key raises instead of adding a field
  config.update_from_flattened_dict(overrides)
  config.unlock()
  return config


def eval_config(data_dir, **overrides):
  """`tiny_config` with a small evaluation: 16 view images, 10 Newton steps
  per probe fit, batches of 64; `evaluated_run`'s settings. `overrides`
  (dotted fields) apply last, these included."""
  return tiny_config(data_dir, **{
      'eval.num_view_images': 16, 'eval.probe_steps': 10,
      'eval.batch_size': 64, **overrides})


# Images per class of train and test that `small_digits` keeps.
SMALL_DIGITS = (12, 6)


def copy_run(workdir: str, tmp_path) -> str:
  """A copy of the run directory `workdir` at `tmp_path/run`, to change."""
  copy = os.path.join(str(tmp_path), 'run')
  shutil.copytree(workdir, copy)
  return copy


def small_digits(monkeypatch):
  """Makes `data.load_split` return the first `SMALL_DIGITS` images of each
  class: the evaluation size of the tests, `evaluated_run`'s included."""
  from otclr_jax import data  # pylint: disable=g-import-not-at-top
  load = data.load_split

  def small(name, split, image_size, data_dir=None, **kwargs):
    full = load(name, split, image_size, data_dir, **kwargs)
    per_class = SMALL_DIGITS[0] if split == 'train' else SMALL_DIGITS[1]
    keep = np.sort(np.concatenate([np.flatnonzero(full.labels == c)[:per_class]
                                   for c in range(full.num_classes)]))
    return full._replace(images=full.images[keep], labels=full.labels[keep])

  monkeypatch.setattr(data, 'load_split', small)


def assert_usage_error(caplog, match: str, run) -> None:
  """`run()` returns the usage status 2 and logs one error matching `match`."""
  caplog.clear()
  with caplog.at_level(logging.ERROR):
    assert run() == 2
  errors = [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR]
  assert len(errors) == 1, errors
  assert re.search(match, errors[0]), errors[0]


class SignalsInAFinaliser:
  """Sends `signum` to this process from `__del__`, where a raise is dropped.

  Create one and drop it at once: Python runs the signal's handler inside the
  finaliser, which prints and discards what the handler raises, as when a
  signal lands in JAX's garbage-collection callback.
  """

  def __init__(self, signum):
    self.signum = signum

  def __del__(self):
    os.kill(os.getpid(), self.signum)
    for _ in range(10_000):  # The handler runs in here.
      pass


# Machine epsilons, twice the unit roundoffs u (2**-24 for float32).
EPS32 = float(np.finfo(np.float32).eps)
EPS64 = float(np.finfo(np.float64).eps)
# Standard deviations the probabilistic bound allows: it fails with
# probability 2 exp(-LAMBDA**2 / 2) = 2.5e-14 per result, so the ten million
# results of a network's gradient all meet it with probability 1 - 3e-7.
LAMBDA = 8.0


def chain(*sums, stages: int = 0, funcs: int = 0) -> int:
  """Roundings on the longest chain from a computation's inputs to a result.

  A sum of m terms rounds m times; an arithmetic stage at most twice (x / y
  may become x * (1 / y)); a function at most 12 times: XLA:CPU's and
  NumPy's are accurate to 6 ulp (XLA's tanh and expm1; its exp and log to
  1, NumPy's AVX-512 float64 loops to 4).

  Args:
    *sums: the reductions on the chain: each the number of terms it adds
      (a sum, a dot product, a mean), a shape whose entries it adds, or the
      `chain` of a computation that feeds this one.
    stages: arithmetic on the chain (x - y, x * y, x / y, sqrt, a constant
      rounded to the format), one per operation.
    funcs: exp, log, cos, tanh, erf, rsqrt on the chain.
  """
  return int(sum(np.prod(s) for s in sums)) + 2 * stages + 12 * funcs


def rounding_tol(*sums, stages: int = 0, funcs: int = 0, k: float = 1.0,
                 eps: float = EPS32) -> float:
  """How far two evaluations of one real-valued result may lie apart,
  relatively: 2 k min(n, LAMBDA sqrt(n)) u for n = `chain`(...).

  n roundings make the exact result times prod_i (1 + d_i), |d_i| <= u, in
  whatever order a sum's roundings come (AVX2 or AVX-512 lanes, a GEMM's
  blocking, pairwise sums): at most n u off (Higham, Accuracy and Stability
  of Numerical Algorithms, Lemma 3.1), and LAMBDA sqrt(n) u off but with
  probability 2.5e-14 for independent zero-mean d_i (Higham and Mary, SIAM
  J. Sci. Comput. 41(5), 2019); two evaluations that each meet the smaller
  bound lie within twice it. k, the condition number, is how much the
  formula amplifies its terms' relative errors: 1 for terms of one sign,
  |x| for exp(x), the terms' magnitudes over the result where they cancel;
  for an absolute tolerance, multiply by the terms' scale instead.

  Args:
    *sums: `chain`'s reductions.
    stages: `chain`'s arithmetic operations.
    funcs: `chain`'s functions.
    k: growth factor (condition number), >= 0.
    eps: machine epsilon of the arithmetic (EPS64 for float64).
  """
  n = chain(*sums, stages=stages, funcs=funcs)
  if n < 1 or k < 0:
    raise ValueError(f'rounding_tol needs n >= 1 and k >= 0, got {n}, {k}.')
  return k * min(n, LAMBDA * math.sqrt(n)) * eps


def network_chain(model, shape, **kwargs) -> int:
  """`chain` of a flax network's outputs on inputs of `shape`, read off its
  kernels and BatchNorm activations.

  Every layer in series (a shortcut is a shorter path): a kernel's fan-in
  and a stage for its bias or residual sum; a BatchNorm's mean and variance
  over all but the feature axis, its rsqrt and five stages (x - mean,
  var + eps, the product, scale, shift); a global pool over at most H x W
  of the input. Running averages (eval mode) round less.

  Args:
    model: the flax module.
    shape: its input's shape, [B, H, W, C] or [B, D].
    **kwargs: `init`'s and `apply`'s keywords, e.g. train=True.
  """
  x = jnp.zeros(shape)
  is_norm = lambda module, _: isinstance(module, nn.BatchNorm)

  def run():
    variables = model.init(jax.random.key(0), x, **kwargs)
    _, state = model.apply(variables, x, capture_intermediates=is_norm,
                           mutable=True, **kwargs)
    return variables['params'], state['intermediates']

  params, norms = jax.eval_shape(run)
  kernels = [leaf.shape for path, leaf
             in flax.traverse_util.flatten_dict(params).items()
             if path[-1] == 'kernel']
  outputs = [leaf.shape for leaf in jax.tree.leaves(norms)]
  return chain(*(s[:-1] for s in kernels), *(s[:-1] for s in outputs * 2),
               shape[1:-1], stages=len(kernels) + 5 * len(outputs) + 1,
               funcs=len(outputs))


def ot_chain(m: int, num_iters: int, image=(), result='scalings') -> int:
  """`chain` of `ot`'s Sinkhorn `result` on an m x m grid.

  The kernel exp(-cost / eps): 6 stages and exp (the exponent's rounding,
  amplified by cost / eps, scales entries exp(-cost / eps), and
  x exp(-x) <= 1 / e); each of the 2 num_iters half-iterations b / (K v),
  two sums of m and the division, passes earlier errors on unamplified.
  `image` (H, W) adds the measures before: the resize's sums over H and W,
  the shift and the division by the mass's sum over m^2. 'cost' adds
  u K v, its log and the sum over m^2; 'views' the splat (its hat weights
  and three sums of m), mass and offset, and the resize back.
  """
  n = chain(*image, *[m] * (4 * num_iters), stages=6 + 2 * num_iters,
            funcs=1)
  if image:
    n += chain(m * m, stages=3)
  extra = {'scalings': chain(), 'cost': chain(2 * m, m * m, stages=5,
                                              funcs=1),
           'views': chain(m, m, m, m, m, stages=8)}
  return n + extra[result]


def ot_cost_scale(a, b, epsilon: float, num_iters: int) -> float:
  """The magnitudes `ot.cost_from_scalings` adds up, the largest over a
  batch: eps (sum |row log u| + sum |col log v| + sum row), in float64 from
  the float32 scalings; an absolute tolerance's scale for a cost."""
  from otclr_jax import ot  # pylint: disable=g-import-not-at-top
  u, v = (np.asarray(t, np.float64)
          for t in ot.sinkhorn_scalings(a, b, epsilon, num_iters))
  kx = np.exp(-ot.axis_cost(u.shape[-1]) / epsilon)
  row = u * (kx @ v @ kx)
  col = v * (kx @ u @ kx)
  return epsilon * float(np.max(np.sum(
      np.abs(row * np.log(u)) + np.abs(col * np.log(v)) + row,
      axis=(-2, -1))))


def numpy_variables(module, shape, seed=0):
  """A flax module's initial variables filled from NumPy: He-normal kernels,
  fresh BatchNorm, zero biases. `module.init` would compile one random-number
  kernel per parameter shape, seconds on a shared CPU."""
  rng = np.random.default_rng(seed)
  abstract = flax.traverse_util.flatten_dict(jax.eval_shape(
      lambda: module.init(jax.random.key(0), jnp.zeros(shape), train=False)))
  filled = {}
  for path, leaf in abstract.items():
    if path[-1] == 'kernel':
      value = rng.normal(0.0, np.sqrt(2.0 / np.prod(leaf.shape[:-1])),
                         leaf.shape)
    else:
      value = np.full(leaf.shape, float(path[-1] in ('scale', 'var')))
    filled[path] = jnp.asarray(value, leaf.dtype)
  return flax.traverse_util.unflatten_dict(filled)


def mean_std_rtol(values) -> tuple[float, float]:
  """`rounding_tol`s of float64 NumPy means and sample deviations of `values`.

  Against any other float64 evaluation. The mean: the sum and the division.
  The standard deviation (ddof=1): each deviation x - mean carries the
  mean's error and its own rounding at the scale |x| + |mean|, which moves
  the sum of squares by 2 sum |dev| (|x| + |mean|) times it, relative to
  sum dev^2 (k); the squares, their sum and the division round relative;
  the square root halves the variance's error and rounds once.

  Returns:
    (rtol of the mean, rtol of the standard deviation).
  """
  x = np.asarray(values, np.float64)
  dev = x - x.mean()
  spread = np.sum(dev ** 2)
  # Values without spread (a single one) leave no deviation to amplify.
  k = (2 * np.sum(np.abs(dev) * (np.abs(x) + abs(x.mean()))) / spread
       if spread > 0 else 0.0)
  tol = lambda k: rounding_tol(len(x), stages=2, k=k, eps=EPS64)
  rtol_std = 0.5 * (tol(k) + tol(1.0)) + rounding_tol(stages=1, eps=EPS64)
  return rounding_tol(len(x), stages=1, eps=EPS64), rtol_std


# Sweeps: tiny sweep files, what runs leave behind, a fake launcher.


TINY = {
    'image_size': 8,
    'total_steps': 2,
    'log_every_steps': 1,
    'checkpoint_every_steps': 2,
    'model.proj_hidden_dim': 32,
    'model.proj_dim': 16,
    'ot.grid_size': 4,
    'batch_size': 16,
}


def write_sweep(path, axes, fixed=None, base=None, config='digits'):
  """A sweep file: `base` set in get_config, `axes` x `fixed` in get_hyper."""
  body = [f'  config.{k} = {v!r}' for k, v in {**TINY, **(base or {})}.items()]
  parts = [f'      hyper.sweep({"config." + k!r}, {v!r}),'
           for k, v in axes.items()]
  parts += [f'      hyper.fixed({"config." + k!r}, {v!r}),'
            for k, v in (fixed or {}).items()]
  path.write_text('\n'.join([
      f'from configs import {config}', '', '', 'def get_config():',
      f'  config = {config}.get_config()', *body, '  return config', '', '',
      'def get_hyper(hyper):', '  return hyper.product([', *parts, '  ])',
      '']))
  return str(path)


def tiny_grid(methods=('otclr',), seeds=(0,)):
  return {'seed': list(seeds), 'method': list(methods)}


def flags_of(argv):
  return dict(a[2:].split('=', 1) for a in argv if a.startswith('--'))


def aggregate_only(workdir):
  return sweep_lib.main(['sweep', f'--workdir={workdir}', '--aggregate_only'])


def sweep_file(name):
  return os.path.join(REPO, 'launch', 'sweeps', f'{name}.py')


# A stand-in for training: reports progress in its workdir's metrics.jsonl
# and status.json (argv[3], if given), and on SIGTERM saves (here: writes a
# file) and exits 0.
STOPPABLE_CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    def stop(*_):
      open(sys.argv[1], 'w').write('stopped')
      sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    if len(sys.argv) > 3:
      with open(os.path.join(sys.argv[3], 'status.json'), 'w') as f:
        json.dump({'state': 'running', 'step': 1, 'total_steps': 2}, f)
      with open(os.path.join(sys.argv[3], 'metrics.jsonl'), 'w') as f:
        f.write(json.dumps({'step': 1, 'loss': 2.5}) + '\\n')
    print('a log line that is not progress', flush=True)
    open(sys.argv[2], 'w').write('ready')
    time.sleep(60)
    sys.exit(3)
""")


def when_ready(path, action, timeout=30):
  def wait():
    deadline = time.time() + timeout
    while not os.path.exists(path) and time.time() < deadline:
      time.sleep(0.05)
    action()
  thread = threading.Thread(target=wait)
  thread.start()
  return thread


def resolved_config(argv):
  """The ConfigDict a `python -m otclr_jax.main` argv would run."""
  return config_files.apply_overrides(
      config_files.load(flags_of(argv)['config']),
      [a for a in argv if a.startswith('--config.')])


def write_run_files(workdir, config, *, state='finished', step=None,
                    evaluated=True):
  """What training (config.json, status.json, a checkpoint) and evaluation
  (eval/results.json, eval/config.json) leave in a run directory."""
  total = config.total_steps
  step = total if step is None else step
  os.makedirs(os.path.join(workdir, 'checkpoints', str(step)), exist_ok=True)
  train_config = config.to_dict()
  train_config['mode'] = 'train'
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(train_config, f)
  with open(os.path.join(workdir, 'status.json'), 'w') as f:
    json.dump({'state': state, 'step': step, 'total_steps': total,
               'updated': '2026-11-21T00:00:00+00:00'}, f)
  if evaluated:
    fake_results(workdir, step, config)
    with open(os.path.join(workdir, 'eval', 'config.json'), 'w') as f:
      json.dump({**train_config, 'mode': 'eval'}, f)


class FakeLauncher:
  """Pretends to train/evaluate: writes what train.py and evaluate.py would."""

  def __init__(self, fail=(), stop_during=None, stop_at_step=None,
               exit_stopped=()):
    self.calls = []
    # (run, mode) pairs that exit 1, or a dict of their exit statuses.
    self.fail = fail if isinstance(fail, dict) else dict.fromkeys(fail, 1)
    self.stop_during = stop_during
    self.stop_at_step = stop_at_step
    self.exit_stopped = set(exit_stopped)  # runs whose training exits 75
    self.stop_signal = None

  def __call__(self, argv, log_path):
    flags = flags_of(argv)
    workdir = flags['workdir']
    name = os.path.basename(workdir)
    mode = flags.get('config.mode', 'train')
    self.calls.append((name, mode))
    assert os.path.dirname(log_path) == workdir
    if (name, mode) in self.fail:
      return self.fail[(name, mode)]
    config = resolved_config(argv)
    if mode == 'train':
      if self.stop_during == name or name in self.exit_stopped:
        if self.stop_during == name:
          self.stop_signal = signal.SIGTERM
        step = self.stop_at_step or 1
        write_run_files(workdir, config, state='stopped', step=step,
                        evaluated=False)
        return 75 if name in self.exit_stopped else 0
      write_run_files(workdir, config, evaluated=False)
    else:
      status = json.load(open(os.path.join(workdir, 'status.json')))
      fake_results(workdir, status['step'], config)
      with open(os.path.join(workdir, 'eval', 'config.json'), 'w') as f:
        json.dump(config.to_dict(), f)
    return 0


def fake_results(workdir, step, config=None):
  """eval/results.json at `step`; with `config`, what the tables read too."""
  os.makedirs(os.path.join(workdir, 'eval'), exist_ok=True)
  results = {'step': step}
  if config is not None:
    results.update(method=config.method, seed=config.seed,
                   batch_size=config.batch_size,
                   pretrain_dataset=config.dataset,
                   config={**config.to_dict(), 'mode': 'eval'})
  with open(os.path.join(workdir, 'eval', 'results.json'), 'w') as f:
    json.dump(results, f)


# Evaluation results as results.json holds them.


def run_results(method, seed, top1, floor, batch_size=256, pretrain='cifar10'):
  """A run's results.json: probe top-1 `top1` over a floor `floor`."""
  views = {'view_distance': 0.5, 'view_cosine': 0.8, 'anchor_distance': 0.6,
           'pixel_l2': 0.0, 'silhouette': 0.1, 'compactness': 0.05,
           'centroid_margin': 0.3, 'inter_intra_ratio': 1.0}
  return {
      'step': 100, 'checkpoint': f'/runs/{method}{seed}/checkpoints/100',
      'method': method, 'seed': seed, 'batch_size': batch_size,
      'pretrain_dataset': pretrain, 'image_size': 32, 'hardware': 'cpu',
      # SVHN first: the table must still put CIFAR-10 first (paper order).
      'linear': {'svhn_cropped': {'top1': top1 - 10.0, 'top5': 80.0},
                 'cifar10': {'top1': top1, 'top5': 90.0, 'knn_top1': 30.0,
                             'weight_decay': 1e-4, 'num_train': 50000,
                             'num_test': 10000}},
      'random_init': {'cifar10': {'top1': floor, 'top5': 50.0}},
      'clusters': {'cifar10': {'silhouette': 0.02, 'compactness': 0.5,
                               'centroid_margin': 0.1,
                               'inter_intra_ratio': 1.1, 'num_points': 10000}},
      'views': {'simclr': views,
                'otclr': {**views, 'view_distance': 0.3, 'pixel_l2': 0.17}},
  }


def paired_results(otclr_top1, simclr_top1, floors):
  """OTCLR and SimCLR results of seeds 0, 1, ... with the given top-1s."""
  return ([run_results('otclr', s, v, f) for s, (v, f) in
           enumerate(zip(otclr_top1, floors))]
          + [run_results('simclr', s, v, f) for s, (v, f) in
             enumerate(zip(simclr_top1, floors))])


def stored_config(method, seed, batch_size, dataset, **fields):
  """The default config as results.json stores it, with these settings."""
  from configs import default  # pylint: disable=g-import-not-at-top
  config = default.get_config()
  config.method, config.seed, config.dataset = method, seed, dataset
  config.batch_size = batch_size
  for name, value in fields.items():
    *parents, leaf = name.split('.')
    node = config
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config.to_dict()


def configured_results(method, seed, top1, floor, **fields):
  """`run_results` with its stored digits config, `fields` overridden."""
  result = run_results(method, seed, top1, floor, batch_size=64,
                       pretrain='digits')
  result['config'] = stored_config(method, seed, 64, 'digits', **fields)
  return result
