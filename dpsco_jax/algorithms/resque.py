"""ReSQue parallel and private SCO (paper 002: Carmon, Jambulapati, Jin, Lee, Liu, Sidford,
Tian, "ReSQueing Parallel and Private Stochastic Convex Optimization", 2023).

Parallel SCO (Theorem 1): ball acceleration (:mod:`.ball_acceleration`) over
``F = f^_rho`` with ``r = rho = eps_opt / (sqrt(d) L)`` and EpochSGD (Alg. 1) ball oracles,
each one batched round of ReSQue queries. ``resque_parallel_sco`` reports the query depth and
total queries needed to reach a target accuracy; ``minibatch_sgd`` is the baseline whose query
depth is its number of steps.

Private SCO (Section 4), item level, replace-one neighbours:
  * Alg. 3/4 :func:`localized_resque_sgd` — subsampled (WITH replacement) ReSQue SGD in
    ``B_xbar(r)``, phases ``T_i = T^/2^i``, ``eta_i = 4^-i eta``, Gaussian output perturbation
    ``zeta_i ~ N(0, (L eta_i / beta)^2 I)`` at every phase end (the ONLY privacy noise), the
    composite regularized step of Alg. 4. All ``T^ - 1`` queries are one batched round.
  * Alg. 5 :func:`strongly_convex_resque` — ``k = ceil(log2 log2 T)`` calls of Alg. 4 with the
    eq. (28) schedule (``beta_i T_i`` doubling, distance bounds ``r_i``).
  * Alg. 6 :func:`mlmc_prox_estimator` — MLMC bias reduction, ``J ~ Geom(1/2)``.
  * Alg. 7 :func:`high_probability_solver` — ``ceil(20 log(1/zeta))`` runs of Alg. 5 +
    :func:`~dpsco_jax.algorithms.ball_acceleration.majority_aggregate` (Lemma 11).
  * Theorem 3 private ERM: ball acceleration with O_ls = Alg. 7, O_bo = Alg. 5,
    O_sp = Alg. 6 (the ``v``-update uses Alg. 6's estimate).
  * Prop. 11 / Theorem 4: phased localization over disjoint batches ``n_i = n / 2^i`` with
    regularization ``lam_i = 1/(eta_i n_i)``, ``eta_i = 4^-i eta`` (reconstruction of [FKT20]).

Accounting (Section 4, spec 002 §4). Relation: replace-one, item level (``n`` public; other
relations are refused). The sensitivity of Alg. 3/4 holds only with high probability (Lemma 5
drift bound), so the standard subsampled-Gaussian accountant does NOT apply. Each Alg. 4 call
is an :class:`~dpsco_jax.privacy.ApproxRdpEvent` ``(alpha, alpha tau, delta_call, delta')``
(Lemma 7) on the library's one :class:`~dpsco_jax.privacy.PrivacyLedger`, which sums the
charges per ``(alpha, delta')`` (Lemma 3) and converts once (Corollary 1): ``eps_dp =
sum(alpha tau) + log(1/delta')/(alpha - 1)``, ``delta_dp = delta' + (1 + e^eps_dp)
sum(delta_call)``, with ``delta' = delta/3`` (spec §8 item 12). The planned calls of a phase
are spent BEFORE the phase runs (budget ``epsilon``); a per-phase guard ledger also spends each
realized call before it runs and refuses one beyond the phase budget. Two constant sets:
  * ``"explicit"`` (Lemma 7's proof constants): ``tau = 13 (1.2 T/n)^2 6000 beta^2
    log^2(2/delta)``, preconditions ``T/n <= 1/60``, ``6000 beta^2 log^2(2/delta) <= 1/3``,
    ``alpha < 3 / (6000 beta^2 log^2(2/delta))``, ``delta < 1/6``,
    ``rho/r >= 1728 log^2(log2 T / delta)``.
  * ``"c_priv"``: ``tau = C_priv (beta log(1/delta) T/n)^2`` with a user ``C_priv`` (the
    paper's unspecified universal constant).
``beta = 1/z`` is calibrated by the library's one calibrator (``calibrate_noise_multiplier``)
so that the WORST-CASE plan of calls (iteration cap, bisection cap, deepest MLMC level) meets
the target; the reported ``(eps, delta)`` and
``gradient_evaluations`` are those of the plan (data independent); realized counts, which
depend on the data through the bisection, go to ``Result.debug`` only.
Provenance: ``theorem`` only with the explicit constants AND every precondition holding for
every planned call; otherwise ``heuristic`` (the notes list the violated conditions). The ``theory``
preset computes eq. (30)-(34) parameters and raises :class:`PrivacyPreconditionError` naming
the violated condition; at CPU-scale ``n`` it always raises (``rho/r >= 1728 log^2`` alone
forces ``r`` tiny) — that is the paper, not a bug. The ``practical`` preset runs and is
labelled ``heuristic`` unless the preconditions hold.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from functools import lru_cache
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax._checks import (check_choice, check_delta, check_epsilon, check_int,
                               check_positive)
from dpsco_jax.algorithms import ball_acceleration as ba
from dpsco_jax.grads import per_example_grads
from dpsco_jax.privacy.calibrate import calibrate_noise_multiplier
from dpsco_jax.privacy.events import ApproxRdpEvent
from dpsco_jax.privacy.ledger import PrivacyBudgetExceeded, PrivacyLedger, PrivacyReport
from dpsco_jax.privacy.relations import check_relation
from dpsco_jax.result import Result
from dpsco_jax.transforms.noise import tree_gaussian_like
from dpsco_jax.transforms.resque import reweight, sample_queries
from dpsco_jax.transforms.steps import project_l2_ball, projected_sgd

PyTree = Any
RELATION = "replace_one"  # item level: one example replaced (n public)
DELTA_PRIME_FRAC = 1.0 / 3.0  # Corollary 1's delta' = delta/3 (spec §8 item 12)


class PrivacyPreconditionError(ValueError):
  """A precondition of a ReSQue privacy statement (Lemma 7, Props 6/8/10, Thm 3) fails."""


# =========================================================================== accounting ==

def alg4_rdp(*, T: int, n: int, beta: float, delta: float, alpha: float, rho_over_r: float,
             constants: str = "explicit", c_priv: float = 60.0) -> tuple[float, dict]:
  """RDP charge ``alpha * tau`` of one Alg. 3/4 call (Lemma 7) and its preconditions.

  Returns ``(eps_rdp, conditions)``; ``conditions`` maps a condition's text to whether it
  holds. ``explicit`` uses the proof constants (spec 002 §4 items 2-5):
  ``tau = 13 s^2 tau0``, ``s = 1.2 T/n``, ``tau0 = 6000 beta^2 log^2(2/delta)``.
  """
  check_int(T, "T")
  check_int(n, "n")
  check_positive(beta, "beta")
  check_delta(delta, "delta")
  check_positive(alpha, "alpha")
  if constants == "explicit":
    tau0 = 6000.0 * beta ** 2 * math.log(2.0 / delta) ** 2
    s = 1.2 * T / n
    tau = 13.0 * s * s * tau0
    cond = {
        "T/n <= 1/60 (Lemma 6)": T / n <= 1.0 / 60.0,
        "s = 1.2T/n < 1/40 (Prop. 7)": s < 1.0 / 40.0,
        "tau0 = 6000 beta^2 log^2(2/delta) <= 1/3 (Prop. 7)": tau0 <= 1.0 / 3.0,
        "alpha < 3/tau0 (Prop. 7)": alpha < 3.0 / tau0,
        "delta < 1/6 (Lemma 7)": delta < 1.0 / 6.0,
        "rho/r >= 1728 log^2(log2 T/delta) (Lemma 5)":
            rho_over_r >= 1728.0 * math.log(max(math.log2(max(T, 2)), 1.0) / delta) ** 2,
    }
  elif constants == "c_priv":
    lg = math.log(1.0 / delta)
    tau = c_priv * (beta * lg * T / n) ** 2
    cond = {
        "T/n <= 1/C_priv": T / n <= 1.0 / c_priv,
        "beta^2 log^2(1/delta) <= 1/C_priv": beta ** 2 * lg ** 2 <= 1.0 / c_priv,
        "alpha < 1/(C_priv beta^2 log^2(1/delta))": alpha < 1.0 / (c_priv * beta ** 2 * lg ** 2),
        "delta < 1/6": delta < 1.0 / 6.0,
        "rho/r >= C_priv log^2(log2 T/delta)":
            rho_over_r >= c_priv * math.log(max(math.log2(max(T, 2)), 1.0) / delta) ** 2,
        "C_priv is the paper's unspecified universal constant (not a proof constant)": False,
    }
  else:
    raise ValueError(f"constants must be 'explicit' or 'c_priv', got {constants!r}")
  return alpha * tau, cond


# ============================================================ Alg. 3 / 4 (localized SGD) ==

@dataclasses.dataclass(frozen=True)
class Alg4Plan:
  """Static schedule of one Alg. 3/4 call: ``T^ = 2^floor(log2 T)``, phase lengths
  ``T^/2^i`` (i = 1..log2 T^), ``eta = (r'/L) min(1/sqrt(T), beta/sqrt(d))``,
  ``eta_i = 4^-i eta``, ``sigma_i = L eta_i / beta``."""
  t_hat: int
  lengths: tuple[int, ...]
  etas: tuple[float, ...]
  sigmas: tuple[float, ...]


def alg4_plan(T: int, *, r_prime: float, lipschitz: float, beta: float, d: int) -> Alg4Plan:
  check_int(T, "T", minimum=2)
  t_hat = 2 ** int(math.floor(math.log2(T)))
  k = int(math.log2(t_hat))
  eta = (r_prime / lipschitz) * min(1.0 / math.sqrt(T), beta / math.sqrt(d))
  lengths = tuple(t_hat // 2 ** i for i in range(1, k + 1))
  etas = tuple(eta / 4 ** i for i in range(1, k + 1))
  sigmas = tuple(lipschitz * e / beta for e in etas)
  return Alg4Plan(t_hat, lengths, etas, sigmas)


def phase_average(y0: PyTree, center: PyTree, reg_center: PyTree, xis: PyTree, grads: PyTree,
                  *, eta: float | jax.Array, lam: float | jax.Array, radius: float | jax.Array,
                  rho: float | jax.Array) -> tuple[PyTree, PyTree]:
  """One phase of Alg. 3/4: ``y_j = argmin_{B_xbar(r)} eta <w(y_{j-1}) g_j, y>
  + 1/2 |y - y_{j-1}|^2 + eta lam/2 |y - c|^2`` over the given queries; returns
  ``(ybar, y_last)`` (``ybar`` = mean of ``y_1..y_T``, the released quantity before noise).

  ``grads`` must be taken at ``center + xis`` (ReSQue contract). ``c = reg_center`` (the
  regularization center; Alg. 4 has ``c = xbar``; localization adds a second quadratic).
  """
  def body(carry, q):
    y, acc = carry
    xi, g = q
    est = reweight(y, center, jax.tree.map(lambda a: a[None], xi),
                   jax.tree.map(lambda a: a[None], g), rho)
    denom = 1.0 + eta * lam
    u = jax.tree.map(lambda yi, ci, gi: (yi + eta * lam * ci - eta * gi) / denom, y, reg_center,
                     est)
    y = project_l2_ball(u, radius, center)
    return (y, jax.tree.map(jnp.add, acc, y)), None

  steps = jax.tree.leaves(xis)[0].shape[0]
  (y, acc), _ = jax.lax.scan(body, (y0, jax.tree.map(jnp.zeros_like, y0)), (xis, grads))
  return jax.tree.map(lambda a: a / steps, acc), y


def draw_queries(key: jax.Array, loss_fn: Callable, items: PyTree, center: PyTree,
                 rho: float | jax.Array, num: int) -> tuple[jax.Array, PyTree, PyTree]:
  """``num`` indices ``z ~ Unif[n]`` WITH replacement, offsets ``xi ~ N(0, rho^2 I)`` and the
  gradients ``grad f^{z}(center + xi)`` — one batched round (the queries do not depend on the
  iterates, spec 002 §3.5 [IMPL])."""
  n = jax.tree.leaves(items)[0].shape[0]
  kz, kx = jax.random.split(key)
  z = jax.random.randint(kz, (num,), 0, n)
  xis, _ = sample_queries(kx, center, rho, num)
  batch = jax.tree.map(lambda a: a[z], items)
  return z, xis, per_example_grads(loss_fn, center, batch, offsets=xis)


@lru_cache(maxsize=None)
def _alg4_compiled(loss_fn: Callable, lengths: tuple[int, ...]):
  @jax.jit
  def run(items, center, reg_center, lam, x0, key, etas, sigmas, radius, rho):
    kq, kn = jax.random.split(key)
    _, xis, grads = draw_queries(kq, loss_fn, items, center, rho, sum(lengths))
    x = x0
    off = 0
    for i, t_i in enumerate(lengths):
      sl = jax.tree.map(lambda a: a[off:off + t_i], (xis, grads))
      ybar, _ = phase_average(x, center, reg_center, sl[0], sl[1], eta=etas[i], lam=lam,
                              radius=radius, rho=rho)
      noise = tree_gaussian_like(jax.random.fold_in(kn, i), ybar, sigmas[i])
      x = jax.tree.map(jnp.add, ybar, noise)  # Gaussian output perturbation (Alg. 3 line 11)
      off += t_i
    return project_l2_ball(x, radius, center)  # post-processing (spec §3.5 [AMBIG])
  return run


def localized_resque_sgd(loss_fn: Callable, items: PyTree, center: PyTree, key: jax.Array, *,
                         T: int, radius: float, rho: float, beta: float, lipschitz: float,
                         lam: float = 0.0, r_prime: float | None = None,
                         x0: PyTree | None = None, reg_center: PyTree | None = None
                         ) -> tuple[PyTree, Alg4Plan]:
  """Alg. 3 (``lam = 0``) / Alg. 4: private localized ReSQue SGD in ``B_center(radius)``.

  Uses ``T^ - 1 <= T`` gradients. Privacy: see :func:`alg4_rdp` (the caller charges the
  ledger BEFORE calling). ``r_prime`` (default ``radius``) is Alg. 4's distance bound
  ``E|x0 - x*|^2 <= r'^2``; ``reg_center`` defaults to ``center``.
  """
  r_prime = radius if r_prime is None else r_prime
  d = sum(int(np.prod(jnp.shape(a))) for a in jax.tree.leaves(center))
  plan = alg4_plan(T, r_prime=r_prime, lipschitz=lipschitz, beta=beta, d=d)
  run = _alg4_compiled(loss_fn, plan.lengths)
  x = run(items, center, center if reg_center is None else reg_center, jnp.float32(lam),
          center if x0 is None else x0, key, jnp.asarray(plan.etas, jnp.float32),
          jnp.asarray(plan.sigmas, jnp.float32), jnp.float32(radius), jnp.float32(rho))
  return x, plan


# ================================================================ Alg. 5 (strongly convex) ==

def alg5_schedule(T: int, *, beta: float, lam: float, lipschitz: float, radius: float, d: int,
                  c_cvx: float = 16.0) -> list[dict]:
  """Eq. (28): ``k = ceil(log2 log2 T)``; call ``i`` (0-based) uses
  ``beta_i = 2^((k-i)/2) beta``, ``T_i = 2^(i-k) T`` (floored, >= 2) and
  ``r_i = min(2r, sqrt(2 D_i / lam))`` with ``E_i = (2 C_cvx^2 L^2/lam)(sqrt(d)/(beta_i T_i)
  + 1/sqrt(T_i))^2``, ``D_0 = 2L^2/lam``, ``D_i = 4 E_i (2L^2/(lam 4 E_0))^(1/2^i)``."""
  check_int(T, "T", minimum=4)
  k = max(1, int(math.ceil(math.log2(math.log2(T)))))
  out = []
  e0 = None
  for i in range(k):
    b_i = 2 ** ((k - i) / 2) * beta
    t_i = max(2, int(T * 2.0 ** (i - k)))
    e_i = (2 * c_cvx ** 2 * lipschitz ** 2 / lam) * (math.sqrt(d) / (b_i * t_i)
                                                     + 1 / math.sqrt(t_i)) ** 2
    e0 = e_i if e0 is None else e0
    d_i = 2 * lipschitz ** 2 / lam if i == 0 else \
        4 * e_i * (2 * lipschitz ** 2 / (lam * 4 * e0)) ** (1 / 2 ** i)
    out.append({"beta": b_i, "T": t_i, "r_prime": min(2 * radius, math.sqrt(2 * d_i / lam))})
  return out


def strongly_convex_resque(loss_fn: Callable, items: PyTree, center: PyTree, key: jax.Array, *,
                           T: int, radius: float, rho: float, beta: float, lam: float,
                           lipschitz: float, reg_center: PyTree | None = None,
                           charge: Callable[[int, float, str], None] | None = None,
                           c_cvx: float = 16.0) -> PyTree:
  """Alg. 5: ``k`` warm-started calls of Alg. 4 (returns ``x_k``; spec §8 item 8).

  ``charge(T_i, beta_i, label)`` is called before each Alg. 4 call (ledger). Its total privacy
  cost is a geometric sum in ``beta_i^2 T_i^2`` ending at ``beta^2 T^2 / 2`` (Prop. 8)."""
  d = sum(int(np.prod(jnp.shape(a))) for a in jax.tree.leaves(center))
  x = center
  for i, call in enumerate(alg5_schedule(T, beta=beta, lam=lam, lipschitz=lipschitz,
                                         radius=radius, d=d, c_cvx=c_cvx)):
    if charge is not None:
      charge(call["T"], call["beta"], f"alg5[{i}]")
    x, _ = localized_resque_sgd(loss_fn, items, center, jax.random.fold_in(key, i), T=call["T"],
                                radius=radius, rho=rho, beta=call["beta"], lipschitz=lipschitz,
                                lam=lam, r_prime=call["r_prime"], x0=x, reg_center=reg_center)
  return x


# ===================================================================== Alg. 6 (MLMC) ==

def mlmc_prox_estimator(loss_fn: Callable, items: PyTree, center: PyTree, key: jax.Array, *,
                        T: int, j_max: int, copies: int, radius: float, rho: float, beta: float,
                        lam: float, lipschitz: float, reg_center: PyTree | None = None,
                        charge: Callable | None = None, level_beta_scaling: str = "paper",
                        js: list[int] | None = None) -> PyTree:
  """Alg. 6: ``xhat = mean_k [x_0 + 2^J (x_J - x_{J-1})]``, ``J ~ Geom(1/2)`` per copy,
  level ``j`` = Alg. 5 with ``(2^(-j/2) beta, 2^j T)`` (``level_beta_scaling="paper"``) or
  ``(beta, 2^j T)`` (``"none"``, the §3.8 bias question). Telescoping gives
  ``E xhat = E x_{j_max}``. ``js`` may pre-draw the J's (they are data independent)."""
  check_int(j_max, "j_max")
  check_int(copies, "copies")
  scale = (lambda j: 2 ** (-j / 2)) if level_beta_scaling == "paper" else (lambda j: 1.0)
  if js is None:
    js = [int(v) for v in jax.random.geometric(jax.random.fold_in(key, 10_000), 0.5, (copies,))]
  acc = None
  copy_keys = jax.random.split(key, len(js))
  for c, j in enumerate(js):
    kc = copy_keys[c]
    kw = dict(radius=radius, rho=rho, lam=lam, lipschitz=lipschitz, reg_center=reg_center,
              charge=charge)
    x0 = strongly_convex_resque(loss_fn, items, center, jax.random.fold_in(kc, 0), T=T,
                                beta=beta, **kw)
    est = x0
    if j <= j_max:
      xj = strongly_convex_resque(loss_fn, items, center, jax.random.fold_in(kc, 1),
                                  T=2 ** j * T, beta=scale(j) * beta, **kw)
      xj1 = strongly_convex_resque(loss_fn, items, center, jax.random.fold_in(kc, 2),
                                   T=2 ** (j - 1) * T, beta=scale(j - 1) * beta, **kw)
      est = jax.tree.map(lambda a, b, e: e + 2 ** j * (a - b), xj, xj1, x0)
    acc = est if acc is None else jax.tree.map(jnp.add, acc, est)
  return jax.tree.map(lambda a: a / len(js), acc)


# ============================================================== Alg. 7 (high probability) ==

def high_probability_solver(loss_fn: Callable, items: PyTree, center: PyTree, key: jax.Array,
                            *, runs: int, T: int, radius: float, rho: float, beta: float,
                            lam: float, lipschitz: float, reg_center: PyTree | None = None,
                            charge: Callable | None = None, c_sc: float = 8192.0,
                            delta_agg: float | None = None) -> PyTree:
  """Alg. 7: ``runs`` (paper ``ceil(20 log(1/zeta))``) independent Alg. 5 runs, then
  Aggregate with ``Delta = 9 sqrt(2 C_sc) (L/lam) (d/(beta^2 T^2) + 1/T)^(1/2)`` (or
  ``delta_agg``). Lemma 11: the output is within ``Delta`` of ``x*`` when >= 51% of the runs
  are within ``Delta/3`` (Markov + Chernoff, Prop. 10)."""
  check_int(runs, "runs")
  d = sum(int(np.prod(jnp.shape(a))) for a in jax.tree.leaves(center))
  pts = [strongly_convex_resque(loss_fn, items, center, jax.random.fold_in(key, i), T=T,
                                radius=radius, rho=rho, beta=beta, lam=lam, lipschitz=lipschitz,
                                reg_center=reg_center, charge=charge) for i in range(runs)]
  if runs == 1:
    return pts[0]
  if delta_agg is None:
    delta_agg = 9 * math.sqrt(2 * c_sc) * (lipschitz / lam) * math.sqrt(d / (beta * T) ** 2 + 1 / T)
  return ba.majority_aggregate(jax.tree.map(lambda *a: jnp.stack(a), *pts), delta_agg)


# ========================================================== parameters (Theorem 3, eq. (30)) ==

def theorem3_params(*, n: int, d: int, epsilon: float, delta: float, lipschitz: float = 1.0,
                    radius: float = 1.0, C: float = 1.0, c_ba: float = 1.0) -> dict:
  """Eqs. (30)-(34) (ceilings added, spec §8 item 12). ``C`` and ``c_ba`` are the paper's
  unspecified universal constants."""
  check_int(n, "n")
  check_int(d, "d")
  eps, dl = check_epsilon(epsilon), check_delta(delta)
  L, R = lipschitz, radius
  lnd = math.log(n / dl)
  eps_opt = C * L * R * (1 / math.sqrt(n) + math.sqrt(d * math.log(1 / dl)) * lnd ** 1.5
                         * math.log(n) / (n * eps))
  kappa = L * R / eps_opt
  rho = eps_opt / (L * math.sqrt(d))
  r = rho / (math.sqrt(C) * lnd ** 2)
  alpha = 4 * math.log(2 / dl) / eps
  beta = eps / (C * lnd * math.sqrt(math.log(1 / dl)))
  K = (R / r) ** (2 / 3)
  lk = math.log(max(kappa, math.e))
  lam_star = eps_opt * K ** 2 * lk ** 2 / R ** 2
  t1 = math.sqrt(C) * (kappa * math.sqrt(d) / (math.sqrt(K) * beta * lk ** 2)
                       + kappa ** 2 / (K * lk ** 3 * lnd))
  t2 = math.sqrt(C) * (kappa * math.sqrt(d) / (math.sqrt(K) * beta * math.sqrt(lk))
                       + kappa ** 2 / (K * lk))
  t3 = math.sqrt(C) * (kappa * math.sqrt(d) / (math.sqrt(K) * beta) + kappa ** 2 / K)
  zeta = 1 / (kappa * c_ba * K * lk)
  return {"eps_opt": eps_opt, "kappa": kappa, "rho": rho, "r": r, "alpha": alpha, "beta": beta,
          "K": K, "lam_star": lam_star, "T1": int(math.ceil(t1)), "T2": int(math.ceil(t2)),
          "T3": int(math.ceil(t3)), "zeta": zeta, "iterations": int(math.ceil(c_ba * K * lk))}


def check_theorem3_preconditions(p: dict, *, n: int, epsilon: float, delta: float,
                                 c_priv: float = 60.0) -> None:
  """Raises :class:`PrivacyPreconditionError` naming the first violated condition of
  Theorem 3 / Props 6-10 for the parameters of :func:`theorem3_params`."""
  checks = [
      ("epsilon < 1 (Theorem 3)", epsilon < 1),
      ("delta < 1/6 (Theorem 3)", delta < 1 / 6),
      ("eps_opt <= L R (Prop. 1: kappa >= 1)", p["kappa"] >= 1),
      ("T1 <= n / C_priv (Prop. 10)", p["T1"] <= n / c_priv),
      ("T2 <= n / C_priv (Prop. 8)", p["T2"] <= n / c_priv),
      ("T3 <= n / (2 C_priv) (Alg. 6 input)", p["T3"] <= n / (2 * c_priv)),
      ("beta^2 log^2(log log n / delta) <= 1/C_priv (Lemma 10)",
       p["beta"] ** 2 * math.log(max(math.log(max(math.log(n), 1.0)), 1e-9) / delta) ** 2
       <= 1 / c_priv),
      ("rho/r >= C_priv log^2(log T / delta) (Lemma 5)",
       p["rho"] / p["r"] >= c_priv * math.log(math.log(max(p["T3"], 3)) / delta) ** 2),
  ]
  for name, ok in checks:
    if not ok:
      raise PrivacyPreconditionError(f"theory preset: precondition violated: {name}")


# ============================================================ private ERM / SCO drivers ==

def _pow2_floor(x: float) -> int:
  return 2 ** max(2, int(math.floor(math.log2(max(x, 4)))))


@dataclasses.dataclass
class _PrivateERMConfig:
  T_ls: int
  T_bo: int
  T_sp: int
  runs_ls: int
  mlmc_copies: int
  j_max: int
  max_iter: int
  max_bisection: int
  rho: float
  r: float
  eps_opt: float
  c_ba: float


def private_erm(loss_fn: Callable, items: PyTree, x_init: PyTree, key: jax.Array, *,
                cfg: _PrivateERMConfig, beta: float, lipschitz: float, R: float,
                reg_lam: float = 0.0, reg_center: PyTree | None = None,
                ball_center: PyTree | None = None,
                charge: Callable[[int, float, str], None] | None = None) -> tuple[PyTree, dict]:
  """Theorem 3 / Corollary 3: ball acceleration on ``F = f^erm_rho + reg_lam/2 |x - c|^2`` over
  ``B_R(ball_center)`` with O_ls = Alg. 7, O_bo = Alg. 5, O_sp = Alg. 6.

  Each oracle solves ``min_{B_y(r)} F(x) + lam/2 |x - y|^2``: the two quadratics merge into
  ``(lam + reg_lam)/2 |x - c'|^2 + const`` with ``c' = (lam y + reg_lam c)/(lam + reg_lam)``
  (Alg. 4's composite step with its regularization center at ``c'``).
  """
  r, rho = cfg.r, cfg.rho
  reg_center = x_init if reg_center is None else reg_center
  ball_center = x_init if ball_center is None else ball_center

  def merged(y, lam):
    lt = lam + reg_lam
    c = jax.tree.map(lambda yi, ci: (lam * yi + reg_lam * ci) / lt, y, reg_center)
    return lt, c

  def ls_oracle(k, y, lam, phi):
    lt, c = merged(y, lam)
    x = high_probability_solver(loss_fn, items, y, k, runs=cfg.runs_ls, T=cfg.T_ls, radius=r,
                                rho=rho, beta=beta, lam=lt, lipschitz=lipschitz, reg_center=c,
                                charge=charge)
    return x, ba.OracleCost(1, 0)

  def bo_oracle(k, y, lam, phi):
    lt, c = merged(y, lam)
    x = strongly_convex_resque(loss_fn, items, y, k, T=cfg.T_bo, radius=r, rho=rho, beta=beta,
                               lam=lt, lipschitz=lipschitz, reg_center=c, charge=charge)
    return x, ba.OracleCost(1, 0)

  def sp_oracle(k, y, lam):
    lt, c = merged(y, lam)
    return mlmc_prox_estimator(loss_fn, items, y, k, T=cfg.T_sp, j_max=cfg.j_max,
                               copies=cfg.mlmc_copies, radius=r, rho=rho, beta=beta, lam=lt,
                               lipschitz=lipschitz, reg_center=c, charge=charge)

  # ReSQue Prop. 1's lam_star/C_ba exceeds CJJS21's lam_max = 2L/r when kappa is small (the
  # log^2 kappa factor); practical deviation: cap lam_min at lam_max/8.
  lam_star = ba.resque_accel_params(lipschitz, r, R, cfg.eps_opt)["lam_star"] / cfg.c_ba
  lam_min = min(lam_star, 2.0 * lipschitz / r / 8.0)
  res = ba.ball_acceleration(bo_oracle, x_init, key, R=R, r=r, eps=cfg.eps_opt,
                             lipschitz=lipschitz, c_ba=cfg.c_ba, lam_min=lam_min,
                             max_iter=cfg.max_iter,
                             max_bisection=cfg.max_bisection, ls_oracle=ls_oracle,
                             prox_oracle=sp_oracle, center=ball_center)
  return res.x, {"iterations": res.iterations, "oracle_calls": res.oracle_calls,
                 "exit": res.exit}


def _plan_charges(cfg: _PrivateERMConfig, *, beta: float, lam_dummy: float, d: int,
                  radius: float, lipschitz: float) -> list[tuple[int, float]]:
  """All ``(T, beta)`` Alg. 4 calls one private ERM may make (worst case: every iteration
  uses ``max_bisection + 3`` line searches — the bisection's bound on distinct ``lam`` — and
  the MLMC draws its deepest level). The ledger still refuses any call beyond the budget."""
  def alg5_calls(T, b):
    return [(c["T"], c["beta"]) for c in alg5_schedule(T, beta=b, lam=lam_dummy,
                                                         lipschitz=lipschitz, radius=radius, d=d)]
  per_iter = []
  per_iter += alg5_calls(cfg.T_ls, beta) * cfg.runs_ls * (cfg.max_bisection + 3)
  per_iter += alg5_calls(cfg.T_bo, beta)
  for _ in range(cfg.mlmc_copies):
    per_iter += alg5_calls(cfg.T_sp, beta)
    j = cfg.j_max  # worst level: 2^j T at 2^{-j/2} beta has the largest beta^2 T^2
    per_iter += alg5_calls(2 ** j * cfg.T_sp, 2 ** (-j / 2) * beta)
    per_iter += alg5_calls(2 ** (j - 1) * cfg.T_sp, 2 ** (-(j - 1) / 2) * beta)
  return per_iter * cfg.max_iter


def _items(problem) -> dict:
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), problem.data)


def _cfg(cfg: dict, name: str, default: Any) -> Any:
  v = cfg.get(name, default)
  return default if v is None else v


ACCOUNTANT_DELTA_SHARE = 1e-3  # the ledger's own delta (no accountant events here)


def _approx_rdp_events(plan, *, n: int, beta: float, delta_call: float, alpha: float,
                       delta_prime: float, ratio: float, constants: str, c_priv: float) -> list:
  """The planned Alg. 4 calls as :class:`ApproxRdpEvent` s (Lemma 7) at noise level ``beta``."""
  return [ApproxRdpEvent(alpha, alg4_rdp(T=t, n=n, beta=b * beta, delta=delta_call,
                                         alpha=alpha, rho_over_r=ratio, constants=constants,
                                         c_priv=c_priv)[0], delta_call, delta_prime)
          for t, b in plan]


def _phase_plan(cfg: dict, *, n_i: int, i: int, eps_i: float, delta_i: float, d: int, L: float,
                R: float, eta_loc: float, ratio: float, constants: str, c_priv: float) -> dict:
  """Data-free plan of localization phase ``i``: the ERM schedule, the worst-case list of
  Alg. 4 calls, ``alpha``, the per-call slack and ``beta`` calibrated by the library's one
  calibrator so that the plan's approximate-RDP events meet ``eps_i`` (``beta = 1 / z``)."""
  lam_i = 1.0 / ((eta_loc / 4 ** i) * n_i)
  eps_opt = check_positive(_cfg(cfg, "eps_opt_scale", 1.0), "eps_opt_scale") * L * R * (
      1 / math.sqrt(n_i) + math.sqrt(d) / (n_i * eps_i))
  eps_opt = min(eps_opt, 0.5 * L * R)
  if cfg.get("rho") is not None:  # practical override of eq. (30)'s rho = eps_opt/(L sqrt d)
    eps_opt = check_positive(cfg["rho"], "rho") * L * math.sqrt(d)
  rho = eps_opt / (L * math.sqrt(d))
  r = rho / ratio
  t_cap = _pow2_floor(_cfg(cfg, "T_frac", 0.25) * n_i)
  erm = _PrivateERMConfig(
      T_ls=t_cap, T_bo=t_cap, T_sp=max(4, t_cap // 4),
      runs_ls=check_int(_cfg(cfg, "runs_ls", 1), "runs_ls"),
      mlmc_copies=check_int(_cfg(cfg, "mlmc_copies", 1), "mlmc_copies"),
      j_max=2, max_iter=check_int(_cfg(cfg, "max_iter", 20), "max_iter"),
      max_bisection=check_int(_cfg(cfg, "max_bisection", 2), "max_bisection"),
      rho=rho, r=r, eps_opt=eps_opt, c_ba=1.0)
  alpha = 4 * math.log(2 / delta_i) / eps_i
  delta_prime = delta_i * DELTA_PRIME_FRAC
  if eps_i - math.log(1 / delta_prime) / (alpha - 1) <= 0:
    raise ValueError(f"epsilon too small for the Corollary 1 conversion at alpha={alpha:.3g} "
                     f"in phase {i}")
  plan = _plan_charges(erm, beta=1.0, lam_dummy=1.0, d=d, radius=r, lipschitz=L)
  # (1 - 1e-9): keep the float sum of the per-call slacks at or below the target delta
  delta_call = delta_i * (1 - DELTA_PRIME_FRAC) / (1 + math.exp(eps_i)) / len(plan) * (1 - 1e-9)
  kw = dict(n=n_i, delta_call=delta_call, alpha=alpha, delta_prime=delta_prime, ratio=ratio,
            constants=constants, c_priv=c_priv)
  z = calibrate_noise_multiplier(lambda z: _approx_rdp_events(plan, beta=1.0 / z, **kw),
                                 epsilon=eps_i, delta=delta_i, relation=RELATION, lower=1e-3)
  return {"erm": erm, "plan": plan, "beta": 1.0 / z, "lam": lam_i, "alpha": alpha,
          "delta_prime": delta_prime, "delta_call": delta_call, "t_cap": t_cap, "kw": kw}


def _run_phase(problem, batch, x, key, p: dict, *, i: int, eps_i: float, delta_i: float,
               L: float, R: float, ratio: float, constants: str, c_priv: float):
  """Runs phase ``i``; a per-phase guard ledger spends every REALIZED call before it runs and
  refuses one beyond ``(eps_i, delta_i)`` (the plan already covers the worst case)."""
  guard = PrivacyLedger(delta=delta_i, epsilon_budget=eps_i, relation=RELATION)
  counter = {"grads": 0, "calls": 0}
  violations: dict[str, int] = {}

  def charge(T, b, label):
    e, cond = alg4_rdp(T=T, n=p["kw"]["n"], beta=b, delta=p["delta_call"], alpha=p["alpha"],
                       rho_over_r=ratio, constants=constants, c_priv=c_priv)
    event = ApproxRdpEvent(p["alpha"], e, p["delta_call"], p["delta_prime"])
    trial = copy.deepcopy(guard).compose(event, label=label)
    if trial.extra_delta() > delta_i * (1 + 1e-9):
      raise PrivacyBudgetExceeded(f"{label}: delta would exceed {delta_i:.3g}; not run")
    guard.spend(event, label=label)  # raises before the call runs
    counter["grads"] += 2 ** int(math.floor(math.log2(T))) - 1
    counter["calls"] += 1
    for name, ok in cond.items():
      if not ok:
        violations[name] = violations.get(name, 0) + 1

  x, info = private_erm(problem.loss_fn, batch, x, key, cfg=p["erm"], beta=p["beta"],
                        lipschitz=L, R=R, reg_lam=p["lam"], reg_center=x,
                        ball_center=problem.init_params(), charge=charge)
  debug = {"alg4_calls": counter["calls"], "gradients": counter["grads"],
           "realized_epsilon": guard.epsilon(), "violations": violations, **info}
  return x, debug


def _phase_sizes(n: int, phases: int) -> list[int]:
  """Prop. 11 [EXT] reconstruction: disjoint batches ``n_i = n/2^i`` (the last takes the rest;
  ``n`` is public under replace-one)."""
  sizes = [n // 2 ** i for i in range(1, phases + 1)]
  sizes[-1] = n - sum(sizes[:-1])
  return sizes


def resque_private_sco(problem, cfg: dict, key: jax.Array) -> Result:
  """Private SCO (Theorem 4): phased localization (Prop. 11) of private ERM (Theorem 3).

  Item level, replace-one only (``relation``; public: ``n``, the config). Config keys:
  ``epsilon, delta, preset ("practical"|"theory"), constants ("explicit"|"c_priv"), c_priv,
  phases, phase_budget ("paper"|"parallel"), rho_over_r, eps_opt_scale, rho, max_iter,
  max_bisection, runs_ls, mlmc_copies, T_frac, debug``. Accounting: every planned Alg. 4 call
  is an :class:`ApproxRdpEvent` on one :class:`PrivacyLedger` (``epsilon_budget=epsilon``),
  spent phase by phase BEFORE the phase runs; the ledger sums them (Lemma 3) and converts
  once per phase (Corollary 1); ``parallel`` phases are ledger groups (disjoint data).
  """
  check_relation(cfg.get("relation", RELATION), supported=(RELATION,),
                 mechanism="ReSQue private SCO")
  eps = check_epsilon(cfg["epsilon"])
  delta = check_delta(cfg["delta"])
  preset = check_choice(_cfg(cfg, "preset", "practical"), "preset", ("practical", "theory"))
  items = _items(problem)
  n = int(jax.tree.leaves(items)[0].shape[0])
  d, L, R = problem.d, float(problem.lipschitz), float(problem.radius)
  constants = check_choice(_cfg(cfg, "constants", "explicit"), "constants",
                           ("explicit", "c_priv"))
  c_priv = check_positive(_cfg(cfg, "c_priv", 60.0 if preset == "theory" else 1.0), "c_priv")
  if preset == "theory":
    p = theorem3_params(n=n, d=d, epsilon=eps, delta=delta, lipschitz=L, radius=R,
                        C=check_positive(_cfg(cfg, "C", 1.0), "C"),
                        c_ba=check_positive(_cfg(cfg, "c_ba", 1.0), "c_ba"))
    check_theorem3_preconditions(p, n=n, epsilon=eps, delta=delta, c_priv=c_priv)
    # Unreachable at CPU scale; a run would need n far beyond memory.
    raise PrivacyPreconditionError("theory preset: parameters valid but the run would need "
                                   f"{p['iterations']} accelerated iterations; not run here")
  phases = check_int(_cfg(cfg, "phases", 2), "phases")
  parallel = check_choice(_cfg(cfg, "phase_budget", "paper"), "phase_budget",
                          ("paper", "parallel")) == "parallel"
  ratio = check_positive(_cfg(cfg, "rho_over_r", 4.0), "rho_over_r")
  delta_blocks = delta * (1 - ACCOUNTANT_DELTA_SHARE)
  ledger = PrivacyLedger(delta=delta * ACCOUNTANT_DELTA_SHARE, epsilon_budget=eps,
                         relation=RELATION)
  eta_loc = (R / L) * min(1 / math.sqrt(n), eps / math.sqrt(d * math.log(1 / delta)))
  common = dict(ratio=ratio, constants=constants, c_priv=c_priv)
  x, off, grads_planned = problem.init_params(), 0, 0
  plan_violations: set[str] = set()
  phase_records, debug_phases = [], []
  for i, n_i in enumerate(_phase_sizes(n, phases), start=1):
    batch = jax.tree.map(lambda a: a[off:off + n_i], items)
    off += n_i
    # paper: eps/2^i, delta/2^i (the last phase takes the remainder, so the sum is eps)
    share = 2.0 ** -min(i, phases - 1) if i == phases else 2.0 ** -i
    eps_i, delta_i = (eps, delta_blocks) if parallel else (eps * share, delta_blocks * share)
    p = _phase_plan(cfg, n_i=n_i, i=i, eps_i=eps_i, delta_i=delta_i, d=d, L=L, R=R,
                    eta_loc=eta_loc, **common)
    for t, b in p["plan"]:  # preconditions of the planned (data-independent) calls
      _, cond = alg4_rdp(T=t, n=n_i, beta=b * p["beta"], delta=p["delta_call"],
                         alpha=p["alpha"], rho_over_r=ratio, constants=constants, c_priv=c_priv)
      plan_violations.update(name for name, ok in cond.items() if not ok)
    for ev in _approx_rdp_events(p["plan"], beta=p["beta"], **p["kw"]):  # before the phase
      ledger.spend(ev, label=f"phase {i}: Alg. 4 call", group=f"phase {i}" if parallel else None)
    x, dbg = _run_phase(problem, batch, x, jax.random.fold_in(key, i), p, i=i, eps_i=eps_i,
                        delta_i=delta_i, L=L, R=R, **common)
    planned = sum(2 ** int(math.floor(math.log2(t))) - 1 for t, _ in p["plan"])
    grads_planned += planned
    phase_records.append({"n": n_i, "eps": eps_i, "beta": p["beta"], "lam": p["lam"],
                          "r": p["erm"].r, "rho": p["erm"].rho, "alpha": p["alpha"],
                          "T": p["t_cap"], "planned_alg4_calls": len(p["plan"]),
                          "planned_gradients": planned, "max_iter": p["erm"].max_iter})
    debug_phases.append(dbg)
  theorem = constants == "explicit" and not plan_violations
  notes = ("approximate RDP (Lemma 3) of Alg. 3/4 output perturbation with high-probability "
           f"sensitivity (Lemma 5/7, constants={constants}); Corollary 1 conversion in the "
           f"ledger; localization phases composed per '{'parallel' if parallel else 'paper'}'; "
           "replace-one, n public. ")
  if not theorem:
    notes += "HEURISTIC: violated " + "; ".join(sorted(plan_violations))
  report = ledger.report(provenance="theorem" if theorem else "heuristic", level="item",
                         mechanisms=("gaussian_output_perturbation",
                                     "subsampling_with_replacement"),
                         paper_epsilon=eps, notes=notes)
  debug = ({"phases": debug_phases, "gradients": sum(p["gradients"] for p in debug_phases)}
           if cfg.get("debug") else None)
  # gradient_evaluations: the data-independent worst-case plan (the realized count depends on
  # the data through the bisection and is only in debug)
  return Result(params=x, privacy=report, gradient_evaluations=int(grads_planned),
                record={"phases": phase_records, "preset": preset, "constants": constants},
                debug=debug)


# ============================================================== parallel SCO (Theorem 1) ==

def _target(problem, cfg: dict) -> float:
  """``target`` if given, else ``target_frac`` (default 0.1) x the excess risk of the initial
  point (the population excess of the planted problems shrinks like sqrt(2/(pi d)))."""
  if cfg.get("target") is not None:
    return check_positive(cfg["target"], "target")
  frac = check_positive(_cfg(cfg, "target_frac", 0.1), "target_frac")
  return frac * problem.excess_risk(problem.init_params())


def resque_parallel_sco(problem, cfg: dict, key: jax.Array) -> Result:
  """Theorem 1 (non-private): ball acceleration + EpochSGD/ReSQue ball oracles on
  ``f^_rho``, ``r = rho = eps_opt/(sqrt(d) L)``. Records the query depth (batched rounds) and
  total queries when the (population) excess risk first reaches ``target`` (evaluated off-line
  on the trajectory: an experiment diagnostic, not something the algorithm uses).

  Config keys: ``target`` / ``target_frac`` (see :func:`_target`), ``eps_opt`` (default
  ``target``), ``c_ba``,
  ``lam_min_scale``, ``max_iter``, ``oracle ("epoch_sgd"|"acsa")``, ``ls_runs``, ``c_phi``.
  """
  items = _items(problem)
  d, L, R = problem.d, float(problem.lipschitz), float(problem.radius)
  target = _target(problem, cfg)
  eps_opt = check_positive(_cfg(cfg, "eps_opt", target), "eps_opt")
  c_ba = check_positive(_cfg(cfg, "c_ba", 1.0), "c_ba")
  r = rho = eps_opt / (math.sqrt(d) * L)
  gorc = ba.dataset_oracle(problem.loss_fn, items)
  kind = check_choice(_cfg(cfg, "oracle", "epoch_sgd"), "oracle", ("epoch_sgd", "acsa"))
  if kind == "epoch_sgd":
    oracle = ba.make_epoch_sgd_oracle(gorc, radius=r, rho=rho, lipschitz=L,
                                      runs=check_int(_cfg(cfg, "ls_runs", 1), "ls_runs"))
  else:
    oracle = ba.make_acsa_oracle(gorc, radius=r, rho=rho, lipschitz=L)
  p = ba.resque_accel_params(L, r, R, eps_opt)
  lam_min = p["lam_star"] * check_positive(_cfg(cfg, "lam_min_scale", 1.0), "lam_min_scale")
  c_phi = check_positive(_cfg(cfg, "c_phi", 1.0), "c_phi")
  logk3 = math.log(max(p["kappa"], math.e)) ** 3
  max_iter = _cfg(cfg, "max_iter", None)
  risks = []
  res = ba.ball_acceleration(oracle, problem.init_params(), key, R=R, r=r, eps=eps_opt,
                             lipschitz=L, lam_min=lam_min, c_ba=c_ba, max_iter=max_iter,
                             bo_phi=lambda lam: lam * r * r / (c_phi * logk3),
                             callback=lambda t, x: risks.append(problem.excess_risk(x)))
  hit = next((i for i, v in enumerate(risks) if v <= target), None)
  rec = {"d": d, "r": r, "rho": rho, "K": p["K"], "kappa": p["kappa"], "lam_star": p["lam_star"],
         "iterations": res.iterations, "query_depth": res.rounds, "total_queries": res.queries,
         "exit": res.exit, "target": target, "final_excess": risks[-1] if risks else None,
         "depth_to_target": res.history[hit]["rounds"] if hit is not None else None,
         "queries_to_target": res.history[hit]["queries"] if hit is not None else None,
         "iterations_to_target": hit + 1 if hit is not None else None}
  report = PrivacyReport(epsilon=math.inf, delta=1.0 - 1e-12, provenance="none",
                         level="none", notes="non-private (parallel SCO, Theorem 1)")
  return Result(params=res.x, privacy=report, gradient_evaluations=int(res.queries), record=rec)


def minibatch_sgd(problem, cfg: dict, key: jax.Array) -> Result:
  """Parallel baseline: projected minibatch SGD (core ``projected_sgd`` with uniform
  averaging), ``lr = R/(L sqrt(steps))``, batch ``batch`` drawn with replacement. Query depth =
  steps; records the first step whose averaged iterate has excess risk ``<= target``
  (evaluated every ``eval_every`` steps). Non-private."""
  items = _items(problem)
  n = int(jax.tree.leaves(items)[0].shape[0])
  L, R = float(problem.lipschitz), float(problem.radius)
  steps = check_int(_cfg(cfg, "steps", 20000), "steps")
  batch = check_int(_cfg(cfg, "batch", 64), "batch")
  every = check_int(_cfg(cfg, "eval_every", 100), "eval_every")
  target = _target(problem, cfg)
  lr = check_positive(_cfg(cfg, "lr", R / (L * math.sqrt(steps))), "lr")
  tx = projected_sgd(lr, radius=R, averaging="uniform")
  loss_fn = problem.loss_fn

  @jax.jit
  def chunk(params, state, k):
    def body(carry, kk):
      p, s = carry
      z = jax.random.randint(kk, (batch,), 0, n)
      g = per_example_grads(loss_fn, p, jax.tree.map(lambda a: a[z], items))
      g = jax.tree.map(lambda a: jnp.mean(a, axis=0), g)
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None
    (params, state), _ = jax.lax.scan(body, (params, state), jax.random.split(k, every))
    return params, state

  params = problem.init_params()
  state = tx.init(params)
  hit = None
  for c in range(steps // every):
    params, state = chunk(params, state, jax.random.fold_in(key, c))
    if hit is None and problem.excess_risk(state.released) <= target:
      hit = (c + 1) * every
  out = state.released
  rec = {"steps": steps, "batch": batch, "lr": lr, "target": target,
         "final_excess": problem.excess_risk(out), "query_depth": steps,
         "total_queries": steps * batch, "depth_to_target": hit,
         "queries_to_target": hit * batch if hit is not None else None}
  report = PrivacyReport(epsilon=math.inf, delta=1.0 - 1e-12, provenance="none",
                         level="none", notes="non-private minibatch SGD (parallel baseline)")
  return Result(params=out, privacy=report, gradient_evaluations=steps * batch, record=rec)


ALGORITHMS = {
    "resque_parallel_sco": resque_parallel_sco,
    "resque_private_sco": resque_private_sco,
    "minibatch_sgd": minibatch_sgd,
}
