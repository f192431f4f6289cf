"""Differentially private bilevel optimization (paper 004: Kornowski, "Differentially Private
Bilevel Optimization"; spec ``004_dp_bilevel.md``).

Problem (BO): ``min_{x in X} F(x) = f(x, y*(x))`` with ``y*(x) = argmin_y g(x, y)``, ``g(x, .)``
``mu_g``-strongly convex, both levels ERMs over one dataset ``S`` (footnote 1).

  * The Hessian-free penalty hypergradient (Eq. 3)
    ``grad_x f(x, y^lam) + lam (grad_x g(x, y^lam) - grad_x g(x, y*))`` per example, evaluated
    at PRIVATE lower-level estimates only (§3: the exact ``y*(x)`` leaks, Example 3.1); the
    problem and hypergradients are in :mod:`dpsco_jax.problems.bilevel`.
  * The private lower-level solver DP-Loc-(S)GD (:mod:`.localized_gd`).
  * Algorithm 1 (full batch) and Algorithm 3 (mini-batch) as the chain
    ``clip_per_user(C_out) -> aggregate(mean, n|b) -> add_gaussian_noise -> [public terms]
    -> projected_sgd(eta, X) -> track_min_step`` inside one ``lax.scan`` over ``T``, with warm
    starts of the inner solves and the min-norm output ``x_{t_out}``,
    ``t_out = argmin_t ||x_{t+1} - x_t||`` (Alg 1 lines 7-8; post-processing).
  * Exact accounting (:mod:`.plan`): ``2T`` inner solves and ``T`` outer Gaussian steps (Alg 3:
    Poisson at the public rate ``b/n``, fixed denominator ``b``), composed by PLD under the
    paper's replace-one relation (the only one supported), the noise calibrated to the target
    (spec §3.4 replaces the paper's loose Lemma 2.1 composition, E2). A configured
    ``epsilon`` is a budget. The paper's own noise formula and the epsilon its composition
    certifies for our noise are reported beside.
  * The §7 application, private ridge-penalty tuning, with the corrected sign (E1):
    :func:`dp_ridge_tuning`.

Sensitivity is enforced by per-example clipping at both levels (spec §3.4, E6, E7): Lemma 4.5
bounds the outer vector only at the exact ``y``'s and the inner Lipschitz assumption holds
only on ``Y``. The ``theory`` preset clips at the paper's Lipschitz bounds (``C_out = 5 l
kappa``), so clipping is inactive whenever the assumptions hold."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax.cache import bounded_cache
from dpsco_jax.algorithms.bilevel.config import (BilevelConfig as BilevelSchema,
                                                  NonPrivatePenaltyConfig)
from dpsco_jax.algorithms.common import real_rows_mask
from dpsco_jax.algorithms.registration import register
from dpsco_jax.algorithms.bilevel.plan import (  # noqa: F401 (re-exported)
    RELATION, BilevelConfig, BilevelPlan, bilevel_config, bilevel_events, bilevel_minibatch_planner,
    bilevel_planner, bilevel_population_planner, config_view,
    noise_ratios, nonprivate_penalty_planner, outer_stage, paper_bilevel_noise,
    paper_composition_epsilon, theory_params, with_noise)
from dpsco_jax.algorithms.bilevel.localized_gd import dp_loc_gd
from dpsco_jax.privacy.ledger import PrivacyLedger, PrivacyReport
from dpsco_jax.problems.bilevel import (BilevelProblem, ProblemConstants,  # noqa: F401
                                       diabetes_ridge_problem, exact_lower_solve, project_x,
                                       exact_penalty_hypergrad, full_f, full_g,
                                       gradient_mapping, hyperobjective, implicit_hypergrad,
                                       penalty_hypergrad_per_example, penalty_hypergrad_public,
                                       ridge_tuning_problem, synthetic_ridge_problem)
from dpsco_jax.result import Result
from dpsco_jax.transforms.clipping import aggregate, clip_per_user
from dpsco_jax.transforms.noise import add_gaussian_noise
from dpsco_jax.transforms.post_processing import MinStepState, track_min_step
from dpsco_jax.transforms.steps import projected_sgd, tree_l2_norm

PyTree = Any

__all__ = [
    "ProblemConstants", "BilevelProblem", "BilevelConfig", "BilevelOutput", "MinStepState",
    "track_min_step", "penalty_hypergrad_per_example", "penalty_hypergrad_public",
    "exact_lower_solve", "exact_penalty_hypergrad", "implicit_hypergrad", "hyperobjective",
    "gradient_mapping", "theory_params", "bilevel_config", "bilevel_events", "noise_ratios",
    "with_noise", "paper_bilevel_noise", "paper_composition_epsilon", "dp_bilevel_run",
    "dp_bilevel_releases", "dp_bilevel", "dp_ridge_tuning", "ridge_tuning_problem",
    "synthetic_ridge_problem", "diabetes_ridge_problem", "nonprivate_penalty_method",
]


# --- The driver (Alg 1 / Alg 3): one jitted lax.scan over T ---------------------------------------

def outer_privatizer(bcfg: BilevelConfig, n: int, key: jax.Array
                     ) -> optax.GradientTransformationExtraArgs:
  """The outer Gaussian mechanism of Alg 1/3 line 4 over the per-example ``v_i``:
  ``clip_per_user(C_out) -> aggregate(mean, n | b_out) -> add_gaussian_noise`` at
  :func:`~.plan.outer_stage`'s std."""
  stage = outer_stage(bcfg, n)
  return optax.chain(
      clip_per_user(bcfg.clip_out),
      aggregate("mean", denominator=stage.sensitivity.denominator),
      add_gaussian_noise(stage.std, key))


class BilevelOutput(NamedTuple):
  x_out: jax.Array        # x_{t_out}
  x_last: jax.Array       # x_T
  t_out: jax.Array
  xs: jax.Array           # x_0..x_{T-1}   (public: the privatized trajectory)
  step_norms: jax.Array   # ||x_{t+1} - x_t||  (public)
  y_star: jax.Array       # last private y estimates (public: DP outputs)
  y_lam: jax.Array


class BilevelReleases(NamedTuple):
  """Per-step privatized releases (leading axis ``T``): the noisy outer hypergradient mean
  (zeros when the outer step is post-processing, §7) and the two private inner solutions."""
  outer: jax.Array
  y_star: jax.Array
  y_lam: jax.Array


def _inner_solves(problem: BilevelProblem, bcfg: BilevelConfig, x, starts, keys, data,
                  shard: dict):
  """The two private inner solves of one iteration (on ``g`` and on ``f/lam + g``)."""
  lam = bcfg.lam
  g_reg = None if problem.g_reg is None else (lambda y: problem.g_reg(x, y))

  def lam_reg(y):
    out = jnp.zeros((), y.dtype)
    if problem.f_reg is not None:
      out = out + problem.f_reg(x, y) / lam
    if problem.g_reg is not None:
      out = out + problem.g_reg(x, y)
    return out
  y_t, _ = dp_loc_gd(lambda y, ex: problem.g_ex(x, y, ex), starts[0], data, keys[0],
                     bcfg.inner_y, reg_fn=g_reg, **shard)
  yl_t, _ = dp_loc_gd(lambda y, ex: problem.f_ex(x, y, ex) / lam + problem.g_ex(x, y, ex),
                      starts[1], data, keys[1], bcfg.inner_lam,
                      reg_fn=lam_reg if (problem.f_reg or problem.g_reg) else None, **shard)
  return y_t, yl_t


def _run(problem: BilevelProblem, bcfg: BilevelConfig, key: jax.Array,
         forced: BilevelReleases | None, data: PyTree = None, n_real: int | None = None,
         users: Any = None) -> tuple[BilevelOutput, BilevelReleases]:
  """Alg 1/3; ``forced`` replays a release history. On a mesh ``data`` is padded and sharded by
  ``users`` and rows from ``n_real`` on are masked out of every clipped sum, so ``n`` is
  ``n_real`` and the Poisson draws are the one-device run's."""
  data = problem.data if data is None else data
  n = problem.n if n_real is None else int(n_real)
  n_rows = int(jax.tree.leaves(data)[0].shape[0])
  shard = {} if users is None else {"n_real": n, "users": users}
  if users is not None:
    data = jax.lax.with_sharding_constraint(data, users)
  k_loop, k_out_noise = jax.random.split(key)
  per_ex = penalty_hypergrad_per_example(problem, bcfg.lam)
  public = penalty_hypergrad_public(problem, bcfg.lam)
  privatize = outer_privatizer(bcfg, n, k_out_noise)
  stepper = optax.chain(
      projected_sgd(bcfg.eta, radius=problem.x_radius, center=problem.x_center),
      track_min_step())
  x0 = project_x(problem, problem.x0)
  y0 = problem.y0

  def body(carry, xs):
    x, y_w, yl_w, p_state, s_state = carry
    t, forced_t = xs
    k_y, k_l, k_s = jax.random.split(jax.random.fold_in(k_loop, t), 3)
    starts = (y_w, yl_w) if bcfg.warm_start else (y0, y0)
    y_t, yl_t = _inner_solves(problem, bcfg, x, starts, (k_y, k_l), data, shard)
    if forced_t is not None:
      y_t, yl_t = forced_t.y_star, forced_t.y_lam
    if bcfg.outer_data_terms:
      mask = None
      if bcfg.batch_out is not None:  # Alg 3: one Poisson sample (rate b_out/n) for all terms
        mask = jax.random.bernoulli(k_s, bcfg.batch_out / n, (n,))
      mask = real_rows_mask(mask, n, n_rows)   # a mesh's pad rows: never in a sum
      g_rel, p_state = privatize.update(per_ex(x, yl_t, y_t, data), p_state, x,
                                        user_mask=mask)
    else:
      # Data terms provably x-free (checked in bilevel_config): their x-gradients are zero.
      g_rel = jnp.zeros_like(x)
    g_used = g_rel if forced_t is None else forced_t.outer
    upd, s_state = stepper.update(g_used + public(x, yl_t, y_t), s_state, x)
    x_new = optax.apply_updates(x, upd)
    out = (x, tree_l2_norm(upd), BilevelReleases(g_rel, y_t, yl_t))
    return (x_new, y_t, yl_t, p_state, s_state), out

  (x_last, y_t, yl_t, _, s_state), (xs, norms, rel) = jax.lax.scan(
      body, (x0, y0, y0, privatize.init(x0), stepper.init(x0)),
      (jnp.arange(bcfg.steps), forced))
  min_state = s_state[1]
  return BilevelOutput(x_out=min_state.released, x_last=x_last, t_out=min_state.best_t, xs=xs,
                       step_norms=norms, y_star=y_t, y_lam=yl_t), rel


def dp_bilevel_run(problem: BilevelProblem, bcfg: BilevelConfig, key: jax.Array
                   ) -> BilevelOutput:
  """Runs Alg 1 / Alg 3 with a planned ``bcfg`` (jittable, ``problem`` and ``bcfg`` static).
  Accounting is the caller's (:func:`dp_bilevel`)."""
  return _run(problem, bcfg, key, None)[0]


def dp_bilevel_releases(problem: BilevelProblem, bcfg: BilevelConfig, key: jax.Array, *,
                        forced: BilevelReleases | None = None) -> BilevelReleases:
  """Audit hook: the per-step releases (:class:`BilevelReleases`, leading axis ``T``) for
  ``problem.data`` and ``key`` (same keys as :func:`dp_bilevel_run`). ``forced`` (a
  neighbour's history) replays it, so both datasets are queried at the same ``x_t`` with the
  same private ``y``'s; a zero outer multiplier exposes the noiseless clipped mean. The inner
  solves' releases: :func:`~.localized_gd.dp_loc_gd_releases`."""
  return _run(problem, bcfg, key, forced)[1]


class _Static(NamedTuple):
  """The hashable key of a compiled run: the problem's functions and scalars, never its arrays
  (a neighbouring dataset reuses the executable)."""
  f_ex: Any
  g_ex: Any
  f_reg: Any
  g_reg: Any
  consts: ProblemConstants
  x_radius: float | None
  y_radius: float | None


@bounded_cache(32)
def _compiled_run(static: _Static, bcfg: BilevelConfig, mesh: Any, n_real: int | None):
  """The jitted run ``(key, data, x0, y0, x_center) -> BilevelOutput``; with ``mesh`` the data
  arrives padded and each device clips its own examples."""
  users = None
  if mesh is not None:
    from jax.sharding import NamedSharding, PartitionSpec
    users = NamedSharding(mesh, PartitionSpec("users"))

  def run(key, data, x0, y0, x_center):
    problem = BilevelProblem(name="", data=data, x0=x0, y0=y0, x_center=x_center,
                             **static._asdict())
    return _run(problem, bcfg, key, None, data, n_real, users)[0]
  return jax.jit(run)


def _run_compiled(problem: BilevelProblem, bcfg: BilevelConfig, key: jax.Array,
                  mesh: Any = None) -> BilevelOutput:
  """Runs Alg 1 / 3 through the bounded cache of compiled programs. ``mesh``: the examples
  are padded to its ``users`` axis and sharded over it; the noise is drawn once."""
  data, n_real = problem.data, None
  if mesh is not None:
    from dpsco_jax.algorithms.common import _on_mesh
    data, n_real = _on_mesh(data, mesh, "users")
  static = _Static(problem.f_ex, problem.g_ex, problem.f_reg, problem.g_reg, problem.consts,
                   problem.x_radius, problem.y_radius)
  return _compiled_run(static, bcfg, mesh, n_real)(key, data, problem.x0, problem.y0,
                                                   problem.x_center)


def _execute(plan: BilevelPlan, problem: BilevelProblem, key: jax.Array,
             privacy: PrivacyReport, debug: bool) -> Result:
  """Runs a planned Alg 1 / Alg 3 and reports ``privacy``. The record holds public quantities
  only; ``debug`` adds the private ``y``'s distance to the exact ones and the metrics."""
  bcfg, n = plan.bcfg, plan.n
  out = _run_compiled(problem, bcfg, key, getattr(problem, "mesh", None))
  # Poisson masks keep shapes static: every (inner or outer) step evaluates all n gradients.
  evals = bcfg.steps * n * (bcfg.inner_y.rounds * bcfg.inner_y.steps
                            + bcfg.inner_lam.rounds * bcfg.inner_lam.steps + 1)
  diagnostics = None
  if debug:
    x_last_in = out.xs[-1]
    diagnostics = {"inner_y_error_last": float(jnp.linalg.norm(
        out.y_star - exact_lower_solve(problem, x_last_in))),
                   "inner_lam_error_last": float(jnp.linalg.norm(
                       out.y_lam - exact_lower_solve(problem, x_last_in, bcfg.lam))),
                   "metrics": problem.metrics(out.x_out, bcfg.eta)}
  record = {"x_out": np.asarray(out.x_out).tolist(), "t_out": int(out.t_out),
            "min_step_norm_over_eta": float(np.min(np.asarray(out.step_norms))) / bcfg.eta,
            **plan.record}
  return Result(params=out.x_out, privacy=privacy, gradient_evaluations=int(evals),
                record=record, debug=diagnostics)


#: why the bilevel methods take no loss_fn + UserData (dp.run / dp.fit): their registrations'
#: reason. The private ones do take a mesh (the runner's ``devices:`` key, ``problem.mesh``).
_BILEVEL = ("it is a bilevel method: it needs an outer and an inner loss (a BilevelProblem, "
            "see dpsco_jax.problems.bilevel), not one loss_fn")
_TRAITS = dict(config=BilevelSchema, paper="004", unsupported=_BILEVEL, mesh=True)


@register("dp_bilevel_minibatch", planner=bilevel_minibatch_planner, **_TRAITS)
@register("dp_bilevel", planner=bilevel_planner, **_TRAITS)
def run_dp_bilevel(plan, problem: BilevelProblem, key: jax.Array) -> Result:
  """Runs ``plan.detail`` (a :class:`~.plan.BilevelPlan`: Alg 1, or Alg 3 when a batch size
  is set; ``dp_bilevel_minibatch`` defaults both to ``n // 10``) and reports ``plan.privacy``."""
  return _execute(plan.detail, problem, key, plan.privacy, bool(plan.config.debug))


@register("dp_bilevel_population", planner=bilevel_population_planner, **_TRAITS)
def run_dp_bilevel_population(plan, problem: BilevelProblem, key: jax.Array) -> Result:
  """§6 / Thm 6.1: the same algorithm; the theory preset adds ``K3 sqrt(d_x/n)`` to alpha and
  the record reports the population metrics the theorem bounds."""
  res = run_dp_bilevel(plan, problem, key)
  res.record["target"] = "population"
  return res


def dp_bilevel(problem: BilevelProblem, cfg: dict, key: jax.Array, *,
               ledger: PrivacyLedger | None = None) -> Result:
  """Alg 1 / Alg 3 (``inner_batch_size`` / ``outer_batch_size`` set) with exact accounting:
  planned by :func:`~.plan.bilevel_planner` and run by its runner.

  Item level, replace-one (public: ``n``, shapes, the config). Every mechanism is spent on a
  replace-one ledger with ``epsilon_budget=epsilon`` BEFORE the run (an explicit
  ``noise_multiplier`` above the budget raises :class:`PrivacyBudgetExceeded`; nothing is
  released). ``ledger`` (optional): an existing replace-one ledger to spend on as well
  (composition with other releases; its budget is enforced and the report is its). Provenance
  ``accountant``; the record holds public quantities only; ``debug: true`` adds the private
  ``y``'s distance to the exact ones."""
  if ledger is not None and ledger.relation != RELATION:
    raise ValueError(f"ledger.relation must be {RELATION!r} (the paper's adjacency)")
  cfg = config_view(cfg)
  privacy, _, _, plan = bilevel_planner(problem, cfg)   # raises over budget: nothing runs
  if ledger is not None:
    privacy = plan.charge(ledger)
  return _execute(plan, problem, key, privacy, bool(cfg.debug))


# --- Non-private reference (the "non-private optimum" of the experiments) -------------------------

def nonprivate_penalty_method(problem: BilevelProblem, *, lam: float, eta: float, steps: int,
                              newton_steps: int = 30) -> jax.Array:
  """NON-PRIVATE projected penalty GD with exact inner solves (spec T8). Returns ``x_T``.

  ``eta`` is the *largest* step: ``eta_t = min(eta_{t-1}, 1 / c_t)`` with ``c_t`` the secant
  curvature ``|<g_t - g_{t-1}, x_t - x_{t-1}>| / ||x_t - x_{t-1}||^2`` of the last step (a fixed
  step oscillated near small penalties on the ridge-tuning problem; an Armijo test on ``L*_lam``
  fails in float32, where ``lam (g(y^lam) - g(y*))`` cancels)."""
  def body(carry, _):
    x, step, x_prev, g_prev = carry
    g = exact_penalty_hypergrad(problem, lam, x, newton_steps=newton_steps)
    dx, dg = x - x_prev, g - g_prev
    moved = jnp.sum(dx * dx)
    curv = jnp.abs(jnp.sum(dg * dx)) / jnp.where(moved > 0, moved, 1.0)
    step = jnp.where((moved > 0) & (curv * step > 1.0), 1.0 / curv, step)
    return (project_x(problem, x - step * g), step, x, g), None

  @jax.jit
  def solve(x0):
    x0 = project_x(problem, x0)
    init = (x0, jnp.asarray(eta, x0.dtype), x0, jnp.zeros_like(x0))
    return jax.lax.scan(body, init, None, length=steps)[0][0]
  return solve(problem.x0)


_EXACT = ("the non-private reference solves its inner problems exactly (Newton on the whole "
          "dataset, one device): no per-example clipped step to shard")


@register("nonprivate_penalty", config=NonPrivatePenaltyConfig, paper="004",
          planner=nonprivate_penalty_planner, unsupported=_BILEVEL, mesh=_EXACT)
def run_nonprivate_penalty(plan, problem: BilevelProblem, key: jax.Array) -> Result:
  """The non-private reference (:func:`nonprivate_penalty_method`) with the plan's schedule."""
  del key
  p = plan.detail
  x = nonprivate_penalty_method(problem, lam=float(p.lam), eta=float(p.learning_rate),
                                steps=int(p.num_steps), newton_steps=int(p.newton_steps))
  return Result(params=x, privacy=plan.privacy, gradient_evaluations=0,
                record={"non_private": True})


def dp_ridge_tuning(a_tr, b_tr, a_val, b_val, *, epsilon: float, delta: float, key: jax.Array,
                    omega_bounds=(1e-3, 5.0), omega0: float = 1.0, lam: float = 30.0,
                    learning_rate: float = 0.5, num_steps: int = 30,
                    inner_num_steps: int = 300, inner_rounds: int = 2,
                    clip_norm: float | None = None,
                    curvature_bounds: tuple[float, float] = (0.0, 4.0),
                    theta_radius: float = 5.0, debug: bool = False):
  """Tunes a ridge penalty privately (§7, corrected sign E1): ``omega <- Pi_X(omega - eta lam
  (R(theta^lam) - R(theta)))`` with ``R = ||.||^2/2`` and ``theta, theta^lam`` from DP-Loc-GD;
  the whole budget goes to the inner solves (the outer step is post-processing). Returns a
  ``Result`` whose ``params`` is ``[omega]``."""
  prob = ridge_tuning_problem(a_tr, b_tr, a_val, b_val, omega_bounds=omega_bounds,
                              omega0=omega0, clip=clip_norm, curvature_bounds=curvature_bounds,
                              theta_radius=theta_radius)
  return dp_bilevel(prob, {"epsilon": epsilon, "delta": delta, "lam": lam,
                           "learning_rate": learning_rate, "num_steps": num_steps,
                           "inner_num_steps": inner_num_steps, "inner_rounds": inner_rounds,
                           "debug": debug}, key)
