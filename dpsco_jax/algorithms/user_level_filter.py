"""User-level DP-SCO with private outlier removal (paper 000: Lowy, Liu, Asi, NeurIPS 2024).

Algorithms (spec ``shared/specs/000_user_level_dpsco.md``):

* ``user_level_phased_sgd`` — **Algorithm 1** (linear time, ``<= nm`` gradients). Disjoint phases
  ``D_i``; each split into ``C`` disjoint groups; one-pass projected SGD per group (``vmap`` over
  groups of a ``lax.scan``; items in a uniformly random order, i.e. without replacement, as
  in the proof of Lemma B.4; the average of ``x_1..x_T``, spec §7 item 12); FILTER on the ``C``
  averaged iterates (score radius ``tau_i``, degree radius ``2 tau_i``); one-shot Laplace test
  ``s + Lap(b) >= 4C/5`` (line 13); output perturbation ``x_i = mean + N(0, sigma_i^2 I)``
  (line 25); on a failed test the whole run releases the data-independent fallback point
  (line 22 "output 0", spec §7 item 9); optional projection of ``x_i`` (post-processing,
  spec §7 item 10).
* ``user_level_accelerated_erm`` — **Algorithms 2-3**. Phased regularized ERM
  ``F_i(x) = mean_{Z in D_i} F(x, Z) + lambda_i/2 ||x - x_{i-1}||^2`` solved by multi-stage AC-SA
  through the chain ``[clip_per_user] -> outlier_filter -> add_gaussian_noise ->
  add_prox_to_anchor -> acsa``: per step a uniformly random ``K_i``-subset of ``D_i``
  *without* replacement (spec §7 item 2), per-user gradients at AC-SA's query point ``x_md``
  (item 3), FILTER at radius ``2 tau`` with AboveThreshold halting (threshold drawn once per
  phase, item 1), Gaussian noise, the data-independent prox term *after* the noise, output
  ``x_ag``. A halt in any phase releases the fallback point (item 9).
* ``user_level_accelerated_erm_smoothed`` — Section 4: Algorithm 3 on the uniform-ball
  convolution ``f_r`` with a fresh ``y ~ Unif(B_r)`` per (step, user, item) and
  ``beta = L sqrt(d)/r`` (Lemma D.1, Thm D.3).

Privacy (spec §3). FILTER, not clipping, is what bounds the sensitivity: kept sets have diameter
``<= 2 r_h`` and, with common coins, neighbouring kept sets differ in ``<= 1 + k(zeta)`` points,
so the filtered mean moves by at most ``Delta = 4 r_h (1 + k(zeta)) / (f K)`` w.p. ``1 - zeta``
on the good event (``f = 2/3`` Alg. 1, ``1/10`` Alg. 2; explicit constants derived in
:func:`~dpsco_jax.algorithms.user_level_schedules.certified_sensitivity`; the paper only gives
``O(tau log(1/zeta)/K)``, Lemmas B.2/C.2). Per phase:

* Alg. 1: Laplace test (pure ``2/b``-DP) + one Gaussian mechanism of shift ``Delta_i``.
* Alg. 2: AboveThreshold (pure ``eps_AT``) + ``T_i`` subsampled (without replacement,
  ``K_i`` of ``n_i``) Gaussian mechanisms of shift ``Delta_i``.

Phases use disjoint users, so they compose in parallel (ledger ``group=phase``). Pure-DP parts
are added by basic composition (a pure-DP mechanism is not a Laplace mechanism, so it is not
folded into the RDP curve). The Gaussian parts use the RDP accountant under replace-one
(``SampledWithoutReplacementDpEvent`` exists only there), at ``delta/2``; the other ``delta/2``
covers the coupling failures ``zeta`` and the bad noise events.

Presets and provenance:

* ``theory`` — paper constants (:class:`PaperConstants`), preconditions raise; noise from the
  paper's ``sigma_i``; provenance ``theorem`` (Thms B.1/C.1/D.3). The accountant's epsilon for
  the same sigma (with the explicit sensitivity) is recorded beside it.
* ``practical`` — :class:`ScaledConstants`; noise calibrated by the accountant to the certified
  sensitivity (``sensitivity: certified``). Provenance ``accountant`` when every phase's bad
  events fit in ``delta/2``; otherwise — always at n ~ 1e3, where the Laplace margins
  ``K/20`` are comparable to the noise ``16/eps`` — ``heuristic``, with the reason in the notes.
  ``sensitivity: typical`` uses ``2 r_h / K`` (no membership flips): always ``heuristic``; it
  shows the rate the method would reach at scale.
* ``noise: false`` — the non-private ablation (filter on, sigma = 0): ``heuristic``, eps = inf.

Config keys (besides the common ones): ``preset``, ``sensitivity``, ``num_phases``,
``num_groups`` (Alg. 1), ``batch_users`` (``K_i``), ``q_exp``, ``p_exp``, ``eta``, ``lam``,
``lam_scale`` (practical: multiplies Thm C.3's lambda),
``tau``, ``smoothing_radius``, ``max_steps`` (cap on ``T_i``, practical only), ``clip``,
``project_output``, ``fallback`` (``"zero"``), ``noise``, ``debug``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax._checks import check_choice, check_delta, check_epsilon, check_positive
from dpsco_jax.algorithms.common import cfg_get
from dpsco_jax.algorithms.user_level_schedules import (Alg1Schedule, Alg3Schedule,
                                                       alg1_schedule, alg3_schedule,
                                                       certified_sensitivity,
                                                       good_event_failure,
                                                       typical_sensitivity)
from dpsco_jax.grads import per_user_grads
from dpsco_jax.privacy import (PrivacyLedger, PrivacyReport, Provenance,
                                      calibrate_noise_multiplier, pure_dp_event)
from dpsco_jax.privacy.sparse_vector import (above_threshold_epsilon, laplace_test,
                                             laplace_test_epsilon)
from dpsco_jax.problems import SCOProblem, make as make_core_problem
from dpsco_jax.result import Result
from dpsco_jax.smoothing import smoothing_offsets
from dpsco_jax.transforms.clipping import clip_per_user
from dpsco_jax.transforms.filtering import (filter_halted, filter_points, find_filter_state,
                                            outlier_filter)
from dpsco_jax.transforms.noise import add_gaussian_noise, tree_gaussian_like
from dpsco_jax.transforms.steps import (acsa, add_prox_to_anchor, project_l2_ball,
                                        projected_sgd, released_params)

PyTree = Any
RELATION = "replace_one"   # Definition 1.3: neighbouring datasets replace one user
SENSITIVITIES = ("certified", "typical")

__all__ = ["user_level_phased_sgd", "user_level_accelerated_erm",
           "user_level_accelerated_erm_smoothed", "corrupt_users", "hinge_problem",
           "ALGORITHMS", "PROBLEMS"]


# ----------------------------------------------------------------------------- helpers

def _common(problem: SCOProblem, cfg: dict) -> tuple[float, float, str, str, bool, bool]:
  eps = check_epsilon(cfg["epsilon"])
  delta = check_delta(cfg["delta"])
  preset = check_choice(cfg_get(cfg, "preset", "practical"), "preset", ("theory", "practical"))
  sens = check_choice(cfg_get(cfg, "sensitivity", "certified"), "sensitivity", SENSITIVITIES)
  noise = bool(cfg_get(cfg, "noise", True))
  debug = bool(cfg_get(cfg, "debug", False))
  return eps, delta, preset, sens, noise, debug


def _fallback(problem: SCOProblem, cfg: dict) -> PyTree:
  """The data-independent point released on a halt ("output 0", Alg. 1 line 22 / Alg. 2
  line 18). ``0`` is inside every centred ball; ``fallback: init`` uses ``init_params()``."""
  choice = check_choice(cfg_get(cfg, "fallback", "zero"), "fallback", ("zero", "init"))
  p = problem.init_params()
  return jax.tree.map(jnp.zeros_like, p) if choice == "zero" else p


def _user_permutation(key: jax.Array, n: int) -> np.ndarray:
  return np.asarray(jax.random.permutation(key, n))


def _take(data: PyTree, idx: np.ndarray) -> PyTree:
  return jax.tree.map(lambda x: x[idx], data)


def _pure_ledger(delta: float, budget: float) -> PrivacyLedger:
  """Ledger of the pure-DP tests (one per phase, parallel across phases). A single pure
  ``eps``-DP event has the same ``eps`` under every neighbouring relation; PLD converts the
  Laplace event exactly but only under add/remove, hence that label here. The score's
  sensitivity 2 already is the replace-one bound."""
  return PrivacyLedger(delta=delta, epsilon_budget=budget, relation="add_remove",
                       accountant="pld")


def _nonprivate_report() -> PrivacyReport:
  """``noise: false`` ablation: not private at all (filter on, sigma = 0)."""
  return PrivacyReport(epsilon=math.inf, delta=1.0 - 1e-12, provenance="none", level="none",
                       relation=RELATION, notes="non-private ablation: filter on, sigma = 0")


def _provenance_note(bad: float, delta_slack: float) -> tuple[str, str]:
  if bad <= delta_slack:
    return (Provenance.ACCOUNTANT.value,
            f"good events hold except w.p. {bad:.3g} <= delta/2; Gaussian parts by the RDP "
            "accountant (replace-one), pure parts by basic composition")
  return (Provenance.HEURISTIC.value,
          f"the coupling's bad events (Laplace noise beyond the K/20 margins, flip tails) "
          f"have probability {bad:.3g} > delta/2 = {delta_slack:.3g} at this scale, so the "
          "accountant's number is not a proven (eps, delta); needs larger K_i (spec 000 §3.2)")


# ------------------------------------------------------------------------- Algorithm 1

@functools.partial(jax.jit, static_argnames=("loss_fn", "eta", "radius"))
def _sgd_groups(loss_fn: Callable, items: PyTree, x0: PyTree, key: jax.Array, *, eta: float,
                radius: float) -> PyTree:
  """One-pass projected SGD in every group, vmapped: ``items`` leaves ``[C, T, ...]``.

  Items are visited in a fresh uniformly random order (sampling without replacement, proof
  of Lemma B.4); the output is the uniform average of ``x_1..x_T`` (core ``projected_sgd``
  with ``averaging="uniform"``)."""
  tx = projected_sgd(eta, radius=radius, averaging="uniform")
  grad = jax.grad(loss_fn)

  def one_group(group_items, k):
    t = jax.tree.leaves(group_items)[0].shape[0]
    order = jax.random.permutation(k, t)
    ordered = jax.tree.map(lambda x: x[order], group_items)

    def body(carry, item):
      params, state = carry
      upd, state = tx.update(grad(params, item), state, params)
      return (optax.apply_updates(params, upd), state), None

    (params, state), _ = jax.lax.scan(body, (x0, tx.init(x0)), ordered)
    return released_params(state, params)

  c = jax.tree.leaves(items)[0].shape[0]
  return jax.vmap(one_group)(items, jax.random.split(key, c))


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


def _alg1_schedule(problem: SCOProblem, cfg: dict, eps: float, delta: float,
                   preset: str) -> Alg1Schedule:
  return alg1_schedule(n=problem.n_users, m=problem.m, d=problem.d, epsilon=eps, delta=delta,
                       lipschitz=problem.lipschitz, radius=problem.radius,
                       smoothness=problem.smoothness, preset=preset,
                       q_exp=cfg.get("q_exp"), p_exp=cfg.get("p_exp"), eta=cfg.get("eta"),
                       num_groups=cfg.get("num_groups"), num_phases=cfg.get("num_phases"))


def user_level_phased_sgd(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """Algorithm 1 of paper 000 (see module docstring)."""
  eps, delta, preset, sens_mode, noise_on, debug = _common(problem, cfg)
  sched = _alg1_schedule(problem, cfg, eps, delta, preset)
  c = sched.num_groups
  eps_test = laplace_test_epsilon(sched.laplace_scale, 2.0)       # score sensitivity 2
  if eps_test >= eps:
    raise ValueError(f"the Laplace test alone spends {eps_test:.3g} >= epsilon={eps}")
  eps_gauss, delta_gauss = eps - eps_test, delta / 2
  project = bool(cfg_get(cfg, "project_output", preset == "practical"))
  radius = problem.radius
  ledger = PrivacyLedger(delta=delta_gauss, epsilon_budget=eps_gauss if noise_on else None,
                         relation=RELATION, accountant="rdp")
  pure = _pure_ledger(delta, eps_test)
  k_perm, k_run = jax.random.split(key)
  perm = _user_permutation(k_perm, problem.n_users)
  x = problem.init_params()
  start, halted_phase, worst_bad = 0, None, 0.0
  sigmas, deltas = [], []
  dbg: dict = {"scores": [], "num_kept": []} if debug else None
  grads = 0
  for ph in sched.phases:
    zeta = delta / (4.0 * len(sched.phases))
    r_h = 2.0 * ph.tau
    if not noise_on:
      sens = math.nan
    elif sens_mode == "certified":
      sens = certified_sensitivity(r_h, c, zeta, min_kept_fraction=2.0 / 3.0)
    else:
      sens = typical_sensitivity(r_h, c)
    bad = good_event_failure(c, math.inf, sched.laplace_scale, 1, 2.0 / 15.0) + zeta
    worst_bad = max(worst_bad, bad)
    if not noise_on:
      sigma = 0.0
    elif preset == "theory":
      sigma = ph.sigma_paper
      ledger.compose(dp_accounting.GaussianDpEvent(sigma / sens), label=f"phase{ph.index}",
                     group=f"phase{ph.index}")
    else:
      z = calibrate_noise_multiplier(lambda z: dp_accounting.GaussianDpEvent(z),
                                     epsilon=eps_gauss, delta=delta_gauss, relation=RELATION,
                                     accountant="rdp")
      sigma = z * sens
      ledger.spend(dp_accounting.GaussianDpEvent(z), label=f"phase{ph.index} output "
                   f"perturbation (z={z:.4g}, Delta={sens:.4g})", group=f"phase{ph.index}")
    if noise_on:
      pure.spend(pure_dp_event(eps_test), label=f"phase{ph.index} Laplace test",
                 group=f"phase{ph.index}")
    sigmas.append(sigma)
    deltas.append(sens)
    users = perm[start:start + ph.n_users]
    start += ph.n_users
    used = users[:c * ph.users_per_group]          # floor(n_i / C) users per group
    items = jax.tree.map(
        lambda a: a[used].reshape((c, ph.users_per_group * problem.m) + a.shape[2:]),
        problem.data)
    k_sgd, k_rel = jax.random.split(jax.random.fold_in(k_run, ph.index))
    pts = _sgd_groups(problem.loss_fn, items, x, k_sgd, eta=ph.eta, radius=radius)
    grads += c * ph.steps
    passed, x_new, res = _filter_release(pts, k_rel, tau=ph.tau,
                                         lap_scale=sched.laplace_scale,
                                         threshold=sched.threshold, sigma=sigma)
    if debug:
      dbg["scores"].append(float(res.score))
      dbg["num_kept"].append(int(res.num_kept))
    if not bool(passed):           # the released test bit: host branching is post-processing
      halted_phase = ph.index
      break
    x = project_l2_ball(x_new, radius) if project else x_new
  out = _fallback(problem, cfg) if halted_phase is not None else x

  report = _report(
      noise_on, preset=preset, sens_mode=sens_mode, eps=eps, delta=delta,
      acc_eps=eps_test + ledger.epsilon() if noise_on else 0.0, worst_bad=worst_bad,
      theorem="Theorem B.1 (paper constants, preconditions checked); accountant with "
              "explicit Delta",
      typical="typical sensitivity 2 r_h / C (no membership flips) is not a worst-case bound",
      mechanisms=("laplace_test", "filter", "gaussian_output_perturbation"))
  record = {"preset": preset, "sensitivity": sens_mode, "num_groups": c,
            "phases": [ph.__dict__ for ph in sched.phases], "sigma": sigmas,
            "sensitivity_values": deltas, "laplace_scale": sched.laplace_scale,
            "halted_phase": halted_phase, "eta": sched.eta}
  return Result(params=out, privacy=report, gradient_evaluations=int(grads), record=record,
                debug=dbg)


def _report(noise_on: bool, *, preset: str, sens_mode: str, eps: float, delta: float,
            acc_eps: float, worst_bad: float, theorem: str, typical: str,
            mechanisms: tuple[str, ...]) -> PrivacyReport:
  """The provenance rule shared by Algorithms 1 and 3: ``theory`` -> theorem (the paper's
  epsilon, the accountant's beside it); ``typical`` sensitivity -> heuristic; ``certified`` ->
  accountant only when the coupling's bad events fit in delta/2 (``_provenance_note``)."""
  if not noise_on:
    return _nonprivate_report()
  if preset == "theory":
    prov, note, rep_eps = (Provenance.THEOREM.value,
                           f"{theorem} gives eps={acc_eps:.4g}", eps)
  elif sens_mode == "typical":
    prov, note, rep_eps = Provenance.HEURISTIC.value, typical, acc_eps
  else:
    (prov, note), rep_eps = _provenance_note(worst_bad, delta / 2), acc_eps
  return PrivacyReport(epsilon=rep_eps, delta=delta, provenance=prov, level="user",
                       relation=RELATION, mechanisms=mechanisms, paper_epsilon=eps,
                       notes=note)


# ---------------------------------------------------------------------- Algorithms 2-3

@functools.partial(jax.jit, static_argnames=(
    "loss_fn", "batch", "steps", "lam", "smoothness", "sigma", "filter_radius",
    "threshold_fraction", "threshold_scale", "query_scale", "radius", "stage_length",
    "smoothing_radius", "clip", "debug"))
def _alg2_phase(loss_fn: Callable, data: PyTree, x_prev: PyTree, key: jax.Array, *,
                batch: int, steps: int, lam: float, smoothness: float, sigma: float,
                filter_radius: float, threshold_fraction: float, threshold_scale: float,
                query_scale: float, radius: float | None, stage_length: int,
                smoothing_radius: float | None, clip: float | None, debug: bool):
  """Algorithm 2 on one phase's users ``data`` (leaves ``[n_i, m, ...]``), jitted; one compile
  per distinct static configuration, reused across seeds. Returns ``(x_ag, halted, filter
  state)``."""
  n_i = jax.tree.leaves(data)[0].shape[0]
  m = jax.tree.leaves(data)[0].shape[1]
  k_filter, k_noise, k_sample, k_smooth = jax.random.split(key, 4)
  stages = [] if clip is None else [clip_per_user(clip)]
  tx = optax.chain(
      *stages,
      outlier_filter(batch, filter_radius, key=k_filter, threshold_fraction=threshold_fraction,
                     threshold_scale=threshold_scale, query_scale=query_scale, debug=debug),
      add_gaussian_noise(sigma, k_noise),
      add_prox_to_anchor(lam, anchor=x_prev),
      acsa(smoothness + lam, strong_convexity=lam, radius=radius, stage_length=stage_length))

  def body(carry, t):
    params, state = carry
    if batch < n_i:   # uniformly random K_i-subset, fresh each step (spec §7 item 2)
      idx = jax.random.choice(jax.random.fold_in(k_sample, t), n_i, (batch,), replace=False)
      users = jax.tree.map(lambda a: a[idx], data)
    else:
      users = data
    offsets = None
    if smoothing_radius is not None:
      offsets = smoothing_offsets(jax.random.fold_in(k_smooth, t), params, smoothing_radius,
                                  batch, m)
    g = per_user_grads(loss_fn, params, users, offsets=offsets)
    upd, new_state = tx.update(g, state, params)
    new_params = optax.apply_updates(params, upd)
    was_halted, now_halted = filter_halted(state), filter_halted(new_state)
    # Once halted: params frozen from the halting step on, the whole state from the next.
    params = jax.tree.map(lambda a, b: jnp.where(now_halted, a, b), params, new_params)
    state = jax.tree.map(lambda a, b: jnp.where(was_halted, a, b), state, new_state)
    return (params, state), None

  (params, state), _ = jax.lax.scan(body, (x_prev, tx.init(x_prev)), jnp.arange(steps))
  return released_params(state, params), filter_halted(state), find_filter_state(state)


def _alg3_schedule(problem: SCOProblem, cfg: dict, eps: float, delta: float, preset: str,
                   smoothed: bool) -> Alg3Schedule:
  beta = math.inf if smoothed else problem.smoothness
  r = cfg.get("smoothing_radius") if smoothed else None
  lam = cfg.get("lam")
  scale = cfg.get("lam_scale")
  if scale is not None:     # practical: multiply the Thm C.3 lambda (more localization)
    if preset == "theory":
      raise ValueError("lam_scale is a practical-preset option")
    n, m, d, L, R = problem.n_users, problem.m, problem.d, problem.lipschitz, problem.radius
    lam = check_positive(scale, "lam_scale") * (L / R) * (
        1 / math.sqrt(n * m) + math.sqrt(d) / (eps * n * math.sqrt(m))) if lam is None else lam
  return alg3_schedule(n=problem.n_users, m=problem.m, d=problem.d, epsilon=eps, delta=delta,
                       lipschitz=problem.lipschitz, radius=problem.radius, smoothness=beta,
                       preset=preset, q_exp=cfg.get("q_exp"), p_exp=cfg.get("p_exp"),
                       lam=lam, batch_users=cfg.get("batch_users"),
                       num_phases=cfg.get("num_phases"), tau=cfg.get("tau"),
                       smoothing_radius=r)


def _gauss_event(z: float, n_i: int, k_i: int, steps: int) -> dp_accounting.DpEvent:
  g = dp_accounting.GaussianDpEvent(z)
  one = g if k_i >= n_i else dp_accounting.SampledWithoutReplacementDpEvent(n_i, k_i, g)
  return dp_accounting.SelfComposedDpEvent(one, steps)


def _run_alg3(problem: SCOProblem, cfg: dict, key: jax.Array, *, smoothed: bool) -> Result:
  eps, delta, preset, sens_mode, noise_on, debug = _common(problem, cfg)
  sched = _alg3_schedule(problem, cfg, eps, delta, preset, smoothed)
  max_steps = cfg.get("max_steps")
  if max_steps is not None and preset == "theory":
    raise ValueError("max_steps is a practical-preset option (theory uses the paper's T_i)")
  clip = cfg.get("clip")
  clip = None if clip in (None, False) else check_positive(
      problem.lipschitz if clip is True else clip, "clip")
  radius = problem.radius
  eps_at = above_threshold_epsilon(sched.threshold_scale, sched.query_scale, 2.0)
  if eps_at >= eps:
    raise ValueError(f"AboveThreshold alone spends {eps_at:.3g} >= epsilon={eps}")
  eps_gauss, delta_gauss = eps - eps_at, delta / 2
  ledger = PrivacyLedger(delta=delta_gauss,
                         epsilon_budget=eps_gauss if (noise_on and preset != "theory") else None,
                         relation=RELATION, accountant="rdp")
  pure = _pure_ledger(delta, eps_at)
  k_perm, k_run = jax.random.split(key)
  perm = _user_permutation(k_perm, problem.n_users)
  x = problem.init_params()
  start, halted_phase, worst_bad, grads = 0, None, 0.0, 0
  rec_phases, dbg = [], ({"phases": []} if debug else None)
  for ph in sched.phases:
    steps = ph.steps if max_steps is None else min(ph.steps, int(max_steps))
    stage = min(ph.stage_length, steps)
    zeta = delta / (4.0 * steps * len(sched.phases))
    r_h = 2.0 * sched.tau
    if not noise_on:
      sens = math.nan
    elif sens_mode == "certified":
      sens = certified_sensitivity(r_h, ph.batch, zeta, min_kept_fraction=0.1)
    else:
      sens = typical_sensitivity(r_h, ph.batch)
    bad = good_event_failure(ph.batch, sched.threshold_scale, sched.query_scale, steps,
                             1.0 / 20.0) + steps * zeta
    worst_bad = max(worst_bad, bad)
    z = math.nan
    if not noise_on:
      sigma = 0.0
    elif preset == "theory":
      sigma = ph.sigma_paper
      ledger.compose(_gauss_event(sigma / sens, ph.n_users, ph.batch, steps),
                     label=f"phase{ph.index}", group=f"phase{ph.index}")
    else:
      make = functools.partial(_gauss_event, n_i=ph.n_users, k_i=ph.batch, steps=steps)
      z = calibrate_noise_multiplier(make, epsilon=eps_gauss, delta=delta_gauss,
                                     relation=RELATION, accountant="rdp")
      sigma = z * sens
      ledger.spend(make(z), label=f"phase{ph.index}: {steps} x Gaussian (z={z:.4g}, "
                   f"Delta={sens:.4g}, K={ph.batch} of {ph.n_users})", group=f"phase{ph.index}")
    if noise_on:
      pure.spend(pure_dp_event(eps_at), label=f"phase{ph.index} AboveThreshold",
                 group=f"phase{ph.index}")
    users = perm[start:start + ph.n_users]
    start += ph.n_users
    x_new, halted, fstate = _alg2_phase(
        problem.loss_fn, _take(problem.data, users), x, jax.random.fold_in(k_run, ph.index),
        batch=ph.batch, steps=steps, lam=ph.lam, smoothness=sched.smoothness, sigma=sigma,
        filter_radius=r_h, threshold_fraction=sched.threshold_fraction,
        threshold_scale=sched.threshold_scale, query_scale=sched.query_scale, radius=radius,
        stage_length=stage, smoothing_radius=sched.smoothing_radius, clip=clip, debug=debug)
    grads += steps * ph.batch * problem.m
    rec_phases.append({"index": ph.index, "n_users": ph.n_users, "batch": ph.batch,
                       "steps": steps, "lam": ph.lam, "stage_length": stage, "sigma": sigma,
                       "noise_multiplier": z, "sensitivity": sens,
                       "sigma_paper": ph.sigma_paper})
    if debug:
      d = fstate.debug
      dbg["phases"].append({"halted": bool(halted), "min_score": float(d.min_score),
                            "steps_run": int(d.steps_run),
                            "steps_all_kept": int(d.steps_all_kept)})
    if bool(halted):            # the AboveThreshold answer is released: post-processing
      halted_phase = ph.index
      break
    x = x_new
  out = _fallback(problem, cfg) if halted_phase is not None else x

  report = _report(
      noise_on, preset=preset, sens_mode=sens_mode, eps=eps, delta=delta,
      acc_eps=eps_at + ledger.epsilon() if noise_on else 0.0, worst_bad=worst_bad,
      theorem="Theorem C.1/D.3 (paper constants, preconditions checked); accountant with the "
              "explicit coupled Delta",
      typical="typical sensitivity 2 r_h / K (no membership flips) is not a worst-case bound",
      mechanisms=("above_threshold", "filter", "subsampled_gaussian_wor"))
  record = {"preset": preset, "sensitivity": sens_mode, "tau": sched.tau,
            "smoothness": sched.smoothness, "smoothing_radius": sched.smoothing_radius,
            "lambda": sched.lam, "threshold_scale": sched.threshold_scale,
            "query_scale": sched.query_scale, "phases": rec_phases,
            "halted_phase": halted_phase, "epsilon_above_threshold": eps_at}
  return Result(params=out, privacy=report, gradient_evaluations=int(grads), record=record,
                debug=dbg)


def user_level_accelerated_erm(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """Algorithm 3 (with Algorithm 2 per phase) for smooth losses (Thms 3.1/3.2)."""
  return _run_alg3(problem, cfg, key, smoothed=False)


def user_level_accelerated_erm_smoothed(problem: SCOProblem, cfg: dict,
                                        key: jax.Array) -> Result:
  """Algorithm 3 on the ball smoothing ``f_r`` (Section 4, Thm 4.1/D.3)."""
  return _run_alg3(problem, cfg, key, smoothed=True)


# ---------------------------------------------------------------------- problems of ours

def corrupt_users(problem: SCOProblem, fraction: float, *, mode: str = "flip",
                  key: jax.Array, scale: float = 100.0) -> SCOProblem:
  """A copy of ``problem`` whose random ``floor(fraction n)`` users are adversarial.

  Modes: ``flip`` (labels ``y -> 1 - y`` / ``-y``: gradients pointing the opposite way),
  ``huge`` (features times ``scale``: huge gradients), ``random`` (features replaced by random
  ``scale``-norm directions, random labels: spread outliers). Risk and optimum stay those of the
  clean population, so ``excess_risk`` measures the damage.
  """
  if not 0.0 <= fraction < 1.0:
    raise ValueError(f"fraction must lie in [0, 1), got {fraction}")
  check_choice(mode, "mode", ("flip", "huge", "random"))
  n = problem.n_users
  k = int(math.floor(fraction * n))
  bad = np.zeros(n, bool)
  bad[np.asarray(jax.random.permutation(key, n))[:k]] = True
  badj = jnp.asarray(bad)
  x, y = problem.data["x"], problem.data["y"]
  sel = lambda a, b: jnp.where(badj.reshape((-1,) + (1,) * (a.ndim - 1)), b, a)
  binary = bool(jnp.all((y == 0) | (y == 1)))
  if mode == "flip":
    y2 = sel(y, 1.0 - y if binary else -y)
    x2 = x
  elif mode == "huge":
    x2, y2 = sel(x, scale * x), y
  else:
    kx, ky = jax.random.split(jax.random.fold_in(key, 1))
    g = jax.random.normal(kx, x.shape)
    x2 = sel(x, scale * g / jnp.linalg.norm(g, axis=-1, keepdims=True))
    y2 = sel(y, jax.random.bernoulli(ky, 0.5, y.shape).astype(y.dtype) if binary
             else jax.random.normal(ky, y.shape))
  import dataclasses
  meta = dict(problem.meta, corrupted_fraction=k / n, corruption_mode=mode)
  return dataclasses.replace(problem, name=f"{problem.name}_corrupted", data={"x": x2, "y": y2},
                             meta=meta)


def hinge_loss(w: jax.Array, ex: dict) -> jax.Array:
  return jax.nn.relu(1.0 - ex["y"] * jnp.dot(ex["x"], w))


def hinge_problem(*, n_users: int, m: int, d: int, key: jax.Array, radius: float = 2.0,
                  n_eval: int = 3000) -> SCOProblem:
  """Non-smooth linear SVM (hinge loss, ``L = 1``) on the core logistic data model.

  Features uniform on the sphere, ``y in {-1, 1}`` with ``P(y = 1 | x) = sigmoid(<w*, x>)``.
  The evaluation risk integrates the label noise: ``mean_x p relu(1 - t) + (1-p) relu(1 + t)``
  with ``t = <w, x>``; its minimizer over the ``R``-ball is found by linear programming
  (HiGHS) — exact for this piecewise-linear objective; if the LP optimum leaves the ball the
  problem raises (pick a larger radius).
  """
  from scipy.optimize import linprog
  base = make_core_problem("logistic", n_users=n_users, m=m, d=d, key=key, radius=radius,
                           n_eval=n_eval)
  k_eval = jax.random.fold_in(key, 7)
  xe = jax.random.normal(k_eval, (n_eval, d))
  xe = xe / jnp.linalg.norm(xe, axis=1, keepdims=True)
  w_star = base.meta["w_star"]
  p = jax.nn.sigmoid(xe @ w_star)
  xn, pn = np.asarray(xe, np.float64), np.asarray(p, np.float64)
  # variables [w (d), u (n), v (n)]: u >= 1 - t, v >= 1 + t, u, v >= 0
  from scipy import sparse
  ne = n_eval
  cost = np.concatenate([np.zeros(d), pn / ne, (1 - pn) / ne])
  eye, zero = sparse.identity(ne, format="csr"), sparse.csr_matrix((ne, ne))
  a_ub = sparse.vstack([sparse.hstack([sparse.csr_matrix(-xn), -eye, zero]),
                        sparse.hstack([sparse.csr_matrix(xn), zero, -eye])], format="csr")
  sol = linprog(cost, A_ub=a_ub, b_ub=-np.ones(2 * ne),
                bounds=[(None, None)] * d + [(0, None)] * (2 * ne), method="highs")
  if not sol.success:
    raise RuntimeError(f"hinge optimum LP failed: {sol.message}")
  w_opt = jnp.asarray(sol.x[:d], jnp.float32)
  if float(jnp.linalg.norm(w_opt)) > radius:
    raise ValueError(f"radius={radius} is smaller than the hinge optimum's norm "
                     f"{float(jnp.linalg.norm(w_opt)):.3g}")

  def risk(w):
    t = xe @ w
    return jnp.mean(p * jax.nn.relu(1 - t) + (1 - p) * jax.nn.relu(1 + t))
  risk = jax.jit(risk)
  y_pm = 2.0 * base.data["y"] - 1.0
  import dataclasses
  return dataclasses.replace(base, name="hinge", loss_fn=hinge_loss,
                             data={"x": base.data["x"], "y": y_pm}, lipschitz=1.0,
                             smoothness=math.inf, x_opt=w_opt, risk_fn=risk,
                             opt_risk=float(risk(w_opt)), meta={"w_star": w_star})


def _problem_kwargs(cfg: dict) -> dict:
  out = {k: cfg[k] for k in ("n_users", "m", "d", "radius") if k in cfg}
  return out


def _logistic_corrupted(cfg: dict, key: jax.Array) -> SCOProblem:
  k_prob, k_bad = jax.random.split(key)
  base = make_core_problem("logistic", key=k_prob, **_problem_kwargs(cfg),
                           **{k: cfg[k] for k in ("heterogeneity", "n_eval") if k in cfg})
  return corrupt_users(base, float(cfg_get(cfg, "corruption", 0.05)),
                       mode=cfg_get(cfg, "corruption_mode", "flip"), key=k_bad,
                       scale=float(cfg_get(cfg, "corruption_scale", 100.0)))


def _hinge(cfg: dict, key: jax.Array) -> SCOProblem:
  return hinge_problem(key=key, **_problem_kwargs(cfg),
                       **({"n_eval": cfg["n_eval"]} if "n_eval" in cfg else {}))


ALGORITHMS = {
    "user_level_phased_sgd": user_level_phased_sgd,
    "user_level_accelerated_erm": user_level_accelerated_erm,
    "user_level_accelerated_erm_smoothed": user_level_accelerated_erm_smoothed,
}

PROBLEMS = {
    "logistic_corrupted": _logistic_corrupted,
    "hinge": _hinge,
}
