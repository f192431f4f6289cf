"""DP-Loc-GD and DP-Loc-SGD: localized, projected, averaged noisy (S)GD for strongly convex ERM.

Reference: Kornowski, "Differentially Private Bilevel Optimization" (paper 004), Algorithm 2
(DP-Loc-GD, Thm 8.2) and Algorithm 4 (DP-Loc-SGD, Thm A.1); spec ``004_dp_bilevel.md`` §2.2,
§2.4, §3.4. The paper's private lower-level solver; a general private solver for any
``mu``-strongly convex ``h(y) = (1/n) sum_i h(y; xi_i)``.

Algorithm (round ``m = 0..M-1``, step ``t = 0..T-1`` restarting every round)::

    y^m_{t+1} = Pi_{B(y^m_0, R_m)}[ y^m_t - eta_t (clipmean_i grad h(y^m_t; xi_i) + nu^m_t) ]
    y^{m+1}_0 = (1/T) sum_{t=0}^{T-1} y^m_t          (Alg 2 line 7: includes y^m_0)

as the privatizer ``clip_per_user(C) -> aggregate("mean", denominator) ->
add_gaussian_noise(z C / denominator)`` (the per-step release) and the public step
``add_public_gradient(grad r) -> projected_sgd(eta_t, radius=R_m, center=y^m_0)``; one example
= one row (item level).

Privacy contract.
  * Relation: ``replace_one`` only (the paper's adjacency). Public: ``n`` (the full-batch
    denominator and the sampling rate), every field of :class:`LocGDConfig` and ``r(y)``.
    Others are refused (``add_remove`` would make the denominator ``n`` private).
  * Sensitivity: each per-example gradient is clipped to ``C`` (spec §3.4/E7: the paper assumes
    L-Lipschitz losses *on Y* but queries gradients anywhere in the ball); the clipped sum has
    replace-one sensitivity ``2C``, which the ledger applies to ``z = sigma / C``.
  * Events: a full-batch step is ``GaussianDpEvent(z)``; DP-Loc-SGD samples each example with
    probability ``q = b / n`` (Poisson; ``b`` the fixed denominator), a step is
    ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``; a solve is ``SelfComposedDpEvent(step,
    M T)`` (:func:`loc_gd_event`), composed by PLD. Poisson rather than a fixed-size subset
    because dp_accounting accounts sampling without replacement only with RDP, much looser
    here. The price: the mask is applied to all ``n`` per-example gradients (static shapes).
    The paper samples with replacement (spec E4).
  * Declared constants (issue 23.3): **enforced**. L is only the default clip, mu only the
    steps and radii, R only ``radius0``: none enters the accounting (provenance
    ``accountant`` on a user's loss).
  * Noise is drawn only by ``add_gaussian_noise`` (a fresh ``fold_in`` key per step); ``r(y)``
    is added after the noise; radii, steps and rounds are public: a wrong radius costs
    utility, never privacy.
  * An explicit ``noise_multiplier`` over the ``epsilon`` budget is refused by the planner
    before anything runs. Audit hook: :func:`dp_loc_gd_releases`.

Deviations from the paper:
  * exact accounting (PLD) instead of Lemma 2.1/2.2 constants (spec E2); the paper's own
    per-step sigma is reported (:func:`paper_loc_gd_stddev`);
  * the radii have no stated constants: ``A = max(s, C) sqrt(1 + ln T)/(mu sqrt(T))`` (``s``
    the mean gradient's noise std) and ``R_m = min(2 R_{m-1}, c (sqrt(R_{m-1} A) + A
    sqrt(d)))``, ``c = radius_const`` (spec §3.4, default 4);
  * ``T_GD = n^2`` in the ``theory`` preset; ``practical`` uses ``min(n^2, ceil(c rho n^2 /
    d))`` steps (spec §3.4, E9) and may use the step ``eta_t = 1/(beta + mu t)``."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax.algorithms.bilevel.config import LocGdConfig, LocSgdConfig
from dpsco_jax.algorithms.registration import register
from dpsco_jax.algorithms.common import emit_progress, progress_session, real_rows_mask
from dpsco_jax.cache import bounded_cache
# the config, accounting, presets and the runner's plan (re-exported: the audits and the tests
# read them here)
from dpsco_jax.algorithms.bilevel.localized_gd_plan import (  # noqa: F401
    LocGDAux, LocGDConfig, LocGDRunPlan, RELATION, SUPPORTED_RELATIONS, loc_gd_planner,
    noise_denominator,
    advanced_composition_step, check_loc_gd_precondition, check_loc_gd_relation,
    loc_gd_event, loc_gd_plan_for_problem, loc_gd_practical_config, loc_gd_radii,
    loc_gd_rounds, loc_gd_stage, loc_gd_stddev, loc_gd_step_event,
    loc_gd_theory_config, paper_loc_gd_stddev, plan_dp_loc_gd, with_calibrated_noise)
from dpsco_jax.grads import per_example_grads
from dpsco_jax.result import Result
from dpsco_jax.transforms.clipping import aggregate, clip_per_user
from dpsco_jax.transforms.noise import add_gaussian_noise
from dpsco_jax.transforms.post_processing import add_public_gradient
from dpsco_jax.transforms.steps import projected_sgd, released_params, tree_l2_norm

PyTree = Any
ExampleLoss = Callable[[PyTree, PyTree], jax.Array]
__all__ = [
    "LocGDConfig", "LocGDAux", "dp_loc_gd", "dp_loc_sgd", "dp_loc_gd_releases",
    "loc_gd_stage", "loc_gd_stddev", "loc_gd_radii", "loc_gd_event", "loc_gd_step_event",
    "loc_gd_rounds", "loc_gd_theory_config", "loc_gd_practical_config", "with_calibrated_noise",
    "check_loc_gd_relation", "plan_dp_loc_gd", "paper_loc_gd_stddev", "advanced_composition_step",
    "add_public_gradient", "run_dp_loc_gd", "LocGDRunPlan", "loc_gd_plan_for_problem",
    "RELATION",
]


# --- The solver -----------------------------------------------------------------------------------

def _num_examples(data: PyTree) -> int:
  sizes = {x.shape[0] for x in jax.tree.leaves(data)}
  if len(sizes) != 1:
    raise ValueError(f"data leaves disagree on the example axis: {sorted(sizes)}")
  return sizes.pop()


def _round_chains(cfg: LocGDConfig, n: int, key: jax.Array, radius: float, center: PyTree,
                  reg_grad: Callable | None):
  """The privatizer (its output is the release) and the public step of one round."""
  denom = noise_denominator(cfg, n)
  privatizer = optax.chain(clip_per_user(cfg.clip_norm), aggregate("mean", denominator=denom),
                           add_gaussian_noise(loc_gd_stddev(cfg, n), key))
  mu, beta = cfg.mu, cfg.smoothness
  if cfg.step_rule == "paper":
    lr = lambda t: 1.0 / (mu * (t + 1.0))   # Thm 8.2: eta_t = 1/(mu (t+1))
  else:
    lr = lambda t: 1.0 / (beta + mu * t)   # practical: stable for a beta-smooth h
  stepper = optax.chain(add_public_gradient(reg_grad),
                        projected_sgd(lr, radius=radius, center=center, averaging="uniform"))
  return privatizer, stepper


def _solve(loss_ex: ExampleLoss, y0: PyTree, data: PyTree, key: jax.Array, cfg: LocGDConfig,
           reg_fn: Callable | None, forced: PyTree | None, n_real: int | None = None,
           users: Any = None, report: int | None = None, tick: jax.Array | None = None):
  """The solver; returns ``(y_out, aux, releases)`` (releases leaves ``[M, T, ...]``).
  ``forced``: advance with these releases instead (replay). ``n_real`` / ``users``: a mesh's
  real rows and sharding. ``report`` / ``tick``: a progress session's."""
  n_rows = _num_examples(data)
  n = n_rows if n_real is None else int(n_real)
  if users is not None:
    data = jax.lax.with_sharding_constraint(data, users)
  q = None if cfg.batch_size is None else noise_denominator(cfg, n) / n
  dim = sum(int(np.prod(jnp.shape(x))) for x in jax.tree.leaves(y0))
  radii = loc_gd_radii(cfg, n, dim)
  reg_grad = None if reg_fn is None else jax.grad(reg_fn)
  center, max_dists, centers, releases = y0, [], [], []
  for m in range(cfg.rounds):  # M is a small static number (log log n): unrolled
    k_noise, k_sample = jax.random.split(jax.random.fold_in(key, m))
    privatizer, stepper = _round_chains(cfg, n, k_noise, radii[m], center, reg_grad)
    forced_m = None if forced is None else jax.tree.map(lambda r, m=m: r[m], forced)

    def step(carry, xs, privatizer=privatizer, stepper=stepper, center=center,
             k_sample=k_sample, m=m):
      y, pst, sst, md = carry
      t, forced_t = xs
      mask = None
      if q is not None:  # Alg 4's B^m_t: Poisson sample at the public rate b/n (static shape)
        mask = jax.random.bernoulli(jax.random.fold_in(k_sample, t), q, (n,))
      mask = real_rows_mask(mask, n, n_rows)   # a mesh's pad rows: never sampled
      grads = per_example_grads(loss_ex, y, data)
      release, pst = privatizer.update(grads, pst, y, user_mask=mask)
      used = release if forced_t is None else forced_t
      upd, sst = stepper.update(used, sst, y)
      y_new = optax.apply_updates(y, upd)
      dist = tree_l2_norm(jax.tree.map(jnp.subtract, y_new, center))
      emit_progress(report, tick, m * cfg.steps + t)   # the step count only
      return (y_new, pst, sst, jnp.maximum(md, dist)), release

    init = (center, privatizer.init(center), stepper.init(center),
            jnp.zeros((), jnp.result_type(float)))
    (y_last, _, sst, max_dist), rel = jax.lax.scan(step, init,
                                                   (jnp.arange(cfg.steps), forced_m))
    max_dists.append(max_dist)
    releases.append(rel)
    avg = released_params(sst, y_last)  # uniform mean of y_1..y_T (core convention)
    if cfg.average == "paper":
      # Alg 2 line 7 averages y_0..y_{T-1}: the same sum with y_T swapped for y_0.
      avg = jax.tree.map(lambda a, c, l: a + (c - l) / cfg.steps, avg, center, y_last)
    centers.append(avg)
    center = avg
  aux = LocGDAux(radii=jnp.asarray(radii), stddev=jnp.asarray(loc_gd_stddev(cfg, n)),
                 max_dist=jnp.stack(max_dists),
                 centers=jax.tree.map(lambda *c: jnp.stack(c), *centers))
  return center, aux, jax.tree.map(lambda *r: jnp.stack(r), *releases)


def dp_loc_gd(loss_ex: ExampleLoss, y0: PyTree, data: PyTree, key: jax.Array,
              cfg: LocGDConfig, *, reg_fn: Callable[[PyTree], jax.Array] | None = None,
              n_real: int | None = None, users: Any = None) -> tuple[PyTree, LocGDAux]:
  """One DP-Loc-GD (``cfg.batch_size is None``) or DP-Loc-SGD solve. Jittable (``cfg`` static).
  Accounting is the caller's (:func:`loc_gd_event`, charged before).

  Args:
    loss_ex: ``loss_ex(y, example) -> scalar``, the per-example part of ``h``.
    y0: the start ``y_0`` (any pytree); never an exact data-dependent minimizer.
    data: examples, leaves ``[n, ...]``.
    key: PRNG key.
    cfg: :class:`LocGDConfig`.
    reg_fn: optional data-independent term ``r(y)``; its gradient is added after the noise.
    n_real, users: on a mesh, the real rows (the rest is masked padding) and the sharding.

  Returns:
    ``(y_out, aux)`` with ``y_out = y^M_0``."""
  return _solve(loss_ex, y0, data, key, cfg, reg_fn, None, n_real, users)[:2]


def dp_loc_gd_releases(loss_ex: ExampleLoss, y0: PyTree, data: PyTree, key: jax.Array,
                       cfg: LocGDConfig, *, reg_fn: Callable[[PyTree], jax.Array] | None = None,
                       forced: PyTree | None = None) -> PyTree:
  """Audit hook: the per-step releases ``clipmean(grad h(y_t)) + nu_t`` of a solve (leaves
  ``[M, T, *y.shape]``). ``forced`` (a release history, e.g. a neighbour's) makes the solver
  advance with those releases, so both datasets are queried at the same points; with the same
  ``key`` the noise and masks coincide. Same keys as :func:`dp_loc_gd`."""
  return _solve(loss_ex, y0, data, key, cfg, reg_fn, forced)[2]


def dp_loc_sgd(loss_ex: ExampleLoss, y0: PyTree, data: PyTree, key: jax.Array,
               cfg: LocGDConfig, *, reg_fn: Callable[[PyTree], jax.Array] | None = None
               ) -> tuple[PyTree, LocGDAux]:
  """DP-Loc-SGD (Alg 4): :func:`dp_loc_gd` with Poisson samples of expected size
  ``cfg.batch_size`` (must be set)."""
  if cfg.batch_size is None:
    raise ValueError("dp_loc_sgd needs cfg.batch_size (use dp_loc_gd for full batch)")
  return dp_loc_gd(loss_ex, y0, data, key, cfg, reg_fn=reg_fn)


# --- Runner entry (strongly convex SCO problems of the core, item-level) --------------------------

def _item_level_data(problem) -> PyTree:
  """Flattens ``[n_users, m, ...]`` to ``[n_users*m, ...]``: one item = one example."""
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), problem.data)


@bounded_cache(32)
def compiled_solve(loss_fn: ExampleLoss, lcfg: LocGDConfig, l2: float,
                   n_real: int | None = None, users: Any = None,
                   report: int | None = None) -> Callable:
  """One jitted solve per (loss, config, ridge, mesh, progress): data, key and tick are
  arguments, so seeds compile once."""
  reg = (None if l2 <= 0 else
         lambda y: 0.5 * l2 * sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(y)))
  return jax.jit(lambda y, data, k, tick: _solve(loss_fn, y, data, k, lcfg, reg, None, n_real,
                                                 users, report, tick)[:2])


# item rows sharded over the mesh's users axis
_TRAITS = dict(paper="004", planner=loc_gd_planner, level="item", reads_m=True, mesh=True)


@register("dp_loc_sgd", config=LocSgdConfig, **_TRAITS)   # batch_size required by its schema
@register("dp_loc_gd", config=LocGdConfig, **_TRAITS)
def run_dp_loc_gd(plan, problem, key: jax.Array) -> Result:
  """Runner entry: DP-Loc-(S)GD on a core ``SCOProblem`` (item level, replace-one).

  Keys: :class:`~.config.LocGdConfig` (``mu`` defaults to the declared ``strong_convexity``,
  ``clip_norm`` to L, ``radius0`` to ``2 R``; ``l2`` adds the data-independent ``l2/2 ||y||^2``).
  Runs ``plan.detail`` (a :class:`LocGDRunPlan`) and reports ``plan.privacy``."""
  lplan: LocGDRunPlan = plan.detail
  data, lcfg, n, l2 = _item_level_data(problem), lplan.config, lplan.n, lplan.l2
  solve_args: tuple = ()
  mesh = getattr(problem, "mesh", None)
  if mesh is not None:   # items sharded over the users axis, padded with masked copies
    from jax.sharding import NamedSharding, PartitionSpec
    from dpsco_jax.algorithms.common import _on_mesh
    data, n_real = _on_mesh(data, mesh, "users")
    solve_args = (n_real, NamedSharding(mesh, PartitionSpec("users")))
  # progress: the solve's M T steps, epsilon None until the last report (no per-step event)
  with progress_session(getattr(problem, "progress", None), lplan.num_steps) as session:
    y_out, aux = compiled_solve(problem.loss_fn, lcfg, float(l2), *solve_args,
                                report=session.report)(problem.init_params(), data, key,
                                                       session.tick())
  debug = ({"max_dist_per_round": np.asarray(aux.max_dist).tolist()}
           if plan.config.debug else None)
  record = {"noise_multiplier": lcfg.noise_multiplier, "batch_size": lcfg.batch_size,
            "noise_std": loc_gd_stddev(lcfg, n),
            "paper_noise_std": paper_loc_gd_stddev(lcfg, n, epsilon=lplan.epsilon,
                                                   delta=lplan.delta),
            "rounds": lcfg.rounds, "num_steps": lcfg.steps,
            "radii": list(map(float, aux.radii)), "preset": lplan.preset}
  # Poisson masks keep shapes static: every step evaluates all n per-example gradients.
  evals = lcfg.rounds * lcfg.steps * n
  return Result(params=y_out, privacy=plan.privacy, gradient_evaluations=int(evals),
                record=record, debug=debug)
