"""Paper 001's phased algorithms: Phased-ERM (Alg. 3), Phased-SCO (Alg. 4) and the strongly
convex reductions (Algs 5-6), each a sequence of SCOutputPert calls.

Split out of :mod:`dpsco_jax.algorithms.output_perturbation` (re-exported there; see its
docstring for the deviations). Accounting: every call is an ``ApproxDpEvent`` block (Thm 3.3)
on the one ledger, all charged before the first release (:func:`_spend_phases`); Phased-ERM
composes ``T`` calls at ``(eps/T, delta/T)`` (basic composition), Phased-SCO one call at the
full ``(eps, delta)`` per disjoint user block (``group=``: parallel composition).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpsco_jax import config_families as cf
from dpsco_jax.algorithms.registry import register
from dpsco_jax.algorithms.output_perturbation import (OutputPertSettings, _check_common,
                                                      _check_min_users, _debug_dict, _Hook,
                                                      _problem_mu, _provenance, _settings_for,
                                                      block_ledger, block_report,
                                                      plan_sc_output_pert,
                                                      sc_output_pert_release)
from dpsco_jax.privacy import ApproxDpEvent, PrivacyLedger
from dpsco_jax.privacy import discrete_laplace as tdl
from dpsco_jax.problems import SCOProblem
from dpsco_jax.result import Result
from dpsco_jax.transforms.steps import project_l2_ball

__all__ = ["phased_erm_schedule", "phased_sco_schedule", "phased_erm_output_pert",
           "phased_sco_output_pert", "localization_radius", "sc_erm_output_pert",
           "sc_sco_output_pert"]


class _PhaseOut(NamedTuple):
  theta: jax.Array
  infos: list
  bottoms: list
  dbgs: list
  certs: list


def _phased(loss_fn, data, key, *, phases: list[tuple[float, slice]], epsilon: float,
            delta: float, beta: float, lipschitz: float, smoothness: float, mu0: float,
            radius: float, d: int, m: int, theta0: jax.Array, settings: OutputPertSettings,
            label: str, hook: _Hook | None = None) -> tuple[list, _PhaseOut]:
  """Runs the phases ``(lambda_i, user slice)``; every phase is planned first (the caller
  has charged the ledger with :func:`_spend_phases`)."""
  infos = []
  for i, (lam_i, users) in enumerate(phases):
    n_i = users.stop - users.start
    _check_min_users(n_i, epsilon, delta, settings, f"{label} phase {i + 1}")
    infos.append(plan_sc_output_pert(
        n_users=n_i, m=m, lipschitz=lipschitz, smoothness=smoothness, mu0=mu0, lam=lam_i,
        radius=radius, epsilon=epsilon, delta=delta, beta=beta, settings=settings))
  theta = project_l2_ball(jnp.asarray(theta0, jnp.float32), radius)
  bottoms, dbgs, certs = [], [], []
  keys = jax.random.split(key, len(phases))
  for (lam_i, users), info, k in zip(phases, infos, keys):
    block = jax.tree.map(lambda x: x[users], data)
    out, bottom, dbg, cert = sc_output_pert_release(
        loss_fn, block, k, info=info, lam=lam_i, anchor=theta, radius=radius, center=None,
        settings=settings, hook=hook)
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


def _spend_phases(ledger: PrivacyLedger, *, sco: bool, n_users: int, m: int, epsilon: float,
                  delta: float, label: str) -> None:
  """Charges the ledger with the phases' (eps, delta) blocks before any release: Phased-ERM
  ``T = ceil(log2 nm)`` sequential calls at ``(eps/T, delta/T)`` (basic composition);
  Phased-SCO one call at ``(eps, delta)`` per disjoint user block (``group=``: parallel)."""
  if sco:
    n0 = tdl.min_users(epsilon, delta)
    if n_users < 2 * n0:
      raise ValueError(f"n_users: Phased-SCO needs n >= 2 N0 = {2 * n0} users at "
                       f"(eps={epsilon}, delta={delta}); got {n_users}")
    for i in range(int(math.floor(math.log2(n_users / n0)))):
      ledger.spend(ApproxDpEvent(epsilon, delta), label=f"{label} block {i + 1} SCOutputPert",
                   group=f"{label} block {i + 1}")
    return
  T = max(1, math.ceil(math.log2(n_users * m)))
  ledger.spend(ApproxDpEvent(epsilon / T, delta / T), label=f"{label} SCOutputPert phases",
               count=T)


def _phased_erm_run(problem, key, *, eps, delta, settings, theta0, lam=None,
                    beta=None, label="Phased-ERM", hook=None):
  n, m = problem.n_users, problem.m
  sch = phased_erm_schedule(n_users=n, m=m, d=problem.d, lipschitz=problem.lipschitz,
                            diameter=2 * problem.radius, epsilon=eps, delta=delta, beta=beta,
                            lam=lam)
  phases = [(lam_i, slice(0, n)) for lam_i in sch["lams"]]
  infos, out = _phased(problem.loss_fn, problem.data, key, phases=phases,
                       epsilon=sch["epsilon"], delta=sch["delta"], beta=sch["beta"],
                       lipschitz=problem.lipschitz, smoothness=problem.smoothness,
                       mu0=_problem_mu(problem), radius=problem.radius, d=problem.d, m=m,
                       theta0=theta0, settings=settings, label=label, hook=hook)
  return sch, out


def _phased_sco_run(problem, key, *, eps, delta, settings, theta0, lam=None,
                    beta=None, label="Phased-SCO", hook=None):
  n, m = problem.n_users, problem.m
  sch = phased_sco_schedule(n_users=n, m=m, d=problem.d, lipschitz=problem.lipschitz,
                            diameter=2 * problem.radius, epsilon=eps, delta=delta, beta=beta,
                            lam=lam)
  phases = list(zip(sch["lams"], sch["blocks"]))
  infos, out = _phased(problem.loss_fn, problem.data, key, phases=phases, epsilon=eps,
                       delta=delta, beta=sch["beta"], lipschitz=problem.lipschitz,
                       smoothness=problem.smoothness, mu0=_problem_mu(problem),
                       radius=problem.radius, d=problem.d, m=m, theta0=theta0,
                       settings=settings, label=label, hook=hook)
  return sch, out


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


def _phased_driver(problem: SCOProblem, cfg: dict, key: jax.Array, hook: _Hook | None, *,
            sco: bool) -> Result:
  """Algorithms 3 / 4: every phase is charged (one (eps, delta) block each) before any runs."""
  settings = _settings_for(cfg)
  eps, delta = _check_common(cfg, settings)
  ledger = block_ledger(settings, eps, delta)
  _spend_phases(ledger, sco=sco, n_users=problem.n_users, m=problem.m, epsilon=eps,
                delta=delta, label="Phased-SCO" if sco else "Phased-ERM")
  run = _phased_sco_run if sco else _phased_erm_run
  sch, out = run(problem, key, eps=eps, delta=delta, settings=settings,
                 theta0=problem.init_params(), beta=settings.beta, hook=hook)
  prov, notes = _provenance(settings, out.infos)
  how = ("parallel composition over disjoint blocks" if sco
         else "basic composition over T phases")
  return Result(params=out.theta,
                privacy=block_report(ledger, prov, paper_epsilon=eps, notes=f"{notes}; {how}"),
                gradient_evaluations=sum(i.gradient_evaluations for i in out.infos),
                record=_phase_record(sch, out, settings),
                debug=_debug_dict(out.dbgs, out.certs) if settings.debug else None)


@register("phased_erm_output_pert", config=cf.OutputPertConfig, paper="001")
def phased_erm_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array, *,
                           _hook: _Hook | None = None) -> Result:
  """Phased-ERM (Alg. 3, Thm 4.1): convex G-Lipschitz loss, excess empirical risk
  ``Õ(RG sqrt(d)/(n sqrt(m)))``; (eps, delta) by basic composition of T calls."""
  return _phased_driver(problem, cfg, key, _hook, sco=False)


@register("phased_sco_output_pert", config=cf.OutputPertConfig, paper="001")
def phased_sco_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array, *,
                           _hook: _Hook | None = None) -> Result:
  """Phased-SCO (Alg. 4, Thm 5.1): disjoint user blocks, parallel composition."""
  return _phased_driver(problem, cfg, key, _hook, sco=True)


def localization_radius(sigma0: float, d: int, beta: float, tau: float) -> float:
  """``R' = σ0 (sqrt(d) + sqrt(2 ln(1/β))) + τ`` — Gaussian norm concentration (explicit form of
  Alg. 5 line 4's ``C σ sqrt(d log(1/β))``) plus the solver error."""
  return sigma0 * (math.sqrt(d) + math.sqrt(2.0 * math.log(1.0 / beta))) + tau


def _sc_reduction(problem, cfg, key, *, sco: bool, hook: _Hook | None = None) -> Result:
  settings = _settings_for(cfg)
  eps, delta = _check_common(cfg, settings)
  mu = _problem_mu(problem)
  if mu <= 0:
    raise ValueError("strong_convexity: Algs 5-6 need a strongly convex problem")
  n, m, d = problem.n_users, problem.m, problem.d
  beta = settings.beta if settings.beta is not None else 1.0 / (2.0 * n * n * m)
  ledger = block_ledger(settings, eps, delta)
  _check_min_users(n, eps / 2, delta / 2, settings, "SCOutputPert warm start")
  info0 = plan_sc_output_pert(n_users=n, m=m, lipschitz=problem.lipschitz,
                              smoothness=problem.smoothness, mu0=mu, lam=0.0,
                              radius=problem.radius, epsilon=eps / 2, delta=delta / 2,
                              beta=beta, settings=settings)
  # every block of both halves is charged before the warm start is released
  ledger.spend(ApproxDpEvent(eps / 2, delta / 2), label="SCOutputPert warm start")
  _spend_phases(ledger, sco=sco, n_users=n, m=m, epsilon=eps / 2, delta=delta / 2,
                label="Phased-SCO" if sco else "Phased-ERM")
  r_prime = localization_radius(info0.sigma, d, beta, info0.plan.tau)
  if sco:  # Alg. 6 line 4, second term with the constant 30 of Prop. B.1
    r_prime += 30.0 * problem.lipschitz * math.sqrt(math.log(2.0 / beta)) / (mu * math.sqrt(
        n * m))
  k0, k1 = jax.random.split(key)
  G = problem.lipschitz
  if sco:
    lam = (G / r_prime) * max(math.sqrt(d) / (n * math.sqrt(m)), 1.0 / math.sqrt(n * m))
  else:
    lam = G * math.sqrt(d) / (r_prime * n * math.sqrt(m))
  theta0, bottom0, dbg0, cert0 = sc_output_pert_release(
      problem.loss_fn, problem.data, k0, info=info0, lam=0.0,
      anchor=jnp.zeros((d,), jnp.float32), radius=problem.radius, center=None,
      settings=settings, hook=hook)
  if bool(bottom0):  # spec §2.7 [A]: fixed point of K and R' = diam K (post-processing)
    theta0 = jnp.zeros((d,), jnp.float32)
    lam = G * math.sqrt(d) / (2 * problem.radius * n * math.sqrt(m)) if not sco else (
        G / (2 * problem.radius)) * max(math.sqrt(d) / (n * math.sqrt(m)),
                                        1.0 / math.sqrt(n * m))
  # K' = K ∩ B(θ0, R') is used only through ||θ0 - θ*|| <= R' and λ; phases solve over K,
  # where Lemma 4.2 holds as well (spec §2.7 deviation note in the module docstring).
  run = _phased_sco_run if sco else _phased_erm_run
  sch, out = run(problem, k1, eps=eps / 2, delta=delta / 2, settings=settings,
                 theta0=theta0, lam=lam, beta=beta,
                 label="Phased-SCO" if sco else "Phased-ERM", hook=hook)
  prov, notes = _provenance(settings, [info0] + list(out.infos))
  rec = _phase_record(sch, out, settings)
  rec.update({"R_prime": r_prime, "sigma0": info0.sigma, "bottom0": bool(bottom0)})
  return Result(params=out.theta, privacy=block_report(
      ledger, prov, paper_epsilon=eps, notes=notes + "; two halves at (eps/2, delta/2)"),
      gradient_evaluations=info0.gradient_evaluations + sum(
          i.gradient_evaluations for i in out.infos),
      record=rec,
      debug=_debug_dict([dbg0] + out.dbgs, [cert0] + out.certs) if settings.debug else None)


@register("sc_erm_output_pert", config=cf.OutputPertConfig, paper="001")
def sc_erm_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array, *,
                       _hook: _Hook | None = None) -> Result:
  """Strongly-Convex-ERM (Alg. 5, Thm 4.3): excess ``Õ(G² d/(μ n² m))``."""
  return _sc_reduction(problem, cfg, key, sco=False, hook=_hook)


@register("sc_sco_output_pert", config=cf.OutputPertConfig, paper="001")
def sc_sco_output_pert(problem: SCOProblem, cfg: dict, key: jax.Array, *,
                       _hook: _Hook | None = None) -> Result:
  """Strongly-Convex-SCO (Alg. 6, Thm 5.3): excess ``Õ((G²/μ)(d/(n² m) + 1/(nm)))``."""
  return _sc_reduction(problem, cfg, key, sco=True, hook=_hook)


