"""Differentially private bilevel optimization (paper 004: Kornowski, "Differentially Private
Bilevel Optimization"; spec ``004_dp_bilevel.md``).

Problem (BO): ``min_{x in X} F(x) = f(x, y*(x))`` with ``y*(x) = argmin_y g(x, y)``, ``g(x, .)``
``mu_g``-strongly convex, both levels ERMs over one dataset ``S`` (footnote 1: per-level
membership through weights inside each example).

Pieces (spec §6.1):
  * :func:`penalty_hypergrad_per_example` — the Hessian-free penalty hypergradient (Eq. 3)
    ``grad_x f(x, y^lam) + lam (grad_x g(x, y^lam) - grad_x g(x, y*))`` per example, evaluated at
    PRIVATE lower-level estimates only (§3: evaluating it at the exact ``y*(x)`` leaks, see
    :func:`implicit_hypergrad` on Example 3.1);
  * the private lower-level solver DP-Loc-GD / DP-Loc-SGD (``localized_gd.py``; its data-free
    plan in ``localized_gd_plan.py``, its planner in ``plan.py``);
  * layout: problem, hypergradients and ridge instances in :mod:`dpsco_jax.problems.bilevel`; config,
    presets, events and the paper's formulas in :mod:`.plan` (data free); the
    driver, the output rule and the audit hook :func:`dp_bilevel_releases` here;
  * Algorithm 1 (full batch) and Algorithm 3 (mini-batch) as the chain
    ``clip_per_user(C_out) -> aggregate(mean, n|b) -> add_gaussian_noise -> [public terms]
    -> projected_sgd(eta, X) -> track_min_step`` inside one ``lax.scan`` over ``T``, with warm
    starts of the inner solves and the min-norm output rule ``x_{t_out}``,
    ``t_out = argmin_t ||x_{t+1} - x_t||`` (Alg 1 lines 7-8; post-processing);
  * :func:`theory_params` (Thm 4.1 / 5.1 / 6.1 parameter assignment with its precondition) and a
    ``practical`` preset;
  * exact accounting: every mechanism (``2T`` inner solves of ``M*T_in`` Gaussian steps each and
    ``T`` outer Gaussian steps; Alg 3 samples Poisson minibatches at the public rate ``b/n``
    with the fixed denominator ``b``) is a ``dp_accounting`` event composed by the PLD
    accountant under the paper's replace-one relation (the only one supported: ``n`` is
    public; others are refused); the noise is calibrated by the library's one calibrator so the
    composition meets the target (spec §3.4 replaces the paper's loose Lemma 2.1
    composition, E2). A configured ``epsilon`` is a budget: an explicit ``noise_multiplier``
    above it raises before anything runs. The paper's own
    noise formula (Lemma 2.2 with ``(eps/sqrt(18T), delta/(3(T+1)))``) and the epsilon its
    composition would certify for our noise are reported beside;
  * the §7 application, private ridge-penalty tuning, with the corrected sign (E1), as
    :func:`dp_ridge_tuning` and the ``ridge_tuning`` problem factory.

Sensitivity is enforced by per-example clipping at both levels (spec §3.4, E6, E7): the paper's
Lemma 4.5 bounds the outer per-example vector only at the exact ``y``'s and its Lipschitz
assumption for the inner problems only on ``Y``; clipping makes the bound unconditional. In the
``theory`` preset the clip norms are the paper's Lipschitz bounds (``C_out = 5 l kappa``, Lemma
4.5's proof constant), so clipping is inactive whenever the assumptions hold.

Vectors: ``x`` (upper level) and ``y`` (lower level) are flat ``jnp`` vectors.
"""

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
from dpsco_jax.transforms.post_processing import track_min_step
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


# --------------------------------------------------------------------------------------------
# The driver (Alg 1 / Alg 3): one jitted lax.scan over T
# --------------------------------------------------------------------------------------------

def outer_privatizer(bcfg: BilevelConfig, n: int, key: jax.Array
                     ) -> optax.GradientTransformationExtraArgs:
  """The outer Gaussian mechanism of Alg 1/3 line 4 as a core chain over the per-example
  ``v_i``: ``clip_per_user(C_out) -> aggregate(mean, n | b_out) -> add_gaussian_noise``.
  The noise is :func:`~dpsco_jax.algorithms.bilevel.plan.outer_stage`'s (sensitivity
  ``C_out / denominator``, ``2 C_out / denominator`` under replace-one, which the ledger
  prices; std ``z_out C_out / denominator``)."""
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
  """The two private inner solves of one iteration (DP-Loc-(S)GD on ``g`` and ``f/lam + g``)
  on ``data`` (``shard``: a mesh's ``n_real`` / ``users``, or empty)."""
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
  """Alg 1/3; ``forced`` replays a release history (advance with it, release on this data).

  On a mesh (:func:`_run_compiled`): ``data`` is ``problem.data`` padded to a multiple of the
  devices and sharded by ``users``; rows from ``n_real`` on are padding, masked out of every
  clipped sum (outer and inner), so ``n`` (the denominators, the Poisson rates, the plan) is
  ``n_real`` and the Poisson draws are those of the one-device run."""
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
  """Runs Alg 1 (full batch) / Alg 3 (Poisson minibatches) with a planned ``bcfg``.
  Jittable with ``problem`` and ``bcfg`` static. Accounting is the caller's job
  (:func:`dp_bilevel`); nothing here calls a non-private exact solver."""
  return _run(problem, bcfg, key, None)[0]


def dp_bilevel_releases(problem: BilevelProblem, bcfg: BilevelConfig, key: jax.Array, *,
                        forced: BilevelReleases | None = None) -> BilevelReleases:
  """Audit hook: the per-step privatized releases of a run (:class:`BilevelReleases`, leading
  axis ``T``) for ``problem.data`` and ``key`` (same keys as :func:`dp_bilevel_run`).

  ``forced`` (a release history, e.g. of a neighbouring dataset) replays it: the run advances
  with the forced releases, so both datasets are queried at the same ``x_t`` with the same
  private ``y``'s, and the outer release is the Gaussian mechanism on this data at those
  points. With the same key the noise and Poisson masks coincide; a zero outer multiplier
  exposes the noiseless clipped mean (replace-one difference ``<= 2 C_out / denominator``).
  The inner solves' own per-step releases: :func:`~.localized_gd.dp_loc_gd_releases`."""
  return _run(problem, bcfg, key, forced)[1]


class _Static(NamedTuple):
  """What a compiled bilevel run is keyed by (hashable; :func:`dpsco_jax.cache.bounded_cache`):
  the problem's functions and scalars, never its arrays. The data, ``x0``, ``y0`` and
  ``x_center`` are arguments of the program, so a neighbouring dataset (same functions, other
  data) reuses the executable with its own data, and a problem whose functions close over data
  is another key (function identity)."""
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
  arrives padded to a multiple of its ``users`` axis (rows from ``n_real`` on masked) and each
  device differentiates and clips its own examples."""
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
  """Runs Alg 1 / 3 through the library's one bounded cache of compiled programs (seeds and
  neighbouring datasets of the same problem reuse it). ``mesh`` (issue 24.2): the examples are
  padded to a multiple of its ``users`` axis and sharded over it; the clipped sums are reduced
  across the axis and the noise drawn once."""
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
  """Runs a planned Alg 1 / Alg 3 on ``problem`` and reports ``privacy`` (the plan's, or the
  caller's ledger's). The record holds public quantities only: the plan's numbers, the
  privatized step norms and ``t_out``. ``debug``: the last private ``y`` estimates' distance to
  the exact ones (non-private) and the problem's metrics go to ``Result.debug``."""
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
  is set; ``dp_bilevel_minibatch`` defaults both to ``n // 10``) and reports ``plan.privacy``
  (see :func:`dp_bilevel`)."""
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
  planned by ``dp_bilevel``'s planner (:func:`~.plan.bilevel_planner`) and run by its runner.

  Item level, replace-one (public: the number of examples ``n``, shapes, the config). The plan
  (:func:`~.plan.bilevel_config`) is data free; every mechanism is spent on a
  replace-one ledger with ``epsilon_budget=epsilon`` BEFORE the run (an explicit
  ``noise_multiplier`` above the budget raises :class:`PrivacyBudgetExceeded`; nothing is
  released). ``ledger`` (optional) is an existing replace-one ledger to spend on (composition
  with other releases; its own budget is enforced as well, and the report is its). Provenance
  ``accountant``. The record holds public quantities only: the calibrated noise, the paper's
  formula beside it, the privatized step norms and ``t_out``. With ``debug: true`` the last
  private ``y`` estimates' distance to the exact ones (non-private) goes to ``debug``.
  """
  if ledger is not None and ledger.relation != RELATION:
    raise ValueError(f"ledger.relation must be {RELATION!r} (the paper's adjacency)")
  cfg = config_view(cfg)
  privacy, _, _, plan = bilevel_planner(problem, cfg)   # raises over budget: nothing runs
  if ledger is not None:
    privacy = plan.charge(ledger)
  return _execute(plan, problem, key, privacy, bool(cfg.debug))


# --------------------------------------------------------------------------------------------
# Non-private reference (the "non-private optimum" of the experiments)
# --------------------------------------------------------------------------------------------

def nonprivate_penalty_method(problem: BilevelProblem, *, lam: float, eta: float, steps: int,
                              newton_steps: int = 30) -> jax.Array:
  """NON-PRIVATE projected penalty GD with exact inner solves (spec T8). Returns ``x_T``.

  ``eta`` is the *largest* step size: each step uses ``eta_t = min(eta_{t-1}, 1 / c_t)`` with
  ``c_t = |<g_t - g_{t-1}, x_t - x_{t-1}>| / ||x_t - x_{t-1}||^2`` the secant curvature of the
  last step, so the step never exceeds the inverse of a curvature the iterates have seen. A
  fixed ``eta = 2`` on the ridge-tuning problem oscillated between the lower boundary and a
  point with ``F' ~ 0.1`` on 11 of 100 seeds (gap up to 1e-2 where the reference is ~1e-8):
  ``eta F'' > 2`` near small penalties, and the last iterate of the 2-cycle was returned. (An
  Armijo test on the value ``L*_lam`` does not work in float32: ``lam (g(y^lam) - g(y*))``
  cancels and the sufficient decrease is lost in rounding near the optimum.)"""
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
  """Tunes a ridge penalty privately (§7, corrected sign E1): the update is
  ``omega <- Pi_X(omega - eta lam (R(theta^lam) - R(theta)))`` (``eta = learning_rate``,
  ``num_steps`` outer steps) with ``R = ||.||^2/2`` and
  ``theta, theta^lam`` from DP-Loc-GD. The whole budget goes to the two inner solves (the outer
  step is post-processing). Returns a ``Result`` whose ``params`` is ``[omega]``."""
  prob = ridge_tuning_problem(a_tr, b_tr, a_val, b_val, omega_bounds=omega_bounds,
                              omega0=omega0, clip=clip_norm, curvature_bounds=curvature_bounds,
                              theta_radius=theta_radius)
  return dp_bilevel(prob, {"epsilon": epsilon, "delta": delta, "lam": lam,
                           "learning_rate": learning_rate, "num_steps": num_steps,
                           "inner_num_steps": inner_num_steps, "inner_rounds": inner_rounds,
                           "debug": debug}, key)
