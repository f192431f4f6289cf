"""Monteiro-Svaiter ball acceleration (paper 002, Section 3).

References: Carmon, Jambulapati, Jin, Lee, Liu, Sidford, Tian, "ReSQueing Parallel and Private
Stochastic Convex Optimization" (2023) [ReSQue], Props 1-2, Theorems 1-2; Carmon, Jambulapati,
Jin, Sidford, "Thinking Inside the Ball", COLT 2021 [CJJS21], Alg. 1 (BROO acceleration with
LAMBDA-BISECTION; spec EXT_acsa_ball_acceleration.md §B.2).

Minimizes a convex, L-Lipschitz ``F`` (here ``f^_rho``, reached through ReSQue queries) over
``B_R(x0)`` given a *ball oracle* ``ball_oracle(key, center, lam, phi) -> (x, OracleCost)``
(eq. (8), Def. 4; the oracles are in :mod:`.ball_oracles`, re-exported here).
:func:`ball_acceleration` is CJJS21 Alg. 1 with ReSQue Prop. 1/2's oracle parameters (its
invariants are checked every iteration); :func:`iterated_ball_prox` is plain
``x_{k+1} = O(x_k)`` for comparison.

Deviations:
  * CJJS21 line 7 uses ``lam (y_t - x_{t+1})`` from the ball-oracle output; ReSQue Prop. 1
    feeds an MLMC stochastic-proximal estimate. The parallel pipeline uses the ball-oracle
    output at accuracy ``phi`` (bias at most ``sqrt(2 lam phi)``); the private pipeline uses
    the MLMC estimator (Alg. 6).
  * Exits: CJJS21 line 8 tests 1 (``A >= R^2/eps``) and 2 (small ``lam``) and ReSQue Prop. 1's
    cap ``ceil(C_ba K log kappa)``; tests 3-4 need function values, which a stochastic oracle
    does not have. The output is the last ``x``.
  * ``lam_min`` defaults to ReSQue's ``lam_star / C_ba`` rather than CJJS21's
    ``eps/(6 r R)`` (stochastic oracles cost ``~1/lam^2`` queries); ``lam_max = 2 L / r``.
  * Optional warm start of the bisection from the previous ``lam`` (spec 002 §3.1 [IMPL])."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dpsco_jax._checks import check_int, check_positive
# the oracles are part of this module's public surface (re-exported)
from dpsco_jax.algorithms.resque.ball_oracles import (  # noqa: F401
    BallOracle, GradOracle, OracleCost, acsa_ball, acsa_plan, ball_composite_step,
    dataset_oracle, epoch_sgd_ball, epoch_sgd_plan, make_acsa_oracle, make_epoch_sgd_oracle,
    make_exact_ball_oracle, majority_aggregate)
from dpsco_jax.transforms.steps import project_l2_ball, tree_l2_norm

PyTree = Any


# ------------------------------------------------------------------------ ball acceleration --

@dataclasses.dataclass
class BallAccelResult:
  """Output of :func:`ball_acceleration` / :func:`iterated_ball_prox`. ``history``: per outer
  iteration ``x``, ``lam``, ``A``, cumulative ``rounds`` (query depth) and ``queries``."""
  x: PyTree
  iterations: int
  oracle_calls: int
  rounds: int
  queries: int
  exit: str
  history: list


def resque_accel_params(lipschitz: float, radius_r: float, radius_big: float,
                        eps: float) -> dict:
  """ReSQue Prop. 1: ``kappa = L R/eps``, ``K = (R/r)^(2/3)``,
  ``lam_star = eps K^2 log^2(kappa) / R^2``."""
  kappa = lipschitz * radius_big / eps
  k = (radius_big / radius_r) ** (2.0 / 3.0)
  lam_star = eps * k ** 2 * math.log(max(kappa, math.e)) ** 2 / radius_big ** 2
  return {"kappa": kappa, "K": k, "lam_star": lam_star}


def _alpha_tau(tau: float) -> float:
  return tau / (1.0 + tau + math.sqrt(1.0 + 2.0 * tau))


def ball_acceleration(ball_oracle: BallOracle, x0: PyTree, key: jax.Array, *, R: float,
                      r: float, eps: float, lipschitz: float, lam_min: float | None = None,
                      lam_max: float | None = None, c_ba: float = 1.0,
                      max_iter: int | None = None, ls_accuracy: float | None = None,
                      bo_phi: Callable[[float], float] | None = None,
                      warm_start: bool = True, band: tuple[float, float] = (13 / 16, 15 / 16),
                      max_bisection: int = 40,
                      callback: Callable[[int, PyTree], None] | None = None,
                      ls_oracle: BallOracle | None = None,
                      prox_oracle: Callable[[jax.Array, PyTree, float], PyTree] | None = None,
                      center: PyTree | None = None) -> BallAccelResult:
  """Monteiro-Svaiter ball acceleration (CJJS21 Alg. 1; ReSQue Prop. 1/2 parameters).

  Per outer iteration ``t``:
    1. ``lam_{t+1}`` = LAMBDA-BISECTION: ``lam`` with ``|O(y_lam, lam) - y_lam|`` in the band
       ``[13r/16, 15r/16]`` (long step) or near ``lam_min`` (short step), ``y_lam = alpha_{2 A
       lam} x + (1 - alpha_{2 A lam}) v``, ``alpha_tau = tau / (1 + tau + sqrt(1 + 2 tau))``;
       one ``ls_oracle`` call per distinct ``lam`` at accuracy ``ls_accuracy`` (default
       ``r/17``).
    2. ``a = (1 + sqrt(1 + 4 lam A))/(2 lam)``, ``A' = A + a``, ``y = (A x + a v)/A'``.
    3. ``x' = O(y, lam, phi = bo_phi(lam))``, default ``phi = lam r^2 / (c_ba log^3 kappa)``.
    4. ``v' = Pi_{B_R(center)}(v - a lam (y - x'))``, with ``prox_oracle(key, y, lam)``'s
       estimate of ``bprox(y)`` in place of ``x'`` when given (ReSQue's MLMC Alg. 6).

  Stops when ``A >= R^2/eps``, when ``lam <= eps/(3 r R)``, or after ``max_iter`` (default
  ``ceil(c_ba K log kappa)``). A violated invariant raises ``RuntimeError``. Returns a
  :class:`BallAccelResult` (``rounds``: the query depth)."""
  check_positive(R, "R")
  check_positive(r, "r")
  check_positive(eps, "eps")
  check_positive(lipschitz, "lipschitz")
  if r > R:
    raise ValueError(f"r must be <= R, got r={r}, R={R}")
  p = resque_accel_params(lipschitz, r, R, eps)
  lam_min = p["lam_star"] / c_ba if lam_min is None else check_positive(lam_min, "lam_min")
  lam_max = 2.0 * lipschitz / r if lam_max is None else check_positive(lam_max, "lam_max")
  if lam_min >= lam_max:
    raise ValueError(f"lam_min ({lam_min:.3g}) must be < lam_max ({lam_max:.3g})")
  if max_iter is None:
    max_iter = int(math.ceil(c_ba * p["K"] * math.log(max(p["kappa"], math.e))))
  check_int(max_iter, "max_iter")
  delta_ls = r / 17.0 if ls_accuracy is None else check_positive(ls_accuracy, "ls_accuracy")
  logk3 = math.log(max(p["kappa"], math.e)) ** 3
  if bo_phi is None:
    bo_phi = lambda lam: lam * r * r / (c_ba * logk3)
  ls_oracle = ball_oracle if ls_oracle is None else ls_oracle
  center = x0 if center is None else center
  x, v, a_cum, lam = x0, project_l2_ball(x0, R, center), 0.0, None
  calls = rounds = queries = 0
  history = []
  exit_reason = "max_iter"
  key_iter = key

  def count(cost: OracleCost) -> None:
    nonlocal calls, rounds, queries
    calls, rounds, queries = calls + 1, rounds + cost.rounds, queries + cost.queries

  for t in range(max_iter):
    key_iter, k_ls, k_bo, k_sp = jax.random.split(key_iter, 4)
    dists: dict[float, float] = {}

    def dist(lam_try):   # step 1: one line-search oracle call per distinct lam
      if lam_try not in dists:
        al = _alpha_tau(2.0 * a_cum * lam_try)
        y = jax.tree.map(lambda xi, vi: al * xi + (1.0 - al) * vi, x, v)
        out, cost = ls_oracle(jax.random.fold_in(k_ls, len(dists)), y, lam_try,
                              0.5 * lam_try * delta_ls ** 2)
        count(cost)
        dists[lam_try] = float(tree_l2_norm(jax.tree.map(jnp.subtract, out, y)))
      return dists[lam_try]

    lam = _bisection(dist, lam if warm_start else None, lam_min, lam_max, band[0] * r,
                     band[1] * r, r, R, lipschitz, max_bisection)
    # steps 2-4
    a = (1.0 + math.sqrt(1.0 + 4.0 * lam * a_cum)) / (2.0 * lam)
    a_new = a_cum + a
    y = jax.tree.map(lambda xi, vi: (a_cum * xi + a * vi) / a_new, x, v)
    x_new, cost = ball_oracle(k_bo, y, lam, bo_phi(lam))
    count(cost)
    x_prox = x_new if prox_oracle is None else prox_oracle(k_sp, y, lam)
    v = project_l2_ball(jax.tree.map(lambda vi, yi, xi: vi - a * lam * (yi - xi), v, y, x_prox),
                        R, center)
    # invariants (CJJS21 Alg. 1 line 4 and line 7)
    if not math.isclose(lam * a * a, a_new, rel_tol=1e-9):
      raise RuntimeError(f"invariant lam a^2 = A violated at t={t}: {lam * a * a} vs {a_new}")
    vdist = float(tree_l2_norm(jax.tree.map(jnp.subtract, v, center)))
    if vdist > R * (1.0 + 1e-5):
      raise RuntimeError(f"invariant v in B_R(x0) violated at t={t}: |v - x0| = {vdist}")
    x, a_cum = x_new, a_new
    history.append({"t": t, "lam": lam, "a": a, "A": a_cum, "rounds": rounds,
                    "queries": queries, "x": x})
    if callback is not None:
      callback(t, x)
    if a_cum >= R * R / eps:
      exit_reason = "A>=R^2/eps"
      break
    if lam <= eps / (3.0 * r * R):
      exit_reason = "small_lambda"
      break
  return BallAccelResult(x=x, iterations=len(history), oracle_calls=calls, rounds=rounds,
                         queries=queries, exit=exit_reason, history=history)


def _bisection(dist, lam0, lam_min, lam_max, lo, hi, r, R, lipschitz, max_steps):
  """CJJS21 LAMBDA-BISECTION (lines 13-21), optionally warm-started at ``lam0``."""
  steps = 0
  lam = lam_max if lam0 is None else min(max(lam0, lam_min), lam_max)
  if lam0 is None or dist(lam) <= lo:   # halve from lam_max (or the warm start) ...
    while lam >= lam_min and dist(lam) <= lo and steps < max_steps:
      lam /= 2.0
      steps += 1
  else:   # ... or double from the warm start
    while 2.0 * lam <= lam_max and dist(2.0 * lam) > lo and steps < max_steps:
      lam *= 2.0
      steps += 1
    if 2.0 * lam > lam_max:
      return lam
  if lam <= lam_min:
    return 2.0 * lam if 2.0 * lam <= lam_max else lam_max  # line 15
  lam_u, lam_l = 2.0 * lam, lam
  if dist(lam_l) <= hi:  # line 17
    return lam_l
  lam_m = math.sqrt(lam_u * lam_l)
  while (not lo <= dist(lam_m) <= hi and
         math.log2(lam_u / lam_l) >= r / (8.0 * (R + lipschitz / lam_l)) and steps < max_steps):
    if dist(lam_m) < lo:
      lam_u = lam_m
    else:
      lam_l = lam_m
    lam_m = math.sqrt(lam_u * lam_l)
    steps += 1
  return lam_m


def iterated_ball_prox(ball_oracle: BallOracle, x0: PyTree, key: jax.Array, *, lam: float,
                       phi: float, n_iter: int,
                       stop: Callable[[PyTree], bool] | None = None) -> BallAccelResult:
  """Plain ``x_{k+1} = O(x_k, lam, phi)`` (no acceleration), for comparison with
  :func:`ball_acceleration`. Stops after ``n_iter`` or when ``stop(x)`` is True."""
  check_positive(lam, "lam")
  check_int(n_iter, "n_iter")
  x = x0
  rounds = queries = 0
  history = []
  exit_reason = "max_iter"
  for t in range(n_iter):
    x, cost = ball_oracle(jax.random.fold_in(key, t), x, lam, phi)
    rounds += cost.rounds
    queries += cost.queries
    history.append({"t": t, "rounds": rounds, "queries": queries, "x": x})
    if stop is not None and stop(x):
      exit_reason = "stop"
      break
  return BallAccelResult(x=x, iterations=len(history), oracle_calls=len(history), rounds=rounds,
                         queries=queries, exit=exit_reason, history=history)
