"""Paper 001's phased algorithms: Phased-ERM (Alg. 3), Phased-SCO (Alg. 4) and the strongly
convex reductions (Algs 5-6), each a sequence of SCOutputPert calls.

Split out of :mod:`dpsco_jax.algorithms.output_perturbation.driver` (re-exported there; see its
docstring for the deviations). Accounting: every call is an ``ApproxDpEvent`` block (Thm 3.3)
on the one ledger, all charged before the first release (:func:`_phase_blocks`, charged by
:func:`~dpsco_jax.algorithms.output_perturbation.driver.charge_output_pert`); Phased-ERM
composes ``T`` calls at ``(eps/T, delta/T)`` (basic composition), Phased-SCO one call at the
full ``(eps, delta)`` per disjoint user block (``group=``: parallel composition).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dpsco_jax.config import families as cf
from dpsco_jax.algorithms.registration import register
from dpsco_jax.algorithms.output_perturbation.base import (
    OutputPertPlan, OutputPertSettings, SCInfo, _check_common, _check_min_users,
    _debug_dict, _Hook, _problem_mu, _require_mu, _require_radius, _settings_for,
    certificate_constants, charge_output_pert, output_pert_report, plan_sc_output_pert,
    planner_of, sc_output_pert_release)
from dpsco_jax.privacy import discrete_laplace as tdl
from dpsco_jax.problems import SCOProblem
from dpsco_jax.result import Result
from dpsco_jax.transforms.steps import project_l2_ball

__all__ = ["phased_erm_schedule", "phased_sco_schedule", "phased_erm_output_pert",
           "phased_sco_output_pert", "localization_radius", "sc_erm_output_pert",
           "sc_sco_output_pert", "phased_plan", "sc_reduction_plan"]


class _PhaseOut(NamedTuple):
  theta: jax.Array
  infos: list
  bottoms: list
  dbgs: list
  certs: list


def _phase_infos(problem, phases: list[tuple[float, slice]], *, epsilon: float, delta: float,
                 beta: float, mu0: float, settings: OutputPertSettings, label: str
                 ) -> tuple[SCInfo, ...]:
  """Plans every phase ``(lambda_i, user slice)`` (data free: sizes and constants only)."""
  infos = []
  for i, (lam_i, users) in enumerate(phases):
    n_i = users.stop - users.start
    _check_min_users(n_i, epsilon, delta, settings, f"{label} phase {i + 1}")
    infos.append(plan_sc_output_pert(
        n_users=n_i, m=problem.m, lipschitz=problem.lipschitz, smoothness=problem.smoothness,
        mu0=mu0, lam=lam_i, radius=problem.radius, epsilon=epsilon, delta=delta, beta=beta,
        settings=settings))
  return tuple(infos)


def _run_phases(loss_fn, data, key, *, phases: list[tuple[float, slice]], infos, radius: float,
                theta0: jax.Array, settings: OutputPertSettings, hook: _Hook | None = None,
                mesh: Any = None) -> _PhaseOut:
  """Runs the planned phases (the caller has charged the ledger with every block)."""
  theta = project_l2_ball(jnp.asarray(theta0, jnp.float32), radius)
  bottoms, dbgs, certs = [], [], []
  keys = jax.random.split(key, len(phases))
  for (lam_i, users), info, k in zip(phases, infos, keys):
    block = jax.tree.map(lambda x: x[users], data)
    out, bottom, dbg, cert = sc_output_pert_release(
        loss_fn, block, k, info=info, lam=lam_i, anchor=theta, radius=radius, center=None,
        settings=settings, hook=hook, mesh=mesh)
    # spec §7 items 4, 9: project the new anchor into K (post-processing); ⊥ keeps the anchor
    theta = project_l2_ball(out, radius)
    bottoms.append(bool(bottom))
    dbgs.append(dbg)
    certs.append(cert)
  return _PhaseOut(theta, list(infos), bottoms, dbgs, certs)


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


def _phase_schedule(problem, *, sco: bool, epsilon: float, delta: float,
                    beta: float | None, lam: float | None) -> tuple[dict, list, float, float]:
  """Alg. 3 / Alg. 4's schedule on the public facts: ``(schedule, phases, eps_phase,
  delta_phase)`` with ``phases`` the ``(lambda_i, user slice)`` of every DelOutputPert call."""
  n, m = problem.n_users, problem.m
  kw = dict(n_users=n, m=m, d=problem.d, lipschitz=problem.lipschitz,
            diameter=2 * problem.radius, epsilon=epsilon, delta=delta, beta=beta, lam=lam)
  if sco:
    sch = phased_sco_schedule(**kw)
    return sch, list(zip(sch["lams"], sch["blocks"])), epsilon, delta
  sch = phased_erm_schedule(**kw)
  return sch, [(lam_i, slice(0, n)) for lam_i in sch["lams"]], sch["epsilon"], sch["delta"]


def _phase_blocks(sch: dict, *, sco: bool, epsilon: float, delta: float, label: str
                  ) -> list[tuple[str, float, float, int, str | None]]:
  """The ledger blocks of the phases at their per-call ``(epsilon, delta)``, charged before any
  release: Phased-ERM ``T = ceil(log2 nm)`` sequential calls at ``(eps/T, delta/T)`` (basic
  composition); Phased-SCO one call at ``(eps, delta)`` per disjoint user block (``group=``:
  parallel composition)."""
  if sco:
    return [(f"{label} block {i + 1} SCOutputPert", epsilon, delta, 1, f"{label} block {i + 1}")
            for i in range(sch["T"])]
  return [(f"{label} SCOutputPert phases", epsilon, delta, sch["T"], None)]


def _phase_record(sch: dict, out: _PhaseOut, settings: OutputPertSettings) -> dict:
  rec = {k: v for k, v in sch.items() if k in ("epsilon", "delta", "beta", "lam", "N0")}
  rec["num_phases"] = sch["T"]   # the schedule's T (calls of DelOutputPert)
  rec.update({"sigmas": [i.sigma for i in out.infos], "Deltas": [i.Delta for i in out.infos],
              "kappa": out.infos[0].kappa if out.infos else None,
              "bottoms": out.bottoms, "preset": settings.preset,
              "solver_iterations": [i.plan.iterations for i in out.infos]})
  if "blocks" in sch:
    rec["blocks"] = [(b.start, b.stop) for b in sch["blocks"]]
  return rec


def phased_plan(problem, cfg: dict, *, sco: bool) -> OutputPertPlan:
  """The data-free plan of Phased-ERM (Alg. 3) / Phased-SCO (Alg. 4): the schedule, every
  phase's DelOutputPert call and the ledger blocks (public facts and config only)."""
  name = "phased_sco_output_pert" if sco else "phased_erm_output_pert"
  label = "Phased-SCO" if sco else "Phased-ERM"
  settings = _settings_for(cfg)
  eps, delta = _check_common(cfg, settings)
  _require_radius(problem, name)
  sch, phases, eps_p, delta_p = _phase_schedule(problem, sco=sco, epsilon=eps, delta=delta,
                                                beta=settings.beta, lam=None)
  mu0 = _problem_mu(problem)
  infos = _phase_infos(problem, phases, epsilon=eps_p, delta=delta_p, beta=sch["beta"],
                       mu0=mu0, settings=settings, label=label)
  how = ("parallel composition over disjoint blocks" if sco
         else "basic composition over T phases")
  return OutputPertPlan(name, settings, eps, delta, mu0, settings.beta, infos,
                        tuple(_phase_blocks(sch, sco=sco, epsilon=eps_p, delta=delta_p,
                                            label=label)),
                        {"schedule": sch, "phases": phases}, f"; {how}",
                        declared=certificate_constants(problem, infos))


def _phased_driver(problem: SCOProblem, cfg: dict, key: jax.Array, hook: _Hook | None, *,
                   sco: bool) -> Result:
  """Algorithms 3 / 4: every phase is charged (one (eps, delta) block each) before any runs."""
  plan = phased_plan(problem, cfg, sco=sco)
  ledger = charge_output_pert(plan)
  out = _run_phases(problem.loss_fn, problem.data, key, phases=plan.schedule["phases"],
                    infos=plan.infos, radius=problem.radius, theta0=problem.init_params(),
                    settings=plan.settings, hook=hook, mesh=getattr(problem, "mesh", None))
  return Result(params=out.theta, privacy=output_pert_report(plan, ledger),
                gradient_evaluations=sum(i.gradient_evaluations for i in out.infos),
                record=_phase_record(plan.schedule["schedule"], out, plan.settings),
                debug=_debug_dict(out.dbgs, out.certs) if plan.settings.debug else None)


@register("phased_erm_output_pert", config=cf.OutputPertConfig, paper="001", reads_m=True, mesh=True,
          planner=planner_of(phased_plan, sco=False))
def phased_erm_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array, *,
                           _hook: _Hook | None = None) -> Result:
  """Phased-ERM (Alg. 3, Thm 4.1): convex G-Lipschitz loss, excess empirical risk
  ``Õ(RG sqrt(d)/(n sqrt(m)))``; (eps, delta) by basic composition of T calls."""
  return _phased_driver(problem, cfg, key, _hook, sco=False)


@register("phased_sco_output_pert", config=cf.OutputPertConfig, paper="001", reads_m=True, mesh=True,
          planner=planner_of(phased_plan, sco=True))
def phased_sco_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array, *,
                           _hook: _Hook | None = None) -> Result:
  """Phased-SCO (Alg. 4, Thm 5.1): disjoint user blocks, parallel composition."""
  return _phased_driver(problem, cfg, key, _hook, sco=True)


def localization_radius(sigma0: float, d: int, beta: float, tau: float) -> float:
  """``R' = σ0 (sqrt(d) + sqrt(2 ln(1/β))) + τ`` — Gaussian norm concentration (explicit form of
  Alg. 5 line 4's ``C σ sqrt(d log(1/β))``) plus the solver error."""
  return sigma0 * (math.sqrt(d) + math.sqrt(2.0 * math.log(1.0 / beta))) + tau


def _reduction_lam(problem, r: float, *, sco: bool) -> float:
  """Alg. 5 / Alg. 6's lambda for localization radius ``r`` (``R'``, or ``diam K`` after ⊥)."""
  G, n, m, d = problem.lipschitz, problem.n_users, problem.m, problem.d
  if sco:
    return (G / r) * max(math.sqrt(d) / (n * math.sqrt(m)), 1.0 / math.sqrt(n * m))
  return G * math.sqrt(d) / (r * n * math.sqrt(m))


def sc_reduction_plan(problem, cfg: dict, *, sco: bool) -> OutputPertPlan:
  """The data-free plan of Strongly-Convex-ERM / -SCO (Algs 5-6): the warm start's
  SCOutputPert at (eps/2, delta/2), ``R'``, lambda and every phase of the second half at
  (eps/2, delta/2), with all their ledger blocks (public facts and config only)."""
  name = "sc_sco_output_pert" if sco else "sc_erm_output_pert"
  label = "Phased-SCO" if sco else "Phased-ERM"
  settings = _settings_for(cfg)
  eps, delta = _check_common(cfg, settings)
  mu = _require_mu(problem, f"{name} (Algs 5-6)")
  _require_radius(problem, name)
  n, m, d = problem.n_users, problem.m, problem.d
  beta = settings.beta if settings.beta is not None else 1.0 / (2.0 * n * n * m)
  _check_min_users(n, eps / 2, delta / 2, settings, "SCOutputPert warm start")
  info0 = plan_sc_output_pert(n_users=n, m=m, lipschitz=problem.lipschitz,
                              smoothness=problem.smoothness, mu0=mu, lam=0.0,
                              radius=problem.radius, epsilon=eps / 2, delta=delta / 2,
                              beta=beta, settings=settings)
  r_prime = localization_radius(info0.sigma, d, beta, info0.plan.tau)
  if sco:  # Alg. 6 line 4, second term with the constant 30 of Prop. B.1
    r_prime += 30.0 * problem.lipschitz * math.sqrt(math.log(2.0 / beta)) / (mu * math.sqrt(
        n * m))
  lam = _reduction_lam(problem, r_prime, sco=sco)
  sch, phases, eps_p, delta_p = _phase_schedule(problem, sco=sco, epsilon=eps / 2,
                                                delta=delta / 2, beta=beta, lam=lam)
  infos = _phase_infos(problem, phases, epsilon=eps_p, delta=delta_p, beta=sch["beta"],
                       mu0=mu, settings=settings, label=label)
  # every block of both halves is charged before the warm start is released
  blocks = [("SCOutputPert warm start", eps / 2, delta / 2, 1, None)] + _phase_blocks(
      sch, sco=sco, epsilon=eps_p, delta=delta_p, label=label)
  return OutputPertPlan(name, settings, eps, delta, mu, beta, (info0,) + infos, tuple(blocks),
                        {"schedule": sch, "phases": phases, "R_prime": r_prime, "lam": lam},
                        "; two halves at (eps/2, delta/2)",
                        # after a ⊥ warm start the phases are re-planned at another lambda
                        # (same blocks): their solver distance may read L
                        declared=certificate_constants(problem, (info0,) + infos,
                                                       lipschitz=True))


def _sc_reduction(problem, cfg, key, *, sco: bool, hook: _Hook | None = None) -> Result:
  plan = sc_reduction_plan(problem, cfg, sco=sco)
  ledger = charge_output_pert(plan)
  settings, info0, d = plan.settings, plan.infos[0], problem.d
  sch, phases, infos = plan.schedule["schedule"], plan.schedule["phases"], plan.infos[1:]
  k0, k1 = jax.random.split(key)
  theta0, bottom0, dbg0, cert0 = sc_output_pert_release(
      problem.loss_fn, problem.data, k0, info=info0, lam=0.0,
      anchor=jnp.zeros((d,), jnp.float32), radius=problem.radius, center=None,
      settings=settings, hook=hook, mesh=getattr(problem, "mesh", None))
  if bool(bottom0):  # spec §2.7 [A]: fixed point of K and R' = diam K (post-processing)
    theta0 = jnp.zeros((d,), jnp.float32)
    lam = _reduction_lam(problem, 2 * problem.radius, sco=sco)
    sch, phases, eps_p, delta_p = _phase_schedule(
        problem, sco=sco, epsilon=plan.epsilon / 2, delta=plan.delta / 2, beta=plan.beta,
        lam=lam)
    # the same calls (sizes, budgets: the same blocks and provenance) at another lambda
    infos = _phase_infos(problem, phases, epsilon=eps_p, delta=delta_p, beta=sch["beta"],
                         mu0=plan.mu, settings=settings,
                         label="Phased-SCO" if sco else "Phased-ERM")
  # K' = K ∩ B(θ0, R') is used only through ||θ0 - θ*|| <= R' and λ; phases solve over K,
  # where Lemma 4.2 holds as well (spec §2.7 deviation note in the module docstring).
  out = _run_phases(problem.loss_fn, problem.data, k1, phases=phases, infos=infos,
                    radius=problem.radius, theta0=theta0, settings=settings, hook=hook,
                    mesh=getattr(problem, "mesh", None))
  rec = _phase_record(sch, out, settings)
  rec.update({"R_prime": plan.schedule["R_prime"], "sigma0": info0.sigma,
              "bottom0": bool(bottom0)})
  return Result(params=out.theta, privacy=output_pert_report(plan, ledger),
                gradient_evaluations=info0.gradient_evaluations + sum(
                    i.gradient_evaluations for i in out.infos),
                record=rec,
                debug=_debug_dict([dbg0] + out.dbgs, [cert0] + out.certs)
                if settings.debug else None)


@register("sc_erm_output_pert", config=cf.OutputPertConfig, paper="001", reads_m=True, mesh=True,
          planner=planner_of(sc_reduction_plan, sco=False))
def sc_erm_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array, *,
                       _hook: _Hook | None = None) -> Result:
  """Strongly-Convex-ERM (Alg. 5, Thm 4.3): excess ``Õ(G² d/(μ n² m))``."""
  return _sc_reduction(problem, cfg, key, sco=False, hook=_hook)


@register("sc_sco_output_pert", config=cf.OutputPertConfig, paper="001", reads_m=True, mesh=True,
          planner=planner_of(sc_reduction_plan, sco=True))
def sc_sco_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array, *,
                       _hook: _Hook | None = None) -> Result:
  """Strongly-Convex-SCO (Alg. 6, Thm 5.3): excess ``Õ((G²/μ)(d/(n² m) + 1/(nm)))``."""
  return _sc_reduction(problem, cfg, key, sco=True, hook=_hook)


