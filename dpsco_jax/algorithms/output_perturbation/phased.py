"""Paper 001's phased algorithms: Phased-ERM (Alg. 3), Phased-SCO (Alg. 4) and the strongly
convex reductions (Algs 5-6), each a sequence of SCOutputPert calls (deviations: the
:mod:`.driver` docstring). Every call's block was charged when the plan was made; Phased-ERM
composes ``T`` calls at ``(eps/T, delta/T)``, Phased-SCO one call at the full ``(eps, delta)``
per disjoint user block (parallel composition).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from dpsco_jax.algorithms.output_perturbation.config import OutputPertConfig
from dpsco_jax.algorithms.registration import register
from dpsco_jax.algorithms.output_perturbation.base import (ReleaseHook, release_debug,
                                                           sc_output_pert_release)
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


def _run(plan: Any, problem: SCOProblem, key: jax.Array, hook: ReleaseHook | None, *,
         warm_start: bool) -> Result:
  """Runs ``plan``'s calls in order, each anchored at the last (projected) output; with
  ``warm_start`` first Algs 5-6's SCOutputPert call, and after a ⊥ warm start the planned
  ``after_bottom`` second half."""
  p, d = plan.detail, problem.d
  sch, phases, infos = p.schedule["schedule"], p.schedule["phases"], p.infos
  release = functools.partial(sc_output_pert_release, problem.loss_fn, radius=problem.radius,
                              center=None, settings=p.settings, hook=hook,
                              mesh=getattr(problem, "mesh", None))
  theta, calls, extra = problem.init_params(), [], {}
  if warm_start:
    k0, key = jax.random.split(key)
    info0, infos = infos[0], infos[1:]
    theta, bottom0, dbg0, cert0 = release(problem.data, k0, info=info0, lam=0.0,
                                          anchor=jnp.zeros((d,), jnp.float32))
    calls.append((info0, bottom0, dbg0, cert0))
    if bool(bottom0):  # spec §2.7 [A]: fixed point of K and R' = diam K (post-processing)
      theta = jnp.zeros((d,), jnp.float32)
      sch, phases, infos = p.schedule["after_bottom"]
    # K' = K ∩ B(θ0, R') is used only through ||θ0 - θ*|| <= R' and λ; phases solve over K,
    # where Lemma 4.2 holds as well (spec §2.7 deviation note in the module docstring).
    extra = {"R_prime": p.schedule["R_prime"], "sigma0": info0.sigma, "bottom0": bool(bottom0)}
  theta = project_l2_ball(jnp.asarray(theta, jnp.float32), problem.radius)
  bottoms = []
  for (lam_i, users), info, k in zip(phases, infos, jax.random.split(key, len(phases))):
    block = jax.tree.map(lambda x: x[users], problem.data)
    out, bottom, dbg, cert = release(block, k, info=info, lam=lam_i, anchor=theta)
    # spec §7 items 4, 9: project the new anchor into K (post-processing); ⊥ keeps the anchor
    theta = project_l2_ball(out, problem.radius)
    bottoms.append(bool(bottom))
    calls.append((info, bottom, dbg, cert))
  rec = {k: v for k, v in sch.items() if k in ("epsilon", "delta", "beta", "lam", "N0")}
  rec["num_phases"] = sch["T"]
  rec.update({"sigmas": [i.sigma for i in infos], "Deltas": [i.Delta for i in infos],
              "kappa": infos[0].kappa if infos else None, "bottoms": bottoms,
              "preset": p.settings.preset,
              "solver_iterations": [i.plan.iterations for i in infos]})
  if "blocks" in sch:
    rec["blocks"] = [(b.start, b.stop) for b in sch["blocks"]]
  return Result(params=theta, privacy=plan.privacy,
                gradient_evaluations=sum(c[0].gradient_evaluations for c in calls),
                record={**rec, **extra},
                debug=release_debug([c[2] for c in calls], [c[3] for c in calls])
                if p.settings.debug else None)


@register("phased_erm_output_pert", config=OutputPertConfig, paper="001", reads_m=True,
          mesh=True, planner=planner_of(phased_plan, sco=False))
def phased_erm_output_pert(plan: Any, problem: SCOProblem, key: jax.Array, *,
                           _hook: ReleaseHook | None = None) -> Result:
  """Phased-ERM (Alg. 3, Thm 4.1): convex G-Lipschitz loss, excess empirical risk
  ``Õ(RG sqrt(d)/(n sqrt(m)))``; (eps, delta) by basic composition of T calls."""
  return _run(plan, problem, key, _hook, warm_start=False)


@register("phased_sco_output_pert", config=OutputPertConfig, paper="001", reads_m=True,
          mesh=True, planner=planner_of(phased_plan, sco=True))
def phased_sco_output_pert(plan: Any, problem: SCOProblem, key: jax.Array, *,
                           _hook: ReleaseHook | None = None) -> Result:
  """Phased-SCO (Alg. 4, Thm 5.1): disjoint user blocks, parallel composition."""
  return _run(plan, problem, key, _hook, warm_start=False)


@register("sc_erm_output_pert", config=OutputPertConfig, paper="001", reads_m=True, mesh=True,
          planner=planner_of(sc_reduction_plan, sco=False))
def sc_erm_output_pert(plan: Any, problem: SCOProblem, key: jax.Array, *,
                       _hook: ReleaseHook | None = None) -> Result:
  """Strongly-Convex-ERM (Alg. 5, Thm 4.3): excess ``Õ(G² d/(μ n² m))``."""
  return _run(plan, problem, key, _hook, warm_start=True)


@register("sc_sco_output_pert", config=OutputPertConfig, paper="001", reads_m=True, mesh=True,
          planner=planner_of(sc_reduction_plan, sco=True))
def sc_sco_output_pert(plan: Any, problem: SCOProblem, key: jax.Array, *,
                       _hook: ReleaseHook | None = None) -> Result:
  """Strongly-Convex-SCO (Alg. 6, Thm 5.3): excess ``Õ((G²/μ)(d/(n² m) + 1/(nm)))``."""
  return _run(plan, problem, key, _hook, warm_start=True)
