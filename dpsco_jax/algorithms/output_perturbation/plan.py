"""The data-free plans of paper 001's algorithms (config and public facts only: ``n_users``,
``m``, ``d``, the declared constants), and the planners :func:`dpsco_jax.plan` calls:
:func:`planner_of` (a DelOutputPert plan's blocks) and :func:`naive_planner`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import dp_accounting

from dpsco_jax._checks import check_positive
from dpsco_jax.algorithms.declared import (conditional_note, declared_constants,
                                           declared_provenance)
from dpsco_jax.algorithms.output_perturbation.base import (
    OutputPertPlan, SCInfo, block_ledger, certificate_constants, plan_sc_output_pert,
    settings_from_cfg)
from dpsco_jax.algorithms.output_perturbation.solver import SolverPlan, solver_plan
from dpsco_jax.algorithms.registration import Planned
from dpsco_jax.algorithms.output_perturbation.config import (NaiveOutputPertConfig,
                                                             OutputPertConfig)
from dpsco_jax.privacy import PrivacyReport, Provenance, calibrate_noise_multiplier
from dpsco_jax.privacy import discrete_laplace as tdl
from dpsco_jax.privacy.mechanisms import gaussian_sigma_analytic, gaussian_sigma_classic
from dpsco_jax.privacy.sensitivity import GaussianStage, Sensitivity
from dpsco_jax.data.problem import MissingConstant
from dpsco_jax.problems import SCOProblem


def _problem_mu(problem: SCOProblem) -> float:
  return float(problem.meta.get("strong_convexity", 0.0)) if problem.meta else 0.0


def _require_mu(problem, what: str) -> float:
  """The declared strong convexity mu (:class:`MissingConstant` when absent or zero)."""
  mu = _problem_mu(problem)
  if not mu > 0:
    raise MissingConstant(
        f"strong_convexity: {what} needs a strongly convex loss: declare mu with "
        "constants={'strong_convexity': ...} (a synthetic problem: e.g. 'l2_logistic' with "
        "l2 > 0)")
  return mu


def _require_radius(problem, what: str) -> float:
  """The finite radius R of K (:class:`MissingConstant` when undeclared)."""
  radius = float(problem.radius)
  if not math.isfinite(radius):
    raise MissingConstant(f"radius: {what} needs the finite radius R of the constraint set "
                          "(its phases are localized in K): declare constants={'radius': ...}")
  return radius


def _call(problem, n: int, lam: float, *, epsilon: float, delta: float, beta: float,
          mu0: float, settings: OutputPertConfig, what: str) -> SCInfo:
  """One planned DelOutputPert call on ``n`` users at prox weight ``lam``, its user count
  checked against 2(4 kappa + 1) (ValueError: n_users)."""
  need = tdl.min_users(epsilon, delta)
  if n < need and not (settings.stability_test == "exact" or n <= settings.max_exact_users):
    raise ValueError(f"n_users: {what} needs at least 2(4 kappa + 1) = {need} users at "
                     f"(eps={epsilon:.4g}, delta={delta:.3g}); got {n}")
  if settings.preset == "theory" and n < need:
    raise ValueError(f"n_users: theory preset requires n >= 2(4 kappa+1) = {need} "
                     f"(Thm 3.1, n >= C log(1/delta)/eps) for {what}; got {n}")
  return plan_sc_output_pert(
      n_users=n, m=problem.m, lipschitz=problem.lipschitz, smoothness=problem.smoothness,
      mu0=mu0, lam=lam, radius=problem.radius, epsilon=epsilon, delta=delta, beta=beta,
      settings=settings)


def sc_output_pert_plan(problem, cfg: dict) -> OutputPertPlan:
  """The plan of ``sc_output_pert``: one DelOutputPert call."""
  settings = settings_from_cfg(cfg)
  eps, delta = float(settings.epsilon), float(settings.delta)
  mu = _require_mu(problem, "sc_output_pert")
  beta = settings.beta if settings.beta is not None else 1e-3
  if settings.preset == "theory" and beta * 1.0 >= 1 / math.e:
    raise ValueError("beta must be < 1/e (Lemma 3.8)")
  info = _call(problem, problem.n_users, 0.0, epsilon=eps, delta=delta, beta=beta, mu0=mu,
               settings=settings, what="SCOutputPert")
  # the baseline's sigma at the same budget, recorded beside the run's
  return OutputPertPlan("sc_output_pert", settings, eps, delta, mu, beta, (info,),
                        (("SCOutputPert (Thm 3.3)", eps, delta, 1, None),),
                        {"sigma_naive": naive_sigma(problem, eps, delta, settings)},
                        declared=certificate_constants(problem, (info,)))



def minimizer_sensitivity(lipschitz: float, mu: float, n_users: int) -> Sensitivity:
  """The exact ERM minimizer's sensitivity (``mu``-strongly convex, ``G``-bounded per-user
  gradients): ``G / (mu n)`` add/remove-equivalent, ``2G/(mu n)`` under replace-one
  (Chaudhuri et al. 2011)."""
  return Sensitivity(lipschitz, mu * n_users, "minimizer G/(mu n)")


def naive_sigma(problem: SCOProblem, eps: float, delta: float,
                settings: OutputPertConfig, tau: float = 0.0) -> float:
  """Closed-form σ of the baseline (noise ratio and records; the run's is calibrated):
  ``2G/(μ n) + 2τ``, analytic (practical) or classic (theory) Gaussian (spec §5)."""
  mu = _problem_mu(problem)
  sens = minimizer_sensitivity(problem.lipschitz, mu, problem.n_users).under(
      "replace_one") + 2.0 * tau
  if settings.preset == "theory":
    return gaussian_sigma_classic(sens, eps, delta)
  return gaussian_sigma_analytic(sens, eps, delta)


@dataclasses.dataclass(frozen=True)
class NaivePlan:
  """Plan of ``naive_output_pert``: the solver, the replace-one sensitivity ``2G/(mu n) + 2
  tau``, ``z`` (calibrated, or the config's) and ``sigma = z sens / 2``."""
  settings: OutputPertConfig
  epsilon: float
  delta: float
  mu: float
  sensitivity: float
  solver: SolverPlan
  noise_multiplier: float
  label: str = "output perturbation (Gaussian, sens 2G/(mu n))"
  declared: tuple[tuple[str, float], ...] = ()

  @property
  def event(self) -> dp_accounting.DpEvent:
    return dp_accounting.GaussianDpEvent(self.noise_multiplier)

  @property
  def stage(self) -> GaussianStage:
    """``z`` on the minimizer's replace-one shift ``Delta`` (the std's unit: ``Delta / 2``)."""
    return GaussianStage(self.noise_multiplier,
                         Sensitivity.from_replace_one(self.sensitivity, "2G/(mu n) + 2 tau"),
                         "output")

  @property
  def sigma(self) -> float:
    return self.stage.std

  @property
  def stages(self) -> tuple[GaussianStage, ...]:
    return (self.stage,)

  @property
  def events(self) -> tuple[dp_accounting.DpEvent, ...]:
    return (self.event,)

  def charge(self) -> PrivacyReport:
    """Charges the one Gaussian event to a fresh ledger and returns the guarantee:
    ``accountant``, or ``declared`` when the sensitivity rests on a user's declared
    constants.

    Raises:
      PrivacyBudgetExceeded: an explicit ``noise_multiplier`` is over the budget (before any
        release).
    """
    ledger = block_ledger(self.settings, self.epsilon, self.delta)
    ledger.spend(self.event, label=self.label)
    notes = ("naive user-level output perturbation (replace-one, n public); sensitivity "
             "2G/(mu n) does not improve with m")
    if self.declared:
      notes += "; " + conditional_note(
          self.declared, "the sensitivity 2G/(mu n) + 2 tau bounds the minimizer of a "
          "mu-strongly convex, beta-smooth loss with G-bounded per-user gradients")
    return ledger.report(provenance=declared_provenance(Provenance.ACCOUNTANT, self.declared),
                         level="user", mechanisms=("gaussian output perturbation",),
                         paper_epsilon=self.epsilon, notes=notes)


def naive_plan(problem, cfg: dict) -> NaivePlan:
  settings = settings_from_cfg(cfg, NaiveOutputPertConfig)
  eps, delta = float(settings.epsilon), float(settings.delta)
  mu = _require_mu(problem, "naive_output_pert")
  base = minimizer_sensitivity(problem.lipschitz, mu, problem.n_users).under(settings.relation)
  tau = settings.solver_tol * base / 4.0
  plan = solver_plan(smoothness=problem.smoothness, strong_convexity=mu,
                     distance=min(2 * problem.radius, 2 * problem.lipschitz / mu), tau=tau)
  sens = base + 2.0 * tau
  z = settings.noise_multiplier
  z = (calibrate_noise_multiplier(dp_accounting.GaussianDpEvent, epsilon=eps, delta=delta,
                                  relation=settings.relation, key=("gaussian",))
       if z is None else check_positive(z, "noise_multiplier"))
  # 2G/(mu n) + 2 tau: L, mu, beta (solver accuracy) and convexity, none enforced (docstring)
  declared = declared_constants(problem, ("lipschitz", "strong_convexity", "smoothness"),
                                convex=True)
  return NaivePlan(settings, eps, delta, mu, sens, plan, z, declared=declared)


def naive_planner(facts, cfg: dict) -> Planned:
  p = naive_plan(facts, cfg)
  schedule = {"sensitivity": p.sensitivity, "sigma": p.sigma,
              "solver_iterations": p.solver.iterations}
  return Planned(p.charge(), p.noise_multiplier, schedule, p)



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


def _phases(problem, *, sco: bool, diameter: float, epsilon: float, delta: float,
            beta: float | None, mu0: float, settings: OutputPertConfig
            ) -> tuple[dict, list, tuple[SCInfo, ...], list]:
  """Phased-ERM (Alg. 3) / Phased-SCO (Alg. 4) with lambda at ``diameter`` (``diam K``, or
  Algs 5-6's localization radius): ``(schedule, phases, infos, blocks)``, ``phases`` every
  call's ``(lambda_i, user slice)``, ``blocks`` the ledger's: Phased-ERM ``T`` sequential calls
  at ``(eps/T, delta/T)`` (basic composition), Phased-SCO one per disjoint user block at the
  full ``(eps, delta)`` (``group=``: parallel composition)."""
  n, label = problem.n_users, "Phased-SCO" if sco else "Phased-ERM"
  kw = dict(n_users=n, m=problem.m, d=problem.d, lipschitz=problem.lipschitz,
            diameter=diameter, epsilon=epsilon, delta=delta, beta=beta)
  if sco:
    sch = phased_sco_schedule(**kw)
    phases, eps_p, delta_p = list(zip(sch["lams"], sch["blocks"])), epsilon, delta
    blocks = [(f"{label} block {i + 1} SCOutputPert", eps_p, delta_p, 1,
               f"{label} block {i + 1}") for i in range(sch["T"])]
  else:
    sch = phased_erm_schedule(**kw)
    phases = [(lam_i, slice(0, n)) for lam_i in sch["lams"]]
    eps_p, delta_p = sch["epsilon"], sch["delta"]
    blocks = [(f"{label} SCOutputPert phases", eps_p, delta_p, sch["T"], None)]
  infos = tuple(_call(problem, users.stop - users.start, lam_i, epsilon=eps_p, delta=delta_p,
                      beta=sch["beta"], mu0=mu0, settings=settings,
                      what=f"{label} phase {i + 1}")
                for i, (lam_i, users) in enumerate(phases))
  return sch, phases, infos, blocks


def phased_plan(problem, cfg: dict, *, sco: bool) -> OutputPertPlan:
  """The plan of Phased-ERM (Alg. 3) / Phased-SCO (Alg. 4): schedule, calls, blocks."""
  name = "phased_sco_output_pert" if sco else "phased_erm_output_pert"
  settings = settings_from_cfg(cfg)
  eps, delta = float(settings.epsilon), float(settings.delta)
  _require_radius(problem, name)
  mu0 = _problem_mu(problem)
  sch, phases, infos, blocks = _phases(problem, sco=sco, diameter=2 * problem.radius,
                                       epsilon=eps, delta=delta, beta=settings.beta, mu0=mu0,
                                       settings=settings)
  how = ("parallel composition over disjoint blocks" if sco
         else "basic composition over T phases")
  return OutputPertPlan(name, settings, eps, delta, mu0, settings.beta, infos, tuple(blocks),
                        {"schedule": sch, "phases": phases}, f"; {how}",
                        declared=certificate_constants(problem, infos))


def localization_radius(sigma0: float, d: int, beta: float, tau: float) -> float:
  """``R' = σ0 (sqrt(d) + sqrt(2 ln(1/β))) + τ`` — Gaussian norm concentration (explicit form of
  Alg. 5 line 4's ``C σ sqrt(d log(1/β))``) plus the solver error."""
  return sigma0 * (math.sqrt(d) + math.sqrt(2.0 * math.log(1.0 / beta))) + tau


def sc_reduction_plan(problem, cfg: dict, *, sco: bool) -> OutputPertPlan:
  """The plan of Strongly-Convex-ERM / -SCO (Algs 5-6): the warm start at (eps/2, delta/2),
  ``R'``, lambda and every call of the second half at (eps/2, delta/2), with their blocks.

  A ⊥ warm start (spec §2.7 [A]) restarts the second half from K's fixed point with
  ``R' = diam K``: the same calls (sizes, budgets: the same blocks and provenance) at another
  lambda. Which one runs is post-processing of the released ⊥ flag, so both are planned here:
  ``schedule["after_bottom"]`` holds the other ``(schedule, phases, infos)``."""
  name = "sc_sco_output_pert" if sco else "sc_erm_output_pert"
  settings = settings_from_cfg(cfg)
  eps, delta = float(settings.epsilon), float(settings.delta)
  mu = _require_mu(problem, f"{name} (Algs 5-6)")
  _require_radius(problem, name)
  n, m = problem.n_users, problem.m
  beta = settings.beta if settings.beta is not None else 1.0 / (2.0 * n * n * m)
  half = dict(epsilon=eps / 2, delta=delta / 2, beta=beta, mu0=mu, settings=settings)
  info0 = _call(problem, n, 0.0, **half, what="SCOutputPert warm start")
  r_prime = localization_radius(info0.sigma, problem.d, beta, info0.plan.tau)
  if sco:  # Alg. 6 line 4, second term with the constant 30 of Prop. B.1
    r_prime += 30.0 * problem.lipschitz * math.sqrt(math.log(2.0 / beta)) / (mu * math.sqrt(
        n * m))
  # the second half at lambda (G/R') ... (Algs 5-6), or after a ⊥ warm start at diam K
  sch, phases, infos, blocks = _phases(problem, sco=sco, diameter=r_prime, **half)
  after_bottom = _phases(problem, sco=sco, diameter=2 * problem.radius, **half)[:3]
  # every block of both halves is charged before the warm start is released
  blocks = [("SCOutputPert warm start", eps / 2, delta / 2, 1, None)] + blocks
  return OutputPertPlan(name, settings, eps, delta, mu, beta, (info0,) + infos, tuple(blocks),
                        {"schedule": sch, "phases": phases, "R_prime": r_prime,
                         "lam": sch["lam"], "after_bottom": after_bottom},
                        "; two halves at (eps/2, delta/2)",
                        # the after-⊥ phases run at another lambda (same blocks): their
                        # solver distance may read L
                        declared=certificate_constants(problem, (info0,) + infos,
                                                       lipschitz=True))


def planner_of(make_plan: Callable[..., OutputPertPlan], **kw: Any
               ) -> Callable[..., Planned]:
  """The planner of a DelOutputPert algorithm whose plan is ``make_plan(facts, cfg, **kw)``."""
  def planner(facts: Any, cfg: dict) -> Planned:
    p = make_plan(facts, cfg, **kw)
    calls = [{"epsilon": i.epsilon, "delta": i.delta, "sigma": i.sigma, "Delta": i.Delta,
              "kappa": i.kappa, "solver_iterations": i.plan.iterations} for i in p.infos]
    schedule = {"calls": calls, **{k: v for k, v in p.schedule.items()
                                   if k in ("R_prime", "lam")}}
    return Planned(p.charge(), None, schedule, p)
  return planner
