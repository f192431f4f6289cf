"""The data-free plan of paper 002's private ReSQue (``resque_private_sco``, Section 4,
Prop. 11 / Theorem 4): what :func:`dpsco_jax.plan` reads and :mod:`.private` runs.

From the config and the public ``n``, ``d``, ``L``, ``R`` only: every localization phase's ERM
schedule (``n_i = n / 2^i`` disjoint items), the WORST-CASE list of Alg. 4 calls one private
ERM may make (iteration cap, bisection cap, deepest MLMC level), ``beta = 1/z`` from the
library's one calibrator and the approximate-RDP event of every planned call (Lemma 7,
:mod:`.accounting`), all charged on a fresh ledger before anything runs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax

from dpsco_jax._checks import check_choice, check_epsilon, check_int, check_positive
from dpsco_jax.algorithms.common import required_delta
from dpsco_jax.algorithms.declared import (conditional_note, declared_constants,
                                           declared_provenance)
from dpsco_jax.algorithms.registration import Planned
from dpsco_jax.algorithms.resque.accounting import (ACCOUNTANT_DELTA_SHARE, DELTA_PRIME_FRAC,
                                                    RELATION, PrivacyPreconditionError,
                                                    approx_rdp_events, call_event,
                                                    check_theorem3_preconditions,
                                                    theorem3_params)
from dpsco_jax.algorithms.resque.solvers import alg5_schedule
from dpsco_jax.algorithms.resque.config import ResquePrivateConfig
from dpsco_jax.config.families import Schema
from dpsco_jax.data.problem import MissingConstant
from dpsco_jax.privacy.calibrate import calibrate_noise_multiplier
from dpsco_jax.privacy.events import ApproxRdpEvent
from dpsco_jax.privacy.ledger import PrivacyLedger, PrivacyReport
from dpsco_jax.privacy.relations import check_relation
from dpsco_jax.privacy.sensitivity import GaussianStage, Sensitivity


@dataclasses.dataclass
class PrivateERMConfig:
  """One phase's private-ERM schedule (Theorem 3)."""
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


def _plan_charges(cfg: PrivateERMConfig, *, beta: float, lam_dummy: float, d: int,
                  radius: float, lipschitz: float) -> list[tuple[int, float]]:
  """All ``(T, beta)`` Alg. 4 calls one private ERM may make, in the worst case: every iteration
  uses ``max_bisection + 3`` line searches and the MLMC draws its deepest level."""
  def alg5_calls(T, b):
    return [(c["T"], c["beta"]) for c in alg5_schedule(T, beta=b, lam=lam_dummy,
                                                         lipschitz=lipschitz, radius=radius, d=d)]
  per_iter = alg5_calls(cfg.T_ls, beta) * cfg.runs_ls * (cfg.max_bisection + 3)
  per_iter += alg5_calls(cfg.T_bo, beta)
  for _ in range(cfg.mlmc_copies):
    per_iter += alg5_calls(cfg.T_sp, beta)
    j = cfg.j_max  # worst level: 2^j T at 2^{-j/2} beta has the largest beta^2 T^2
    per_iter += alg5_calls(2 ** j * cfg.T_sp, 2 ** (-j / 2) * beta)
    per_iter += alg5_calls(2 ** (j - 1) * cfg.T_sp, 2 ** (-(j - 1) / 2) * beta)
  return per_iter * cfg.max_iter


def phase_plan(cfg: Mapping | Any, *, n_i: int, i: int, eps_i: float, delta_i: float, d: int,
               L: float, R: float, eta_loc: float, ratio: float, constants: str, c_priv: float,
               eps_total: float | None = None) -> dict:
  """Data-free plan of localization phase ``i``: the ERM schedule, the worst-case Alg. 4 calls,
  ``alpha``, the per-call slack and ``beta = 1/z`` calibrated so the calls' events meet
  ``eps_i``. Phases with equal ``(alpha, delta')`` merge into one Lemma 3 block converted at
  the SUM of their epsilons, so ``delta_call`` is sized with ``e^eps_total`` (``eps_total``,
  default ``eps_i``) to keep ``delta' + (1 + e^eps) sum(delta_call)`` within the budget."""
  cfg = ResquePrivateConfig.of(cfg)
  lam_i = 1.0 / ((eta_loc / 4 ** i) * n_i)
  eps_opt = check_positive(cfg.eps_opt_scale, "eps_opt_scale") * L * R * (
      1 / math.sqrt(n_i) + math.sqrt(d) / (n_i * eps_i))
  eps_opt = min(eps_opt, 0.5 * L * R)
  if cfg.rho is not None:  # practical override of eq. (30)'s rho = eps_opt/(L sqrt d)
    eps_opt = check_positive(cfg.rho, "rho") * L * math.sqrt(d)
  rho = eps_opt / (L * math.sqrt(d))
  r = rho / ratio
  t_cap = 2 ** int(math.floor(math.log2(max(cfg.T_frac * n_i, 4))))   # a power of 2, >= 4
  erm = PrivateERMConfig(
      T_ls=t_cap, T_bo=t_cap, T_sp=max(4, t_cap // 4),
      runs_ls=check_int(cfg.runs_ls, "runs_ls"),
      mlmc_copies=check_int(cfg.mlmc_copies, "mlmc_copies"),
      j_max=2, max_iter=check_int(cfg.max_iter, "max_iter"),
      max_bisection=check_int(cfg.max_bisection, "max_bisection"),
      rho=rho, r=r, eps_opt=eps_opt, c_ba=1.0)
  alpha = 4 * math.log(2 / delta_i) / eps_i
  delta_prime = delta_i * DELTA_PRIME_FRAC
  if eps_i - math.log(1 / delta_prime) / (alpha - 1) <= 0:
    raise ValueError(f"epsilon too small for the Corollary 1 conversion at alpha={alpha:.3g} "
                     f"in phase {i}")
  plan = _plan_charges(erm, beta=1.0, lam_dummy=1.0, d=d, radius=r, lipschitz=L)
  # (1 - 1e-9): keep the float sum of the per-call slacks at or below the target delta
  eps_conv = eps_i if eps_total is None else max(eps_i, eps_total)
  delta_call = (delta_i * (1 - DELTA_PRIME_FRAC) / (1 + math.exp(eps_conv)) / len(plan)
                * (1 - 1e-9))
  kw = dict(n=n_i, delta_call=delta_call, alpha=alpha, delta_prime=delta_prime, ratio=ratio,
            constants=constants, c_priv=c_priv)
  z = calibrate_noise_multiplier(lambda z: approx_rdp_events(plan, beta=1.0 / z, **kw),
                                 epsilon=eps_i, delta=delta_i, relation=RELATION, lower=1e-3,
                                 key=("resque_approx_rdp", tuple(plan), tuple(sorted(kw.items()))))
  return {"erm": erm, "plan": plan, "beta": 1.0 / z, "lam": lam_i, "alpha": alpha,
          "delta_prime": delta_prime, "delta_call": delta_call, "t_cap": t_cap, "kw": kw}


def _phase_sizes(n: int, phases: int) -> list[int]:
  """Prop. 11 [EXT]: disjoint batches ``n_i = n/2^i``, the last takes the rest."""
  sizes = [n // 2 ** i for i in range(1, phases + 1)]
  sizes[-1] = n - sum(sizes[:-1])
  return sizes


@dataclasses.dataclass(frozen=True)
class PhasePlan:
  """Plan of localization phase ``index`` (1-based) over ``n`` items: budget ``(eps, delta)``,
  ``p`` (:func:`phase_plan`'s dict) and the planned calls' approximate-RDP ``events``."""
  index: int
  n: int
  eps: float
  delta: float
  p: dict
  events: tuple[ApproxRdpEvent, ...]

  @property
  def gradients(self) -> int:
    """Worst-case gradient count: ``T^ - 1`` per planned Alg. 4 call."""
    return sum(2 ** int(math.floor(math.log2(t))) - 1 for t, _ in self.p["plan"])

  @property
  def planned_calls(self) -> int:
    return len(self.p["plan"])


@dataclasses.dataclass(frozen=True)
class ResquePrivatePlan:
  """Everything :func:`resque_private_sco` will do and spend, from the config and the public
  ``n``, ``d``, ``L``, ``R`` only (identical for replace-one neighbours)."""
  epsilon: float
  delta: float
  n: int
  lipschitz: float
  radius: float
  preset: str
  constants: str
  c_priv: float
  ratio: float
  parallel: bool
  phases: tuple[PhasePlan, ...]
  violations: tuple[str, ...]  # preconditions some planned call violates (sorted)
  #: the declared constants Lemma 5's drift bound rests on (``()``: held by construction)
  declared: tuple[tuple[str, float], ...] = ()

  @property
  def provenance(self) -> str:
    base = "theorem" if self.constants == "explicit" and not self.violations else "heuristic"
    return declared_provenance(base, self.declared)

  @property
  def num_steps(self) -> int:
    """The planned Alg. 4 calls of every phase (progress reports): the worst case the ledger is
    charged with; the realized calls depend on the data."""
    return sum(ph.planned_calls for ph in self.phases)

  @property
  def stages(self) -> tuple[GaussianStage, ...]:
    """One stage per localization phase: ``z = 1/beta`` on the unit ``L`` (Alg. 4's noise
    ``sigma_i = L eta_i / beta`` scales it by its step ``eta_i``; the approximate-RDP events
    price it, Lemma 5/7)."""
    unit = Sensitivity(self.lipschitz, 1.0, "L per unit Alg. 4 step eta_i")
    return tuple(GaussianStage(1.0 / ph.p["beta"], unit, f"phase {ph.index}")
                 for ph in self.phases)

  @property
  def events(self) -> tuple[ApproxRdpEvent, ...]:
    return tuple(ev for ph in self.phases for ev in ph.events)

  def charge(self) -> PrivacyReport:
    """Charges a fresh ledger with every planned Alg. 4 call before anything runs (raises
    :class:`PrivacyBudgetExceeded` first over ``epsilon``); returns the guarantee (item level)."""
    ledger = PrivacyLedger(delta=self.delta * ACCOUNTANT_DELTA_SHARE,
                           epsilon_budget=self.epsilon, relation=RELATION)
    for ph in self.phases:
      for ev in ph.events:
        ledger.spend(ev, label=f"phase {ph.index}: Alg. 4 call",
                     group=f"phase {ph.index}" if self.parallel else None)
    notes = ("approximate RDP (Lemma 3) of Alg. 3/4 output perturbation with high-probability "
             f"sensitivity (Lemma 5/7, constants={self.constants}); Corollary 1 conversion in "
             "the ledger; localization phases composed per "
             f"'{'parallel' if self.parallel else 'paper'}'; replace-one, n public. ")
    if self.provenance == "heuristic":
      notes += "HEURISTIC: violated " + "; ".join(self.violations)
    if self.declared:
      notes += ("; " if self.provenance == "heuristic" else "") + conditional_note(
          self.declared, "Lemma 5's drift bound and sigma_i = L eta_i / beta need every "
          "gradient norm <= L and a convex loss (eq. (18))")
    return ledger.report(provenance=self.provenance, level="item",
                         mechanisms=("gaussian_output_perturbation",
                                     "subsampling_with_replacement"),
                         paper_epsilon=self.epsilon, notes=notes)


def _theory_refusal(cfg: Schema, *, n: int, d: int, eps: float, delta: float, L: float,
                    R: float, c_priv: float) -> PrivacyPreconditionError:
  """The ``theory`` preset: raises naming the first violated precondition of eq. (30)-(34) /
  Theorem 3; valid parameters are still refused (unreachable at CPU scale)."""
  p = theorem3_params(n=n, d=d, epsilon=eps, delta=delta, lipschitz=L, radius=R,
                      C=check_positive(cfg.C, "C"), c_ba=check_positive(cfg.c_ba, "c_ba"))
  check_theorem3_preconditions(p, n=n, epsilon=eps, delta=delta, c_priv=c_priv)
  return PrivacyPreconditionError("theory preset: parameters valid but the run would need "
                                  f"{p['iterations']} accelerated iterations; not run here")


def resque_private_plan(problem, cfg: Mapping | Any, *, data: dict | None = None
                        ) -> ResquePrivatePlan:
  """The data-free plan of :func:`resque_private_sco` from the public ``n_users * m`` items
  (public under replace-one), ``d``, ``L`` and a finite ``R``. ``data`` (the audit hook's
  dataset, leaves ``[users, m, ...]``) only supplies its size."""
  cfg = ResquePrivateConfig.of(cfg)
  check_relation(cfg.relation, supported=(RELATION,), mechanism="ReSQue private SCO")
  eps, delta = check_epsilon(cfg.epsilon), required_delta(cfg.delta)
  preset = check_choice(cfg.preset, "preset", ("practical", "theory"))
  if data is None:
    n = int(problem.n_users) * int(problem.m)
  else:
    leaves = jax.tree.leaves(data)
    n = int(leaves[0].shape[0] * leaves[0].shape[1])
  d, L, R = problem.d, float(problem.lipschitz), float(problem.radius)
  if not math.isfinite(R):
    raise MissingConstant("radius: resque_private_sco needs the finite radius R of the "
                          "domain (its step sizes and balls scale with R): declare "
                          "constants={'radius': ...}")
  constants = check_choice(cfg.constants, "constants", ("explicit", "c_priv"))
  # derived default: the theory preset's universal constant 60, else 1
  c_priv = check_positive(cfg.get("c_priv", 60.0 if preset == "theory" else 1.0), "c_priv")
  if preset == "theory":
    raise _theory_refusal(cfg, n=n, d=d, eps=eps, delta=delta, L=L, R=R, c_priv=c_priv)
  phases = check_int(cfg.phases, "phases")
  parallel = check_choice(cfg.phase_budget, "phase_budget", ("paper", "parallel")) == "parallel"
  ratio = check_positive(cfg.rho_over_r, "rho_over_r")
  delta_blocks = delta * (1 - ACCOUNTANT_DELTA_SHARE)
  eta_loc = (R / L) * min(1 / math.sqrt(n), eps / math.sqrt(d * math.log(1 / delta)))
  common = dict(ratio=ratio, constants=constants, c_priv=c_priv)
  out, violations = [], set()
  for i, n_i in enumerate(_phase_sizes(n, phases), start=1):
    # paper: eps/2^i, delta/2^i (the last phase takes the remainder, so the sum is eps)
    share = 2.0 ** -min(i, phases - 1) if i == phases else 2.0 ** -i
    eps_i, delta_i = (eps, delta_blocks) if parallel else (eps * share, delta_blocks * share)
    p = phase_plan(cfg, n_i=n_i, i=i, eps_i=eps_i, delta_i=delta_i, d=d, L=L, R=R,
                    eta_loc=eta_loc, eps_total=eps, **common)
    calls = [call_event(t, b * p["beta"], **p["kw"]) for t, b in p["plan"]]
    # preconditions of the planned (data-independent) calls
    violations.update(name for _, cond in calls for name, ok in cond.items() if not ok)
    out.append(PhasePlan(i, n_i, eps_i, delta_i, p, tuple(ev for ev, _ in calls)))
  return ResquePrivatePlan(eps, delta, n, L, R, preset, constants, c_priv, ratio, parallel,
                           tuple(out), tuple(sorted(violations)),
                           declared_constants(problem, ("lipschitz",), convex=True))


def resque_private_planner(facts, cfg: Mapping | Any, *, data: dict | None = None) -> Planned:
  """``dpsco_jax.plan``'s planner: the plan (``detail``) and its charge. ``data``: the audit
  hook's dataset under test (its public size only)."""
  p = resque_private_plan(facts, cfg, data=data)
  report = p.charge()
  phases = [{"n": ph.n, "epsilon": ph.eps, "delta": ph.delta, "beta": ph.p["beta"],
             "noise_multiplier": 1.0 / ph.p["beta"], "planned_alg4_calls": ph.planned_calls,
             "planned_gradients": ph.gradients} for ph in p.phases]
  return Planned(report, phases[0]["noise_multiplier"], {"phases": phases}, p)
