"""The linear probe: softmax regression on standardised frozen features.

Full-batch L-BFGS; the L2 strength is chosen on a stratified held-out part of
the TRAIN split, then the probe is refitted on all of it (docs/method.md
section 7). The grid is fitted as a regularisation path, strongest penalty
first, each fit warm-started from the previous one and stopped on a relative
gradient tolerance; the refit starts from the selected solution.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any, Iterator, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree_utils as otu

from otclr_jax import fileio
from otclr_jax.evaluation import features


# L2 strengths lambda of the probe, loss = mean CE + lambda / 2 ||W||^2 on
# standardised features (bias not penalised). No lambda = 0: on separable
# features that loss has no minimum, and where the fit stops would decide
# the result.
L2_GRID = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
HOLDOUT_FRACTION = 0.1
HOLDOUT_SEED = 0
# Stop L-BFGS once the gradient norm with respect to (W, b) is this fraction
# of its norm at zero weights. On CIFAR-10 features of a random-init
# ResNet-18, 1e-5 and 1e-6 choose the same lambda and give the same test
# top-1, 1e-5 in a quarter fewer steps; scikit-learn's default (an absolute
# 1e-4 on the largest gradient entry) is looser.
PROBE_TOLERANCE = 1e-5

DEFAULT_PROBE_STEPS = 500


def stratified_holdout(labels: np.ndarray, fraction: float = HOLDOUT_FRACTION,
                       seed: int = HOLDOUT_SEED) -> np.ndarray:
  """Marks a stratified random `fraction` of the examples as held out.

  In each class of c examples, round(fraction * c) of them, at least 1 and at
  most c - 1 (none for a single example), chosen by one
  `np.random.default_rng(seed)` visiting the classes in increasing order.

  Args:
    labels: int [N].
    fraction: share held out, in (0, 1).
    seed: fixed seed; the same labels always give the same split.

  Returns:
    bool [N], True for held-out examples.
  """
  if not 0.0 < fraction < 1.0:
    raise ValueError(f'fraction must lie in (0, 1), got {fraction}.')
  labels = np.asarray(labels)
  rng = np.random.default_rng(seed)
  held = np.zeros(len(labels), bool)
  for label in np.unique(labels):
    members = np.flatnonzero(labels == label)
    count = len(members)
    n_held = 0 if count < 2 else min(max(round(fraction * count), 1),
                                     count - 1)
    held[rng.permutation(members)[:n_held]] = True
  return held


def _moments(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Float64 column mean and standard deviation [D] of x [N, D]."""
  mean = x.mean(axis=0, dtype=np.float64)
  std = x.std(axis=0, dtype=np.float64)
  # A constant feature (e.g. a dead ReLU channel) is centred, not scaled.
  return mean, np.where(std > 0, std, 1.0)


def _matmul(a, b):
  # Full float32 products: TF32 noise would perturb the line search and the
  # kNN ranking differently on different accelerators.
  return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _eigenbasis(x: jax.Array, weights: jax.Array):
  """Eigenvalues [D] and eigenvectors [D, D] of x's weighted second moment.

  Float64 on the host: the smallest eigenvalues set the preconditioner.
  """
  moment = np.asarray(_matmul((x * weights[:, None]).T, x), np.float64)
  eigenvalues, vectors = np.linalg.eigh(moment / float(jnp.sum(weights)))
  return (jnp.asarray(np.maximum(eigenvalues, 0.0), jnp.float32),
          jnp.asarray(vectors, jnp.float32))


# Rows per block of the probe's fused pass over the features (`_blocks`):
# large enough for full-speed products, small enough (4 MiB at D = 512) that
# a block read for the logits is still in cache for the gradient.
BLOCK_ROWS = 2048


@jax.jit
def _blocks(x, y, weights):
  """Splits the rows into equal blocks for `_weighted_ce`, padding with zeros.

  Args:
    x: float32 [N, D].
    y: int32 [N].
    weights: float32 [N].

  Returns:
    x [K, R, D], y [K, R], weights [K, R] with K = ceil(N / BLOCK_ROWS) and
    R = ceil(N / K); the K * R - N padding rows have weight 0.
  """
  n = x.shape[0]
  k = -(-n // BLOCK_ROWS)
  rows = -(-n // k)
  pad = k * rows - n
  return (jnp.pad(x, ((0, pad), (0, 0))).reshape(k, rows, x.shape[1]),
          jnp.pad(y, (0, pad)).reshape(k, rows),
          jnp.pad(weights, (0, pad)).reshape(k, rows))


def _ce_and_grad(w, b, x, y, weights):
  """Weighted cross-entropy sum and its gradient in one pass over the rows.

  Each block's logits and its share of the gradient are computed together,
  so the features are read from memory once per evaluation instead of once
  for the logits and again for the gradient: the probe is bound by that
  traffic on CPU (N x D floats against C = 10 classes).

  Args:
    w: float32 [C, D], class-major.
    b: float32 [C].
    x: float32 [K, R, D] blocks (`_blocks`).
    y: int32 [K, R].
    weights: float32 [K, R].

  Returns:
    (sum_i weights_i CE_i, its gradient [C, D] in w, its gradient [C] in b).
  """
  def block(carry, xyw):
    total, grad_w, grad_b = carry
    xb, yb, wb = xyw
    log_p = jax.nn.log_softmax(_matmul(xb, w.T) + b, axis=1)  # [R, C]
    onehot = jax.nn.one_hot(yb, w.shape[0], dtype=log_p.dtype)
    total = total - jnp.sum(wb * jnp.sum(onehot * log_p, axis=1))
    delta = wb[:, None] * (jnp.exp(log_p) - onehot)  # d total / d logits
    return (total, grad_w + _matmul(delta.T, xb),
            grad_b + jnp.sum(delta, axis=0)), None

  zero = jnp.zeros((), w.dtype)
  (total, grad_w, grad_b), _ = jax.lax.scan(
      block, (zero, jnp.zeros_like(w), jnp.zeros_like(b)), (x, y, weights))
  return total, grad_w, grad_b


@jax.custom_vjp
def _weighted_ce(w, b, x, y, weights):
  """sum_i weights_i CE(x_i w^T + b, y_i) over `_blocks` rows (`_ce_and_grad`).

  Its forward pass computes the gradient too and its backward pass only
  scales it: L-BFGS asks for the gradient at nearly every point whose value
  it asks for, and the fused pass costs about what the logits alone do.
  """
  return _ce_and_grad(w, b, x, y, weights)[0]


def _weighted_ce_fwd(w, b, x, y, weights):
  total, grad_w, grad_b = _ce_and_grad(w, b, x, y, weights)
  return total, (grad_w, grad_b)


def _weighted_ce_bwd(grads, g):
  grad_w, grad_b = grads
  return g * grad_w, g * grad_b, None, None, None


_weighted_ce.defvjp(_weighted_ce_fwd, _weighted_ce_bwd)


@functools.partial(jax.jit, static_argnames=('max_steps',))
def _fit_probe(blocks, l2, eigenvalues, init, *, max_steps):
  """Weighted softmax regression by preconditioned L-BFGS from `init`.

  `blocks` = (x, y, weights) from `_blocks`, x holding the features in the
  eigenbasis of their second moment (an orthogonal change of basis, which
  leaves ||W||^2 unchanged), with `eigenvalues` [D]. L-BFGS runs on
  W' = W * sqrt(eigenvalue + l2) row by row, in which the penalised loss's
  curvature is nearly uniform, so it converges in tens of steps where the
  raw problem can take thousands.

  Returns:
    ({'w' [D, C] in the eigenbasis, 'b' [C]}, L-BFGS steps taken). Stops
    when the gradient norm falls to `PROBE_TOLERANCE` times its norm at
    zero weights, or after `max_steps` iterations.
  """
  total = jnp.sum(blocks[2])
  # Directions without variance carry no gradient; the floor only keeps
  # their scale finite at l2 = 0.
  floor = 1e-8 * jnp.max(eigenvalues)
  # Class-major [C, D] inside the fit (`_weighted_ce`).
  scale = jax.lax.rsqrt(jnp.maximum(eigenvalues, floor) + l2)[None, :]

  def loss(p):
    w = scale * p['w']
    return (_weighted_ce(w, p['b'], *blocks) / total
            + 0.5 * l2 * jnp.sum(w**2))

  start = {'w': init['w'].T / scale, 'b': init['b']}

  def weight_space_norm(grad):
    # The gradient with respect to (W, b), not to the preconditioned W':
    # W' has the W-gradient divided by (eigenvalue + l2)^(1/2), which at
    # l2 = 0 explodes along directions of (numerically) no variance, so a
    # tolerance in W' would mean something different for every lambda.
    return otu.tree_norm({'w': grad['w'] / scale, 'b': grad['b']})

  reference = weight_space_norm(jax.grad(loss)(jax.tree.map(jnp.zeros_like,
                                                            start)))
  opt = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(loss)

  def step(carry):
    p, state = carry
    value, grad = value_and_grad(p, state=state)
    updates, state = opt.update(grad, state, p, value=value, grad=grad,
                                value_fn=loss)
    return optax.apply_updates(p, updates), state

  def keep_going(carry):
    _, state = carry
    count = otu.tree_get(state, 'count')
    grad_norm = weight_space_norm(otu.tree_get(state, 'grad'))
    # The state's gradient is only filled in by the first step.
    return (count == 0) | ((count < max_steps)
                           & (grad_norm > PROBE_TOLERANCE * reference))

  params, state = jax.lax.while_loop(keep_going, step,
                                     (start, opt.init(start)))
  return ({'w': (scale * params['w']).T, 'b': params['b']},
          otu.tree_get(state, 'count'))


@jax.jit
def _logits(params, x):
  return _matmul(x, params['w']) + params['b']


@jax.jit
def _scores(params, x, y):
  """Top-1 hits, top-5 hits and cross-entropy per example."""
  logits = _logits(params, x)
  label_logit = jnp.take_along_axis(logits, y[:, None], axis=1)
  # Rank = number of classes scoring strictly higher than the label; with
  # fewer than 5 classes every rank is < 5, so top-5 is 100%.
  rank = jnp.sum(logits > label_logit, axis=1)
  top1 = jnp.argmax(logits, axis=1) == y
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  return top1, rank < 5, ce


def _l2_path(fit, x, y, weights, held, eigenvalues, l2_grid, params):
  """Fits every lambda of `l2_grid` and picks one on the held-out rows.

  The regularisation path runs strongest penalty first: each fit starts from
  the previous solution (the first from `params`), which is close to its own.

  Args:
    fit: `_fit_probe` with its static arguments bound.
    x: float32 [N, D] standardised train features in their eigenbasis.
    y: int32 [N] labels.
    weights: float32 [N], 0 on the held-out rows.
    held: bool [N], the held-out rows.
    eigenvalues: [D], of the fitted rows' second moment.
    l2_grid: the candidate lambdas.
    params: zero {'w' [D, C], 'b' [C]}.

  Returns:
    (the chosen lambda, its held-out top-1 in [0, 1], its params). The best
    held-out top-1 wins, then the lower held-out cross-entropy, then the
    first in `l2_grid`; a diverged fit (non-finite weights) ranks last.
  """
  zeros, candidates, solutions = params, [], {}
  blocks = _blocks(x, y, weights)
  for index in sorted(range(len(l2_grid)), key=lambda i: -l2_grid[i]):
    l2 = float(l2_grid[index])
    params, steps = fit(blocks, jnp.float32(l2), eigenvalues, params)
    if not all(np.isfinite(v).all() for v in jax.device_get(params).values()):
      # The path restarts from zero after a diverged fit.
      params = zeros
      val_top1, val_ce = 0.0, math.inf
    else:
      top1, _, ce = jax.device_get(_scores(params, x, y))
      val_top1, val_ce = float(np.mean(top1[held])), float(np.mean(ce[held]))
    logging.info('probe lambda=%g: held-out top-1 %.2f%%, CE %.4f (%d '
                 'L-BFGS steps)', l2, 100 * val_top1, val_ce, int(steps))
    candidates.append((-val_top1, val_ce if math.isfinite(val_ce) else math.inf,
                       index))
    solutions[index] = params
  neg_val_top1, _, index = min(candidates)
  return float(l2_grid[index]), -neg_val_top1, solutions[index]


class Probe(NamedTuple):
  """A fitted linear probe: `logits = ((h - mean) / std) @ w + b`.

  Attributes:
    w: float32 [D, C].
    b: float32 [C].
    mean: float64 [D], the train features' mean.
    std: float64 [D], their standard deviation (1 for constant features).
    weight_decay: the L2 strength it was fitted with.
  """
  w: np.ndarray
  b: np.ndarray
  mean: np.ndarray
  std: np.ndarray
  weight_decay: float

  def logits(self, features: np.ndarray) -> np.ndarray:
    """Class scores float32 [N, C] of encoder features [N, D].

    The same float32 computation as the probe's evaluation, so predictions
    reproduce the reported accuracies exactly.
    """
    features = np.asarray(features, np.float32)
    if features.ndim != 2 or features.shape[1] != len(self.mean):
      raise ValueError(f'features must be [N, {len(self.mean)}], got '
                       f'{features.shape}.')
    x = ((features - self.mean) / self.std).astype(np.float32)
    return np.asarray(_logits({'w': jnp.asarray(self.w),
                               'b': jnp.asarray(self.b)}, jnp.asarray(x)))


def probe_path(workdir: str, step: int, name: str) -> str:
  """`<workdir>/eval/probe_step<step>_<dataset key>.npz`."""
  return os.path.join(workdir, 'eval',
                      f'probe_step{int(step)}_{features.dataset_key(name)}.npz')


def save_probe(path: str, probe: Probe, *, dataset: str, step: int,
               top1: float, weights: str = '') -> None:
  """Writes a probe, with the dataset, step and test top-1 it belongs to.

  `weights` is the encoder's `variables_fingerprint`, recording which
  checkpoint the probe was fitted on.
  """
  fileio.atomic_write(path, lambda f: np.savez(
      f, w=probe.w, b=probe.b, mean=probe.mean, std=probe.std,
      weight_decay=probe.weight_decay, dataset=dataset, step=int(step),
      top1=float(top1), weights=weights))


def load_probe(path: str) -> Probe:
  """Reads a probe written by `save_probe` (i.e. by `evaluate`).

  Raises:
    FileNotFoundError: no probe at `path`; the message says how to make it.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(
        f'No linear probe {path}; run the evaluation first: `python -m '
        'otclr_jax.main --config=configs/<config>.py --workdir=<run dir> '
        '--config.mode=eval` (it saves the probe of every dataset it '
        'evaluates).')
  with np.load(path, allow_pickle=False) as f:
    return Probe(w=f['w'], b=f['b'], mean=f['mean'], std=f['std'],
                 weight_decay=float(f['weight_decay']))


def linear_probe(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray,
                 test_y: np.ndarray, num_classes: int, *,
                 l2_grid=L2_GRID, max_steps: int = DEFAULT_PROBE_STEPS,
                 holdout_fraction: float = HOLDOUT_FRACTION,
                 holdout_seed: int = HOLDOUT_SEED,
                 return_probe: bool = False):
  """Linear probe with the L2 strength chosen on held-out training data.

  For each lambda in `l2_grid`, a probe is fitted on 90% of the train split
  (standardised with that part's statistics) and scored on the held-out,
  stratified 10%; the best lambda (top-1, then lower cross-entropy, then the
  first in the grid) is refitted on the whole train split, standardised with
  the train statistics, and scored on the test split. `test_x` and `test_y`
  are not touched before that last step.

  Args:
    train_x: float [N, D] features.
    train_y: int [N] labels in [0, num_classes).
    test_x: float [M, D].
    test_y: int [M].
    num_classes: C >= 2.
    l2_grid: candidate lambdas >= 0.
    max_steps: maximum L-BFGS iterations per fit.
    holdout_fraction: share of each class held out for the selection.
    holdout_seed: seed of the held-out split.
    return_probe: also return the final probe.

  Returns:
    {'top1', 'top5' (percent on the test split), 'weight_decay' (the chosen
    lambda), 'val_top1' (its held-out top-1, percent), 'num_train',
    'num_test'}; with `return_probe`, the pair (that dict, `Probe`).
  """
  train_x = np.asarray(train_x, np.float32)
  test_x = np.asarray(test_x, np.float32)
  train_y = np.asarray(train_y, np.int32)
  test_y = np.asarray(test_y, np.int32)
  if (train_x.ndim != 2 or test_x.ndim != 2
      or train_x.shape[1] != test_x.shape[1]):
    raise ValueError(f'features must be [N, D] and [M, D], got {train_x.shape} '
                     f'and {test_x.shape}.')
  if len(train_y) != len(train_x) or len(test_y) != len(test_x):
    raise ValueError('each feature row needs one label.')
  if num_classes < 2:
    raise ValueError(f'num_classes must be >= 2, got {num_classes}.')
  for labels, split in ((train_y, 'train'), (test_y, 'test')):
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
      raise ValueError(f'{split} labels must lie in [0, {num_classes}); '
                       'unlabelled examples (-1) cannot be probed.')
  if not l2_grid or min(l2_grid) < 0:
    raise ValueError(f'l2_grid must be non-empty and >= 0, got {l2_grid}.')
  fit = functools.partial(_fit_probe, max_steps=max_steps)

  held = stratified_holdout(train_y, holdout_fraction, holdout_seed)
  fit_mean, fit_std = _moments(train_x[~held])
  scale = lambda v: ((v - fit_mean) / fit_std).astype(np.float32)
  # Standardised once, on the device once, for the whole grid; the held-out
  # rows get weight 0 rather than being cut out, so that the grid and the
  # refit share one compiled fit.
  x, y = jnp.asarray(scale(train_x)), jnp.asarray(train_y)
  weights = jnp.asarray(~held, jnp.float32)
  eigenvalues, basis = _eigenbasis(x, weights)
  x = _matmul(x, basis)
  best, val_top1, selected = _l2_path(
      fit, x, y, weights, held, eigenvalues, l2_grid,
      {'w': jnp.zeros((x.shape[1], num_classes), jnp.float32),
       'b': jnp.zeros((num_classes,), jnp.float32)})

  mean, std = _moments(train_x)
  scale = lambda v: ((v - mean) / std).astype(np.float32)
  # Warm start: the selected probe rewritten for the full split's
  # standardisation and eigenbasis, so that it computes the same logits.
  w, b = (np.asarray(v, np.float64) for v in jax.device_get(
      (_matmul(basis, selected['w']), selected['b'])))
  x = jnp.asarray(scale(train_x))
  weights = jnp.ones(len(train_y), jnp.float32)
  eigenvalues, basis = _eigenbasis(x, weights)
  init = {'w': _matmul(basis.T,
                       jnp.asarray((std / fit_std)[:, None] * w, jnp.float32)),
          'b': jnp.asarray(b + ((mean - fit_mean) / fit_std) @ w, jnp.float32)}
  x = _matmul(x, basis)
  params, _ = fit(_blocks(x, y, weights), jnp.float32(best), eigenvalues,
                  init)
  params = {'w': _matmul(basis, params['w']), 'b': params['b']}
  top1, top5, _ = jax.device_get(
      _scores(params, jnp.asarray(scale(test_x)), jnp.asarray(test_y)))
  row = {'top1': 100.0 * float(np.mean(top1)),
         'top5': 100.0 * float(np.mean(top5)),
         'weight_decay': best, 'val_top1': 100.0 * val_top1,
         'num_train': int(len(train_y)), 'num_test': int(len(test_y))}
  if not return_probe:
    return row
  w, b = jax.device_get((params['w'], params['b']))
  return row, Probe(w=np.asarray(w), b=np.asarray(b), mean=mean, std=std,
                    weight_decay=float(best))


def evaluate(ctx) -> Iterator[tuple[tuple[str, ...], Any]]:
  """The probe evaluator: top-1 / top-5 of every encoder on every dataset.

  Saves the checkpoint's probe of each dataset (`probe_path`) for the
  figures.

  Args:
    ctx: the evaluation's `evaluate.Context`.

  Yields:
    `((row, dataset, metric), value)` for the rows of `ctx.encoders`, and the
    probe's settings under `('protocol', ...)`.
  """
  max_steps = int(ctx.config.eval.probe_steps)
  for name in ctx.datasets:
    feats, num_classes = ctx.features(name)
    for row_name, by_split in feats.items():
      (train_x, train_y), (test_x, test_y) = by_split['train'], by_split['test']
      start = time.perf_counter()
      row, fitted = linear_probe(train_x, train_y, test_x, test_y, num_classes,
                                 max_steps=max_steps, return_probe=True)
      logging.info('%s %s: probe top-1 %.2f%% top-5 %.2f%% (lambda %g) [%.1f '
                   's]', row_name, name, row['top1'], row['top5'],
                   row['weight_decay'], time.perf_counter() - start)
      if row_name == 'linear':
        save_probe(probe_path(ctx.workdir, ctx.step, name), fitted,
                   dataset=name, step=ctx.step, top1=row['top1'],
                   weights=ctx.weights)
      for metric, value in row.items():
        yield (row_name, name, metric), value
  yield ('protocol', 'probe'), ('softmax regression on standardised features, '
                                'full-batch L-BFGS (optax.lbfgs)')
  yield ('protocol', 'probe_max_steps'), max_steps
  yield ('protocol', 'probe_tolerance'), PROBE_TOLERANCE
  yield ('protocol', 'l2_grid'), list(L2_GRID)
  yield ('protocol', 'holdout_fraction'), HOLDOUT_FRACTION
  yield ('protocol', 'holdout_seed'), HOLDOUT_SEED
