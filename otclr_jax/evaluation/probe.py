"""The linear probe: softmax regression on standardised frozen features.

Each fit minimises mean CE + lambda / 2 ||W||^2 (bias not penalised) by
float64 Newton-CG until the (W, b) gradient norm is at most `GRAD_TOL`.
lambda is chosen on a stratified held-out part of TRAIN, then the probe is
refitted on all of it (docs/method.md section 7). The solver's arithmetic
runs in JAX on an accelerator and in NumPy on a CPU (`linear_probe`'s
`backend`); its control loop is Python either way.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import time
from typing import Any, Iterator, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from scipy import linalg
from scipy import special
import threadpoolctl

from otclr_jax import fileio
from otclr_jax import rundir
from otclr_jax import threads
from otclr_jax.evaluation import features


# lambda of mean CE + lambda / 2 ||W||^2 (bias unpenalised). No 0: separable
# features have no optimum. No 1e-6: never chosen on CIFAR-10, and costly.
L2_GRID = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
HOLDOUT_FRACTION = 0.1
HOLDOUT_SEED = 0
# Top-5 is reported with more classes than this; with as few it is 100%.
TOP5 = 5
# Converged when the (W, b) gradient norm is at most this. Absolute: the
# loss is a mean, O(1) at zero, and float64 resolves its gradient to ~1e-14.
GRAD_TOL = 1e-8
# Newton iterations per fit; a fit stopped here is flagged unconverged.
DEFAULT_PROBE_STEPS = 500
# Identifies the result for stale-results checks (launch/run_state.py):
# solver internals that reach the same optimum (preconditioner, damping)
# leave it unchanged.
SOLVER = ('softmax regression on standardised features, float64 Newton with '
          'class-block-preconditioned conjugate gradients, to a (W, b) '
          f'gradient norm <= {GRAD_TOL:g}')


# The probe's part of `rundir.PROTOCOL_FIELDS`, as results.json records it.
PROTOCOL = {'probe': SOLVER, 'probe_tolerance': GRAD_TOL,
            'l2_grid': list(L2_GRID), 'holdout_fraction': HOLDOUT_FRACTION,
            'holdout_seed': HOLDOUT_SEED}


def stratified_holdout(labels: np.ndarray, fraction: float = HOLDOUT_FRACTION,
                       seed: int = HOLDOUT_SEED) -> np.ndarray:
  """Marks a stratified random `fraction` of the examples as held out.

  Per class of c examples, round(fraction * c) clipped to [1, c - 1] (none
  when c = 1).

  Args:
    labels: int [N].
    fraction: share held out, in (0, 1).
    seed: the same labels and seed always give the same split.

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


def _standardiser(x: np.ndarray):
  """The float64 map x -> (x - mean) / std of x [N, D]'s column moments."""
  mean = x.mean(axis=0, dtype=np.float64)
  std = x.std(axis=0, dtype=np.float64)
  # A constant feature (e.g. a dead ReLU channel) is centred, not scaled.
  std = np.where(std > 0, std, 1.0)
  return mean, std


def _eigenbasis(x: np.ndarray) -> np.ndarray:
  """The eigenvectors [D, D] of x's second moment (decorrelates features)."""
  return np.linalg.eigh(x.T @ x / len(x))[1]


def _value(xp, zt, y, w, b, l2):
  """(value, softmax probabilities [N, C]) at (w [D, C], b [C]) in `xp`."""
  logits = w.T @ zt + b[:, None]  # [C, N]
  shift = logits.max(axis=0)  # log-sum-exp by hand: p reuses its exp
  exp = xp.exp(logits - shift)
  total = exp.sum(axis=0)
  value = (xp.mean(shift + xp.log(total) - logits[y, xp.arange(y.shape[0])])
           + 0.5 * l2 * xp.sum(w * w))
  return value, (exp / total).T


def _gradient(xp, zt, onehot_t, w, p, l2):
  """(dW [D, C], db [C]) at weights w and probabilities p [N, C]."""
  del xp  # the operators alone
  residual = (p.T - onehot_t) / p.shape[0]  # [C, N]
  return zt @ residual.T + l2 * w, residual.sum(axis=1)


def _hessp(xp, zt1, pt, dw, db, l2):
  """The Hessian at softmax p times (dW [D, C], db [C]); pt = p^T float32
  [C, N], zt1 = [z, 1]^T float32 [D + 1, N]."""
  zt, n = zt1[:-1], zt1.shape[1]
  dz = dw.T.astype(xp.float32) @ zt + db.astype(xp.float32)[:, None]
  dp = pt * (dz - xp.sum(pt * dz, axis=0, keepdims=True))  # [C, N]
  return ((zt @ dp.T).astype(xp.float64) / n + l2 * dw,
          dp.sum(axis=1, dtype=xp.float64) / n)


# Examples per float32 block sum; the chunks add up in float64, so rounding
# stays far below the smallest lambda's share of the curvature.
_ROWS = 8192


def _curvature_blocks(xp, zt1, p, directions):
  """mean_i u^T S_i u [z_i, 1] [z_i, 1]^T [P, D + 1, D + 1] for the columns
  u of directions [C, P]; zt1 = [z, 1]^T float32 [D + 1, N], S_i = diag(p_i)
  - p_i p_i^T at p [N, C]. As u^T S_i u >= 0, each block is a a^T with a the
  columns scaled by its root: numpy runs that as a SYRK, twice as fast. One
  direction at a time, so JAX's memory holds one [D + 1, _ROWS] product.
  """
  d1, n = zt1.shape
  # sqrt(u^T S_i u) [P, N]
  scale = xp.sqrt(xp.maximum(p @ directions**2 - (p @ directions)**2, 0.0)
                  ).astype(xp.float32).T

  # All examples: from every 4th, CG needs so many more iterations that the
  # random-init CIFAR-10 probe takes longer in all.
  def block(s):
    total = xp.zeros((d1, d1))
    for start in range(0, n, _ROWS):
      a = zt1[:, start:start + _ROWS] * s[start:start + _ROWS]
      total = total + (a @ a.T).astype(xp.float64)
    return total
  if xp is np:
    return np.stack([block(s) for s in scale]) / n
  return jax.lax.map(block, scale) / n


def _invert_coupled(own, crosses, pairs):
  """g -> H^-1 g for the symmetric H [G (D + 1), G (D + 1)] of the blocks
  own [G, D + 1, D + 1] and crosses[i] at pairs[i] = (a, b), a < b; None
  where H is not positive definite."""
  k, d1 = own.shape[:2]
  # LAPACK reads and writes only the lower triangle (C order's upper).
  hessian = np.zeros((k, d1, k, d1))
  for block, (a, b) in zip([*own, *crosses],
                           [(a, a) for a in range(k)] + pairs):
    hessian[a, :, b] = block
  factor, info = linalg.lapack.dpotrf(hessian.reshape(k * d1, k * d1).T,
                                      lower=True, overwrite_a=True)
  if info == 0:
    inverse, info = linalg.lapack.dpotri(factor, lower=True, overwrite_c=True)
  if info != 0:
    return None
  return lambda g: linalg.blas.dsymv(1.0, inverse, g, lower=True)


class _Backend(NamedTuple):
  """The probe's kernels in one array library (module `xp`): `_KERNELS`
  bound to it, then the coupled inverse and the solve's context."""
  xp: Any
  value: Any
  gradient: Any
  hessp: Any
  curvature_blocks: Any
  invert_coupled: Any
  context: Any  # () -> the context manager the solve runs in


_KERNELS = (_value, _gradient, _hessp, _curvature_blocks)
NUMPY = _Backend(np, *(functools.partial(f, np) for f in _KERNELS),
                 _invert_coupled, contextlib.nullcontext)


@contextlib.contextmanager
def _jax_context():
  """float64 and float32 products at full precision (no TF32), for the
  probe's calls only: training keeps JAX's defaults."""
  with jax.enable_x64(True), jax.default_matmul_precision('float32'):
    yield


def _on_device(kernel, **jit_args):
  """`kernel` jitted, called in `_jax_context` (float64 arguments stay so)."""
  jitted = jax.jit(kernel, **jit_args)

  def call(*args):
    with _jax_context():
      return jitted(*args)
  return call


@functools.partial(_on_device, static_argnums=2)
def _jax_coupled_inverse(own, crosses, pairs):
  """H^-1 [G (D + 1), G (D + 1)] of `_invert_coupled`'s blocks (NaN where
  H is not positive definite)."""
  k, d1 = own.shape[:2]
  stack = jnp.concatenate([own, crosses, jnp.swapaxes(crosses, 1, 2)])
  where = np.arange(k)[:, None] * (np.arange(k) == np.arange(k)[:, None])
  for index, (a, b) in enumerate(pairs):
    where[a, b], where[b, a] = k + index, k + len(pairs) + index
  hessian = jnp.transpose(stack[where], (0, 2, 1, 3)).reshape(k * d1, k * d1)
  factor = jnp.linalg.cholesky(hessian)
  return jax.scipy.linalg.cho_solve((factor, True), jnp.eye(k * d1))


def _jax_invert_coupled(own, crosses, pairs):
  """`_invert_coupled` in JAX: H's inverse, explicit, multiplies each g."""
  inverse = _jax_coupled_inverse(own, jnp.stack(crosses), tuple(pairs))
  if not bool(jnp.isfinite(inverse).all()):
    return None
  return lambda g: inverse @ g


JAX = _Backend(jnp, *(_on_device(functools.partial(f, jnp)) for f in _KERNELS),
               _jax_invert_coupled, _jax_context)


def _backend(name: str) -> _Backend:
  """'numpy', 'jax' or 'auto': JAX on an accelerator, NumPy on a CPU."""
  if name not in ('auto', 'numpy', 'jax'):
    raise ValueError(f"backend must be 'auto', 'numpy' or 'jax', got {name!r}.")
  # Not JAX on a CPU too: XLA's float32 Hessian product, most of a probe's
  # time, takes 1.7-2.3x NumPy's at N = 45,000, D = 512, C = 10
  # (docs/results.md).
  if name == 'auto':
    name = 'numpy' if jax.default_backend() == 'cpu' else 'jax'
  return JAX if name == 'jax' else NUMPY


class _Objective:
  """mean CE(z W + b, y) + l2 / 2 ||W||^2 and its derivatives.

  z [N, D]: standardised features in their eigenbasis (orthogonal, so ||W||
  and the gradient norm are basis-independent), held by `backend` (on the
  accelerator for JAX). Stored transposed: numpy's GEMMs stream [D, N]
  faster.
  """

  def __init__(self, z, y, l2, num_classes, backend=NUMPY):
    self.l2, self.backend = l2, backend
    zt = np.ascontiguousarray(np.asarray(z, np.float64).T)
    # float32 only steers CG; the value and gradient stay float64. The ones
    # row is the bias's feature.
    zt1 = np.concatenate([zt, np.ones((1, len(z)))], dtype=np.float32)
    with backend.context():
      xp = backend.xp
      self.y = xp.asarray(y)
      self.onehot_t = xp.asarray(np.eye(num_classes)[:, y])  # [C, N]
      self.zt, self.zt1 = xp.asarray(zt), xp.asarray(zt1)  # [D (+ 1), N]

  def at(self, l2: float) -> '_Objective':
    """The same features' objective at another lambda (arrays shared)."""
    other = copy.copy(self)
    other.l2 = l2
    return other

  def value(self, w, b):
    """(float value, softmax probabilities [N, C]) at (w [D, C], b [C])."""
    value, p = self.backend.value(self.zt, self.y, w, b, self.l2)
    return float(value), p

  def gradient(self, w, p):
    """(dW [D, C], db [C]) at the point of weights w and probabilities p."""
    return self.backend.gradient(self.zt, self.onehot_t, w, p, self.l2)

  def steering(self, p):
    """p^T as float32 [C, N], for `hessp`."""
    if self.backend.xp is np:
      return np.ascontiguousarray(p.T, np.float32)
    return p.T.astype(self.backend.xp.float32)

  def hessp(self, pt, dw, db):
    """The Hessian at softmax p times (dW, db); pt = `steering(p)`."""
    return self.backend.hessp(self.zt1, pt, dw, db, self.l2)


def _class_rotation(p) -> np.ndarray:
  """q [C, C - 1]: the complement of the ones vector, rotated to diagonalise
  the mean softmax curvature at p [N, C] (the loss is invariant to shifting
  every class's weights by the same vector)."""
  n, num_classes = p.shape
  ones_complement = np.linalg.qr(np.eye(num_classes)
                                 - 1.0 / num_classes)[0][:, :-1]
  mean_curvature = (np.diag(np.asarray(p.mean(axis=0)))
                    - np.asarray(p.T @ p) / n)
  return ones_complement @ np.linalg.eigh(
      ones_complement.T @ mean_curvature @ ones_complement)[1]


# Bytes of the float64 (C - 1)(D + 1) square the class-coupled
# preconditioner may hold (CIFAR-10's: 170 MB; C = 100 would need 21 GB).
# Each CG step reads it, so the bound also caps a step's cost. Above it the
# coupled build rebuilds the class blocks at the current point instead.
# Why not couple groups of classes within the bound: at C = 100, groups of 5
# took 3.5x the time of the class blocks alone (13 min 45 s against 3 min 58
# s on 20,000 x 512 synthetic features, 2 loaded cores).
COUPLED_BYTES = 2**30


def _couples(k: int, d1: int) -> bool:
  """Whether the coupled square of k rotated classes of d1 fits the bound."""
  return 8 * (k * d1)**2 <= COUPLED_BYTES


def _class_preconditioner(objective, p, coupled=False):
  """Maps a gradient ([D, C], [C]) to an inverse Hessian approximation times it.

  In the rotated classes q = `_class_rotation(p)`, block (a, b) of the
  Hessian is mean_i q_a^T S_i q_b [z_i, 1] [z_i, 1]^T (+ l2 on W when a = b),
  S_i = diag(p_i) - p_i p_i^T. Without `coupled` only the blocks a = b are
  kept; with it and within `COUPLED_BYTES`, the whole (C - 1)(D + 1) square:
  5x the SYRKs at C = 10, for fits where the coupling between classes
  dominates (small lambda).
  """
  backend, zt1, l2 = objective.backend, objective.zt1, objective.l2
  xp, k, d1 = backend.xp, p.shape[1] - 1, zt1.shape[0]
  with backend.context():
    q = _class_rotation(p)
    curvature = backend.curvature_blocks(zt1, p, xp.asarray(q))
    # The bias is not penalised; a floor keeps its block invertible.
    bias = np.zeros((d1, d1))
    bias[-1, -1] = 1.0
    own = (curvature * xp.asarray(1.0 + 1e-9 * bias)
           + xp.asarray(l2 * (np.eye(d1) - bias) + 1e-12 * bias))
    solve = None
    if coupled and _couples(k, d1) and k > 1:
      pairs = [(a, b) for a in range(k) for b in range(a + 1, k)]
      # Off the diagonal by polarisation: block (a, b) is half of (q_a +
      # q_b)'s block less those of q_a and q_b, all three with weights >= 0.
      sums = backend.curvature_blocks(zt1, p, xp.asarray(np.stack(
          [q[:, a] + q[:, b] for a, b in pairs], axis=1)))
      crosses = [0.5 * (block - curvature[a] - curvature[b])
                 for block, (a, b) in zip(sums, pairs)]
      solve = backend.invert_coupled(own, crosses, pairs)
    if solve is None:  # also where the coupled one is not positive definite
      # Batched explicit inverses L^-T L^-1: per-block LAPACK calls or solves
      # each step cost more than a Hessian product.
      cholesky_inverse = xp.linalg.inv(xp.linalg.cholesky(own))
      inverses = xp.swapaxes(cholesky_inverse, 1, 2) @ cholesky_inverse
      solve = lambda g: (inverses @ g.reshape(k, d1, 1)).reshape(-1)
    q = xp.asarray(q)

  def apply(gw, gb):
    g = (xp.concatenate([gw, gb[None]]) @ q).T  # [C - 1, D + 1]
    out = solve(g.reshape(-1)).reshape(k, d1).T @ q.T
    return out[:-1], out[-1]
  return apply


class Fit(NamedTuple):
  """One solved lambda: weights [D, C] and bias [C] in the solve's basis."""
  w: np.ndarray
  b: np.ndarray
  l2: float
  steps: int
  grad_norm: float
  converged: bool

  def record(self) -> dict[str, Any]:
    return {'lambda': self.l2, 'steps': self.steps,
            'grad_norm': self.grad_norm, 'converged': self.converged}


# CG iterations per Newton step; a cut solve is still a descent direction.
MAX_CG_STEPS = 250
# At this many CG iterations in one Newton step, the preconditioner is
# rebuilt at the current point with the class coupling and CG restarts from
# its iterate. A coupled build costs ~400 Hessian products at N = 45,000;
# with it the next Newton steps take a few CG iterations, where the class
# blocks alone take 250 (lambda = 1e-5, random-init CIFAR-10 features).
COUPLE_AFTER = 120
# After a step that backtracked, CG solves (H + DAMPING |g| I) s = -g: far
# from the optimum (the refit starts from a fit to other rows) the Newton
# step overshoots; a full step switches the damping off again, so the local
# convergence stays quadratic.
DAMPING = 0.1


def _solve(objective, w, b, max_steps) -> Fit:
  """Minimises `objective` from (w [D, C], b [C]), in float64.

  Damped Newton with backtracking; directions by preconditioned CG to a
  relative residual of min(0.5, sqrt(|g|)), no tighter than `GRAD_TOL` needs.
  The arrays live in `objective.backend`; the loop's scalars in Python.
  """
  with objective.backend.context():
    xp = objective.backend.xp
    # The steps stay in the complement of the class-shift direction, where the
    # optimum lies: shifting W's classes together only changes the penalty.
    w, b = xp.asarray(w), xp.asarray(b)
    w, b = w - w.mean(axis=1, keepdims=True), b - b.mean()
    value, p = objective.value(w, b)
    precondition = _class_preconditioner(objective, p)
    dot = lambda a, b_: float((a[0] * b_[0]).sum() + (a[1] * b_[1]).sum())
    steps, t = 0, 1.0
    while True:
      gw, gb = objective.gradient(w, p)
      grad_norm = math.sqrt(dot((gw, gb), (gw, gb)))
      if (not math.isfinite(grad_norm) or grad_norm <= GRAD_TOL
          or steps == max_steps):
        break
      steps += 1
      pt = objective.steering(p)
      damping = DAMPING * grad_norm if t < 1.0 else 0.0
      tolerance = max(min(0.5, math.sqrt(grad_norm)),
                      0.5 * GRAD_TOL / grad_norm) * grad_norm
      sw, sb = xp.zeros_like(gw), xp.zeros_like(gb)
      rw, rb = -gw, -gb
      dw, db = precondition(rw, rb)
      rz = dot((rw, rb), (dw, db))
      for cg_steps in range(1, MAX_CG_STEPS + 1):
        hw, hb = objective.hessp(pt, dw, db)
        hw, hb = hw + damping * dw, hb + damping * db
        alpha = rz / dot((dw, db), (hw, hb))
        sw, sb = sw + alpha * dw, sb + alpha * db
        rw, rb = rw - alpha * hw, rb - alpha * hb
        if math.sqrt(dot((rw, rb), (rw, rb))) <= tolerance:
          break
        if cg_steps == COUPLE_AFTER:
          precondition = _class_preconditioner(objective, p, coupled=True)
          dw, db = precondition(rw, rb)
          rz = dot((rw, rb), (dw, db))
          continue
        zw, zb = precondition(rw, rb)
        rz, rz_old = dot((rw, rb), (zw, zb)), rz
        if rz_old == 0:
          break  # a singular preconditioner (a class without train rows)
        dw, db = zw + (rz / rz_old) * dw, zb + (rz / rz_old) * db
      # Backtracking (Armijo): the full Newton step near the optimum.
      slope, t = dot((gw, gb), (sw, sb)), 1.0
      for _ in range(40):
        trial = objective.value(w + t * sw, b + t * sb)
        if trial[0] <= value + 1e-4 * t * slope:
          break
        t *= 0.5
      else:
        break  # No decrease left at float64's resolution.
      w, b = w + t * sw, b + t * sb
      value, p = trial
    return Fit(np.asarray(w), np.asarray(b), objective.l2, steps, grad_norm,
               grad_norm <= GRAD_TOL)


# Relative column size below which a direction is empty: float64 leaves
# ~1e-17 in the null space, real directions are orders above.
EMPTY_DIRECTION = 1e-12


def _span_solver(z, y, num_classes, backend=NUMPY):
  """solve(l2, w [D, C], b [C], max_steps) -> Fit: `_solve` for z [N, D] in
  the directions in which z varies. Elsewhere the loss is l2 / 2 ||W||^2
  alone, so W = 0 there; the gradient norm covers all directions.
  """
  size = np.maximum(z.max(axis=0), -z.min(axis=0))
  live = size > EMPTY_DIRECTION * size.max(initial=0.0)
  z_live = z if live.all() else np.ascontiguousarray(z[:, live])
  objective = _Objective(z_live, y, 0.0, num_classes, backend)

  def solve(l2, w, b, max_steps):
    fit = _solve(objective.at(l2), w[live], b, max_steps)
    if live.all():
      return fit
    p = special.softmax(z_live @ fit.w + fit.b, axis=1)
    p[np.arange(len(y)), y] -= 1.0
    empty = z[:, ~live].T @ p / len(y)  # the gradient there, at W = 0
    grad_norm = math.hypot(fit.grad_norm, float(np.linalg.norm(empty)))
    w = np.zeros_like(w)
    w[live] = fit.w
    return fit._replace(w=w, grad_norm=grad_norm,
                        converged=grad_norm <= GRAD_TOL)
  return solve


def _scores(w, b, x, y):
  """Top-1 hits, top-5 hits and cross-entropy [N] of float64 logits."""
  logits = x @ w + b
  label_logit = np.take_along_axis(logits, y[:, None], axis=1)
  # Ties go to the lower class, as argmax's: equal logits (a collapsed
  # encoder) are not all in the top 5. With fewer than 5 classes top-5 is 100%.
  lower = np.arange(logits.shape[1]) < y[:, None]
  rank = np.sum((logits > label_logit) | ((logits == label_logit) & lower),
                axis=1)
  rank = np.where(np.isfinite(logits).all(axis=1), rank, logits.shape[1])
  ce = special.logsumexp(logits, axis=1) - label_logit[:, 0]
  return rank == 0, rank < 5, ce


def _l2_path(x, y, held, num_classes, l2_grid, max_steps, backend):
  """Fits every lambda of `l2_grid` on the kept rows, picks one on `held`.

  Strongest penalty first, each fit warm-started from the previous one; x
  [N, D] is standardised with the kept rows. Returns (the `select`ed fit, w
  in x's basis; its held-out top-1 in percent; the records in grid order).
  """
  basis = _eigenbasis(x[~held])
  fit_x, held_x = x[~held] @ basis, x[held] @ basis
  solve = _span_solver(fit_x, y[~held], num_classes, backend)
  w, b = np.zeros((x.shape[1], num_classes)), np.zeros(num_classes)
  fits, records = [None] * len(l2_grid), [None] * len(l2_grid)
  start = time.perf_counter()
  for done, index in enumerate(
      sorted(range(len(l2_grid)), key=lambda i: -l2_grid[i]), 1):
    fit = solve(float(l2_grid[index]), w, b, max_steps)
    if np.isfinite(fit.grad_norm):
      top1, _, ce = _scores(fit.w, fit.b, held_x, y[held])
      val_top1, val_ce = float(np.mean(top1)), float(np.mean(ce))
      w, b = fit.w, fit.b
    else:
      val_top1, val_ce = 0.0, math.inf
      w, b = np.zeros_like(w), np.zeros_like(b)
    log = logging.info if fit.converged else logging.warning
    # Smaller lambdas take longer: the estimate is a lower bound.
    elapsed = time.perf_counter() - start
    log('probe fit %d/%d, lambda=%g: held-out top-1 %.2f%%, CE %.4f (%d '
        'Newton steps, gradient norm %.1e%s) [%.0f s, ETA >= %.0f s]', done,
        len(l2_grid) + 1, fit.l2, 100 * val_top1, val_ce, fit.steps,
        fit.grad_norm, '' if fit.converged else ', NOT CONVERGED', elapsed,
        elapsed / done * (len(l2_grid) + 1 - done))
    fits[index] = fit
    records[index] = dict(fit.record(), val_top1=100.0 * val_top1,
                          val_ce=val_ce)
  index = select(records)
  chosen = fits[index]
  return (chosen._replace(w=basis @ chosen.w), records[index]['val_top1'],
          records)


def select(records: list[dict[str, Any]]) -> int:
  """Chosen record's index: converged, best held-out top-1, lower CE, first."""
  return min(range(len(records)), key=lambda i: (
      not records[i]['converged'], -records[i]['val_top1'],
      records[i]['val_ce'], i))


def _as_features(x) -> np.ndarray:
  """Features as float32, or float64 if given so (rounding would lose it)."""
  x = np.asarray(x)
  return x if x.dtype == np.float64 else np.asarray(x, np.float32)


class Probe(NamedTuple):
  """A fitted linear probe: `logits = ((h - mean) / std) @ w + b`.

  Attributes:
    w: float64 [D, C].
    b: float64 [C].
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
    """Class scores float64 [N, C] of features [N, D], as evaluated."""
    features = _as_features(features)
    if features.ndim != 2 or features.shape[1] != len(self.mean):
      raise ValueError(f'features must be [N, {len(self.mean)}], got '
                       f'{features.shape}.')
    return ((features - self.mean) / self.std) @ self.w + self.b


def probe_path(workdir: str, step: int, name: str) -> str:
  """`<workdir>/eval/probe_step<step>_<dataset key>.npz`."""
  return os.path.join(workdir,
                      rundir.probe_file(step, features.dataset_key(name)))


def save_probe(path: str, probe: Probe, *, dataset: str, step: int,
               top1: float, weights: str = '') -> None:
  """Writes `probe` to `path` (.npz) with dataset, step, top-1 and weights."""
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
                 return_probe: bool = False, backend: str = 'auto'):
  """Linear probe with the L2 strength chosen on held-out training data.

  Each lambda is fitted on the kept part of TRAIN (standardised with its
  statistics) and scored on the stratified held-out part; the `select`ed one
  is refitted on all of TRAIN and scored on TEST, which is used only there.

  Args:
    train_x: float [N, D] features.
    train_y: int [N] labels in [0, num_classes).
    test_x: float [M, D].
    test_y: int [M].
    num_classes: C >= 2.
    l2_grid: candidate lambdas > 0.
    max_steps: maximum Newton iterations per fit.
    return_probe: also return the final probe.
    backend: where the solver's arithmetic runs: 'jax' (the default device),
      'numpy', or 'auto' (JAX on an accelerator, NumPy on a CPU). The BLAS
      threads are limited by `threads.host_threads` either way.

  Returns:
    {'top1', 'top5' (test, percent; top-5 only with more than `TOP5`
    classes), 'converged' (the chosen fit and the
    refit reached `GRAD_TOL`), 'weight_decay' (chosen lambda), 'val_top1'
    (its held-out top-1, percent), 'num_train', 'num_test',
    'fits' (per lambda, then the refit: `Fit.record`, plus held-out scores)};
    with `return_probe`, the pair (that dict, `Probe`).
  """
  train_x, test_x = _as_features(train_x), _as_features(test_x)
  train_y = np.asarray(train_y, np.int64)
  test_y = np.asarray(test_y, np.int64)
  if (train_x.ndim != 2 or test_x.ndim != 2
      or train_x.shape[1] != test_x.shape[1]):
    raise ValueError(f'features must be [N, D] and [M, D], got {train_x.shape} '
                     f'and {test_x.shape}.')
  if len(train_y) != len(train_x) or len(test_y) != len(test_x):
    raise ValueError('each feature row needs one label.')
  if not len(train_x) or not len(test_x):
    raise ValueError('the probe needs at least one train and one test row.')
  if num_classes < 2:
    raise ValueError(f'num_classes must be >= 2, got {num_classes}.')
  features.check_labels(num_classes, train=train_y, test=test_y)
  if not l2_grid or min(l2_grid) <= 0:
    raise ValueError(f'l2_grid must be non-empty and > 0, got {l2_grid}.')

  backend = _backend(backend)
  held = stratified_holdout(train_y)
  if not held.any():
    raise ValueError('the probe needs held-out rows to choose lambda: every '
                     'class has a single train example.')
  with threadpoolctl.threadpool_limits(threads.host_threads()):
    return _fit_and_score(train_x, train_y, test_x, test_y, num_classes, held,
                          l2_grid, max_steps, return_probe, backend)


def _fit_and_score(train_x, train_y, test_x, test_y, num_classes, held,
                   l2_grid, max_steps, return_probe, backend):
  """`linear_probe` after its checks."""
  fit_mean, fit_std = _standardiser(train_x[~held])
  chosen, val_top1, records = _l2_path(
      (train_x - fit_mean) / fit_std, train_y, held, num_classes, l2_grid,
      max_steps, backend)

  mean, std = _standardiser(train_x)
  x = (train_x - mean) / std
  basis = _eigenbasis(x)
  # Warm start: the selected probe, same logits in the new standardisation.
  w = (std / fit_std)[:, None] * chosen.w
  b = chosen.b + ((mean - fit_mean) / fit_std) @ chosen.w
  refit = _span_solver(x @ basis, train_y, num_classes, backend)(
      chosen.l2, basis.T @ w, b, max_steps)
  if not refit.converged:
    logging.warning('probe refit at lambda=%g did not converge (gradient '
                    'norm %.1e after %d Newton steps).', chosen.l2,
                    refit.grad_norm, refit.steps)
  w = basis @ refit.w
  top1, top5, _ = _scores(w, refit.b, (test_x - mean) / std, test_y)
  row = {'top1': 100.0 * float(np.mean(top1)),
         # The reported number is the protocol's only if both fits are.
         'converged': bool(chosen.converged and refit.converged),
         'weight_decay': chosen.l2, 'val_top1': val_top1,
         'num_train': int(len(train_y)), 'num_test': int(len(test_y)),
         'fits': records + [dict(refit.record(), refit=True)]}
  if num_classes > TOP5:
    row['top5'] = 100.0 * float(np.mean(top5))
  if not return_probe:
    return row
  return row, Probe(w=w, b=refit.b, mean=mean, std=std,
                    weight_decay=chosen.l2)


def evaluate(ctx) -> Iterator[tuple[tuple[str, ...], Any]]:
  """The probe evaluator: top-1 / top-5 of every encoder on every dataset.

  Saves the 'linear' row's probe of each dataset to `probe_path`.

  Args:
    ctx: the evaluation's `evaluate.Context`.

  Yields:
    `((row, dataset, metric), value)` for the rows of `ctx.encoders`, every
    fit's record under `('probe_fits', row, dataset)`, and the probe's
    settings under `('protocol', ...)`.
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
                   's]', row_name, name, row['top1'], row.get('top5', math.nan),
                   row['weight_decay'], time.perf_counter() - start)
      if row_name == 'linear':
        save_probe(probe_path(ctx.workdir, ctx.step, name), fitted,
                   dataset=name, step=ctx.step, top1=row['top1'],
                   weights=ctx.weights)
      yield ('probe_fits', row_name, name), row.pop('fits')
      for metric, value in row.items():
        yield (row_name, name, metric), value
  yield ('protocol', 'probe_max_steps'), max_steps
  for field, value in PROTOCOL.items():
    yield ('protocol', field), value
