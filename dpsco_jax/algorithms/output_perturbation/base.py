"""What every paper-001 driver shares: the config's checks, SCOutputPert (Alg. 2) planned and
released, and the plan with its (eps, delta) blocks. The paper, deviations, presets and
provenance: the :mod:`.driver` docstring.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from dpsco_jax.algorithms.output_perturbation.config import OutputPertConfig
from dpsco_jax._checks import check_int, check_positive, check_probability
from dpsco_jax.algorithms.output_perturbation import deletion_stability as ds
from dpsco_jax.algorithms.common import real_rows_mask
from dpsco_jax.algorithms.declared import (conditional_note, declared_constants,
                                           declared_provenance)
from dpsco_jax.algorithms.output_perturbation.solver import (SolverPlan, certify_solution,
                                                             solve_all_subsets, solve_masked,
                                                             solver_plan)
from dpsco_jax.privacy import (ApproxDpEvent, PrivacyLedger, PrivacyReport, Provenance,
                               check_relation)
from dpsco_jax.privacy import discrete_laplace as tdl
from dpsco_jax.privacy.sensitivity import GaussianStage, Sensitivity

#: Paper 001's adjacency: replace one user's data, n and m public. The sensitivities divide by
#: the public n (Alg. 2's Delta, the certificate, the naive 2G/(mu n)) and the stability test
#: deletes users from a dataset of known size, so add/remove (private n) is refused; zero-out
#: is not analysed by the paper and is refused as well.
RELATION = "replace_one"


def settings_from_cfg(cfg: Mapping | Any, schema: type = OutputPertConfig) -> OutputPertConfig:
  """The run's config (an instance of ``schema``, unset keys at their defaults) with what its
  types do not state checked (ValueError names the key): ``max_exact_users <= 22``,
  ``solver_tol <= 1``, an explicit ``Delta`` only under the practical preset, the relation, and
  the theory preset's ranges ``epsilon <= 1``, ``delta <= 1/2`` (paper Def. 1.1)."""
  cfg = schema.of(cfg)
  unset = {f.name: f.default for f in dataclasses.fields(cfg)
           if getattr(cfg, f.name) is None and f.default is not None}
  if unset:
    cfg = dataclasses.replace(cfg, **unset)
  mx = check_int(cfg.max_exact_users, "max_exact_users", minimum=1)
  if mx > 22:
    raise ValueError(f"max_exact_users must be <= 22 (2^n solves), got {mx}")
  tol = check_positive(cfg.solver_tol, "solver_tol")
  if tol > 1:
    raise ValueError(f"solver_tol must be <= 1, got {tol}")
  if cfg.beta is not None:
    check_probability(cfg.beta, "beta")
  if cfg.Delta is not None:
    check_positive(cfg.Delta, "Delta")
    if cfg.preset == "theory":
      raise ValueError("Delta: the theory preset uses Alg. 2's Δ; an explicit Delta needs "
                       "preset='practical'")
  check_relation(cfg.relation, supported=(RELATION,),
                 mechanism="paper 001's output perturbation (sensitivities divide by the "
                           "public number of users n)")
  if cfg.preset == "theory":
    if cfg.epsilon > 1.0:
      raise ValueError(f"epsilon={cfg.epsilon}: the theory preset needs epsilon in (0, 1] "
                       "(paper Def. 1.1 assumptions); use preset='practical'")
    if cfg.delta > 0.5:
      raise ValueError(f"delta={cfg.delta}: the theory preset needs delta in (0, 1/2]")
  return cfg


def calibration(preset: str) -> str:
  """The Gaussian calibration of a preset: Dwork-Roth's (``"paper"``, theory) or analytic."""
  return "paper" if preset == "theory" else "analytic"


def block_ledger(settings: OutputPertConfig, epsilon: float, delta: float) -> PrivacyLedger:
  """A fresh ledger with the budget ``min(epsilon, epsilon_budget)``."""
  budget = settings.epsilon_budget
  return PrivacyLedger(delta=delta, epsilon_budget=epsilon if budget is None
                       else min(epsilon, float(budget)), relation=settings.relation)


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
  # the App. C certificate may decide this call (its soundness reads mu, beta and the solver
  # distance, which reads L when it is 2G/(2 lambda + mu0) rather than 2R)
  certificate: bool = False
  distance_reads_lipschitz: bool = False

  @property
  def stage(self) -> GaussianStage:
    """The call's Gaussian: ``sigma`` (calibrated at ``(eps', delta')`` by
    :func:`~dpsco_jax.privacy.discrete_laplace.sigma`, the std the run adds) on Thm 3.3's
    chain distance ``8 kappa Delta``, i.e. multiplier ``sigma / (8 kappa Delta)``."""
    dist = 8.0 * self.kappa * self.Delta
    return GaussianStage(self.sigma / dist, Sensitivity(dist, 1.0, "chain distance 8 kappa "
                                                        "Delta"), "DelOutputPert")


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
                        beta: float, settings: OutputPertConfig) -> SCInfo:
  """SCOutputPert's data-free part: Δ, σ, the solver. certificate mode: ``Δ = Δ_stat (1 +
  tol)``, ``Δ_stat = 2 r γ/(μ (n - r))``, solver accuracy and residual threshold ``τ = e_max
  = tol Δ_stat / 4`` (:func:`.deletion_stability.certified_sensitivity`). exact mode: Alg. 2's
  Δ plus ``2τ`` (or ``settings.Delta``)."""
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
  dist_l = 2.0 * lipschitz / (2.0 * lam + mu0) if lam + mu0 > 0 else math.inf
  dist, reads_l = min(2.0 * radius, dist_l), dist_l < 2.0 * radius
  plan = solver_plan(smoothness=smoothness + lam, strong_convexity=mu, distance=dist,
                     tau=tau * mu / (smoothness + lam))  # residual <= L τ_s/μ = τ
  sig = tdl.sigma(Delta, epsilon, delta, calibration(settings.preset))
  evals = plan.iterations * n_users * m
  if settings.stability_test == "exact":
    evals *= 2 ** n_users
  # sc_output_pert_release tries the certificate only in certificate mode and n > 4 kappa + 1
  cert = settings.stability_test == "certificate" and n_users > r
  return SCInfo(epsilon, delta, p.kappa, float(Delta), float(sig), float(gamma), float(tau),
                plan, exact_feasible, int(evals), cert, bool(reads_l))


def sc_output_pert_release(loss_fn: Callable, data: Any, key: jax.Array, *, info: SCInfo,
                           lam: float, anchor: jax.Array, radius: float,
                           center: jax.Array | None, settings: OutputPertConfig,
                           hook: "ReleaseHook | None" = None, mesh: Any = None
                           ) -> tuple[jax.Array, jax.Array, ds.StabilityDebug, Any]:
  """One SCOutputPert call: ``(params, is_bottom, debug, certificate)``, params the anchor
  when ⊥ (a public point), else ``anchor + u + N(0, σ²I)``. ``hook`` (audit / tests) records
  the release and may switch the Gaussian off. ``mesh``: the users are padded and sharded over
  its ``users`` axis; the padded rows are in no kept set and dropped before the certificate,
  so ``n``, the deletion sets and the release are the one-device run's."""
  n_real = None
  if mesh is not None:
    from dpsco_jax.algorithms.common import _on_mesh
    data, n_real = _on_mesh(data, mesh, "users")
  n_rows = jax.tree.leaves(data)[0].shape[0]
  n = n_rows if n_real is None else n_real
  anchor = jnp.asarray(anchor, jnp.float32)
  center_u = (jnp.zeros_like(anchor) if center is None else center) - anchor
  plan, mu = info.plan, info.plan.strong_convexity
  f_masked = lambda mask: solve_masked(data, real_rows_mask(mask, n, n_rows), anchor,
                                       center_u, loss_fn=loss_fn, lam=float(lam), plan=plan,
                                       radius=float(radius))
  def certify(u_full):
    return certify_solution(data, u_full, anchor, center_u, loss_fn=loss_fn, lam=float(lam),
                            mu=mu, gamma=info.gamma, e_max=info.e_max, radius=float(radius),
                            n_real=n_real if n_rows != n else None)

  def evaluate_all():
    return solve_all_subsets(data, anchor, center_u, loss_fn=loss_fn, lam=float(lam),
                             plan=plan, radius=float(radius), n_users=n)

  use_cert = settings.stability_test == "certificate"
  rel, dbg, cert = ds.del_output_pert(
      key, f_masked, n_users=n, Delta=info.Delta, epsilon=info.epsilon, delta=info.delta,
      sigma=info.sigma if hook is None or hook.add_noise else 0.0,
      public_point=jnp.zeros_like(anchor),
      certify=certify if use_cert and n > 4 * info.kappa + 1 else None,
      on_certificate_failure=settings.on_certificate_failure,
      max_exact_users=settings.max_exact_users, evaluate_all=evaluate_all)
  if hook is not None:
    hook.releases.append({"release": anchor + rel.params, "bottom": bool(rel.is_bottom),
                          "anchor": anchor, "sigma": info.sigma, "Delta": info.Delta})
  return anchor + rel.params, rel.is_bottom, dbg, cert


class ReleaseHook(NamedTuple):
  """Audit / test hook: collects every privatized release; ``add_noise=False`` sets σ = 0."""
  releases: list
  add_noise: bool = True


@dataclasses.dataclass(frozen=True)
class OutputPertPlan:
  """Data-free plan of a paper-001 block driver (public facts and config only).

  ``infos``: every planned DelOutputPert call, in order; ``blocks``: the ledger's ``(label,
  eps, delta, count, group)`` charges; ``schedule``: the run's public schedule (phase lambdas
  and user slices, ``R'``, Algs 5-6's second half after a ⊥ warm start, ``sigma_naive``)."""
  name: str
  settings: OutputPertConfig
  epsilon: float
  delta: float
  mu: float
  beta: float | None
  infos: tuple[SCInfo, ...]
  blocks: tuple[tuple[str, float, float, int, str | None], ...]
  schedule: dict
  how: str = ""
  #: the declared constants the guarantee rests on (``()``: none, or held by construction)
  declared: tuple[tuple[str, float], ...] = ()

  @property
  def stages(self) -> tuple[GaussianStage, ...]:
    """Every planned DelOutputPert call's Gaussian, in order (a call that outputs ⊥ adds
    none; after a ⊥ warm start Algs 5-6 run ``schedule["after_bottom"]``'s calls instead)."""
    return tuple(i.stage for i in self.infos)

  @property
  def events(self) -> tuple[ApproxDpEvent, ...]:
    """One ``ApproxDpEvent(eps_i, delta_i)`` per planned call (Thm 3.3), in order; the
    disjoint user blocks of Phased-SCO compose in parallel (``blocks``' groups)."""
    return tuple(ApproxDpEvent(eps, delta) for _, eps, delta, count, _ in self.blocks
                 for _ in range(count))

  def charge(self) -> PrivacyReport:
    """Charges every block to a fresh ledger before any release and returns the guarantee.

    DelOutputPert is an (eps, delta) black box (Thm 3.3) that no dp_accounting event
    describes: each call is an ``ApproxDpEvent`` block (basic composition; disjoint user
    blocks in parallel via ``group=``), so the report's delta is the blocks' alone. The
    provenance is the planned calls' (``declared`` in place of ``theorem`` when a certificate
    on a user's loss may decide a call: see the module docstring).

    Raises:
      PrivacyBudgetExceeded: the blocks exceed ``min(epsilon, epsilon_budget)``.
    """
    ledger = block_ledger(self.settings, self.epsilon, self.delta)
    for label, eps, delta, count, group in self.blocks:
      ledger.spend(ApproxDpEvent(eps, delta), label=label, count=count, group=group)
    prov, notes = _provenance(self.settings, list(self.infos))
    notes += self.how
    if self.declared:
      notes += "; " + conditional_note(
          self.declared, "the App. C certificate (Lemma C.1) and the solver accuracy tau need "
          "them; stability_test='exact' needs none (Thm 3.3 holds for any f)")
    return ledger.report(provenance=declared_provenance(prov, self.declared), level="user",
                         paper_epsilon=self.epsilon, notes=notes)


def certificate_constants(problem, infos, *, lipschitz: bool = False
                          ) -> tuple[tuple[str, float], ...]:
  """The declared constants the guarantee rests on: none unless a planned call may be decided
  by the App. C certificate; then mu0, beta, L when the solver distance reads it (or
  ``lipschitz=True``: Algs 5-6 after a ⊥ run other calls), and a convex loss (the prox lambda
  is strong convexity only then). ``()`` for problems that hold them by construction."""
  if not any(i.certificate for i in infos):
    return ()
  names = ["strong_convexity", "smoothness"]
  if lipschitz or any(i.certificate and i.distance_reads_lipschitz for i in infos):
    names.append("lipschitz")
  return declared_constants(problem, names, convex=True)



def _provenance(settings: OutputPertConfig, infos: list[SCInfo]) -> tuple[str, str]:
  if settings.on_certificate_failure == "raise" or not all(i.exact_feasible for i in infos):
    return (Provenance.HEURISTIC.value,
            "released values are distributed exactly as DelOutputPert (Thm 3.3), but a failed "
            "certificate would have aborted the run (on_certificate_failure='raise'); that "
            "data-dependent abort is outside the guarantee")
  cal = "Dwork-Roth Gaussian" if settings.preset == "theory" else "analytic Gaussian"
  return (Provenance.THEOREM.value,
          f"Thm 3.3 (DelOutputPert is (eps,delta)-DP for any f and data-independent Delta) "
          f"with {cal} calibration of the 8*kappa*Delta chain distance; exact fallback "
          "available for every call")


def release_debug(dbgs: list, certs: list) -> dict:
  """``Result.debug`` (``debug=True`` only, data-dependent): per call R1, |S|, the path and
  the certificate's gamma_hat and residual."""
  return {"r1": [int(d.r1) for d in dbgs], "s_size": [int(d.s_size) for d in dbgs],
          "certified": [bool(d.certified) for d in dbgs],
          "exact_path": [bool(d.exact_path) for d in dbgs],
          "gamma_hat": [None if c is None else float(c.gamma_hat) for c in certs],
          "residual": [None if c is None else float(c.residual) for c in certs]}
