"""ReSQue parallel SCO (paper 002, Theorem 1) and its minibatch-SGD baseline; non-private.

Ball acceleration (:mod:`.ball_acceleration`) over ``F = f^_rho`` with
``r = rho = eps_opt / (sqrt(d) L)`` and EpochSGD (Alg. 1) ball oracles, each one batched round
of ReSQue queries. :func:`resque_parallel_sco` reports the query depth and total queries needed
to reach a target accuracy; :func:`minibatch_sgd` is the baseline whose query depth is its
number of steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dpsco_jax.algorithms.resque.config import MinibatchSgdConfig, ResqueParallelConfig
from dpsco_jax.algorithms.registration import register
from dpsco_jax._checks import check_choice, check_int, check_positive
from dpsco_jax.algorithms.resque import ball_acceleration as ba
from dpsco_jax.algorithms.resque.solvers import problem_items
from dpsco_jax.config.families import Schema
from dpsco_jax.grads import per_example_grads
from dpsco_jax.privacy.ledger import PrivacyReport
from dpsco_jax.result import Result
from dpsco_jax.transforms.steps import projected_sgd


def _target(problem, cfg: Schema) -> float:
  """``target`` if given, else ``target_frac`` (the schema's 0.1) x the excess risk of the
  initial point (the population excess of the planted problems shrinks like sqrt(2/(pi d)));
  the initial excess is evaluated only when no target is given."""
  if cfg.target is not None:
    return check_positive(cfg.target, "target")
  frac = check_positive(cfg.target_frac, "target_frac")
  return frac * problem.excess_risk(problem.init_params())


#: why the non-private parallel methods run only on synthetic problems (their registrations'
#: ``unsupported=`` and ``mesh=`` reasons)
_TARGET = ("it stops at a target excess risk, which needs a known optimum (a synthetic "
           "problem)")


@register("resque_parallel_sco", legacy=True, config=ResqueParallelConfig, paper="002", unsupported=_TARGET, mesh=_TARGET)
def resque_parallel_sco(problem, cfg: Mapping | Any, key: jax.Array) -> Result:
  """Theorem 1 (non-private): ball acceleration + EpochSGD/ReSQue ball oracles on
  ``f^_rho``, ``r = rho = eps_opt/(sqrt(d) L)``. Records the query depth (batched rounds) and
  total queries when the (population) excess risk first reaches ``target`` (evaluated off-line
  on the trajectory: an experiment diagnostic, not something the algorithm uses).

  Config keys: ``target`` / ``target_frac`` (see :func:`_target`), ``eps_opt`` (default
  ``target``), ``c_ba``,
  ``lam_min_scale``, ``max_iter``, ``oracle ("epoch_sgd"|"acsa")``, ``ls_runs``, ``c_phi``
  (read through :class:`~dpsco_jax.algorithms.resque.config.ResqueParallelConfig`: its defaults).
  """
  cfg = ResqueParallelConfig.of(cfg)
  items = problem_items(problem)
  d, L, R = problem.d, float(problem.lipschitz), float(problem.radius)
  target = _target(problem, cfg)
  eps_opt = check_positive(cfg.get("eps_opt", target), "eps_opt")   # derived: the target
  c_ba = check_positive(cfg.c_ba, "c_ba")
  r = rho = eps_opt / (math.sqrt(d) * L)
  gorc = ba.dataset_oracle(problem.loss_fn, items)
  kind = check_choice(cfg.oracle, "oracle", ("epoch_sgd", "acsa"))
  if kind == "epoch_sgd":
    oracle = ba.make_epoch_sgd_oracle(gorc, radius=r, rho=rho, lipschitz=L,
                                      runs=check_int(cfg.ls_runs, "ls_runs"))
  else:
    oracle = ba.make_acsa_oracle(gorc, radius=r, rho=rho, lipschitz=L)
  p = ba.resque_accel_params(L, r, R, eps_opt)
  lam_min = p["lam_star"] * check_positive(cfg.lam_min_scale, "lam_min_scale")
  c_phi = check_positive(cfg.c_phi, "c_phi")
  logk3 = math.log(max(p["kappa"], math.e)) ** 3
  max_iter = cfg.max_iter
  risks = []
  res = ba.ball_acceleration(oracle, problem.init_params(), key, R=R, r=r, eps=eps_opt,
                             lipschitz=L, lam_min=lam_min, c_ba=c_ba, max_iter=max_iter,
                             bo_phi=lambda lam: lam * r * r / (c_phi * logk3),
                             callback=lambda t, x: risks.append(problem.excess_risk(x)))
  hit = next((i for i, v in enumerate(risks) if v <= target), None)
  rec = {"d": d, "r": r, "rho": rho, "K": p["K"], "kappa": p["kappa"], "lam_star": p["lam_star"],
         "iterations": res.iterations, "query_depth": res.rounds, "total_queries": res.queries,
         "exit": res.exit, "target": target, "final_excess": risks[-1] if risks else None,
         "depth_to_target": res.history[hit]["rounds"] if hit is not None else None,
         "queries_to_target": res.history[hit]["queries"] if hit is not None else None,
         "iterations_to_target": hit + 1 if hit is not None else None}
  report = PrivacyReport(epsilon=math.inf, delta=1.0 - 1e-12, provenance="none",
                         level="none", notes="non-private (parallel SCO, Theorem 1)")
  return Result(params=res.x, privacy=report, gradient_evaluations=int(res.queries), record=rec)


@register("minibatch_sgd", legacy=True, config=MinibatchSgdConfig, paper="002", unsupported=_TARGET, mesh=_TARGET)
def minibatch_sgd(problem, cfg: Mapping | Any, key: jax.Array) -> Result:
  """Parallel baseline: projected minibatch SGD (core ``projected_sgd`` with uniform
  averaging) for ``num_steps`` steps, ``learning_rate = R/(L sqrt(num_steps))`` by default,
  ``batch_size`` examples per step drawn with replacement. Query depth = steps; records the first step whose averaged iterate has excess risk ``<= target``
  (evaluated every ``eval_every`` steps). Non-private. Read through
  :class:`~dpsco_jax.algorithms.resque.config.MinibatchSgdConfig` (its defaults)."""
  cfg = MinibatchSgdConfig.of(cfg)
  items = problem_items(problem)
  n = int(jax.tree.leaves(items)[0].shape[0])
  L, R = float(problem.lipschitz), float(problem.radius)
  steps = check_int(cfg.num_steps, "num_steps")
  batch = check_int(cfg.batch_size, "batch_size")
  every = check_int(cfg.eval_every, "eval_every")
  target = _target(problem, cfg)
  # derived default R / (L sqrt(T)), computed only when no rate is given
  lr = check_positive(cfg.learning_rate if cfg.learning_rate is not None
                      else R / (L * math.sqrt(steps)), "learning_rate")
  tx = projected_sgd(lr, radius=R, averaging="uniform")
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
  for c in range(steps // every):
    params, state = chunk(params, state, jax.random.fold_in(key, c))
    if hit is None and problem.excess_risk(state.released) <= target:
      hit = (c + 1) * every
  out = state.released
  rec = {"num_steps": steps, "batch_size": batch, "learning_rate": lr, "target": target,
         "final_excess": problem.excess_risk(out), "query_depth": steps,
         "total_queries": steps * batch, "depth_to_target": hit,
         "queries_to_target": hit * batch if hit is not None else None}
  report = PrivacyReport(epsilon=math.inf, delta=1.0 - 1e-12, provenance="none",
                         level="none", notes="non-private minibatch SGD (parallel baseline)")
  return Result(params=out, privacy=report, gradient_evaluations=steps * batch, record=rec)
