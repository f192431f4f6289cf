"""ReSQue private SCO driver (paper 002, Section 4, Theorems 3-4), item level, replace-one.

* Theorem 3 private ERM (:func:`private_erm`): ball acceleration with O_ls = Alg. 7,
  O_bo = Alg. 5, O_sp = Alg. 6 (the ``v``-update uses Alg. 6's estimate).
* Prop. 11 / Theorem 4 (:func:`resque_private_sco`): phased localization over disjoint
  batches ``n_i = n / 2^i`` with ``lam_i = 1/(eta_i n_i)``, ``eta_i = 4^-i eta``
  (reconstruction of [FKT20]).

The run executes the data-free plan of :mod:`.plan` (every worst-case Alg. 4 call charged
before anything runs); a per-phase guard ledger also spends each REALIZED call before it runs
and refuses one beyond the phase budget. The reported ``(eps, delta)`` and
``gradient_evaluations`` are the plan's; realized counts (data dependent through the
bisection) go to ``Result.debug`` only.

Constant sets (``constants``): ``"explicit"`` (Lemma 7's proof constants) or ``"c_priv"``
(``tau = C_priv (beta log(1/delta) T/n)^2``, the paper's unspecified universal constant).
Provenance: ``theorem`` only with the explicit constants AND every precondition holding for
every planned call, else ``heuristic`` (the notes list the violated conditions). The
``theory`` preset checks eq. (30)-(34) and raises :class:`PrivacyPreconditionError`; at
CPU-scale ``n`` it always does (``rho/r >= 1728 log^2`` forces ``r`` tiny).

Declared constants, not enforced: Lemma 5's drift bound
``||y_{T_i} - y'_{T_i}||^2 <= 1500 b_i^2 (eta_i L)^2`` (eq. (25)) with noise
``sigma_i = L eta_i / beta`` needs every queried gradient norm ``<= L`` and a *convex* loss
(eq. (18)); clipping to L would break convexity (spec 002 §7.1). R is enforced (every step is
projected). On a user's loss a ``theorem`` report becomes ``declared``
(:mod:`dpsco_jax.algorithms.declared`). Audit hook: :func:`resque_private_releases`."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from dpsco_jax.algorithms.resque.config import ResquePrivateConfig
from dpsco_jax.algorithms.registration import register
from dpsco_jax._checks import check_bool
from dpsco_jax.algorithms.resque import ball_acceleration as ba
from dpsco_jax.algorithms.common import ProgressFn, mesh_users_axis, progress_due
from dpsco_jax.algorithms.resque.accounting import RELATION, call_event
from dpsco_jax.algorithms.resque.plan import (PhasePlan, PrivateERMConfig, ResquePrivatePlan,
                                              resque_private_planner)
from dpsco_jax.algorithms.resque.solvers import (Alg4, Alg4Plan, alg4_phase_releases,
                                                 flat_items, high_probability_solver,
                                                 localized_resque_sgd, mlmc_prox_estimator,
                                                 problem_items, strongly_convex_resque)
from dpsco_jax.privacy.ledger import PrivacyBudgetExceeded, PrivacyLedger
from dpsco_jax.result import Result

PyTree = Any


# ============================================================ private ERM (Theorem 3) ==


def private_erm(loss_fn: Callable, items: PyTree, x_init: PyTree, key: jax.Array, *,
                cfg: PrivateERMConfig, beta: float, lipschitz: float, R: float,
                reg_lam: float = 0.0, reg_center: PyTree | None = None,
                ball_center: PyTree | None = None,
                charge: Callable[[int, float, str], None] | None = None,
                alg4: Alg4 | None = None) -> tuple[PyTree, dict]:
  """Theorem 3 / Corollary 3: ball acceleration on ``F = f^erm_rho + reg_lam/2 |x - c|^2`` over
  ``B_R(ball_center)`` with O_ls = Alg. 7, O_bo = Alg. 5, O_sp = Alg. 6. Each oracle's two
  quadratics merge into ``(lam + reg_lam)/2 |x - c'|^2`` with
  ``c' = (lam y + reg_lam c)/(lam + reg_lam)``. ``charge`` and ``alg4``: see :mod:`.solvers`."""
  r, rho = cfg.r, cfg.rho
  reg_center = x_init if reg_center is None else reg_center
  ball_center = x_init if ball_center is None else ball_center

  def merged(y, lam):
    lt = lam + reg_lam
    c = jax.tree.map(lambda yi, ci: (lam * yi + reg_lam * ci) / lt, y, reg_center)
    return dict(radius=r, rho=rho, beta=beta, lam=lt, lipschitz=lipschitz, reg_center=c,
                charge=charge, alg4=alg4)

  def ls_oracle(k, y, lam, phi):
    x = high_probability_solver(loss_fn, items, y, k, runs=cfg.runs_ls, T=cfg.T_ls,
                                **merged(y, lam))
    return x, ba.OracleCost(1, 0)

  def bo_oracle(k, y, lam, phi):
    x = strongly_convex_resque(loss_fn, items, y, k, T=cfg.T_bo, **merged(y, lam))
    return x, ba.OracleCost(1, 0)

  def sp_oracle(k, y, lam):
    return mlmc_prox_estimator(loss_fn, items, y, k, T=cfg.T_sp, j_max=cfg.j_max,
                               copies=cfg.mlmc_copies, **merged(y, lam))

  # ReSQue Prop. 1's lam_star/C_ba exceeds CJJS21's lam_max = 2L/r when kappa is small (the
  # log^2 kappa factor); practical deviation: cap lam_min at lam_max/8.
  lam_star = ba.resque_accel_params(lipschitz, r, R, cfg.eps_opt)["lam_star"] / cfg.c_ba
  lam_min = min(lam_star, 2.0 * lipschitz / r / 8.0)
  res = ba.ball_acceleration(bo_oracle, x_init, key, R=R, r=r, eps=cfg.eps_opt,
                             lipschitz=lipschitz, c_ba=cfg.c_ba, lam_min=lam_min,
                             max_iter=cfg.max_iter,
                             max_bisection=cfg.max_bisection, ls_oracle=ls_oracle,
                             prox_oracle=sp_oracle, center=ball_center)
  return res.x, {"iterations": res.iterations, "oracle_calls": res.oracle_calls,
                 "exit": res.exit}


# ===================================================== private SCO (Prop. 11 / Theorem 4) ==


def _run_phase(problem, batch, x, key, ph: PhasePlan, plan: ResquePrivatePlan,
               alg4: Alg4 | None = None) -> tuple[PyTree, dict]:
  """Runs phase ``ph``; a per-phase guard ledger spends every REALIZED call before it runs and
  refuses one beyond ``(ph.eps, ph.delta)`` (the plan already covers the worst case)."""
  p = ph.p
  guard = PrivacyLedger(delta=ph.delta, epsilon_budget=ph.eps, relation=RELATION)
  counter = {"grads": 0, "calls": 0}
  violations: dict[str, int] = {}

  def charge(T, b, label):
    event, cond = call_event(T, b, **p["kw"])
    trial = copy.deepcopy(guard).compose(event, label=label)
    if trial.extra_delta() > ph.delta * (1 + 1e-9):
      raise PrivacyBudgetExceeded(f"{label}: delta would exceed {ph.delta:.3g}; not run")
    guard.spend(event, label=label)  # raises before the call runs
    counter["grads"] += 2 ** int(math.floor(math.log2(T))) - 1
    counter["calls"] += 1
    for name, ok in cond.items():
      if not ok:
        violations[name] = violations.get(name, 0) + 1

  x, info = private_erm(problem.loss_fn, batch, x, key, cfg=p["erm"], beta=p["beta"],
                        lipschitz=plan.lipschitz, R=plan.radius, reg_lam=p["lam"], reg_center=x,
                        ball_center=problem.init_params(), charge=charge, alg4=alg4)
  debug = {"alg4_calls": counter["calls"], "gradients": counter["grads"],
           "realized_epsilon": guard.epsilon(exact=True), "violations": violations, **info}
  return x, debug


def _phase_batches(plan: ResquePrivatePlan, items: dict) -> list[dict]:
  """The disjoint item batches of the localization phases (in order)."""
  out, off = [], 0
  for ph in plan.phases:
    out.append(jax.tree.map(lambda a: a[off:off + ph.n], items))
    off += ph.n
  return out


class PlannedCallProgress:
  """A run's progress in PLANNED Alg. 4 calls (``plan.num_steps``): a realized call advances
  the count, never past its phase's planned calls, and a phase's end reports the calls it did
  not need, so every run reports the same steps (only their timing depends on the data).
  Reports are made on the host (the adaptive loop reads every output)."""

  def __init__(self, progress: ProgressFn, total: int):
    self.progress, self.total = progress, int(total)
    self.done = self.reported = self.phase_end = 0

  def phase(self, alg4: Alg4 | None, planned_calls: int) -> Alg4:
    """``alg4`` (default :func:`localized_resque_sgd`) counting its calls as the next phase's."""
    self.phase_end += int(planned_calls)
    run = localized_resque_sgd if alg4 is None else alg4

    def counted(*args, **kwargs):
      out = run(*args, **kwargs)
      self._advance(min(self.done + 1, self.phase_end))
      return out
    return counted

  def end_phase(self) -> None:
    self._advance(self.phase_end)

  def _advance(self, done: int) -> None:
    self.done = done
    for step in range(self.reported + 1, done + 1):
      if progress_due(step, self.total):
        self.progress(step, self.total)
    self.reported = done


def _execute(problem, plan: ResquePrivatePlan, key: jax.Array, items: dict, *,
             alg4_for_phase: Callable[[int], Alg4 | None] = lambda i: None,
             progress: ProgressFn | None = None) -> tuple[PyTree, list[dict]]:
  """Runs the planned phases; phase ``i`` uses key ``fold_in(key, i)`` and warm-starts from the
  previous output. ``progress``: :class:`PlannedCallProgress`."""
  x, debug = problem.init_params(), []
  tracker = None if progress is None else PlannedCallProgress(progress, plan.num_steps)
  for ph, batch in zip(plan.phases, _phase_batches(plan, items)):
    alg4 = alg4_for_phase(ph.index)
    if tracker is not None:
      alg4 = tracker.phase(alg4, ph.planned_calls)
    x, dbg = _run_phase(problem, batch, x, jax.random.fold_in(key, ph.index), ph, plan, alg4)
    if tracker is not None:
      tracker.end_phase()
    debug.append(dbg)
  return x, debug


@register("resque_private_sco", config=ResquePrivateConfig, paper="002",
          planner=resque_private_planner, level="item", reads_m=True,
          mesh=True)   # each round's oracle calls split over it
def resque_private_sco(plan, problem, key: jax.Array) -> Result:
  """Private SCO (Theorem 4): phased localization (Prop. 11) of private ERM (Theorem 3).

  Item level, replace-one only (public: ``n``, the config; keys:
  :class:`~.config.ResquePrivateConfig`). Runs ``plan.detail`` (a
  :class:`~.plan.ResquePrivatePlan`) and reports ``plan.privacy``: every planned Alg. 4 call is
  an :class:`ApproxRdpEvent` on one budgeted :class:`PrivacyLedger`, summed (Lemma 3) and
  converted once (Corollary 1); ``parallel`` phases are ledger groups."""
  rplan: ResquePrivatePlan = plan.detail
  items, alg4 = problem_items(problem), (lambda i: None)
  mesh = getattr(problem, "mesh", None)
  if mesh is not None:   # each round's oracle calls split over the users axis (draw_queries)
    mesh_users_axis(mesh)   # a mesh without the users axis is refused, naming it
    users = NamedSharding(mesh, PartitionSpec("users"))
    items = jax.device_put(items, NamedSharding(mesh, PartitionSpec()))   # replicated
    alg4 = lambda i: functools.partial(localized_resque_sgd, users=users)   # noqa: E731
  # progress: the planned Alg. 4 calls, epsilon None until the last report (api.Progress)
  x, debug_phases = _execute(problem, rplan, key, items, alg4_for_phase=alg4,
                             progress=getattr(problem, "progress", None))
  records = [{"n": ph.n, "eps": ph.eps, "beta": ph.p["beta"], "lam": ph.p["lam"],
              "r": ph.p["erm"].r, "rho": ph.p["erm"].rho, "alpha": ph.p["alpha"],
              "num_steps": ph.p["t_cap"], "planned_alg4_calls": ph.planned_calls,
              "planned_gradients": ph.gradients, "max_iter": ph.p["erm"].max_iter}
             for ph in rplan.phases]
  debug = ({"phases": debug_phases, "gradients": sum(p["gradients"] for p in debug_phases)}
           if plan.config.debug is True else None)  # only a real bool
  # gradient_evaluations: the data-independent worst-case plan (the realized count depends on
  # the data through the bisection and is only in debug)
  return Result(params=x, privacy=plan.privacy,
                gradient_evaluations=int(sum(ph.gradients for ph in rplan.phases)),
                record={"phases": records, "preset": rplan.preset, "constants": rplan.constants},
                debug=debug)


# ================================================================================ audit hook ==

@dataclasses.dataclass(frozen=True)
class Alg4Call:
  """One realized Alg. 3/4 call as the audit hook sees it: ``releases`` (leaves ``[k, ...]``),
  the phases' noisy outputs (one planned :class:`ApproxRdpEvent`); ``output``, the projected
  last release; ``inputs``, the call's arguments (chosen from earlier releases); ``indices``,
  the items queried. Keys and indices stay out of the repr."""
  phase: int                 # localization phase (its disjoint batch of items)
  T: int
  beta: float
  plan: Alg4Plan
  releases: PyTree
  output: PyTree
  indices: jax.Array = dataclasses.field(repr=False)
  inputs: dict = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class ResqueReleases:
  """The data-free plan and every realized Alg. 4 call in order."""
  plan: ResquePrivatePlan
  calls: tuple[Alg4Call, ...]


def _call_record(loss_fn, items, center, key, *, phase, add_noise, forced=None, **kw):
  out, releases, z, a4 = alg4_phase_releases(loss_fn, items, center, key, add_noise=add_noise,
                                             forced=forced, **kw)
  return Alg4Call(phase, kw["T"], kw["beta"], a4, releases, out, z,
                  {"center": center, "key": key, **kw})


def resque_private_releases(problem, cfg: dict, key: jax.Array, *, add_noise: bool = True,
                            data: dict | None = None,
                            forced: ResqueReleases | None = None) -> ResqueReleases:
  """Audit hook: every Alg. 3/4 call :func:`resque_private_sco` makes on ``data``, with its
  per-phase noisy releases (:class:`Alg4Call`).

  Same plan, keys and calls as the driver; ``data`` (default ``problem.data``) is the dataset
  under test, of which the planner reads the public size (and charges first). ``forced`` (a
  reference run's result, e.g. on the neighbour) REPLAYS its calls on ``data``: same inputs
  and keys, phase ``i > 0`` starting from the reference's release ``i-1``, the coupling of
  Lemma 5 (each release moves by at most :data:`~.accounting.LEMMA5_DRIFT` ``b_i eta_i L``).
  ``add_noise=False`` is a TEST HOOK; neither option is ever a release."""
  check_bool(add_noise, "add_noise")
  plan = resque_private_planner(problem, cfg, data=data).detail
  items = flat_items(problem.data if data is None else data)
  if forced is not None:
    if not isinstance(forced, ResqueReleases):
      raise TypeError(f"forced must be a ResqueReleases, got {type(forced).__name__}")
    if forced.plan != plan:
      raise ValueError("forced: the reference run has a different plan (not a neighbour "
                       "under replace_one with the same config)")
    batches = _phase_batches(plan, items)
    return ResqueReleases(plan, tuple(
        _call_record(problem.loss_fn, batches[c.phase - 1], phase=c.phase,
                     add_noise=add_noise, forced=c.releases, **c.inputs)
        for c in forced.calls))
  calls: list[Alg4Call] = []

  def recorder(phase: int) -> Alg4:
    def alg4(loss_fn, batch, center, key, **kw):
      calls.append(_call_record(loss_fn, batch, center, key, phase=phase,
                                add_noise=add_noise, **kw))
      return calls[-1].output, calls[-1].plan
    return alg4

  _execute(problem, plan, key, items, alg4_for_phase=recorder)
  return ResqueReleases(plan, tuple(calls))
