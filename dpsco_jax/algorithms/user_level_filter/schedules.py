"""Pure schedule functions of paper 000 (Algorithms 1 and 3) and their two constant sets.

Everything here is host-side arithmetic on public quantities (``n, m, d, eps, delta, L, R,
beta``), never on data. ``theory`` reproduces the paper's printed formulas with
:class:`PaperConstants` and raises ``ValueError`` naming the violated precondition;
``practical`` keeps the formulas' *shape* with :class:`ScaledConstants` so the algorithms run at
laptop scale (n ~ 1e3). Deviations are listed in each function with the paper's line/equation.

Symbol renames (spec 000 §1): ``p_exp`` (phase exponent), ``q_exp`` (phase-size exponent),
``num_groups`` (C), ``tau`` (concentration radius).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from dpsco_jax._checks import (check_delta, check_epsilon, check_int, check_nonnegative,
                               check_positive)

__all__ = [
    "PaperConstants", "ScaledConstants", "PRESETS", "Alg1Phase", "Alg1Schedule",
    "Alg3Phase", "Alg3Schedule", "alg1_schedule", "alg3_schedule", "phase_sizes",
    "flip_count_bound", "certified_sensitivity", "typical_sensitivity", "good_event_failure",
    "hoeffding_tau",
]


@dataclasses.dataclass(frozen=True)
class PaperConstants:
  """Constants exactly as printed in paper 000 (Alg. 1, Alg. 2, Alg. 3)."""
  groups: float = 100.0        # Alg. 1 line 2: C = 100 log(20 n m e^eps / delta) / eps
  tau1: float = 1000.0         # Alg. 1: tau_i = 1000 eta_i L sqrt(T_i) log(ndm)
  sigma1: float = 100.0        # Alg. 1 line 25: sigma_i = 100 tau_i log^2(n/delta) / (eps C)
  laplace1: float = 20.0       # Alg. 1 line 12: Lap(20/eps)
  batch3: float = 500.0        # Alg. 3 line 4: K_i = 500 log(...) (1/eps + n_i eps/sqrt(...))
  sigma3: float = 1000.0       # Alg. 2 line 14
  tau3: float = 1.0            # Alg. 3: tau = c L log(ndm)/sqrt(m) (constant unspecified)
  threshold_fraction: float = 0.8   # 4C/5, 4K_i/5
  at_threshold: float = 8.0    # Lap(8/eps) threshold noise (Alg. 2 line 4)
  at_query: float = 16.0       # Lap(16/eps) query noise (Alg. 2 line 6)


@dataclasses.dataclass(frozen=True)
class ScaledConstants:
  """Laptop-scale constants (``practical`` preset). The privacy claim then comes from the
  ledger (accountant) with the explicit coupled sensitivity of :func:`certified_sensitivity`
  — or is labelled ``heuristic`` when the good events of Lemmas B.2/C.2 are not small enough
  at this scale (see :func:`good_event_failure`)."""
  num_phases: int = 3          # instead of floor(log2 n) tiny phases
  num_groups: int = 100        # Alg. 1: C groups
  tau1: float = 1.0            # Alg. 1: tau_i = c eta_i L sqrt(T_i log(d T_i C^2/gamma))
  laplace1_budget: float = 0.25   # Alg. 1 test spends eps/4 (the paper's booking) -> Lap(8/eps)
  tau3: float = 0.25           # Alg. 3: tau = c L sqrt(2 log(2 K T / gamma) / m)
  threshold_fraction: float = 0.8
  at_budget: float = 0.5       # AboveThreshold spends eps/2 -> Lap(8/eps), Lap(16/eps)
  steps3: float = 1.0          # T_i = c (1 + sqrt(beta/lambda_i)) log(ndm)
  p_exp: float = 1.0           # lambda_i = lambda 2^{p i}, eta_i = eta 2^{-p i}
  gamma: float = 1e-3          # failure probability inside tau (utility only)


PRESETS = ("theory", "practical")


def _warn(msg: str) -> None:
  warnings.warn(msg, stacklevel=3)


def phase_sizes(n: int, num_phases: int, q_exp: float, *, use_all: bool) -> list[int]:
  """``n_i``. Paper (Alg. 1 line 4, Alg. 3): ``floor((1 - 2^{-q}) n / 2^{i q})``, which leaves
  ``n 2^{-q}``... users unused; ``use_all=True`` (practical) renormalizes the geometric weights
  so the disjoint phases cover all ``n`` users."""
  w = [(1.0 - 2.0 ** -q_exp) / 2.0 ** (i * q_exp) for i in range(1, num_phases + 1)]
  if use_all:
    w = [x / sum(w) for x in w]
  return [int(math.floor(x * n)) for x in w]


def hoeffding_tau(lipschitz: float, m: int, num_pairs_steps: float, gamma: float,
                  scale: float = 1.0) -> float:
  """``min(L, scale * 2L sqrt(2 log(2 P/gamma)/m))``.

  With ``scale = 1``: per-user mean gradients of ``m`` items with norms ``<= L`` are within
  this of their expectation for all ``P`` (user, step) pairs w.p. ``1 - gamma`` (Pinelis'
  norm-subGaussian Hoeffding; Thm A.11 without the dimension factor). The cap at ``L`` is free:
  all per-user gradients lie in the ``L``-ball, so radius ``2L`` already covers every pair.
  ``scale < 1`` (practical) trades the worst-case constant for a smaller radius; privacy holds
  for any ``tau`` (only utility — nobody removed on i.i.d. data — depends on it)."""
  return min(lipschitz, scale * 2.0 * lipschitz
             * math.sqrt(2.0 * math.log(2.0 * num_pairs_steps / gamma) / m))


# ------------------------------------------------------------------ coupled sensitivity

def flip_count_bound(zeta: float, mean: float = 6.0) -> int:
  """Smallest ``k`` with ``P(X >= k) <= zeta`` for ``X`` a sum of independent Bernoullis of
  total mean ``<= mean`` (Chernoff: ``e^{-mu} (e mu / k)^k``).

  With common inclusion coins the kept sets of neighbouring inputs differ, besides the
  replaced point, at the ``j`` whose coin falls between ``p_j`` and ``p'_j``; since
  ``|p_j - p'_j| <= 6/K`` the count has mean ``<= 6``.
  """
  check_positive(zeta, "zeta")
  k = int(math.floor(mean)) + 1
  while -mean + k * (1.0 + math.log(mean / k)) > math.log(zeta):
    k += 1
  return k


def certified_sensitivity(degree_radius: float, num_points: int, zeta: float, *,
                          min_kept_fraction: float) -> float:
  """High-probability l2 sensitivity of the filtered mean under the coupling (Lemma B.2/C.2,
  explicit constants derived here — the paper leaves them as ``O(.)``).

  Let ``S, S'`` be the kept sets on neighbouring inputs (same coins), ``N = |S xor S'|``.
  Kept sets have diameter ``<= 2 r_h`` and share a point, so for any shared ``c``:
  ``||mean(S) - mean(S')|| <= 2 r_h N (1/|S| + 1/|S'|) <= 4 r_h N / min(|S|, |S'|)``
  (tested in ``tests/test_filtering.py``). On the good event ``min |S| >= f K``:
  ``f = 2/3`` for Alg. 1 (score at ``tau``, degree at ``2 tau``: a point with ``> 2K/3``
  ``tau``-neighbours makes them all ``2 tau``-neighbours of ``> 2K/3`` points) and ``f = 1/10``
  for Alg. 2 (``s > 7K/10`` with equal radii). ``N <= 1 + flip_count_bound(zeta)`` w.p.
  ``1 - zeta``. Requires ``N < f K`` so the kept sets overlap.
  """
  check_positive(degree_radius, "degree_radius")
  k = check_int(num_points, "num_points")
  big_n = 1 + flip_count_bound(zeta)
  s_min = min_kept_fraction * k
  if big_n >= s_min:
    raise ValueError(
        f"num_points={k} is too small for the certified coupled sensitivity: need "
        f"min_kept_fraction*K = {s_min:.1f} > 1 + flips = {big_n} (use more users per step, "
        "fewer phases, or sensitivity='typical' (heuristic))")
  return 4.0 * degree_radius * big_n / s_min


def typical_sensitivity(degree_radius: float, num_points: int) -> float:
  """``2 r_h / K``: the filtered mean's change when nobody's membership flips and the replaced
  point stays in a kept set of diameter ``2 r_h``. NOT a worst-case bound — ``heuristic``."""
  return 2.0 * check_positive(degree_radius, "degree_radius") / check_int(num_points,
                                                                          "num_points")


def good_event_failure(num_points: int, threshold_scale: float, query_scale: float,
                       steps: int, margin_fraction: float) -> float:
  """``P(not E)`` where ``E = {|xi| <= margin K} and {|v_t| <= margin K for all t}``:
  ``exp(-mK/b_thr) + T exp(-mK/b_q)`` (Lemma C.2's event with ``m = 1/20``; Alg. 1's with a
  single test and ``m = 2/15``, no threshold noise: pass ``threshold_scale=inf``)."""
  a = margin_fraction * num_points
  thr = 0.0 if math.isinf(threshold_scale) else math.exp(-a / threshold_scale)
  return min(1.0, thr + steps * math.exp(-a / query_scale))


# ------------------------------------------------------------------------ Algorithm 1

@dataclasses.dataclass(frozen=True)
class Alg1Phase:
  index: int
  n_users: int          # n_i
  users_per_group: int  # N_i
  steps: int            # T_i = N_i m (one pass)
  eta: float            # eta_i
  tau: float            # tau_i (score radius; degree radius 2 tau_i)
  sigma_paper: float    # Alg. 1 line 25


@dataclasses.dataclass(frozen=True)
class Alg1Schedule:
  preset: str
  num_groups: int       # C
  laplace_scale: float  # b of the one-shot test
  threshold: float      # 4C/5
  eta: float
  phases: tuple[Alg1Phase, ...]


def alg1_schedule(*, n: int, m: int, d: int, epsilon: float, delta: float, lipschitz: float,
                  radius: float, smoothness: float, preset: str = "practical",
                  q_exp: float | None = None, p_exp: float | None = None,
                  eta: float | None = None, num_groups: int | None = None,
                  num_phases: int | None = None,
                  constants: PaperConstants | ScaledConstants | None = None) -> Alg1Schedule:
  """Algorithm 1's schedule (Thm B.1 parameters).

  theory: ``l = floor(log2 n)``, ``C = floor(100 log(20 n m e^eps/delta)/eps)``,
  ``n_i = floor((1-2^{-q}) n / 2^{iq})``, ``N_i = floor(n_i / C)``, ``T_i = N_i m``,
  ``eta = R/(L sqrt(d m n eps))``, ``eta_i = eta 2^{-p i}`` with ``p = J + 3/2`` and
  ``m = n^J``, ``tau_i = 1000 eta_i L sqrt(T_i) log(ndm)``,
  ``sigma_i = 100 tau_i log^2(n/delta)/(eps C)``, test ``s + Lap(20/eps) >= 4C/5``.
  Raises on ``eps > 10``, the ``n^{1-q}`` condition, ``N_i < 1``.

  practical: ``num_phases`` phases covering all users, ``C = num_groups``, same ``eta``
  formula, ``eta_i = eta 2^{-p i}`` (``p = 1``), ``tau_i = c eta_i L sqrt(T_i log(d T_i C^2 /
  gamma))`` (Lemma 2.3's shape with a small constant), test ``Lap(2/(eps/4))``.
  """
  n, m, d = check_int(n, "n"), check_int(m, "m"), check_int(d, "d")
  eps, delta = check_epsilon(epsilon), check_delta(delta)
  L, R = check_positive(lipschitz, "lipschitz"), check_positive(radius, "radius")
  if preset not in PRESETS:
    raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
  eta0 = R / (L * math.sqrt(d * m * n * eps)) if eta is None else check_positive(eta, "learning_rate")
  if preset == "theory":
    c = constants or PaperConstants()
    if eps > 10:
      raise ValueError(f"epsilon <= 10 is required by Theorem 2.1/B.1, got epsilon={eps}")
    q = 0.1 if q_exp is None else check_positive(q_exp, "q_exp")
    lhs, rhs = n ** (1 - q), 100.0 / (1 - 2 ** -q) * math.log(n / delta) / eps
    if lhs < rhs:
      raise ValueError(f"Theorem B.1 needs n^(1-q_exp) >= 100 log(n/delta)/((1-2^-q) eps): "
                       f"{lhs:.4g} < {rhs:.4g} (n={n}, q_exp={q})")
    big_j = max(1.0, math.log(m) / math.log(n))
    p = big_j + 1.5 if p_exp is None else check_positive(p_exp, "p_exp")
    num_g = int(math.floor(c.groups * math.log(20 * n * m * math.exp(eps) / delta) / eps))
    l = int(math.floor(math.log2(n))) if num_phases is None else check_int(num_phases,
                                                                           "num_phases")
    sizes = phase_sizes(n, l, q, use_all=False)
    lap = c.laplace1 / eps
    if smoothness > L / R * math.sqrt(d * m * n * eps):
      _warn("Algorithm 1 needs beta <= (L/R) sqrt(d m n eps) (Lemma 2.3: eta_i <= 1/beta)")
    if delta >= 1.0 / (n * m):
      _warn("the utility theorems assume delta < 1/(n m)")
    log_ndm = math.log(n * d * m)
    too_few = (f"C={num_g} groups (Algorithm 1 line 6); n={n} is too small for the paper's "
               "constants — use preset='practical'")
  else:
    c = constants or ScaledConstants()
    q = 1.0 if q_exp is None else check_positive(q_exp, "q_exp")
    p = c.p_exp if p_exp is None else check_nonnegative(p_exp, "p_exp")
    num_g = c.num_groups if num_groups is None else check_int(num_groups, "num_groups", 2)
    l = c.num_phases if num_phases is None else check_int(num_phases, "num_phases")
    sizes = phase_sizes(n, l, q, use_all=True)
    lap = 2.0 / (c.laplace1_budget * eps)
    too_few = f"num_groups={num_g}; lower num_groups or num_phases"
  phases = []
  for i, n_i in enumerate(sizes, start=1):
    big_n = n_i // num_g
    if big_n < 1:
      raise ValueError(f"N_i >= 1 violated in phase {i}: n_i={n_i} users for {too_few}")
    t_i = big_n * m
    eta_i = eta0 / 2 ** (p * i)
    if preset == "theory":
      tau_i = c.tau1 * eta_i * L * math.sqrt(t_i) * log_ndm
      sig = c.sigma1 * tau_i * math.log(n / delta) ** 2 / (eps * num_g)
    else:   # the plan calibrates the noise: no paper sigma
      tau_i = c.tau1 * eta_i * L * math.sqrt(t_i * math.log(d * t_i * num_g ** 2 / c.gamma))
      sig = math.nan
    phases.append(Alg1Phase(i, n_i, big_n, t_i, eta_i, tau_i, sig))
  return Alg1Schedule(preset, num_g, lap, c.threshold_fraction * num_g, eta0, tuple(phases))


# ------------------------------------------------------------------------ Algorithm 3

@dataclasses.dataclass(frozen=True)
class Alg3Phase:
  index: int
  n_users: int          # n_i
  batch: int            # K_i
  steps: int            # T_i
  lam: float            # lambda_i
  stage_length: int     # multi-stage AC-SA restart length (EXT A.4: ceil(4 sqrt(2 beta'/mu)))
  sigma_paper: float    # Alg. 2 line 14


@dataclasses.dataclass(frozen=True)
class Alg3Schedule:
  preset: str
  tau: float            # filter radius is 2 tau (both score and degree)
  smoothness: float     # beta (L sqrt(d)/r when smoothed)
  smoothing_radius: float | None
  threshold_fraction: float
  threshold_scale: float  # Lap(8/eps)
  query_scale: float      # Lap(16/eps)
  lam: float
  phases: tuple[Alg3Phase, ...]


def alg3_schedule(*, n: int, m: int, d: int, epsilon: float, delta: float, lipschitz: float,
                  radius: float, smoothness: float, preset: str = "practical",
                  q_exp: float | None = None, p_exp: float | None = None,
                  lam: float | None = None, batch_size: int | None = None,
                  num_phases: int | None = None, tau: float | None = None,
                  smoothing_radius: float | None = None,
                  constants: PaperConstants | ScaledConstants | None = None,
                  lam_scale: float | None = None) -> Alg3Schedule:
  """Algorithm 3's schedule (Thm C.3; Thm D.3 when ``smoothness`` is infinite).

  theory: ``l = floor(log2 n)``, ``lambda = (L/R)(1/sqrt(nm) + sqrt(d)/(eps n sqrt(m)))``
  (Thm C.3; Thm D.3's ``1/sqrt(mn)`` gets the missing ``L/R``, spec §7 item 8),
  ``lambda_i = lambda 2^{p i}`` with ``p = 3q + 2.5 + log_n sqrt(m)``,
  ``T_i = ceil((1 + sqrt(beta/lambda_i)) log(ndm))`` (Lemma D.2, spec §7 item 7),
  ``K_i = ceil(500 log(n_i^2 m^2 e^eps/delta)(1/eps + n_i eps/sqrt(T_i log(1/delta))))``
  (line 4), ``tau = L log(ndm)/sqrt(m)``, ``sigma_i = 1000 tau sqrt(T_i)
  log(n d e^eps/delta)/(eps n_i)``. Non-smooth: ``r = sqrt(d) R/(eps n sqrt(m))``,
  ``beta = L sqrt(d)/r``. Raises on ``eps > 10``, the ``n^{1-q}`` condition, ``K_i > n_i``.

  practical: ``num_phases`` phases covering all users, ``p = 1``, ``K_i = min(n_i,
  batch_size)`` (default ``n_i``), ``T_i`` as in theory times ``steps3``,
  ``tau = hoeffding_tau`` scaled by ``tau3``; noise is calibrated by the driver. ``lam_scale``
  (practical) multiplies Thm C.3's ``lambda`` (more localization) when ``lam`` is not given.
  """
  n, m, d = check_int(n, "n"), check_int(m, "m"), check_int(d, "d")
  eps, delta = check_epsilon(epsilon), check_delta(delta)
  L, R = check_positive(lipschitz, "lipschitz"), check_positive(radius, "radius")
  if preset not in PRESETS:
    raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
  log_ndm = math.log(n * d * m)
  r_s = None
  beta = float(smoothness)
  if not math.isfinite(beta) or smoothing_radius is not None:
    r_s = (math.sqrt(d) * R / (eps * n * math.sqrt(m)) if smoothing_radius is None
           else check_positive(smoothing_radius, "smoothing_radius"))
    beta = L * math.sqrt(d) / r_s                       # Lemma D.1
  check_positive(beta, "smoothness")
  scale = 1.0 if lam_scale is None else check_positive(lam_scale, "lam_scale")
  lam0 = (scale * (L / R) * (1.0 / math.sqrt(n * m) + math.sqrt(d) / (eps * n * math.sqrt(m)))
          if lam is None else check_positive(lam, "lam"))

  if preset == "theory":   # Thm C.3 constants and preconditions (K_i the paper's)
    c = constants or PaperConstants()
    if eps > 10:
      raise ValueError(f"epsilon <= 10 is required by Theorems 3.1/C.1, got epsilon={eps}")
    q = 0.1 if q_exp is None else check_positive(q_exp, "q_exp")
    lhs = n ** (1 - q)
    rhs = 100.0 * math.log(20 * n * m * d * math.exp(eps) / delta) / (eps * (1 - 2 ** -q))
    if lhs <= rhs:
      raise ValueError(f"Theorem C.1 needs n^(1-q_exp) > 100 log(20 n m d e^eps/delta)/"
                       f"(eps (1-2^-q)): {lhs:.4g} <= {rhs:.4g} (n={n}, q_exp={q})")
    if delta >= 1.0 / (n * m):
      _warn("Theorem C.3 (utility) assumes delta < 1/(n m)")
    p = (3 * q + 2.5 + math.log(math.sqrt(m)) / math.log(n)) if p_exp is None else \
        check_positive(p_exp, "p_exp")
    l = (int(math.floor(math.log2(n))) if num_phases is None
         else check_int(num_phases, "num_phases"))
    sizes = phase_sizes(n, l, q, use_all=False)
    tau_v = c.tau3 * L * log_ndm / math.sqrt(m) if tau is None else check_positive(tau, "tau")
    b_thr, b_q = c.at_threshold / eps, c.at_query / eps
  else:   # scaled constants (the noise is calibrated by the plan: sigma_paper NaN)
    c = constants or ScaledConstants()
    q = 1.0 if q_exp is None else check_positive(q_exp, "q_exp")
    p = c.p_exp if p_exp is None else check_nonnegative(p_exp, "p_exp")
    l = c.num_phases if num_phases is None else check_int(num_phases, "num_phases")
    sizes = phase_sizes(n, l, q, use_all=True)
    b_thr, b_q = 2 * 2.0 / (c.at_budget * eps), 4 * 2.0 / (c.at_budget * eps)
  phases = []
  for i, n_i in enumerate(sizes, start=1):
    if preset == "practical" and n_i < 2:
      raise ValueError(f"phase {i} has n_i={n_i} < 2 users; lower num_phases")
    lam_i = lam0 * 2 ** (p * i)
    if preset == "theory":
      t_i = int(math.ceil((1 + math.sqrt(beta / lam_i)) * log_ndm))
      k_i = int(math.ceil(c.batch3 * math.log(n_i ** 2 * m ** 2 * math.exp(eps) / delta)
                          * (1 / eps + n_i * eps / math.sqrt(t_i * math.log(1 / delta)))))
      if k_i > n_i:
        raise ValueError(f"K_i <= n_i violated in phase {i}: K_i={k_i} > n_i={n_i} "
                         "(Theorem C.3); n is too small for the paper's constants — use "
                         "preset='practical'")
      sig = (c.sigma3 * tau_v * math.sqrt(t_i) * math.log(n * d * math.exp(eps) / delta)
             / (eps * n_i))
    else:
      t_i = max(1, int(math.ceil(c.steps3 * (1 + math.sqrt(beta / lam_i)) * log_ndm)))
      k_i = n_i if batch_size is None else min(n_i, check_int(batch_size, "batch_size", 2))
      sig = math.nan
    stage = int(math.ceil(4 * math.sqrt(2 * (beta + lam_i) / lam_i)))
    phases.append(Alg3Phase(i, n_i, k_i, t_i, lam_i, min(stage, t_i), sig))
  if preset == "practical":   # default: the radius of every (user, step) pair of the phases
    tau_v = check_positive(tau, "tau") if tau is not None else hoeffding_tau(
        L, m, max(ph.batch * ph.steps for ph in phases), c.gamma, scale=c.tau3)
  return Alg3Schedule(preset, tau_v, beta, r_s, c.threshold_fraction, b_thr, b_q, lam0,
                      tuple(phases))
