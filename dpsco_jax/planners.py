"""Data-free planners behind :func:`dpsco_jax.plan`: one per algorithm family.

A planner reads a :class:`~dpsco_jax.data.PublicFacts` (sizes and declared constants, never
data) and the validated config, and returns ``(privacy, noise_multiplier, schedule,
detail)``. It calls the same plan and charge functions the family's driver calls, so the plan's
guarantee is the run's (``dpsco_jax.run`` checks that they agree). The privacy report comes
from a fresh ledger charged with the plan's events: a plan over budget raises here, before any
data is read.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from dpsco_jax.config.schema import ConfigError
from dpsco_jax.data.problem import MissingConstant, PublicFacts
from dpsco_jax.privacy.ledger import PrivacyReport

__all__ = ["planner_for", "PLANNED"]

Planned = tuple[PrivacyReport, "float | None", dict, Any]


def _dp_sgd(level: str) -> Callable[[PublicFacts, dict], Planned]:
  def planner(facts: PublicFacts, cfg: dict) -> Planned:
    from dpsco_jax.algorithms.dpsgd.driver import charge_dp_sgd, dp_sgd_plan
    p = dp_sgd_plan(facts, cfg, level=level)
    schedule = {"num_steps": p.steps, "batch_size": p.batch, "sampling": p.sampling,
                "sampling_rate": p.sampling_rate, "denominator": p.denominator,
                "clip_norm": p.clip, "learning_rate": p.lr, "noise_std": p.noise_std}
    return charge_dp_sgd(p), p.noise_multiplier, schedule, p
  return planner


def _srgd(name: str) -> Callable[[PublicFacts, dict], Planned]:
  def planner(facts: PublicFacts, cfg: dict) -> Planned:
    from dpsco_jax.algorithms.srgd import driver as srgd
    p = srgd.plan_for_problem(name, facts, cfg)
    report = srgd.privacy_report(p, srgd.charge(p), facts.m)
    prm = p.params
    schedule = {"num_steps": prm.num_steps, "batch_size": prm.batch_size, "beta": prm.beta,
                "clip_norm": prm.clip_norm, "tree_levels": p.levels, "noise_std": p.noise_std}
    return report, prm.noise_multiplier, schedule, p
  return planner


def _filter(name: str) -> Callable[[PublicFacts, dict], Planned]:
  def planner(facts: PublicFacts, cfg: dict) -> Planned:
    from dpsco_jax.algorithms.user_level_filter import driver as ulf
    from dpsco_jax.algorithms.user_level_filter.plan import PublicSpec, make_ledger
    if not math.isfinite(facts.radius):
      raise MissingConstant(f"{name} needs a finite radius R (its phases localize in balls "
                            "around the previous phase): declare constants={'radius': ...}")
    spec = PublicSpec.of(facts)
    if name == "user_level_phased_sgd":
      p = ulf.plan_phased_sgd(spec, cfg)
      report = ulf.alg1_report(p, make_ledger(p))
    else:
      p = ulf.plan_accelerated_erm(spec, cfg,
                                   smoothed=name == "user_level_accelerated_erm_smoothed")
      report = ulf.alg3_report(p, make_ledger(p))
    phases = [{"sigma": ph.sigma, "noise_multiplier": ph.noise_multiplier,
               "sensitivity": ph.sensitivity} for ph in p.phases]
    z = p.phases[0].noise_multiplier if p.phases else None
    return report, z, {"phases": phases, "epsilon_test": p.epsilon_test}, p
  return planner


def _output_pert(name: str) -> Callable[[PublicFacts, dict], Planned]:
  """Paper 001: the (eps, delta) blocks of every planned DelOutputPert call (user level,
  replace-one); ``naive_output_pert``: one calibrated Gaussian event."""
  def planner(facts: PublicFacts, cfg: dict) -> Planned:
    from dpsco_jax.algorithms.output_perturbation import driver as op
    from dpsco_jax.algorithms.output_perturbation import naive as naive
    from dpsco_jax.algorithms.output_perturbation import phased as phased
    if name == "naive_output_pert":
      p = naive.naive_plan(facts, cfg)
      schedule = {"sensitivity": p.sensitivity, "sigma": p.sigma,
                  "solver_iterations": p.solver.iterations}
      return naive.naive_report(p, naive.charge_naive(p)), p.noise_multiplier, schedule, p
    sco = name in ("phased_sco_output_pert", "sc_sco_output_pert")
    p = (op.sc_output_pert_plan(facts, cfg) if name == "sc_output_pert"
         else phased.phased_plan(facts, cfg, sco=sco) if name.startswith("phased")
         else phased.sc_reduction_plan(facts, cfg, sco=sco))
    calls = [{"epsilon": i.epsilon, "delta": i.delta, "sigma": i.sigma, "Delta": i.Delta,
              "kappa": i.kappa, "solver_iterations": i.plan.iterations} for i in p.infos]
    schedule = {"calls": calls, **{k: v for k, v in p.schedule.items()
                                   if k in ("R_prime", "lam")}}
    return op.output_pert_report(p, op.charge_output_pert(p)), None, schedule, p
  return planner


def _resque(facts: PublicFacts, cfg: dict) -> Planned:
  """Paper 002: every worst-case Alg. 4 call's approximate-RDP event (item level)."""
  from dpsco_jax.algorithms.resque import private as rq
  p = rq.resque_private_plan(facts, cfg)
  report = rq.resque_private_report(p, rq.charge_resque_private(p))
  phases = [{"n": ph.n, "epsilon": ph.eps, "delta": ph.delta, "beta": ph.p["beta"],
             "noise_multiplier": 1.0 / ph.p["beta"], "planned_alg4_calls": len(ph.p["plan"]),
             "planned_gradients": ph.gradients} for ph in p.phases]
  return report, phases[0]["noise_multiplier"], {"phases": phases}, p


def _loc_gd(facts: PublicFacts, cfg: dict) -> Planned:
  """Paper 004: DP-Loc-(S)GD's solve event (item level, replace-one)."""
  from dpsco_jax.algorithms.bilevel import localized_gd as lg
  p = lg.loc_gd_plan_for_problem(facts, cfg)
  report = lg.loc_gd_report(p, lg.charge_loc_gd(p))
  c = p.config
  schedule = {"rounds": c.rounds, "num_steps": c.steps, "batch_size": c.batch_size,
              "clip_norm": c.clip_norm, "mu": c.mu, "radius0": c.radius0,
              "noise_std": lg.loc_gd_stddev(c, p.n)}
  return report, c.noise_multiplier, schedule, p


def _nonprivate(facts: PublicFacts, cfg: dict) -> Planned:
  from dpsco_jax.algorithms.dpsgd.driver import NONPRIVATE_REPORT
  return NONPRIVATE_REPORT, None, {}, None


PLANNED: dict[str, Callable[[PublicFacts, dict], Planned]] = {
    "nonprivate_sgd": _nonprivate,
    "dp_sgd_user": _dp_sgd("user"), "dp_sgd_item": _dp_sgd("item"),
    "dp_sgd_group": _dp_sgd("group"),
    **{n: _srgd(n) for n in ("accelerated_dp_srgd", "dp_srgd_unaccelerated",
                             "accelerated_dp_srgd_independent_noise", "accelerated_dp_sgd",
                             "single_epoch_dp_sgd")},
    **{n: _filter(n) for n in ("user_level_phased_sgd", "user_level_accelerated_erm",
                               "user_level_accelerated_erm_smoothed")},
    **{n: _output_pert(n) for n in ("sc_output_pert", "phased_erm_output_pert",
                                    "phased_sco_output_pert", "sc_erm_output_pert",
                                    "sc_sco_output_pert", "naive_output_pert")},
    "resque_private_sco": _resque,
    "dp_loc_gd": _loc_gd, "dp_loc_sgd": _loc_gd,
}


def planner_for(algorithm: str) -> Callable[[PublicFacts, dict], Planned]:
  """The planner of ``algorithm`` (a ConfigError names the algorithms that have one)."""
  if algorithm not in PLANNED:
    raise ConfigError(f"{algorithm} has no data-free planner in dpsco_jax.plan yet; it runs "
                      "through the runner on synthetic problems. Planned: "
                      + ", ".join(sorted(PLANNED)))
  return PLANNED[algorithm]
