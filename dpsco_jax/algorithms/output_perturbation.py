"""User-level output perturbation via local deletion sensitivity (paper 001).

Ghazi, Kamath, Kumar, Manurangsi, Meka, Zhang, "On User-Level Private Convex Optimization",
ICML 2023 (arXiv 2305.04912). Spec: ``shared/specs/001_ghazi_user_level.md`` (formula tags
[V]/[R]/[A] refer to it).

Algorithms (all user-level, replace-one neighbours):

* ``sc_output_pert`` — SCOutputPert (Alg. 2) = DelOutputPert (Alg. 1) around the minimizer of a
  mu-strongly convex ERM, with the App. C certificate as fast path and the exact stability test
  as fallback (:mod:`dpsco_jax.algorithms.deletion_stability`). (eps, delta) by Thm 3.3.
* ``phased_erm_output_pert`` — Phased-ERM (Alg. 3), convex loss, ``T = ceil(log2(nm))`` calls of
  SCOutputPert at ``(eps/T, delta/T)`` on prox-regularised objectives, projected anchors.
* ``phased_sco_output_pert`` — Phased-SCO (Alg. 4), disjoint user blocks ``(n/2^i, n/2^{i-1}]``,
  each phase at the full (eps, delta) (parallel composition), lambda of spec §7 item 6.
* ``sc_erm_output_pert`` / ``sc_sco_output_pert`` — the strongly convex reductions (Algs 5–6):
  SCOutputPert at (eps/2, delta/2) for a warm start, then Phased-ERM / Phased-SCO at
  (eps/2, delta/2) with lambda from the localization radius R'.
* ``naive_output_pert`` — the baseline: ``θ*(x) + N(0, σ² I)`` with replace-one sensitivity
  ``2G/(μ n)`` (+ the solver's a-priori error), which does not improve with ``m``.

**Where the paper beats the baseline (spec §5).** Both noises scale like ``1/(μ n)``, so
their ratio does not depend on ``n``: ``σ_paper/σ_naive ≈ 8κ · Δ·μn/(2G) · c(ε', δ')/c(ε, δ)``
with ``Δ·μn/G ≈ 10 sqrt((4κ+1) ln n)/√m`` (Alg. 2) or ``≈ 2(4κ+1)γ/G`` (certificate,
``γ ∝ 1/√m``), i.e. ``≈ κ^{1.5..2} sqrt(log(n/β)) / √m``. The paper's mechanism wins only for
``m`` beyond :func:`crossover_m`: at ``ε = 1, δ = 1e-6, n = 10^4`` (theory preset) ``m ≈ 9·10^9``
with Alg. 2's Δ and ``≈ 8·10^12`` with the App. C certificate (the spec's §5 table, with
``G_eff = G``, gives 2·10^9 and 2·10^12); at ``ε = 4, δ = 1e-5`` (practical preset)
``m ≈ 2·10^8`` / ``6·10^9``. That regime is **not reachable** here (``n·m`` items must fit in
memory, and ``n >= 2(4κ+1)``); the experiment shows instead that the ratio falls like
``1/√m`` while the naive baseline is flat in ``m``.

**The solver** (f of Alg. 1) is an optax chain ``add_prox_to_anchor(λ) -> acsa(L, μ, ball K,
restarts)`` run for a data-independent number of iterations that certifies accuracy ``τ`` on
every sub-dataset (multi-stage AC-SA halves the gap per stage of ``N0 = ceil(sqrt(8L/μ))``
iterations: ``||x_k - x*|| <= D 2^{-k/2}``, EXT spec A.3(a)). It works in displacement
coordinates ``u = θ - anchor`` (the released value is ``anchor + u + noise``, post-processing),
so float32 resolves the tiny late-phase displacements of Phased-ERM. f starts from the public
anchor for every sub-dataset: Thm 3.3 needs f to be a function of the sub-dataset alone.

**Deviations** (each documented where it happens): kappa rounded up (Def. 3.4, §7.1); the
constants of Alg. 2 (line 2) and the certificate are the explicit ones of spec §2.3/§2.4 with
inexact-solver and constrained-K terms (§3.3(b), §3.4); ``T`` uses log2 with ceil/floor (§7.3);
anchors are projected onto K and each phase solves over K (its ball K_i is inactive, §2.5);
Phased-SCO/Alg. 6 use ``λ = (G/R) max{√d/(n√m), 1/√(nm)}`` (§7.6); outputs are projected onto
K (post-processing); ⊥ inside the phased algorithms keeps the previous anchor (§7.9); smooth
losses only (the certified solver needs a finite smoothness; the paper needs none).

**Presets.** ``theory``: paper formulas — Dwork–Roth Gaussian ``sqrt(2 ln(2/δ'))·8κΔ/ε'``,
γ from Lemma 3.8 (``10 G sqrt(ln(n/β)/m)``), and the paper's preconditions (``ε <= 1``,
``δ <= 1/2``, ``n >= 2(4κ+1)`` per call, ``β < 1/e``). ``practical``: analytic Gaussian
calibration (Balle–Wang; valid for every ε) and a Hoeffding-type
``γ = 2G(1 + sqrt(2 ln(n/β)))/√m``. The threshold γ never affects privacy (the test with any
data-independent Δ is DP, Thm 3.3); it trades certificate failures against noise.

**Provenance.** ``theorem`` whenever every DelOutputPert call can fall back to the exact test
(``n <= max_exact_users`` users per call): the released value is exactly Alg. 1's output.
With ``on_certificate_failure="raise"`` (needed beyond ~20 users) a failed certificate aborts
the run, a data-dependent event outside any proof: provenance ``heuristic``.

**Privacy diagnostics.** R1, |S|, the certificate flag and norms live only in ``Result.debug``
(``cfg["debug"] = True``); ⊥ flags and σ, Δ, κ are part of the released output / public.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
import optax

from dpsco_jax._checks import (check_choice, check_delta, check_epsilon, check_int,
                               check_positive, check_probability)
from dpsco_jax.algorithms import deletion_stability as ds
from dpsco_jax.grads import per_user_grads
from dpsco_jax.privacy import discrete_laplace as tdl
from dpsco_jax.privacy.ledger import (PrivacyBudgetExceeded, PrivacyLedger, PrivacyReport,
                                      Provenance)
from dpsco_jax.privacy.mechanisms import gaussian_sigma_analytic, gaussian_sigma_classic
from dpsco_jax.problems import SCOProblem
from dpsco_jax.result import Result
from dpsco_jax.transforms.steps import (acsa, add_prox_to_anchor, project_l2_ball,
                                        released_params)

PRESETS = ("theory", "practical")

# ------------------------------------------------------------------------------------------
# Settings.


@dataclasses.dataclass(frozen=True)
class OutputPertSettings:
  """Validated options shared by every algorithm of this module (see module docstring)."""
  preset: str = "practical"
  stability_test: str = "certificate"        # "certificate" (App. C) | "exact" (Alg. 1 as is)
  on_certificate_failure: str = "exact"      # "exact" | "raise" (heuristic provenance)
  max_exact_users: int = 16
  solver_tol: float = 0.05                   # solver error as a fraction of Δ
  beta: float | None = None                  # failure probability (default per algorithm)
  Delta: float | None = None                 # exact mode: explicit Δ (practical preset only)
  epsilon_budget: float | None = None
  debug: bool = False

  @property
  def calibration(self) -> str:
    return "paper" if self.preset == "theory" else "analytic"


def settings_from_cfg(cfg: dict) -> OutputPertSettings:
  """Reads and validates the module's config keys (ValueError names the key)."""
  def get(name, default):
    v = cfg.get(name, default)
    return default if v is None else v
  preset = check_choice(get("preset", "practical"), "preset", PRESETS)
  test = check_choice(get("stability_test", "certificate"), "stability_test",
                      ("certificate", "exact"))
  fail = check_choice(get("on_certificate_failure", "exact"), "on_certificate_failure",
                      ("exact", "raise"))
  mx = check_int(get("max_exact_users", 16), "max_exact_users", minimum=1)
  if mx > 22:
    raise ValueError(f"max_exact_users must be <= 22 (2^n solves), got {mx}")
  tol = check_positive(get("solver_tol", 0.05), "solver_tol")
  if tol > 1:
    raise ValueError(f"solver_tol must be <= 1, got {tol}")
  beta = cfg.get("beta")
  if beta is not None:
    beta = check_probability(beta, "beta")
  Delta = cfg.get("Delta")
  if Delta is not None:
    Delta = check_positive(Delta, "Delta")
    if preset == "theory":
      raise ValueError("Delta: the theory preset uses Alg. 2's Δ; an explicit Delta needs "
                       "preset='practical'")
  budget = cfg.get("epsilon_budget")
  if budget is not None:
    budget = check_epsilon(budget, "epsilon_budget")
  return OutputPertSettings(preset, test, fail, mx, tol, beta, Delta, budget,
                            bool(get("debug", False)))


# ------------------------------------------------------------------------------------------
# The certified solver: an optax chain in displacement coordinates.


class SolverPlan(NamedTuple):
  """Static solver schedule with its a-priori accuracy ``tau`` on every sub-dataset."""
  smoothness: float        # L_F
  strong_convexity: float  # mu_F
  stage_length: int        # N0 >= sqrt(8 L_F / mu_F)
  stages: int              # k: ||x - x*|| <= D 2^{-k/2}
  distance: float          # D >= ||u0 - u*(y)|| for every sub-dataset y
  tau: float               # D 2^{-stages/2}

  @property
  def iterations(self) -> int:
    return self.stage_length * self.stages


def solver_plan(*, smoothness: float, strong_convexity: float, distance: float,
                tau: float) -> SolverPlan:
  """Multi-stage AC-SA (EXT A.3(a), policy ``alpha_t = 2/(t+1)``, ``gamma_t = 4L/(t(t+1))``).

  One stage of ``N0`` iterations from ``x_s``: ``F - F* <= 2 L ||x_s - x*||²/(N0(N0+1))
  <= (4L/(μ N0²)) (F(x_s) - F*)``, a halving when ``N0(N0+1) >= 8 L/μ``; the first stage gives
  ``F - F* <= μ D²/4``, so after ``k`` stages ``||x - x*||² <= 2(F-F*)/μ <= D² 2^{-k}``.
  ``N0`` is rounded up to a power of two and ``k`` to a multiple of 4 (shared compilations).
  """
  L = check_positive(smoothness, "smoothness")
  mu = check_positive(strong_convexity, "strong_convexity")
  D = check_positive(distance, "distance")
  t = check_positive(tau, "tau")
  n0 = max(2, math.ceil(math.sqrt(8.0 * L / mu)))
  n0 = 1 << (n0 - 1).bit_length()
  k = max(1, math.ceil(2.0 * math.log2(D / t))) if D > t else 1
  k = 4 * math.ceil(k / 4)
  return SolverPlan(L, mu, n0, k, D, D * 2.0 ** (-k / 2.0))


def _finite_rows(g: jax.Array) -> jax.Array:
  """NaN/Inf users contribute zero (non-negotiable 4)."""
  ok = jnp.all(jnp.isfinite(g), axis=-1, keepdims=True)
  return jnp.where(ok, g, 0.0)


def _user_grads(loss_fn, anchor, u, data, mask):
  shifted = lambda uu, ex: loss_fn(anchor + uu, ex)
  return _finite_rows(per_user_grads(shifted, u, data, user_mask=mask))


@functools.partial(jax.jit, static_argnames=("loss_fn", "lam", "plan", "radius"))
def _solve(data, mask, anchor, center_u, *, loss_fn, lam: float, plan: SolverPlan,
           radius: float):
  """``u(y) = argmin_{anchor+u in K} L(anchor+u; y) + lam/2 ||u||²`` from ``u0 = 0``.

  Chain: ``add_prox_to_anchor(lam, 0) -> acsa(L_F, mu_F, ball(center_u, R), restarts)``; the
  masked mean divides by the number of kept users (``f`` of the sub-dataset ``y``)."""
  tx = optax.chain(add_prox_to_anchor(lam, jnp.zeros_like(anchor)),
                   acsa(plan.smoothness, strong_convexity=plan.strong_convexity,
                        radius=radius, center=center_u, stage_length=plan.stage_length))
  u0 = jnp.zeros_like(anchor)
  count = jnp.maximum(jnp.sum(mask), 1).astype(anchor.dtype)

  def body(carry, _):
    u, state = carry
    g = jnp.sum(_user_grads(loss_fn, anchor, u, data, mask), axis=0) / count
    upd, state = tx.update(g, state, u)
    return (optax.apply_updates(u, upd), state), None

  (u, state), _ = jax.lax.scan(body, (u0, tx.init(u0)), None, length=plan.iterations)
  return released_params(state, u)


@functools.partial(jax.jit, static_argnames=("loss_fn", "lam", "plan", "radius", "n_users"))
def _solve_all_subsets(data, anchor, center_u, *, loss_fn, lam, plan, radius, n_users):
  """``[2^n, d]`` table of ``f(x_{-S})`` for every deletion set (exact test), chunked."""
  masks = ds.subset_keep_masks(n_users)
  one = lambda mk: _solve(data, mk, anchor, center_u, loss_fn=loss_fn, lam=lam,
                          plan=plan, radius=radius)
  return jax.lax.map(one, masks, batch_size=min(1024, masks.shape[0]))


@functools.partial(jax.jit, static_argnames=("loss_fn", "lam", "mu", "gamma", "e_max",
                                             "radius"))
def _certify(data, u, anchor, center_u, *, loss_fn, lam, mu, gamma, e_max, radius):
  n = jax.tree.leaves(data)[0].shape[0]
  g = _user_grads(loss_fn, anchor, u, data, jnp.ones((n,), bool))
  return ds.lemma_c1_certificate(g, lam * u, u, mu=mu, gamma=gamma, e_max=e_max,
                                 radius=radius, center=center_u)


# ------------------------------------------------------------------------------------------
# SCOutputPert (Alg. 2) for one strongly convex objective.


class SCInfo(NamedTuple):
  """Public description of one SCOutputPert call (data independent)."""
  epsilon: float
  delta: float
  kappa: int
  Delta: float
  sigma: float
  gamma: float
  e_max: float            # certificate threshold on the full-data residual bound
  plan: SolverPlan
  exact_feasible: bool
  gradient_evaluations: int


def gamma_threshold(*, lipschitz: float, n_users: int, m: int, beta: float, preset: str
                    ) -> float:
  """Data-independent bound on centred per-user mean gradients ``||g_i - ḡ||``.

  theory: Lemma 3.8 on centred vectors (norm <= 2G) with a union bound over ``n`` users:
  ``5 (2G) sqrt(m ln(n/β)) / m`` [R]. practical: ``2G (1 + sqrt(2 ln(n/β))) / sqrt(m)``
  (vector Hoeffding for i.i.d. items). Privacy does not depend on this choice."""
  G, n = lipschitz, n_users
  if preset == "theory":
    return 10.0 * G * math.sqrt(math.log(n / beta) / m)
  return 2.0 * G * (1.0 + math.sqrt(2.0 * math.log(n / beta))) / math.sqrt(m)


def alg2_delta(*, lipschitz: float, mu: float, n_users: int, m: int, beta: float, kappa: int
               ) -> float:
  """Alg. 2 line 2 with the explicit constant of spec §2.3 [R]:
  ``5 G_eff sqrt((4κ+1) ln n + ln(1/β)) / (μ (n - 4κ - 1) sqrt(m))``, ``G_eff = 2G``."""
  r = 4 * kappa + 1
  if n_users - r <= 0:
    raise ValueError(f"n_users={n_users} must exceed 4*kappa+1={r} for Alg. 2's Δ")
  return (5.0 * 2.0 * lipschitz * math.sqrt(r * math.log(n_users) + math.log(1.0 / beta))
          / (mu * (n_users - r) * math.sqrt(m)))


def plan_sc_output_pert(*, n_users: int, m: int, lipschitz: float, smoothness: float,
                        mu0: float, lam: float, radius: float, epsilon: float, delta: float,
                        beta: float, settings: OutputPertSettings) -> SCInfo:
  """Everything SCOutputPert needs that does not depend on the data: Δ, σ, the solver.

  certificate mode: ``Δ = Δ_stat (1 + tol)`` with ``Δ_stat = 2 r γ/(μ (n - r))`` and the solver
  accuracy and residual threshold ``τ = e_max = tol Δ_stat / 4``
  (:func:`deletion_stability.certified_sensitivity`). exact mode: Alg. 2's Δ plus ``2τ``
  (or ``settings.Delta``)."""
  p = tdl.del_output_pert_params(epsilon, delta)
  mu = mu0 + lam
  if not math.isfinite(smoothness):
    raise ValueError("smoothness: the certified solver needs a smooth loss (finite beta); "
                     "smooth the loss first")
  r = p.depth + 1
  gamma = gamma_threshold(lipschitz=lipschitz, n_users=n_users, m=m, beta=beta,
                          preset=settings.preset)
  exact_feasible = n_users <= settings.max_exact_users
  if (settings.stability_test == "certificate" and settings.on_certificate_failure == "exact"
      and not exact_feasible):
    raise ValueError(
        f"on_certificate_failure='exact' needs n_users <= max_exact_users="
        f"{settings.max_exact_users} (the exact test enumerates 2^n deletion sets), got "
        f"{n_users}; set on_certificate_failure='raise' (heuristic provenance)")
  if settings.stability_test == "certificate":
    if n_users - r <= 0 and not exact_feasible:
      raise ValueError(f"n_users={n_users} <= 4*kappa+1={r}: the certificate can never hold "
                       f"and the exact test is infeasible (min users {2 * r})")
    if n_users - r > 0:
      stat = 2.0 * r * gamma / (mu * (n_users - r))
      tau = settings.solver_tol * stat / 4.0
      Delta = ds.certified_sensitivity(n_users=n_users, depth=p.depth, gamma=gamma,
                                       e_max=tau, mu=mu, tau=tau)
    else:  # the certificate can never hold: every run takes the exact test
      if settings.Delta is None:
        raise ValueError(f"Delta: n_users={n_users} <= 4*kappa+1={r}, so neither the "
                         "certificate nor Alg. 2's Δ is defined; give an explicit Delta "
                         "(preset='practical')")
      Delta = settings.Delta
      tau = settings.solver_tol * Delta / 4.0
  else:
    if not exact_feasible:
      raise ValueError(f"stability_test='exact' needs n_users <= max_exact_users="
                       f"{settings.max_exact_users}, got {n_users}")
    base = settings.Delta if settings.Delta is not None else alg2_delta(
        lipschitz=lipschitz, mu=mu, n_users=n_users, m=m, beta=beta, kappa=p.kappa)
    tau = settings.solver_tol * base / 2.0
    Delta = base + 2.0 * tau if settings.Delta is None else base
  # a-priori distance from u0 = 0 to every sub-dataset optimum: the anchor lies in K, so
  # ||u*|| <= 2G/(2 lam + mu0) (strong convexity of the prox objective, spec §2.5), and <= 2R.
  dist = 2.0 * radius if lam + mu0 <= 0 else min(2.0 * radius,
                                                  2.0 * lipschitz / (2.0 * lam + mu0))
  plan = solver_plan(smoothness=smoothness + lam, strong_convexity=mu, distance=dist,
                     tau=tau * mu / (smoothness + lam))  # residual <= L τ_s/μ = τ
  sig = tdl.sigma(Delta, epsilon, delta, settings.calibration)
  evals = plan.iterations * n_users * m
  if settings.stability_test == "exact":
    evals *= 2 ** n_users
  return SCInfo(epsilon, delta, p.kappa, float(Delta), float(sig), float(gamma), float(tau),
                plan, exact_feasible, int(evals))


def sc_output_pert_release(loss_fn: Callable, data: Any, key: jax.Array, *, info: SCInfo,
                           lam: float, anchor: jax.Array, radius: float,
                           center: jax.Array | None, settings: OutputPertSettings
                           ) -> tuple[jax.Array, jax.Array, ds.StabilityDebug, Any]:
  """One SCOutputPert call. Returns ``(params, is_bottom, debug, certificate)``; params is the
  anchor when ⊥ (a public point), else ``anchor + u + N(0, σ²I)``."""
  n = jax.tree.leaves(data)[0].shape[0]
  anchor = jnp.asarray(anchor, jnp.float32)
  center_u = (jnp.zeros_like(anchor) if center is None else center) - anchor
  plan, mu = info.plan, info.plan.strong_convexity
  f_masked = lambda mask: _solve(data, mask, anchor, center_u, loss_fn=loss_fn, lam=float(lam),
                                 plan=plan, radius=float(radius))
  def certify(u_full):
    return _certify(data, u_full, anchor, center_u, loss_fn=loss_fn, lam=float(lam), mu=mu,
                    gamma=info.gamma, e_max=info.e_max, radius=float(radius))

  def evaluate_all():
    return _solve_all_subsets(data, anchor, center_u, loss_fn=loss_fn, lam=float(lam),
                              plan=plan, radius=float(radius), n_users=n)

  use_cert = settings.stability_test == "certificate"
  rel, dbg, cert = ds.del_output_pert(
      key, f_masked, n_users=n, Delta=info.Delta, epsilon=info.epsilon, delta=info.delta,
      sigma=info.sigma, public_point=jnp.zeros_like(anchor),
      certify=certify if use_cert and n > 4 * info.kappa + 1 else None,
      on_certificate_failure=settings.on_certificate_failure,
      max_exact_users=settings.max_exact_users, evaluate_all=evaluate_all)
  return anchor + rel.params, rel.is_bottom, dbg, cert


# ------------------------------------------------------------------------------------------
# Host-side (eps, delta) bookkeeping for theorem-level blocks.


class _ApproxDPTally:
  """Basic / parallel composition of theorem-level ``(eps, delta)`` blocks.

  The core ledger composes ``dp_accounting`` events; DelOutputPert is an (eps, delta) black
  box (Thm 3.3) that no DpEvent describes, so its calls are tallied here (basic composition
  for sequential calls, max over disjoint user groups) and checked against the budget BEFORE
  anything runs."""

  def __init__(self, budget: float | None):
    self.budget = budget
    self.entries: list[tuple[str, float, float, str | None]] = []

  def add(self, label: str, eps: float, delta: float, group: str | None = None):
    self.entries.append((label, eps, delta, group))

  def total(self) -> tuple[float, float]:
    seq = [(e, d) for _, e, d, g in self.entries if g is None]
    groups = sorted({g for *_, g in self.entries if g is not None})
    base_e, base_d = sum(e for e, _ in seq), sum(d for _, d in seq)
    if not groups:
      return base_e, base_d
    per = [(sum(e for _, e, _, gg in self.entries if gg == g),
            sum(d for _, _, d, gg in self.entries if gg == g)) for g in groups]
    return base_e + max(e for e, _ in per), base_d + max(d for _, d in per)

  def check(self):
    eps, _ = self.total()
    if self.budget is not None and eps > self.budget * (1 + 1e-9):
      raise PrivacyBudgetExceeded(f"the planned releases need epsilon={eps:.4g} > budget "
                                  f"{self.budget:.4g}; nothing was released")

  def report(self, provenance: str, *, paper_epsilon: float, notes: str) -> PrivacyReport:
    eps, delta = self.total()
    return PrivacyReport(epsilon=float(eps), delta=float(delta), provenance=provenance,
                         level="user", relation="replace_one",
                         mechanisms=tuple(e[0] for e in self.entries),
                         paper_epsilon=paper_epsilon, notes=notes)


# ------------------------------------------------------------------------------------------
# Problem plumbing.


def _problem_mu(problem: SCOProblem) -> float:
  return float(problem.meta.get("strong_convexity", 0.0)) if problem.meta else 0.0


def _check_common(cfg: dict, settings: OutputPertSettings) -> tuple[float, float]:
  eps = check_epsilon(cfg.get("epsilon"), "epsilon")
  delta = check_delta(cfg.get("delta"), "delta")
  if settings.preset == "theory":
    if eps > 1.0:
      raise ValueError(f"epsilon={eps}: the theory preset needs epsilon in (0, 1] (paper "
                       "Def. 1.1 assumptions); use preset='practical'")
    if delta > 0.5:
      raise ValueError(f"delta={delta}: the theory preset needs delta in (0, 1/2]")
  return eps, delta


def _check_min_users(n: int, eps: float, delta: float, settings: OutputPertSettings,
                     what: str):
  need = tdl.min_users(eps, delta)
  if n < need and not (settings.stability_test == "exact" or n <= settings.max_exact_users):
    raise ValueError(f"n_users: {what} needs at least 2(4 kappa + 1) = {need} users at "
                     f"(eps={eps:.4g}, delta={delta:.3g}); got {n}")
  if settings.preset == "theory" and n < need:
    raise ValueError(f"n_users: theory preset requires n >= 2(4 kappa+1) = {need} "
                     f"(Thm 3.1, n >= C log(1/delta)/eps) for {what}; got {n}")


def _provenance(settings: OutputPertSettings, infos: list[SCInfo]) -> tuple[str, str]:
  if settings.on_certificate_failure == "raise" or not all(i.exact_feasible for i in infos):
    return (Provenance.HEURISTIC.value,
            "released values are distributed exactly as DelOutputPert (Thm 3.3), but a failed "
            "certificate would have aborted the run (on_certificate_failure='raise'); that "
            "data-dependent abort is outside the guarantee")
  cal = "Dwork-Roth Gaussian" if settings.calibration == "paper" else "analytic Gaussian"
  return (Provenance.THEOREM.value,
          f"Thm 3.3 (DelOutputPert is (eps,delta)-DP for any f and data-independent Delta) "
          f"with {cal} calibration of the 8*kappa*Delta chain distance; exact fallback "
          "available for every call")


def _settings_for(cfg: dict) -> OutputPertSettings:
  s = settings_from_cfg(cfg)
  return s


def _debug_dict(dbgs: list, certs: list) -> dict:
  out = {"r1": [], "s_size": [], "certified": [], "exact_path": [], "gamma_hat": [],
         "residual": []}
  for d, c in zip(dbgs, certs):
    out["r1"].append(int(d.r1))
    out["s_size"].append(int(d.s_size))
    out["certified"].append(bool(d.certified))
    out["exact_path"].append(bool(d.exact_path))
    out["gamma_hat"].append(None if c is None else float(c.gamma_hat))
    out["residual"].append(None if c is None else float(c.residual))
  return out


def _project(theta, radius):
  return project_l2_ball(theta, radius)


# ------------------------------------------------------------------------------------------
# Runner entry points.


def sc_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """SCOutputPert (Alg. 2, Thm 3.1) on a mu-strongly convex problem (``meta['strong_convexity']``
  or ``cfg['l2']`` via the ``l2_logistic`` problem). Config: ``epsilon, delta, beta (1e-3),
  preset, stability_test, on_certificate_failure, max_exact_users, solver_tol, debug``."""
  settings = _settings_for(cfg)
  eps, delta = _check_common(cfg, settings)
  mu = _problem_mu(problem)
  if mu <= 0:
    raise ValueError("strong_convexity: sc_output_pert needs a strongly convex problem "
                     "(e.g. problem 'l2_logistic' with l2 > 0)")
  n, m = problem.n_users, problem.m
  beta = settings.beta if settings.beta is not None else 1e-3
  if settings.preset == "theory" and beta * 1.0 >= 1 / math.e:
    raise ValueError("beta must be < 1/e (Lemma 3.8)")
  _check_min_users(n, eps, delta, settings, "SCOutputPert")
  info = plan_sc_output_pert(n_users=n, m=m, lipschitz=problem.lipschitz,
                             smoothness=problem.smoothness, mu0=mu, lam=0.0,
                             radius=problem.radius, epsilon=eps, delta=delta, beta=beta,
                             settings=settings)
  tally = _ApproxDPTally(settings.epsilon_budget)
  tally.add("SCOutputPert", eps, delta)
  tally.check()
  anchor = jnp.zeros((problem.d,), jnp.float32)
  theta, bottom, dbg, cert = sc_output_pert_release(
      problem.loss_fn, problem.data, key, info=info, lam=0.0, anchor=anchor,
      radius=problem.radius, center=None, settings=settings)
  prov, notes = _provenance(settings, [info])
  return Result(params=_project(theta, problem.radius),
                privacy=tally.report(prov, paper_epsilon=eps, notes=notes),
                gradient_evaluations=info.gradient_evaluations,
                record={"is_bottom": bool(bottom), "sigma": info.sigma, "Delta": info.Delta,
                        "kappa": info.kappa, "gamma": info.gamma,
                        "solver_iterations": info.plan.iterations, "preset": settings.preset,
                        "sigma_naive": naive_sigma(problem, eps, delta, settings)},
                debug=_debug_dict([dbg], [cert]) if settings.debug else None)


def naive_sigma(problem: SCOProblem, eps: float, delta: float,
                settings: OutputPertSettings, tau: float = 0.0) -> float:
  """σ of the baseline: replace-one sensitivity ``2G/(μ n) + 2τ`` (Chaudhuri et al. 2011;
  spec §5) calibrated by the analytic (practical) or classic (theory) Gaussian mechanism."""
  mu = _problem_mu(problem)
  sens = 2.0 * problem.lipschitz / (mu * problem.n_users) + 2.0 * tau
  if settings.preset == "theory":
    return gaussian_sigma_classic(sens, eps, delta)
  return gaussian_sigma_analytic(sens, eps, delta)


def naive_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """Baseline: ``Π_K(θ̃(x) + N(0, σ²I))`` with replace-one sensitivity ``2G/(μn) + 2τ``.

  ``θ̃`` is the certified solver (accuracy ``τ = tol · 2G/(μn)/4`` a priori), so the exact
  minimizer's sensitivity bound applies up to ``2τ``. Accounted as a Gaussian event under the
  replace-one relation (``z = σ / (sens/2)``): provenance ``accountant``."""
  settings = _settings_for(cfg)
  eps, delta = _check_common(cfg, settings)
  mu = _problem_mu(problem)
  if mu <= 0:
    raise ValueError("strong_convexity: naive_output_pert needs a strongly convex problem")
  n, m = problem.n_users, problem.m
  base = 2.0 * problem.lipschitz / (mu * n)
  tau = settings.solver_tol * base / 4.0
  plan = solver_plan(smoothness=problem.smoothness, strong_convexity=mu,
                     distance=min(2 * problem.radius, 2 * problem.lipschitz / mu),
                     tau=tau)
  sigma_ = naive_sigma(problem, eps, delta, settings, tau)
  sens = base + 2.0 * tau
  ledger = PrivacyLedger(delta=delta, epsilon_budget=settings.epsilon_budget,
                         relation="replace_one")
  ledger.spend(dp_accounting.GaussianDpEvent(sigma_ / (sens / 2.0)),
               label="output perturbation (Gaussian, sens 2G/(mu n))")
  anchor = jnp.zeros((problem.d,), jnp.float32)
  u = _solve(problem.data, jnp.ones((n,), bool), anchor, -anchor, loss_fn=problem.loss_fn,
             lam=0.0, plan=plan, radius=float(problem.radius))
  z = jax.random.normal(key, u.shape, u.dtype)
  theta = _project(anchor + u + sigma_ * z, problem.radius)
  report = ledger.report(provenance=Provenance.ACCOUNTANT, level="user",
                         mechanisms=("gaussian output perturbation",), paper_epsilon=eps,
                         notes="naive user-level output perturbation; sensitivity "
                               "2G/(mu n) does not improve with m")
  return Result(params=theta, privacy=report,
                gradient_evaluations=int(plan.iterations * n * m),
                record={"sigma": sigma_, "sensitivity": sens,
                        "solver_iterations": plan.iterations, "preset": settings.preset})


# ---- phased algorithms ------------------------------------------------------------------


class _PhaseOut(NamedTuple):
  theta: jax.Array
  infos: list
  bottoms: list
  dbgs: list
  certs: list


def _phased(loss_fn, data, key, *, phases: list[tuple[float, slice]], epsilon: float,
            delta: float, beta: float, lipschitz: float, smoothness: float, mu0: float,
            radius: float, d: int, m: int, theta0: jax.Array, settings: OutputPertSettings,
            tally: _ApproxDPTally, parallel: bool, label: str) -> tuple[list, _PhaseOut]:
  """Runs the phases ``(lambda_i, user slice)``; planning (and budget check) first."""
  infos = []
  for i, (lam_i, users) in enumerate(phases):
    n_i = users.stop - users.start
    _check_min_users(n_i, epsilon, delta, settings, f"{label} phase {i + 1}")
    infos.append(plan_sc_output_pert(
        n_users=n_i, m=m, lipschitz=lipschitz, smoothness=smoothness, mu0=mu0, lam=lam_i,
        radius=radius, epsilon=epsilon, delta=delta, beta=beta, settings=settings))
    tally.add(f"{label} phase {i + 1} SCOutputPert", epsilon, delta,
              group=f"{label} block {i + 1}" if parallel else None)
  tally.check()
  theta = project_l2_ball(jnp.asarray(theta0, jnp.float32), radius)
  bottoms, dbgs, certs = [], [], []
  keys = jax.random.split(key, len(phases))
  for (lam_i, users), info, k in zip(phases, infos, keys):
    block = jax.tree.map(lambda x: x[users], data)
    out, bottom, dbg, cert = sc_output_pert_release(
        loss_fn, block, k, info=info, lam=lam_i, anchor=theta, radius=radius, center=None,
        settings=settings)
    # spec §7 items 4, 9: project the new anchor into K (post-processing); ⊥ keeps the anchor
    theta = project_l2_ball(out, radius)
    bottoms.append(bool(bottom))
    dbgs.append(dbg)
    certs.append(cert)
  return infos, _PhaseOut(theta, infos, bottoms, dbgs, certs)


def phased_erm_schedule(*, n_users: int, m: int, d: int, lipschitz: float, diameter: float,
                        epsilon: float, delta: float, beta: float | None = None,
                        lam: float | None = None) -> dict:
  """Alg. 3 parameters: ``T = ceil(log2(nm))`` (§7.3), ``(eps/T, delta/T, beta/T)``,
  ``lambda = G sqrt(d)/(R n sqrt(m))`` and ``beta = 1/(nm)`` (proof of Thm 4.1),
  ``lambda_i = lambda 4^i``, ``R_i = G/lambda_i`` (the Lipschitz constant passed is 2G)."""
  T = max(1, math.ceil(math.log2(n_users * m)))
  beta = 1.0 / (n_users * m) if beta is None else beta
  lam = lipschitz * math.sqrt(d) / (diameter * n_users * math.sqrt(m)) if lam is None else lam
  return {"T": T, "epsilon": epsilon / T, "delta": delta / T, "beta": beta / T,
          "lam": lam, "lams": [lam * 4.0 ** i for i in range(1, T + 1)],
          "radii": [lipschitz / (lam * 4.0 ** i) for i in range(1, T + 1)],
          "phase_lipschitz": 2.0 * lipschitz}


def phased_sco_schedule(*, n_users: int, m: int, d: int, lipschitz: float, diameter: float,
                        epsilon: float, delta: float, beta: float | None = None,
                        lam: float | None = None) -> dict:
  """Alg. 4 parameters: ``N0 = 2(4κ+1)`` (our explicit constant C), ``T = floor(log2(n/N0))``,
  blocks ``(n/2^i, n/2^{i-1}]``, ``lambda = (G/R) max{sqrt(d)/(n sqrt(m)), 1/sqrt(nm)}``
  (spec §7 item 6 fix), ``beta = 1/(nm)``, ``beta' = beta/T``."""
  n0 = tdl.min_users(epsilon, delta)
  if n_users < 2 * n0:
    raise ValueError(f"n_users: Phased-SCO needs n >= 2 N0 = {2 * n0} users at "
                     f"(eps={epsilon}, delta={delta}); got {n_users}")
  T = int(math.floor(math.log2(n_users / n0)))
  beta = 1.0 / (n_users * m) if beta is None else beta
  if lam is None:
    lam = (lipschitz / diameter) * max(math.sqrt(d) / (n_users * math.sqrt(m)),
                                       1.0 / math.sqrt(n_users * m))
  blocks = [slice(n_users // 2 ** i, n_users // 2 ** (i - 1)) for i in range(1, T + 1)]
  return {"T": T, "N0": n0, "beta": beta / T, "lam": lam,
          "lams": [lam * 4.0 ** i for i in range(1, T + 1)], "blocks": blocks}


def _phased_erm_run(problem, key, *, eps, delta, settings, tally, theta0, lam=None,
                    beta=None, label="Phased-ERM"):
  n, m = problem.n_users, problem.m
  sch = phased_erm_schedule(n_users=n, m=m, d=problem.d, lipschitz=problem.lipschitz,
                            diameter=2 * problem.radius, epsilon=eps, delta=delta, beta=beta,
                            lam=lam)
  phases = [(lam_i, slice(0, n)) for lam_i in sch["lams"]]
  infos, out = _phased(problem.loss_fn, problem.data, key, phases=phases,
                       epsilon=sch["epsilon"], delta=sch["delta"], beta=sch["beta"],
                       lipschitz=problem.lipschitz, smoothness=problem.smoothness,
                       mu0=_problem_mu(problem), radius=problem.radius, d=problem.d, m=m,
                       theta0=theta0, settings=settings, tally=tally, parallel=False,
                       label=label)
  return sch, out


def _phased_sco_run(problem, key, *, eps, delta, settings, tally, theta0, lam=None,
                    beta=None, label="Phased-SCO"):
  n, m = problem.n_users, problem.m
  sch = phased_sco_schedule(n_users=n, m=m, d=problem.d, lipschitz=problem.lipschitz,
                            diameter=2 * problem.radius, epsilon=eps, delta=delta, beta=beta,
                            lam=lam)
  phases = list(zip(sch["lams"], sch["blocks"]))
  infos, out = _phased(problem.loss_fn, problem.data, key, phases=phases, epsilon=eps,
                       delta=delta, beta=sch["beta"], lipschitz=problem.lipschitz,
                       smoothness=problem.smoothness, mu0=_problem_mu(problem),
                       radius=problem.radius, d=problem.d, m=m, theta0=theta0,
                       settings=settings, tally=tally, parallel=True, label=label)
  return sch, out


def _phase_record(sch: dict, out: _PhaseOut, settings: OutputPertSettings) -> dict:
  rec = {k: v for k, v in sch.items() if k in ("T", "epsilon", "delta", "beta", "lam", "N0")}
  rec.update({"sigmas": [i.sigma for i in out.infos], "Deltas": [i.Delta for i in out.infos],
              "kappa": out.infos[0].kappa if out.infos else None,
              "bottoms": out.bottoms, "preset": settings.preset,
              "solver_iterations": [i.plan.iterations for i in out.infos]})
  if "blocks" in sch:
    rec["blocks"] = [(b.start, b.stop) for b in sch["blocks"]]
  return rec


def phased_erm_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """Phased-ERM (Alg. 3, Thm 4.1): convex G-Lipschitz loss, excess empirical risk
  ``Õ(RG sqrt(d)/(n sqrt(m)))``; (eps, delta) by basic composition of T calls."""
  settings = _settings_for(cfg)
  eps, delta = _check_common(cfg, settings)
  tally = _ApproxDPTally(settings.epsilon_budget)
  sch, out = _phased_erm_run(problem, key, eps=eps, delta=delta, settings=settings,
                             tally=tally, theta0=problem.init_params(), beta=settings.beta)
  prov, notes = _provenance(settings, out.infos)
  return Result(params=out.theta, privacy=tally.report(
      prov, paper_epsilon=eps, notes=notes + "; basic composition over T phases"),
      gradient_evaluations=sum(i.gradient_evaluations for i in out.infos),
      record=_phase_record(sch, out, settings),
      debug=_debug_dict(out.dbgs, out.certs) if settings.debug else None)


def phased_sco_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """Phased-SCO (Alg. 4, Thm 5.1): disjoint user blocks, parallel composition."""
  settings = _settings_for(cfg)
  eps, delta = _check_common(cfg, settings)
  tally = _ApproxDPTally(settings.epsilon_budget)
  sch, out = _phased_sco_run(problem, key, eps=eps, delta=delta, settings=settings,
                             tally=tally, theta0=problem.init_params(), beta=settings.beta)
  prov, notes = _provenance(settings, out.infos)
  return Result(params=out.theta, privacy=tally.report(
      prov, paper_epsilon=eps, notes=notes + "; parallel composition over disjoint blocks"),
      gradient_evaluations=sum(i.gradient_evaluations for i in out.infos),
      record=_phase_record(sch, out, settings),
      debug=_debug_dict(out.dbgs, out.certs) if settings.debug else None)


def localization_radius(sigma0: float, d: int, beta: float, tau: float) -> float:
  """``R' = σ0 (sqrt(d) + sqrt(2 ln(1/β))) + τ`` — Gaussian norm concentration (explicit form of
  Alg. 5 line 4's ``C σ sqrt(d log(1/β))``) plus the solver error."""
  return sigma0 * (math.sqrt(d) + math.sqrt(2.0 * math.log(1.0 / beta))) + tau


def _sc_reduction(problem, cfg, key, *, sco: bool) -> Result:
  settings = _settings_for(cfg)
  eps, delta = _check_common(cfg, settings)
  mu = _problem_mu(problem)
  if mu <= 0:
    raise ValueError("strong_convexity: Algs 5-6 need a strongly convex problem")
  n, m, d = problem.n_users, problem.m, problem.d
  beta = settings.beta if settings.beta is not None else 1.0 / (2.0 * n * n * m)
  tally = _ApproxDPTally(settings.epsilon_budget)
  _check_min_users(n, eps / 2, delta / 2, settings, "SCOutputPert warm start")
  info0 = plan_sc_output_pert(n_users=n, m=m, lipschitz=problem.lipschitz,
                              smoothness=problem.smoothness, mu0=mu, lam=0.0,
                              radius=problem.radius, epsilon=eps / 2, delta=delta / 2,
                              beta=beta, settings=settings)
  tally.add("SCOutputPert warm start", eps / 2, delta / 2)
  r_prime = localization_radius(info0.sigma, d, beta, info0.plan.tau)
  if sco:  # Alg. 6 line 4, second term with the constant 30 of Prop. B.1
    r_prime += 30.0 * problem.lipschitz * math.sqrt(math.log(2.0 / beta)) / (mu * math.sqrt(
        n * m))
  k0, k1 = jax.random.split(key)
  # plan the second half (budget check) before releasing anything
  G = problem.lipschitz
  if sco:
    lam = (G / r_prime) * max(math.sqrt(d) / (n * math.sqrt(m)), 1.0 / math.sqrt(n * m))
  else:
    lam = G * math.sqrt(d) / (r_prime * n * math.sqrt(m))
  tally_probe = _ApproxDPTally(settings.epsilon_budget)
  tally_probe.entries = list(tally.entries) + [("second half", eps / 2, delta / 2, None)]
  tally_probe.check()
  theta0, bottom0, dbg0, cert0 = sc_output_pert_release(
      problem.loss_fn, problem.data, k0, info=info0, lam=0.0,
      anchor=jnp.zeros((d,), jnp.float32), radius=problem.radius, center=None,
      settings=settings)
  if bool(bottom0):  # spec §2.7 [A]: fixed point of K and R' = diam K (post-processing)
    theta0 = jnp.zeros((d,), jnp.float32)
    lam = G * math.sqrt(d) / (2 * problem.radius * n * math.sqrt(m)) if not sco else (
        G / (2 * problem.radius)) * max(math.sqrt(d) / (n * math.sqrt(m)),
                                        1.0 / math.sqrt(n * m))
  # K' = K ∩ B(θ0, R') is used only through ||θ0 - θ*|| <= R' and λ; phases solve over K,
  # where Lemma 4.2 holds as well (spec §2.7 deviation note in the module docstring).
  run = _phased_sco_run if sco else _phased_erm_run
  sch, out = run(problem, k1, eps=eps / 2, delta=delta / 2, settings=settings, tally=tally,
                 theta0=theta0, lam=lam, beta=beta,
                 label="Phased-SCO" if sco else "Phased-ERM")
  prov, notes = _provenance(settings, [info0] + list(out.infos))
  rec = _phase_record(sch, out, settings)
  rec.update({"R_prime": r_prime, "sigma0": info0.sigma, "bottom0": bool(bottom0)})
  return Result(params=out.theta, privacy=tally.report(
      prov, paper_epsilon=eps, notes=notes + "; two halves at (eps/2, delta/2)"),
      gradient_evaluations=info0.gradient_evaluations + sum(
          i.gradient_evaluations for i in out.infos),
      record=rec,
      debug=_debug_dict([dbg0] + out.dbgs, [cert0] + out.certs) if settings.debug else None)


def sc_erm_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """Strongly-Convex-ERM (Alg. 5, Thm 4.3): excess ``Õ(G² d/(μ n² m))``."""
  return _sc_reduction(problem, cfg, key, sco=False)


def sc_sco_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """Strongly-Convex-SCO (Alg. 6, Thm 5.3): excess ``Õ((G²/μ)(d/(n² m) + 1/(nm)))``."""
  return _sc_reduction(problem, cfg, key, sco=True)


# ------------------------------------------------------------------------------------------
# Where does the paper beat the naive baseline? (spec §5)


def noise_ratio(*, n_users: int, m: int, epsilon: float, delta: float, beta: float = 1e-3,
                preset: str = "practical", lipschitz: float = 1.0, mu: float = 1.0,
                mode: str = "certificate") -> float:
  """``σ_paper / σ_naive`` for SCOutputPert vs the baseline (both ∝ 1/(μ n)); < 1 means the
  paper's mechanism adds less noise."""
  settings = OutputPertSettings(preset=preset, stability_test="certificate",
                                max_exact_users=1)
  p = tdl.del_output_pert_params(epsilon, delta)
  r = p.depth + 1
  gamma = gamma_threshold(lipschitz=lipschitz, n_users=n_users, m=m, beta=beta, preset=preset)
  if mode == "certificate":
    Delta = 2.0 * r * gamma / (mu * (n_users - r))
  else:
    Delta = alg2_delta(lipschitz=lipschitz, mu=mu, n_users=n_users, m=m, beta=beta,
                       kappa=p.kappa)
  s_paper = tdl.sigma(Delta, epsilon, delta, settings.calibration)
  sens = 2.0 * lipschitz / (mu * n_users)
  s_naive = (gaussian_sigma_classic if preset == "theory" else gaussian_sigma_analytic)(
      sens, epsilon, delta)
  return s_paper / s_naive


def crossover_m(*, n_users: int, epsilon: float, delta: float, beta: float = 1e-3,
                preset: str = "practical", mode: str = "certificate") -> float:
  """Smallest ``m`` (bisection over log m) where the paper's σ drops below the baseline's."""
  lo, hi = 0.0, 80.0  # log10 m
  f = lambda lm: noise_ratio(n_users=n_users, m=10 ** lm, epsilon=epsilon, delta=delta,
                             beta=beta, preset=preset, mode=mode) - 1.0
  if f(hi) > 0:
    return math.inf
  for _ in range(60):
    mid = 0.5 * (lo + hi)
    if f(mid) > 0:
      lo = mid
    else:
      hi = mid
  return 10 ** hi


# ------------------------------------------------------------------------------------------
# Problem: L2-regularized logistic regression with bounded features.


def l2_logistic(cfg: dict, key: jax.Array) -> SCOProblem:
  """The core logistic problem (features on the unit sphere) plus ``(l2/2)||θ||²`` per item.

  Lipschitz on the ball of radius R: ``1 + l2 R``; smoothness ``1/4 + l2``; strong convexity
  ``l2`` (``meta['strong_convexity']``). Excess risk is measured on the *regularised*
  population risk against its minimizer (Newton's method on the evaluation set)."""
  from dpsco_jax.problems import make_problem
  l2 = check_positive(cfg.get("l2", 0.1), "l2")
  base = make_problem({**cfg, "problem": "logistic"}, key)
  R = base.radius
  loss = _l2_loss(base.loss_fn, l2)
  risk0 = base.risk_fn
  risk = jax.jit(lambda w: risk0(w) + 0.5 * l2 * jnp.sum(jnp.square(w)))
  w = _regularized_optimum(risk, jnp.asarray(base.x_opt, jnp.float32), R, 0.25 + l2)
  return dataclasses.replace(base, name="l2_logistic", loss_fn=loss,
                             lipschitz=float(base.lipschitz + l2 * R),
                             smoothness=float(base.smoothness + l2), x_opt=w, risk_fn=risk,
                             opt_risk=float(risk(w)),
                             meta={**(base.meta or {}), "strong_convexity": l2, "l2": l2})


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _regularized_optimum(risk, w0, radius, smoothness):
  """Newton's method (interior optimum) then projected gradient (active ball), jitted."""
  grad, hess = jax.grad(risk), jax.hessian(risk)
  w = jax.lax.fori_loop(0, 30, lambda _, w: w - jnp.linalg.solve(hess(w), grad(w)), w0)
  w = project_l2_ball(w, radius)
  return jax.lax.fori_loop(
      0, 300, lambda _, w: project_l2_ball(w - grad(w) / smoothness, radius), w)


@functools.lru_cache(maxsize=None)
def _l2_loss(loss_fn, l2):
  def loss(w, ex):
    return loss_fn(w, ex) + 0.5 * l2 * jnp.sum(jnp.square(w))
  return loss


ALGORITHMS = {
    "sc_output_pert": sc_output_pert,
    "naive_output_pert": naive_output_pert,
    "phased_erm_output_pert": phased_erm_output_pert,
    "phased_sco_output_pert": phased_sco_output_pert,
    "sc_erm_output_pert": sc_erm_output_pert,
    "sc_sco_output_pert": sc_sco_output_pert,
}

PROBLEMS = {"l2_logistic": l2_logistic}
