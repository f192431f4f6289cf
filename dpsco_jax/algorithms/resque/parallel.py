"""ReSQue parallel SCO (paper 002, Theorem 1) and its minibatch-SGD baseline; non-private.

Ball acceleration (:mod:`.ball_acceleration`) over ``F = f^_rho`` with
``r = rho = eps_opt / (sqrt(d) L)`` and EpochSGD (Alg. 1) ball oracles, each one batched round
of ReSQue queries. :func:`resque_parallel_sco` reports the query depth and total queries needed
to reach a target accuracy; :func:`minibatch_sgd` is the baseline whose query depth is its
number of steps. Both run on synthetic problems (the target needs a known optimum)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dpsco_jax.algorithms.resque.config import MinibatchSgdConfig, ResqueParallelConfig
from dpsco_jax.algorithms.registration import Planned, register
from dpsco_jax._checks import check_choice, check_int, check_positive
from dpsco_jax.algorithms.resque import ball_acceleration as ba
from dpsco_jax.algorithms.resque.solvers import problem_items
from dpsco_jax.config.families import Schema
from dpsco_jax.grads import per_example_grads
from dpsco_jax.privacy.ledger import PrivacyReport
from dpsco_jax.result import Result
from dpsco_jax.transforms.steps import projected_sgd


def _target(problem, cfg: Schema) -> float:
  """``target``, else ``target_frac`` x the initial point's excess risk (evaluated only then)."""
  if cfg.target is not None:
    return check_positive(cfg.target, "target")
  frac = check_positive(cfg.target_frac, "target_frac")
  return frac * float(problem.excess_risk(problem.init_params()))


class _NonPrivatePlan:
  """A non-private plan (no noise stage, no event); its report says ``note``."""
  stages = ()
  events = ()
  note = ""

  def charge(self) -> PrivacyReport:
    return PrivacyReport(epsilon=math.inf, delta=1.0 - 1e-12, provenance="none",
                         level="none", notes=self.note)


#: why the non-private parallel methods run only on synthetic problems (their registrations'
#: ``unsupported=`` and ``mesh=`` reasons)
_TARGET = ("it stops at a target excess risk, which needs a known optimum (a synthetic "
           "problem)")


@dataclasses.dataclass(frozen=True)
class ParallelPlan(_NonPrivatePlan):
  """What :func:`resque_parallel_sco` runs: the target, ``eps_opt``, ``r = rho``, the ball
  oracle and ball acceleration's constants (``accel``: Prop. 1's ``K``, ``kappa``,
  ``lam_star``)."""
  target: float
  eps_opt: float
  r: float
  lipschitz: float
  radius: float
  oracle: str
  ls_runs: int | None
  c_ba: float
  lam_min: float
  phi_denominator: float      # c_phi log^3 kappa: the ball oracles' phi = lam r^2 / this
  max_iter: int | None
  accel: dict
  note = "non-private (parallel SCO, Theorem 1)"


def resque_parallel_planner(facts, cfg: Mapping | Any) -> Planned:
  """``resque_parallel_sco``'s plan from the config and the synthetic problem's public ``d``,
  ``L``, ``R`` (and its initial excess risk when no ``target`` is given)."""
  cfg = ResqueParallelConfig.of(cfg)
  d, L, R = int(facts.d), float(facts.lipschitz), float(facts.radius)
  target = _target(facts, cfg)
  eps_opt = check_positive(cfg.get("eps_opt", target), "eps_opt")   # derived: the target
  c_ba = check_positive(cfg.c_ba, "c_ba")
  r = eps_opt / (math.sqrt(d) * L)
  kind = check_choice(cfg.oracle, "oracle", ("epoch_sgd", "acsa"))
  runs = check_int(cfg.ls_runs, "ls_runs") if kind == "epoch_sgd" else None
  p = ba.resque_accel_params(L, r, R, eps_opt)
  lam_min = p["lam_star"] * check_positive(cfg.lam_min_scale, "lam_min_scale")
  phi_den = check_positive(cfg.c_phi, "c_phi") * math.log(max(p["kappa"], math.e)) ** 3
  plan = ParallelPlan(target, eps_opt, r, L, R, kind, runs, c_ba, lam_min, phi_den,
                      cfg.max_iter, {k: p[k] for k in ("K", "kappa", "lam_star")})
  return Planned(plan.charge(), None,
                 {"target": target, "eps_opt": eps_opt, "r": r, "max_iter": cfg.max_iter},
                 plan)


@register("resque_parallel_sco", config=ResqueParallelConfig, paper="002",
          planner=resque_parallel_planner, unsupported=_TARGET, mesh=_TARGET)
def resque_parallel_sco(plan, problem, key: jax.Array) -> Result:
  """Theorem 1 (non-private): ball acceleration + EpochSGD/AC-SA ReSQue ball oracles on
  ``f^_rho``, ``r = rho = eps_opt/(sqrt(d) L)``. Records the query depth (batched rounds) and
  total queries when the excess risk first reaches ``target`` (evaluated off-line on the
  trajectory: a diagnostic the algorithm does not use). Keys:
  :class:`~dpsco_jax.algorithms.resque.config.ResqueParallelConfig`."""
  pp: ParallelPlan = plan.detail
  r, L = pp.r, pp.lipschitz
  gorc = ba.dataset_oracle(problem.loss_fn, problem_items(problem))
  if pp.oracle == "epoch_sgd":
    oracle = ba.make_epoch_sgd_oracle(gorc, radius=r, rho=r, lipschitz=L, runs=pp.ls_runs)
  else:
    oracle = ba.make_acsa_oracle(gorc, radius=r, rho=r, lipschitz=L)
  risks = []
  res = ba.ball_acceleration(oracle, problem.init_params(), key, R=pp.radius, r=r,
                             eps=pp.eps_opt, lipschitz=L, lam_min=pp.lam_min, c_ba=pp.c_ba,
                             max_iter=pp.max_iter,
                             bo_phi=lambda lam: lam * r * r / pp.phi_denominator,
                             callback=lambda t, x: risks.append(problem.excess_risk(x)))
  hit = next((i for i, v in enumerate(risks) if v <= pp.target), None)
  rec = {"d": problem.d, "r": r, "rho": r, **pp.accel,
         "iterations": res.iterations, "query_depth": res.rounds, "total_queries": res.queries,
         "exit": res.exit, "target": pp.target, "final_excess": risks[-1] if risks else None,
         "depth_to_target": res.history[hit]["rounds"] if hit is not None else None,
         "queries_to_target": res.history[hit]["queries"] if hit is not None else None,
         "iterations_to_target": hit + 1 if hit is not None else None}
  return Result(params=res.x, privacy=plan.privacy, gradient_evaluations=int(res.queries),
                record=rec)


@dataclasses.dataclass(frozen=True)
class MinibatchPlan(_NonPrivatePlan):
  """What :func:`minibatch_sgd` runs."""
  n: int
  steps: int
  batch: int
  every: int
  target: float
  learning_rate: float
  radius: float
  note = "non-private minibatch SGD (parallel baseline)"


def minibatch_sgd_planner(facts, cfg: Mapping | Any) -> Planned:
  """``minibatch_sgd``'s plan from the config and the synthetic problem's public facts."""
  cfg = MinibatchSgdConfig.of(cfg)
  L, R = float(facts.lipschitz), float(facts.radius)
  steps = check_int(cfg.num_steps, "num_steps")
  batch = check_int(cfg.batch_size, "batch_size")
  every = check_int(cfg.eval_every, "eval_every")
  target = _target(facts, cfg)
  # derived default R / (L sqrt(T)), computed only when no rate is given
  lr = check_positive(cfg.learning_rate if cfg.learning_rate is not None
                      else R / (L * math.sqrt(steps)), "learning_rate")
  plan = MinibatchPlan(int(facts.n_users) * int(facts.m), steps, batch, every, target, lr, R)
  return Planned(plan.charge(), None,
                 {"num_steps": steps, "batch_size": batch, "learning_rate": lr,
                  "target": target}, plan)


@register("minibatch_sgd", config=MinibatchSgdConfig, paper="002",
          planner=minibatch_sgd_planner, unsupported=_TARGET, mesh=_TARGET)
def minibatch_sgd(plan, problem, key: jax.Array) -> Result:
  """Parallel baseline: projected minibatch SGD with uniform averaging, ``batch_size`` examples
  per step drawn with replacement, ``learning_rate`` default ``R/(L sqrt(num_steps))``. Query
  depth = steps; records the first step whose averaged iterate reaches ``target`` (checked every
  ``eval_every`` steps). Non-private. Keys: :class:`~.config.MinibatchSgdConfig`."""
  mp: MinibatchPlan = plan.detail
  items = problem_items(problem)
  n, batch, every = mp.n, mp.batch, mp.every
  tx = projected_sgd(mp.learning_rate, radius=mp.radius, averaging="uniform")
  loss_fn = problem.loss_fn

  @jax.jit
  def chunk(params, state, k):
    def body(carry, kk):
      p, s = carry
      z = jax.random.randint(kk, (batch,), 0, n)
      g = per_example_grads(loss_fn, p, jax.tree.map(lambda a: a[z], items))
      g = jax.tree.map(lambda a: jnp.mean(a, axis=0), g)
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None
    (params, state), _ = jax.lax.scan(body, (params, state), jax.random.split(k, every))
    return params, state

  params = problem.init_params()
  state = tx.init(params)
  hit = None
  for c in range(mp.steps // every):
    params, state = chunk(params, state, jax.random.fold_in(key, c))
    if hit is None and problem.excess_risk(state.released) <= mp.target:
      hit = (c + 1) * every
  out = state.released
  rec = {"num_steps": mp.steps, "batch_size": batch, "learning_rate": mp.learning_rate,
         "target": mp.target, "final_excess": problem.excess_risk(out), "query_depth": mp.steps,
         "total_queries": mp.steps * batch, "depth_to_target": hit,
         "queries_to_target": hit * batch if hit is not None else None}
  return Result(params=out, privacy=plan.privacy, gradient_evaluations=mp.steps * batch,
                record=rec)
