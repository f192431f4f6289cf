"""User-level DP-SCO with private outlier removal (paper 000: Lowy, Liu, Asi, NeurIPS 2024).

Algorithms (spec ``shared/specs/000_user_level_dpsco.md``; deviations: each function of
:mod:`.schedules`, and the spec §7 items cited below):

* ``user_level_phased_sgd``: **Algorithm 1**. Disjoint phases, each split into ``C`` disjoint
  groups; one-pass projected SGD per group (items without replacement, as in Lemma B.4; the
  average of ``x_1..x_T``, §7 item 12); FILTER on the ``C`` averaged iterates; one-shot
  Laplace test ``s + Lap(b) >= 4C/5`` (line 13); output perturbation ``x_i = mean + N(0,
  sigma_i^2 I)`` (line 25); a failed test releases the data-independent fallback point (line
  22, §7 item 9); optional projection of ``x_i`` (post-processing, §7 item 10).
* ``user_level_accelerated_erm``: **Algorithms 2-3**. Phased regularized ERM solved by
  multi-stage AC-SA through ``[clip_per_user] -> outlier_filter -> add_gaussian_noise ->
  add_prox_to_anchor -> acsa``: per step a uniformly random ``K_i``-subset without
  replacement (§7 item 2), per-user gradients at ``x_md`` (item 3), FILTER at radius ``2 tau``
  with AboveThreshold halting (threshold drawn once per phase, item 1), the prox term after
  the noise, output ``x_ag``. A halt releases the fallback point (item 9).
* ``user_level_accelerated_erm_smoothed``: Section 4, Algorithm 3 on the uniform-ball
  convolution ``f_r`` (a fresh ``y ~ Unif(B_r)`` per step, user and item; ``beta = L
  sqrt(d)/r``, Lemma D.1, Thm D.3).

Privacy (spec §3). FILTER, not clipping, bounds the sensitivity: kept sets have diameter
``<= 2 r_h`` and, with common coins, neighbouring kept sets differ in ``<= 1 + k(zeta)``
points, so the filtered mean moves by at most ``Delta = 4 r_h (1 + k(zeta)) / (f K)`` w.p.
``1 - zeta`` (explicit constants: :func:`.schedules.certified_sensitivity`; the paper gives
``O(tau log(1/zeta)/K)``, Lemmas B.2/C.2). Per phase: Alg. 1 a Laplace test (pure ``2/b``) and
one Gaussian of shift ``Delta_i``; Alg. 2 AboveThreshold (pure ``eps_AT``) and ``T_i``
subsampled (``K_i`` of ``n_i``, without replacement) Gaussians. Declared constants are
**enforced by the filter**: L enters only through the data-independent radius ``tau``, and
FILTER bounds the kept sets' diameter for any points, so the provenance is the same on a
user's loss. Relation, noise convention and accounting: :mod:`.plan`.

Presets (``theory``: the paper's constants and ``sigma_i``; ``practical``: scaled constants,
noise calibrated to the certified sensitivity), ``sensitivity: typical`` and
``privacy_noise: false``, with the provenance of each: :meth:`.plan.FilterPlan.charge`.
``clip_norm`` (``true``: L) clips each item's gradient (Alg. 1) or each user's (Algs 2-3)
before FILTER; it is not part of the sensitivity.

Audit hooks: :func:`user_level_phased_sgd_releases` and
:func:`user_level_accelerated_erm_releases` (the per-phase / per-step privatized releases).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from dpsco_jax.algorithms.user_level_filter.config import (
    AcceleratedErmConfig, AcceleratedErmSmoothedConfig, PhasedSgdConfig)
from dpsco_jax.algorithms.common import ProgressSession, emit_progress, progress_session
from dpsco_jax.algorithms.registration import register
from dpsco_jax.algorithms.user_level_filter.plan import FilterPlan, filter_planner
from dpsco_jax.algorithms.user_level_filter.mesh import (place_groups, place_phase,
                                                          step_user_grads)
from dpsco_jax.privacy.sparse_vector import laplace_test
from dpsco_jax.problems import SCOProblem
from dpsco_jax.problems.user_level import (corrupt_users, hinge_loss,  # noqa: F401 (re-export)
                                           hinge_problem)
from dpsco_jax.result import Result
from dpsco_jax.smoothing import smoothing_offsets
from dpsco_jax.transforms.clipping import clip_per_user, clip_rows
from dpsco_jax.transforms.filtering import (filter_halted, filter_points, find_filter_state,
                                            outlier_filter)
from dpsco_jax.transforms.noise import add_gaussian_noise, tree_gaussian_like
from dpsco_jax.transforms.steps import (acsa, add_prox_to_anchor, project_l2_ball,
                                        projected_sgd, released_params)

PyTree = Any

__all__ = ["user_level_phased_sgd", "user_level_accelerated_erm",
           "user_level_accelerated_erm_smoothed", "user_level_phased_sgd_releases",
           "user_level_accelerated_erm_releases",
           "corrupt_users", "hinge_problem", "hinge_loss"]


def _fallback(problem: SCOProblem, plan: FilterPlan) -> PyTree:
  """The data-independent point released on a halt (Alg. 1 line 22 / Alg. 2 line 18)."""
  p = problem.init_params()
  return jax.tree.map(jnp.zeros_like, p) if plan.fallback == "zero" else p


@functools.partial(jax.jit, static_argnames=("loss_fn", "eta", "radius", "clip", "report"))
def _sgd_groups(loss_fn: Callable, items: PyTree, x0: PyTree, key: jax.Array | None, *,
                eta: float, radius: float, clip: float | None = None,
                keys: jax.Array | None = None, report: int | None = None,
                tick: jax.Array | None = None) -> PyTree:
  """One-pass projected SGD in every group, vmapped (``items`` leaves ``[C, T, ...]``): items
  in a fresh random order (without replacement, Lemma B.4), the uniform average of
  ``x_1..x_T``. ``clip``: each item's gradient (``clip_rows``); FILTER bounds the sensitivity
  whatever the clip, which keeps one item that breaks the declared L from dragging its group
  out of the filter's ball."""
  tx = projected_sgd(eta, radius=radius, averaging="uniform")
  raw_grad = jax.grad(loss_fn)

  def grad(params, item):
    g = raw_grad(params, item)
    if clip is None:
      return g
    clipped, _ = clip_rows(jax.tree.map(lambda x: x[None], g), clip)
    return jax.tree.map(lambda x: x[0], clipped)

  def one_group(group_items, k):
    t = jax.tree.leaves(group_items)[0].shape[0]
    order = jax.random.permutation(k, t)
    ordered = jax.tree.map(lambda x: x[order], group_items)

    def body(carry, xs):
      params, state = carry
      item, s = xs
      upd, state = tx.update(grad(params, item), state, params)
      emit_progress(report, tick, s)
      return (optax.apply_updates(params, upd), state), None

    (params, state), _ = jax.lax.scan(body, (x0, tx.init(x0)), (ordered, jnp.arange(t)))
    return released_params(state, params)

  c = jax.tree.leaves(items)[0].shape[0]
  # ``keys``: the groups' keys as the one-device run splits them (a mesh's padded run)
  return jax.vmap(one_group)(items, jax.random.split(key, c) if keys is None else keys)


@functools.partial(jax.jit, static_argnames=("tau", "lap_scale", "threshold", "sigma"))
def _filter_release(points: PyTree, key: jax.Array, *, tau: float, lap_scale: float,
                    threshold: float, sigma: float):
  """Alg. 1 lines 12-25: FILTER (score at tau, degree at 2 tau), one Laplace test, output
  perturbation. Returns ``(passed, x_i, raw FilterResult)``; the raw part is non-private."""
  k_coin, k_test, k_noise = jax.random.split(key, 3)
  res = filter_points(points, k_coin, score_radius=tau, degree_radius=2.0 * tau)
  passed = laplace_test(k_test, res.score, threshold, lap_scale)
  x = jax.tree.map(jnp.add, res.mean, tree_gaussian_like(k_noise, res.mean, sigma))
  return passed, x, res


def _progress_args(plan: FilterPlan, i: int, session: ProgressSession | None
                   ) -> tuple[int | None, jax.Array | None]:
  """Phase ``i``'s ``(report, tick)``: the session's, offset by the earlier phases' steps."""
  if session is None:
    return None, None
  return session.report, session.tick(sum(plan.phase_steps[:i]))


def _phase_users(plan: FilterPlan, key: jax.Array, n: int) -> list[np.ndarray]:
  perm = np.asarray(jax.random.permutation(key, n))
  out, start = [], 0
  for ph in plan.schedule.phases:
    out.append(perm[start:start + ph.n_users])
    start += ph.n_users
  return out


def _alg1_phases(problem: SCOProblem, plan: FilterPlan, key: jax.Array, *,
                 anchors: list | None = None, add_noise: bool = True,
                 session: ProgressSession | None = None):
  """Algorithm 1's phases (the run and its audit hook): yields ``(i, passed, release x_i, raw
  FilterResult, anchor x_{i-1}, next anchor)``."""
  sched, c, mesh = plan.schedule, plan.schedule.num_groups, getattr(problem, "mesh", None)
  k_perm, k_run = jax.random.split(key)
  x = problem.init_params()
  for i, users in enumerate(_phase_users(plan, k_perm, problem.n_users)):
    x = x if anchors is None else anchors[i]
    ph = sched.phases[i]
    report, tick = _progress_args(plan, i, session)
    used = users[:c * ph.users_per_group]          # floor(n_i / C) users per group
    items = jax.tree.map(
        lambda a: a[used].reshape((c, ph.users_per_group * problem.m) + a.shape[2:]),
        problem.data)
    k_sgd, k_rel = jax.random.split(jax.random.fold_in(k_run, ph.index))
    if mesh is None:
      pts = _sgd_groups(problem.loss_fn, items, x, k_sgd, eta=ph.eta, radius=problem.radius,
                        clip=plan.clip, report=report, tick=tick)
    else:   # groups sharded over the users axis, the one-device run's keys (mesh.place_groups)
      items, keys = place_groups(items, jax.random.split(k_sgd, c), mesh)
      pts = _sgd_groups(problem.loss_fn, items, x, None, eta=ph.eta, radius=problem.radius,
                        clip=plan.clip, keys=keys, report=report, tick=tick)
      pts = jax.tree.map(lambda p: p[:c], pts)
    passed, x_new, res = _filter_release(
        pts, k_rel, tau=ph.tau, lap_scale=sched.laplace_scale, threshold=sched.threshold,
        sigma=plan.phases[i].sigma if add_noise else 0.0)
    nxt = project_l2_ball(x_new, problem.radius) if plan.project_output else x_new
    yield i, passed, x_new, res, x, nxt
    x = nxt


def user_level_phased_sgd_releases(problem: SCOProblem, cfg: dict, key: jax.Array, *,
                                   anchors: list | None = None, add_noise: bool = True
                                   ) -> list[dict]:
  """Audit hook: Algorithm 1's privatized releases, one dict per phase (every phase runs).

  ``{"passed": bool, "release": x_i, "anchor": x_{i-1}}`` with ``x_i = FILTER mean +
  N(0, sigma_i^2 I)`` before the projection. ``anchors[i]`` replaces the phase's starting
  point (a neighbouring dataset evaluated conditionally on the same earlier releases);
  ``add_noise=False`` (tests): sigma = 0, plan and keys unchanged."""
  plan = filter_planner("user_level_phased_sgd")(problem, cfg).detail
  return [{"passed": bool(passed), "release": x_new, "anchor": x}
          for _, passed, x_new, _, x, _ in _alg1_phases(problem, plan, key, anchors=anchors,
                                                      add_noise=add_noise)]


# the certificates read m; Algorithm 1 shards its groups' SGD over a mesh, Algorithms 2-3
# their per-user gradients and FILTER pair counts (mesh.py)
_TRAITS = dict(paper="000", reads_m=True, mesh=True)


@register("user_level_phased_sgd", config=PhasedSgdConfig,
          planner=filter_planner("user_level_phased_sgd"), **_TRAITS)
def user_level_phased_sgd(plan: Any, problem: SCOProblem, key: jax.Array) -> Result:
  """Algorithm 1 of paper 000 (module docstring): runs ``plan``."""
  fp, privacy = plan.detail, plan.privacy
  opt, sched = fp.options, fp.schedule
  x, halted_phase, grads = problem.init_params(), None, 0
  dbg: dict = {"scores": [], "num_kept": []} if opt.debug else None
  with progress_session(getattr(problem, "progress", None), fp.num_steps) as session:
    for i, passed, _, res, _, nxt in _alg1_phases(problem, fp, key, session=session):
      grads += sched.num_groups * sched.phases[i].steps
      if opt.debug:
        dbg["scores"].append(float(res.score))
        dbg["num_kept"].append(int(res.num_kept))
      if not bool(passed):         # the released test bit: host branching is post-processing
        halted_phase = sched.phases[i].index
        break
      x = nxt
  out = _fallback(problem, fp) if halted_phase is not None else x
  record = {"preset": opt.preset, "sensitivity": opt.sensitivity, "relation": opt.relation,
            "num_groups": sched.num_groups,
            "phases": [ph.__dict__ for ph in sched.phases],
            "sigma": [p.sigma for p in fp.phases],
            "noise_multiplier": [p.noise_multiplier for p in fp.phases],
            "sensitivity_values": [p.sensitivity for p in fp.phases],
            "laplace_scale": sched.laplace_scale, "epsilon_test": fp.epsilon_test,
            "halted_phase": halted_phase, "learning_rate": sched.eta, "clip_norm": fp.clip}
  return Result(params=out, privacy=privacy, gradient_evaluations=int(grads), record=record,
                debug=dbg)


@functools.partial(jax.jit, static_argnames=(
    "loss_fn", "batch", "steps", "lam", "smoothness", "sigma", "filter_radius",
    "threshold_fraction", "threshold_scale", "query_scale", "radius", "stage_length",
    "smoothing_radius", "clip", "debug", "collect", "n_users", "users", "report"))
def _alg2_phase(loss_fn: Callable, data: PyTree, x_prev: PyTree, key: jax.Array,
                given: PyTree, use_given: jax.Array, *, batch: int, steps: int, lam: float,
                smoothness: float, sigma: float, filter_radius: float,
                threshold_fraction: float, threshold_scale: float, query_scale: float,
                radius: float | None, stage_length: int, smoothing_radius: float | None,
                clip: float | None, debug: bool, collect: bool = False,
                n_users: int | None = None, users: NamedSharding | None = None,
                report: int | None = None, tick: jax.Array | None = None):
  """Algorithm 2 on one phase's users ``data`` (leaves ``[n_i, m, ...]``): ``(x_ag, halted,
  filter state, releases)``, ``releases`` (``collect``) the per-step noisy filtered means and
  halting flags. ``use_given`` (traced: one compilation) feeds ``given`` (audit replay)
  instead of this run's releases to the post-processing. ``users``: a mesh's users sharding
  (``data`` from ``mesh.place_phase``, its ``n_users`` real rows first)."""
  n_i = jax.tree.leaves(data)[0].shape[0] if n_users is None else n_users
  m = jax.tree.leaves(data)[0].shape[1]
  k_chain, k_sample, k_smooth = jax.random.split(key, 3)
  # the private part ([clip] -> outlier_filter -> add_gaussian_noise), then post-processing
  k_filter, k_noise = jax.random.split(k_chain)
  private = optax.chain(
      *([] if clip is None else [clip_per_user(clip)]),
      outlier_filter(batch, filter_radius, key=k_filter, threshold_fraction=threshold_fraction,
                     threshold_scale=threshold_scale, query_scale=query_scale, debug=debug,
                     rows=users),
      add_gaussian_noise(sigma, k_noise))
  post = optax.chain(
      add_prox_to_anchor(lam, anchor=x_prev),
      acsa(smoothness + lam, strong_convexity=lam, radius=radius, stage_length=stage_length))

  def body(carry, t):
    params, (s_priv, s_post) = carry
    idx = None        # every user, unless a uniformly random K_i-subset, fresh each step
    if batch < n_i:   # (spec §7 item 2)
      idx = jax.random.choice(jax.random.fold_in(k_sample, t), n_i, (batch,), replace=False)
    offsets = None
    if smoothing_radius is not None:
      offsets = smoothing_offsets(jax.random.fold_in(k_smooth, t), params, smoothing_radius,
                                  batch, m)
    g = step_user_grads(loss_fn, params, data, idx, offsets, n_users=n_i, users=users)
    noisy, new_priv = private.update(g, s_priv, params)
    fed = jax.tree.map(lambda a, b: jnp.where(use_given, a[t], b), given, noisy)
    upd, new_post = post.update(fed, s_post, params)
    new_params = optax.apply_updates(params, upd)
    was_halted, now_halted = filter_halted(s_priv), filter_halted(new_priv)
    new_state = (new_priv, new_post)
    # Once halted: params frozen from the halting step on, the whole state from the next.
    params = jax.tree.map(lambda a, b: jnp.where(now_halted, a, b), params, new_params)
    state = jax.tree.map(lambda a, b: jnp.where(was_halted, a, b), (s_priv, s_post),
                         new_state)
    emit_progress(report, tick, t)   # the step count only (a halted phase still counts)
    return (params, state), ((noisy, now_halted) if collect else None)

  init = (private.init(x_prev), post.init(x_prev))
  (params, (s_priv, s_post)), rel = jax.lax.scan(body, (x_prev, init), jnp.arange(steps))
  return (released_params(s_post, params), filter_halted(s_priv), find_filter_state(s_priv),
          rel)


def _alg3_phases(problem: SCOProblem, plan: FilterPlan, key: jax.Array, *,
                 given: list | None = None, anchors: list | None = None,
                 add_noise: bool = True, collect: bool = False,
                 session: ProgressSession | None = None):
  """Algorithm 3's phases (the run and its audit hook): yields ``(i, x_ag, halted, filter
  state, releases, anchor x_{i-1})``."""
  sched = plan.schedule
  k_perm, k_run = jax.random.split(key)
  x = problem.init_params()
  for i, users in enumerate(_phase_users(plan, k_perm, problem.n_users)):
    x = x if anchors is None else anchors[i]
    ph, pn = sched.phases[i], plan.phases[i]
    report, tick = _progress_args(plan, i, session)
    given_i = None if given is None else given[i]
    use_given = jnp.asarray(given_i is not None)
    if given_i is None:
      given_i = jax.tree.map(lambda a: jnp.zeros((pn.steps,) + jnp.shape(a), a.dtype), x)
    data, n_i, spread = jax.tree.map(lambda a: a[users], problem.data), None, None
    if getattr(problem, "mesh", None) is not None:   # users sharded
      data, n_i, spread = place_phase(data, problem.mesh)
    x_new, halted, fstate, rel = _alg2_phase(
        problem.loss_fn, data, x, jax.random.fold_in(k_run, ph.index), given_i, use_given,
        batch=ph.batch, steps=pn.steps, lam=ph.lam, smoothness=sched.smoothness,
        sigma=pn.sigma if add_noise else 0.0, filter_radius=2.0 * sched.tau,
        threshold_fraction=sched.threshold_fraction, threshold_scale=sched.threshold_scale,
        query_scale=sched.query_scale, radius=problem.radius,
        stage_length=min(ph.stage_length, pn.steps), smoothing_radius=sched.smoothing_radius,
        clip=plan.clip, debug=plan.options.debug, collect=collect, n_users=n_i, users=spread,
        report=report, tick=tick)
    yield i, x_new, halted, fstate, rel, x
    x = x_new


def user_level_accelerated_erm_releases(problem: SCOProblem, cfg: dict, key: jax.Array, *,
                                        smoothed: bool = False, given: list | None = None,
                                        anchors: list | None = None, add_noise: bool = True
                                        ) -> list[dict]:
  """Audit hook: Algorithm 3's privatized releases, one dict per phase (every phase runs).

  ``{"updates": [T_i, ...] noisy filtered means, "halted": [T_i] AboveThreshold answers,
  "anchor": x_{i-1}}``. ``given[i]`` (another run's ``updates``) drives the AC-SA steps and
  ``anchors[i]`` replaces the anchor: a neighbouring dataset at the same query points.
  ``add_noise=False`` (tests): sigma = 0, plan and keys unchanged."""
  name = "user_level_accelerated_erm" + ("_smoothed" if smoothed else "")
  plan = filter_planner(name)(problem, cfg).detail
  return [{"updates": upd, "halted": np.asarray(halted), "anchor": x}
          for _, _, _, _, (upd, halted), x in _alg3_phases(
              problem, plan, key, given=given, anchors=anchors, add_noise=add_noise,
              collect=True)]


def run_accelerated_erm(plan: Any, problem: SCOProblem, key: jax.Array) -> Result:
  """Algorithm 3 (Algorithm 2 per phase) of paper 000 (module docstring), registered as
  ``user_level_accelerated_erm`` (smooth losses, Thms 3.1/3.2) and
  ``user_level_accelerated_erm_smoothed`` (on the ball smoothing ``f_r``: Section 4, Thm
  4.1/D.3): runs ``plan``.

  Args:
    plan: the :class:`dpsco_jax.Plan` of either algorithm.
    problem: the problem it runs on.
    key: the run's PRNG key.

  Returns:
    The :class:`~dpsco_jax.result.Result`: the last phase's point (the fallback on a halt),
    ``plan.privacy``, the per-phase record.
  """
  fp = plan.detail
  opt, sched = fp.options, fp.schedule
  x, halted_phase, grads = problem.init_params(), None, 0
  rec_phases, dbg = [], ({"phases": []} if opt.debug else None)
  with progress_session(getattr(problem, "progress", None), fp.num_steps) as session:
    for i, x_new, halted, fstate, _, _ in _alg3_phases(problem, fp, key, session=session):
      ph, pn = sched.phases[i], fp.phases[i]
      grads += pn.steps * ph.batch * problem.m
      rec_phases.append({"index": ph.index, "n_users": ph.n_users, "batch_size": ph.batch,
                         "num_steps": pn.steps, "lam": ph.lam,
                         "stage_length": min(ph.stage_length, pn.steps), "sigma": pn.sigma,
                         "noise_multiplier": pn.noise_multiplier,
                         "sensitivity": pn.sensitivity, "sigma_paper": ph.sigma_paper})
      if opt.debug:
        d = fstate.debug
        dbg["phases"].append({"halted": bool(halted), "min_score": float(d.min_score),
                              "steps_run": int(d.steps_run),
                              "steps_all_kept": int(d.steps_all_kept)})
      if bool(halted):            # the AboveThreshold answer is released: post-processing
        halted_phase = ph.index
        break
      x = x_new
  out = _fallback(problem, fp) if halted_phase is not None else x
  record = {"preset": opt.preset, "sensitivity": opt.sensitivity, "relation": opt.relation,
            "tau": sched.tau, "smoothness": sched.smoothness,
            "smoothing_radius": sched.smoothing_radius, "lambda": sched.lam,
            "threshold_scale": sched.threshold_scale, "query_scale": sched.query_scale,
            "phases": rec_phases, "halted_phase": halted_phase,
            "epsilon_above_threshold": fp.epsilon_test}
  return Result(params=out, privacy=plan.privacy, gradient_evaluations=int(grads),
                record=record, debug=dbg)


user_level_accelerated_erm = register(
    "user_level_accelerated_erm", config=AcceleratedErmConfig,
    planner=filter_planner("user_level_accelerated_erm"), **_TRAITS)(run_accelerated_erm)
user_level_accelerated_erm_smoothed = register(
    "user_level_accelerated_erm_smoothed", config=AcceleratedErmSmoothedConfig,
    planner=filter_planner("user_level_accelerated_erm_smoothed"), **_TRAITS)(run_accelerated_erm)
