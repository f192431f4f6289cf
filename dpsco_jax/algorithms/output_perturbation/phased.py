"""Paper 001's phased algorithms: Phased-ERM (Alg. 3), Phased-SCO (Alg. 4) and the strongly
convex reductions (Algs 5-6), each a sequence of SCOutputPert calls (deviations: the
:mod:`.driver` docstring). Every call's block was charged when the plan was made; Phased-ERM
composes ``T`` calls at ``(eps/T, delta/T)``, Phased-SCO one call at the full ``(eps, delta)``
per disjoint user block (parallel composition).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dpsco_jax.algorithms.output_perturbation.config import OutputPertConfig
from dpsco_jax.algorithms.registration import register
from dpsco_jax.algorithms.output_perturbation.base import (
    OutputPertSettings, ReleaseHook, release_debug, sc_output_pert_release)
# re-exported: their callers read them here
from dpsco_jax.algorithms.output_perturbation.plan import (  # noqa: F401
    localization_radius, phased_erm_schedule, phased_plan, phased_sco_schedule, planner_of,
    sc_reduction_plan)
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


def _run_phases(loss_fn, data, key, *, phases: list[tuple[float, slice]], infos, radius: float,
                theta0: jax.Array, settings: OutputPertSettings,
                hook: ReleaseHook | None = None, mesh: Any = None) -> _PhaseOut:
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


def _phase_record(sch: dict, out: _PhaseOut, settings: OutputPertSettings) -> dict:
  rec = {k: v for k, v in sch.items() if k in ("epsilon", "delta", "beta", "lam", "N0")}
  rec["num_phases"] = sch["T"]
  rec.update({"sigmas": [i.sigma for i in out.infos], "Deltas": [i.Delta for i in out.infos],
              "kappa": out.infos[0].kappa if out.infos else None,
              "bottoms": out.bottoms, "preset": settings.preset,
              "solver_iterations": [i.plan.iterations for i in out.infos]})
  if "blocks" in sch:
    rec["blocks"] = [(b.start, b.stop) for b in sch["blocks"]]
  return rec


def _phased_run(plan: Any, problem: SCOProblem, key: jax.Array,
                hook: ReleaseHook | None) -> Result:
  p = plan.detail
  out = _run_phases(problem.loss_fn, problem.data, key, phases=p.schedule["phases"],
                    infos=p.infos, radius=problem.radius, theta0=problem.init_params(),
                    settings=p.settings, hook=hook, mesh=getattr(problem, "mesh", None))
  return Result(params=out.theta, privacy=plan.privacy,
                gradient_evaluations=sum(i.gradient_evaluations for i in out.infos),
                record=_phase_record(p.schedule["schedule"], out, p.settings),
                debug=release_debug(out.dbgs, out.certs) if p.settings.debug else None)


@register("phased_erm_output_pert", config=OutputPertConfig, paper="001", reads_m=True,
          mesh=True, planner=planner_of(phased_plan, sco=False))
def phased_erm_output_pert(plan: Any, problem: SCOProblem, key: jax.Array, *,
                           _hook: ReleaseHook | None = None) -> Result:
  """Phased-ERM (Alg. 3, Thm 4.1): convex G-Lipschitz loss, excess empirical risk
  ``Õ(RG sqrt(d)/(n sqrt(m)))``; (eps, delta) by basic composition of T calls."""
  return _phased_run(plan, problem, key, _hook)


@register("phased_sco_output_pert", config=OutputPertConfig, paper="001", reads_m=True,
          mesh=True, planner=planner_of(phased_plan, sco=True))
def phased_sco_output_pert(plan: Any, problem: SCOProblem, key: jax.Array, *,
                           _hook: ReleaseHook | None = None) -> Result:
  """Phased-SCO (Alg. 4, Thm 5.1): disjoint user blocks, parallel composition."""
  return _phased_run(plan, problem, key, _hook)


def _sc_reduction(plan: Any, problem: SCOProblem, key: jax.Array,
                  hook: ReleaseHook | None) -> Result:
  """Algs 5-6: runs ``plan``; after a ⊥ warm start, its ``after_bottom`` second half."""
  p = plan.detail
  settings, info0, d = p.settings, p.infos[0], problem.d
  sch, phases, infos = p.schedule["schedule"], p.schedule["phases"], p.infos[1:]
  k0, k1 = jax.random.split(key)
  theta0, bottom0, dbg0, cert0 = sc_output_pert_release(
      problem.loss_fn, problem.data, k0, info=info0, lam=0.0,
      anchor=jnp.zeros((d,), jnp.float32), radius=problem.radius, center=None,
      settings=settings, hook=hook, mesh=getattr(problem, "mesh", None))
  if bool(bottom0):  # spec §2.7 [A]: fixed point of K and R' = diam K (post-processing)
    theta0 = jnp.zeros((d,), jnp.float32)
    sch, phases, infos = p.schedule["after_bottom"]
  # K' = K ∩ B(θ0, R') is used only through ||θ0 - θ*|| <= R' and λ; phases solve over K,
  # where Lemma 4.2 holds as well (spec §2.7 deviation note in the module docstring).
  out = _run_phases(problem.loss_fn, problem.data, k1, phases=phases, infos=infos,
                    radius=problem.radius, theta0=theta0, settings=settings, hook=hook,
                    mesh=getattr(problem, "mesh", None))
  rec = _phase_record(sch, out, settings)
  rec.update({"R_prime": p.schedule["R_prime"], "sigma0": info0.sigma,
              "bottom0": bool(bottom0)})
  return Result(params=out.theta, privacy=plan.privacy,
                gradient_evaluations=info0.gradient_evaluations + sum(
                    i.gradient_evaluations for i in out.infos),
                record=rec,
                debug=release_debug([dbg0] + out.dbgs, [cert0] + out.certs)
                if settings.debug else None)


@register("sc_erm_output_pert", config=OutputPertConfig, paper="001", reads_m=True, mesh=True,
          planner=planner_of(sc_reduction_plan, sco=False))
def sc_erm_output_pert(plan: Any, problem: SCOProblem, key: jax.Array, *,
                       _hook: ReleaseHook | None = None) -> Result:
  """Strongly-Convex-ERM (Alg. 5, Thm 4.3): excess ``Õ(G² d/(μ n² m))``."""
  return _sc_reduction(plan, problem, key, _hook)


@register("sc_sco_output_pert", config=OutputPertConfig, paper="001", reads_m=True, mesh=True,
          planner=planner_of(sc_reduction_plan, sco=True))
def sc_sco_output_pert(plan: Any, problem: SCOProblem, key: jax.Array, *,
                       _hook: ReleaseHook | None = None) -> Result:
  """Strongly-Convex-SCO (Alg. 6, Thm 5.3): excess ``Õ((G²/μ)(d/(n² m) + 1/(nm)))``."""
  return _sc_reduction(plan, problem, key, _hook)
