"""One shape for every algorithm on your own model and data: ``plan`` then ``run`` (or ``fit``).

::

    data = UserData.from_arrays({"x": X, "y": y}, user_ids, max_items_per_user=32)
    config = {"epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.5,
              "num_steps": 200, "batch_size": 64}
    p = dpsco_jax.plan("dp_sgd_user", config, data.spec)      # no data read: epsilon, noise,
    print(p.privacy.epsilon, p.noise_multiplier)              # schedule, events
    result = dpsco_jax.run(p, loss_fn, params, data, key)     # Result: params (your pytree),
                                                              # privacy, record

* ``config`` is a mapping (from Python or a YAML ``algorithm:`` section) or the algorithm's
  frozen config dataclass. It is validated against the algorithm's typed schema
  (:func:`algorithm_config`): unknown keys are refused with a suggestion, numbers must be
  numbers, required keys must be present. ``epsilon: None`` is non-private where the
  algorithm allows it (the report says so).
* :func:`plan` reads only ``spec`` (a :class:`~dpsco_jax.data.DataSpec`: number of users,
  items per user, shapes), the declared constants and the config, and returns a
  :class:`Plan` whose ``privacy`` is the guarantee the run will spend, computed by a fresh
  ledger *before any data is read*. :func:`run` executes it on the data through the
  algorithm's registered driver (which re-derives the same plan from the same public facts;
  a mismatch is a bug and raises before the result is returned).
* The theory constants (L, beta, R, mu) come from ``constants``
  (:class:`~dpsco_jax.data.ProblemConstants`): an algorithm that needs an undeclared one
  raises :class:`~dpsco_jax.data.MissingConstant` naming it.

Every registered algorithm has a planner in :mod:`dpsco_jax.planners` or is refused with the
reason (``UNSUPPORTED``): the bilevel methods need an outer and an inner loss (a
``BilevelProblem``), and ``resque_parallel_sco`` / ``minibatch_sgd`` stop at a target *excess
risk*, which needs a known optimum.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from dpsco_jax.algorithms.registry import algorithms
from dpsco_jax.config.schema import ConfigError
from dpsco_jax.data.problem import ProblemConstants, PublicFacts, UserDataProblem
from dpsco_jax.data.user_data import DataSpec, UserData
from dpsco_jax.privacy.ledger import PrivacyReport
from dpsco_jax.result import Result

__all__ = ["Plan", "plan", "run", "fit", "algorithm_config", "ITEM_LEVEL", "ITEM_GUARANTEE",
           "READS_M", "MESH_READY", "MESH_UNSUPPORTED", "BATCHED", "UNSUPPORTED", "run_seeds", "UndeclaredFact", "Progress", "print_progress"]


class UndeclaredFact(ConfigError):
  """A plan needs a public fact that was measured on the (private) data, not declared."""

#: Algorithms whose rows are items (the item view of the data: weight 1 per real item).
ITEM_LEVEL = frozenset({"dp_sgd_item", "dp_sgd_group", "resque_private_sco", "dp_loc_gd",
                        "dp_loc_sgd"})
#: Item-level guarantees (``dp_sgd_group`` lifts its item-level curve to users, so it is not
#: here): they hold only if every item is kept, since adding or removing one item of a user
#: truncated to ``max_items_per_user`` can change several of its kept items.
ITEM_GUARANTEE = ITEM_LEVEL - {"dp_sgd_group"}
#: Algorithms whose guarantee reads ``m``, the items per user: the item-row count and the
#: denominator ``q * n_users * m`` (item level), the group size (``dp_sgd_group``), per-item
#: sensitivities and certificates (papers 000, 001, 002, 004). A *measured* ``m`` (the largest
#: user's item count) is a function of the private data: one added item can double it and halve
#: the noise. These refuse a measured ``m``; every other planner's plan is the same for ``m``
#: and ``m + 1`` (``tests/test_plan_invariance.py`` checks both directions for every planner).
READS_M = frozenset({"dp_sgd_item", "dp_sgd_group", "resque_private_sco", "dp_loc_gd",
                     "dp_loc_sgd", "phased_erm_output_pert", "phased_sco_output_pert",
                     "sc_erm_output_pert", "sc_sco_output_pert", "user_level_phased_sgd",
                     "user_level_accelerated_erm", "user_level_accelerated_erm_smoothed"})
#: Algorithms whose driver, given the plan's calibrated ``noise_multiplier``, makes exactly the
#: plan again (same events, epsilon and schedule; ``tests/test_plan_invariance.py`` checks it):
#: :func:`run` hands it over, so a fit calibrates once (the driver's own calibration was most
#: of a warm ``fit_model`` epoch). ``dp_sgd_group`` and Algorithm 3 calibrate more than one
#: number, so their drivers still re-derive the plan (and ``run`` checks that it agrees);
#: Algorithm 3's per-phase calibration is memoized on its public numbers (one bisection per
#: phase per process, ``user_level_filter.plan._alg3_calibrated_z``).
REUSES_NOISE_MULTIPLIER = frozenset({
    "dp_sgd_user", "dp_sgd_item", "accelerated_dp_sgd", "accelerated_dp_srgd",
    "accelerated_dp_srgd_independent_noise", "dp_srgd_unaccelerated", "single_epoch_dp_sgd",
    "dp_loc_gd", "dp_loc_sgd"})
#: Algorithms whose per-user gradient step runs with users sharded over a mesh (``run(...,
#: mesh=)``); the others refuse a mesh rather than ignore it.
MESH_READY = frozenset({
    "nonprivate_sgd", "dp_sgd_user", "dp_sgd_item", "dp_sgd_group",
    "accelerated_dp_srgd", "dp_srgd_unaccelerated", "accelerated_dp_srgd_independent_noise",
    "accelerated_dp_sgd", "single_epoch_dp_sgd", "dp_loc_gd", "dp_loc_sgd",
    # per-user gradients sharded, FILTER pair counts split by rows (user_level_filter/mesh.py)
    "user_level_accelerated_erm", "user_level_accelerated_erm_smoothed"})
_OUTPUT_PERT = ("output perturbation: a non-private ERM solve, then one noise draw on its "
                "output; no per-user clipped gradient step to shard (the solver runs on one "
                "device)")
_NOT_ON_USER_DATA = "it does not run on a loss_fn and UserData (see UNSUPPORTED)"
#: Algorithms that refuse a mesh, with the reason (every registry name is in exactly one of
#: ``MESH_READY`` and this; ``tests/test_mesh.py`` checks it).
MESH_UNSUPPORTED = {
    "user_level_phased_sgd": "Algorithm 1 runs non-private SGD through each group's items and "
                             "releases a FILTER of the group outputs: no batched per-user "
                             "gradient step to shard",
    "resque_private_sco": "ReSQue's oracles query items at Gaussian-perturbed points inside a "
                          "host-driven bisection / MLMC loop (no clipped per-user step): not "
                          "sharded yet",
    **{name: _OUTPUT_PERT for name in (
        "naive_output_pert", "sc_output_pert", "phased_erm_output_pert",
        "phased_sco_output_pert", "sc_erm_output_pert", "sc_sco_output_pert")},
    **{name: _NOT_ON_USER_DATA for name in (
        "dp_bilevel", "dp_bilevel_minibatch", "dp_bilevel_population", "nonprivate_penalty",
        "resque_parallel_sco", "minibatch_sgd")},
}
#: Algorithms whose driver runs for a group of seeds as one ``vmap``-ed program
#: (:func:`run_seeds`, the runner's ``batch_seeds``; :mod:`dpsco_jax.sweep`): a plan computed
#: once, one jitted ``lax.scan`` with a leading seed axis, nothing read of the data outside it.
#: The others run one seed at a time (their records say ``batched: false``).
BATCHED = frozenset({
    "nonprivate_sgd", "dp_sgd_user", "dp_sgd_item", "dp_sgd_group",
    "accelerated_dp_srgd", "dp_srgd_unaccelerated", "accelerated_dp_srgd_independent_noise",
    "accelerated_dp_sgd", "single_epoch_dp_sgd"})
#: Algorithms that need more than ``loss_fn`` + data, with the reason.
UNSUPPORTED = {
    **{name: "it is a bilevel method: it needs an outer and an inner loss (a BilevelProblem, "
             "see dpsco_jax.problems.bilevel), not one loss_fn"
       for name in ("dp_bilevel", "dp_bilevel_minibatch", "dp_bilevel_population",
                    "nonprivate_penalty")},
    **{name: "it stops at a target excess risk, which needs a known optimum (a synthetic "
             "problem)" for name in ("resque_parallel_sco", "minibatch_sgd")},
}
#: Keys a run reads besides the algorithm's schema.
_EXTRA_KEYS = {
    "n_users": (int, "declared (public) number of users; required under add_remove"),
    "debug": (bool, "put data-dependent diagnostics (never released) in Result.debug"),
}


def _entry(algorithm: str):
  table = algorithms()
  if not isinstance(algorithm, str) or algorithm not in table:
    import difflib
    hint = difflib.get_close_matches(str(algorithm), list(table), n=1)
    raise ConfigError(f"unknown algorithm {algorithm!r}"
                      + (f" (did you mean {hint[0]!r}?)" if hint else "")
                      + f"; known: {', '.join(sorted(table))}")
  if algorithm in UNSUPPORTED:
    raise ConfigError(f"{algorithm} cannot run on a loss_fn and UserData: "
                      f"{UNSUPPORTED[algorithm]}")
  return table[algorithm]


def algorithm_config(algorithm: str, config: Mapping | Any) -> dict:
  """The validated config of ``algorithm`` as a flat dict (what its driver reads).

  ``config``: a mapping or an instance of the algorithm's config dataclass. Errors are
  :class:`~dpsco_jax.config.schema.ConfigError` naming the key."""
  from dpsco_jax.config.schema import KeySpec, _check_type, _specs, _suggest
  entry = _entry(algorithm)
  if dataclasses.is_dataclass(config) and not isinstance(config, type):
    config = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
  if not isinstance(config, Mapping):
    raise ConfigError(f"config must be a mapping or {entry.config.__name__}, got "
                      f"{type(config).__name__}")
  allowed = _specs(entry.config, "algorithm")
  for name, (tp, doc) in _EXTRA_KEYS.items():
    allowed.setdefault(name, KeySpec(name, tp, None, doc, False, "runner"))
  given = {k: v for k, v in config.items() if k not in ("algorithm", "problem", "seed")}
  for key in given:
    if key not in allowed:
      s = _suggest(str(key), allowed)
      raise ConfigError(f"unknown key {key!r} for algorithm {algorithm!r}"
                        + (f" (did you mean {s!r}?)" if s else "")
                        + f"; it reads: {', '.join(sorted(allowed, key=str.lower))}")
  fields = {f.name for f in dataclasses.fields(entry.config)}
  # the schema's own construction checks types, required keys and requires_one_of
  typed = entry.config(**{k: v for k, v in given.items() if k in fields})
  return {k: getattr(typed, k) if k in fields else _check_type(allowed[k], v)
          for k, v in given.items()}


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything a run will release under, computed before any data is read.

  Attributes:
    algorithm: the registered name.
    config: the validated config (flat dict).
    spec: the public facts about the data the plan was made for.
    constants: the declared constants of the loss class.
    privacy: the guarantee the run spends (epsilon, delta, relation, provenance).
    noise_multiplier: the (first) calibrated noise multiplier, if the family has one.
    schedule: public schedule numbers (steps, batch sizes, phases...).
    num_params: the number of parameters the plan was made for.
    detail: the algorithm family's own plan object (e.g. ``DpSgdPlan``, ``SRGDPlan``,
      ``FilterPlan``), for inspection.
  """
  algorithm: str
  config: dict
  spec: DataSpec
  constants: ProblemConstants
  privacy: PrivacyReport
  noise_multiplier: float | None
  schedule: dict
  num_params: int
  detail: Any = None


def plan(algorithm: str, config: Mapping | Any, spec: DataSpec, *, num_params: int,
         constants: ProblemConstants | dict | None = None) -> Plan:
  """The data-free plan of ``algorithm`` for data described by ``spec`` and a model with
  ``num_params`` parameters (see the module docstring)."""
  from dpsco_jax.planners import planner_for
  entry = _entry(algorithm)
  cfg = algorithm_config(algorithm, config)
  if not isinstance(spec, DataSpec):
    raise TypeError(f"spec must be a DataSpec (UserData.spec), got {type(spec).__name__}")
  _require_declared(entry.name, spec)
  level = "item" if algorithm in ITEM_LEVEL else "user"
  facts = PublicFacts(spec, constants, int(num_params), level)
  consts = facts.constants
  privacy, z, schedule, detail = planner_for(entry.name)(facts, cfg)
  return Plan(entry.name, cfg, spec, consts, privacy, z, schedule, int(num_params), detail)


def _require_declared(algorithm: str, spec: DataSpec) -> None:
  """Refuses a measured ``m`` for an algorithm whose guarantee reads it (``READS_M``).

  ``n_users`` needs no check here: under ``add_remove`` (the one relation that keeps it
  private) every planner reads the config's declared ``n_users``, and under ``replace_one`` /
  ``zero_out`` the realized count is public by the relation itself."""
  if algorithm in READS_M and not spec.declared("max_items_per_user"):
    raise UndeclaredFact(
        f"{algorithm}'s guarantee reads m, the items per user, and this data's m = "
        f"{spec.max_items_per_user} was measured (the largest user's item count: one added item"
        " can change it, and with it the noise). Declare the contribution bound: "
        "UserData.from_arrays(..., max_items_per_user=m), or plan with a DataSpec you "
        "build (a declaration)")


def _num_params(params: Any) -> int:
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def _mesh(algorithm: str, mesh: Any) -> Any:
  """The mesh a run shards users over: ``mesh``, else the one set with
  ``jax.set_mesh`` (if any); refused for an algorithm that
  cannot use it."""
  from dpsco_jax.algorithms.common import mesh_users_axis
  if mesh is None:
    current = jax.sharding.get_mesh()
    mesh = current if isinstance(current, jax.sharding.Mesh) and not current.empty else None
  if mesh is None:
    return None
  mesh_users_axis(mesh)
  if algorithm not in MESH_READY:   # refused, never ignored (a set_mesh context included)
    reason = MESH_UNSUPPORTED.get(algorithm, "not sharded yet")
    raise ValueError(f"{algorithm} does not take a mesh: {reason} (mesh-ready: "
                     f"{', '.join(sorted(MESH_READY))})")
  return mesh


class Progress(NamedTuple):
  """What a run's ``callback`` receives, about 20 times per run: ``step`` of ``num_steps``
  done and ``epsilon``, the exact epsilon (at the plan's delta) of the steps done so far
  (``None`` where the family has no per-step event). Data-independent: the step count and
  the plan are all it is computed from."""
  step: int
  num_steps: int
  epsilon: float | None


def _epsilon_after(p: Plan, steps: int) -> float | None:
  """The accountant's epsilon of the first ``steps`` steps of a DP-SGD plan (else None)."""
  from dpsco_jax.algorithms.dpsgd.plan import DpSgdPlan
  from dpsco_jax.privacy.ledger import epsilon_of
  d = p.detail
  if not isinstance(d, DpSgdPlan) or d.event is None or d.level == "group":
    return None
  # the plan's own event for the shorter run (matrix-factorization noise: the strategy's
  # sensitivity over the steps done, not an independent-noise count)
  return epsilon_of(d.event_after(steps), delta=d.delta, relation=d.relation)


def _progress(p: Plan, callback: Callable[[Progress], None] | None):
  """The host function a driver calls with the steps done, wrapping the user's callback."""
  if callback is None:
    return None
  if not callable(callback):
    raise TypeError(f"callback must be callable, got {type(callback).__name__}")
  total = int(p.schedule.get("num_steps") or 0)
  seen = []

  def on_step(step: int) -> None:
    seen.append(step)
    callback(Progress(step, total, _epsilon_after(p, step)))
  on_step.seen = seen
  return on_step


def print_progress(progress: Progress) -> None:
  """A ready callback: one line per report (steps, epsilon so far)."""
  eps = "" if progress.epsilon is None else f", epsilon so far {progress.epsilon:.4g}"
  print(f"step {progress.step}/{progress.num_steps}{eps}", flush=True)


#: where a run keeps the table: on the device (one jitted scan) or on the host / in a memory
#: map, sampling users there and moving only theirs to the device each step
PLACEMENTS = ("auto", "device", "host")


def _placement(p: Plan, data: UserData, placement: str, mesh: Any) -> str:
  """``auto``: host when the table is memory-mapped (``UserData.open``), else device."""
  if placement not in PLACEMENTS:
    raise ValueError(f"data_placement must be one of {PLACEMENTS}, got {placement!r}")
  if placement == "auto":
    mapped = any(isinstance(x, np.memmap) for x in jax.tree.leaves(data.examples))
    placement = "host" if mapped and p.algorithm == "dp_sgd_user" else "device"
  if placement == "host":
    if p.algorithm != "dp_sgd_user" or (p.schedule or {}).get("sampling") != "poisson":
      raise ValueError("data_placement='host' streams Poisson-sampled users: dp_sgd_user with "
                       f"sampling='poisson' (got {p.algorithm}, sampling="
                       f"{(p.schedule or {}).get('sampling')!r})")
    if mesh is not None:
      raise ValueError("data_placement='host' does not shard over a mesh yet: give one or the "
                       "other")
  return placement



def _check_data_for_plan(p: "Plan", data: UserData, what: str) -> None:
  """``data`` is what ``p`` was planned for (its spec's users and items), whole at item level."""
  if (data.spec.n_users, data.spec.max_items_per_user) != (p.spec.n_users,
                                                           p.spec.max_items_per_user):
    raise ValueError(f"the plan was made for {p.spec.n_users} users x "
                     f"{p.spec.max_items_per_user} items, {what} states {data.spec.n_users} x "
                     f"{data.spec.max_items_per_user}: plan again with its spec")
  if p.algorithm in ITEM_GUARANTEE:
    data.require_all_items(p.algorithm)

def run(p: Plan, loss_fn: Callable, params: Any, data: UserData, key: jax.Array, *,
        mesh: jax.sharding.Mesh | None = None,
        callback: Callable[[Progress], None] | None = None,
        data_placement: str = "auto", distributed: bool | None = None) -> Result:
  """Executes plan ``p`` on ``data``: ``Result.params`` has the structure of ``params``.

  ``mesh``: a ``jax.sharding.Mesh`` with a ``"users"`` axis (default: the mesh set with
  ``jax.set_mesh``, if any). Each device differentiates and clips
  its own users; the clipped sums are reduced across the axis and the noise is drawn once
  from the one key. The plan and ledger do not depend on it, and the released params equal
  the one-device run's to float tolerance (``MESH_READY`` algorithms).

  ``data_placement``: ``"device"`` (the whole table on the device, one jitted scan),
  ``"host"`` (``dp_sgd_user`` with Poisson sampling: users are sampled on the host in
  ``O(q n)`` per step and only their rows reach the device, so the table may be a memory map
  from ``UserData.from_arrays(..., store=dir)`` / ``UserData.open(dir)``), or ``"auto"``
  (host for a memory-mapped table, else device). Same sampling law and guarantee; other
  users are drawn than on the device with the same key.

  ``callback``: called with a :class:`Progress` about 20 times during the run by the
  DP-SGD family and ``nonprivate_sgd`` (steps done, epsilon so far), and once at the end by
  the other algorithms; :func:`print_progress` prints one line each time.

  ``distributed``: run with the other processes of ``jax.distributed`` on this process's
  ``data.shard(...)`` (:mod:`dpsco_jax.distributed`: a handshake compares config, plan, key
  and declared ``n_users`` before the first step). Default: when ``jax.process_count() > 1``
  or ``data`` is a shard."""
  if not isinstance(p, Plan):
    raise TypeError(f"run needs a Plan (dpsco_jax.plan(...)), got {type(p).__name__}")
  if not isinstance(data, UserData):
    raise TypeError(f"data must be a UserData, got {type(data).__name__}")
  if distributed is None:
    distributed = data.shard_info is not None or jax.process_count() > 1
  if distributed:
    from dpsco_jax import distributed as _distributed
    return _distributed.run(p, loss_fn, params, data, key, api=sys.modules[__name__],
                            callback=callback, mesh=mesh, data_placement=data_placement)
  _check_data_for_plan(p, data, "the data")
  level = "item" if p.algorithm in ITEM_LEVEL else "user"
  problem = UserDataProblem(loss_fn, params, data, level=level, constants=p.constants)
  problem.mesh = _mesh(p.algorithm, mesh)
  problem.placement = _placement(p, data, data_placement, problem.mesh)
  problem.progress = _progress(p, callback)
  if problem.d != p.num_params:
    raise ValueError(f"the plan was made for {p.num_params} parameters, params has "
                     f"{problem.d}")
  result = _entry(p.algorithm).driver(problem, _driver_config(p), key)
  if not _same_guarantee(result.privacy, p.privacy):
    raise RuntimeError(f"{p.algorithm}: the run's guarantee {result.privacy.epsilon!r} differs "
                       f"from its plan's {p.privacy.epsilon!r} (a library bug)")
  if problem.progress is not None and not problem.progress.seen:   # no per-step reports
    callback(Progress(int(p.schedule.get("num_steps") or 0),
                      int(p.schedule.get("num_steps") or 0), float(result.privacy.epsilon)))
  return dataclasses.replace(result, params=problem.unflatten(result.params))


def _driver_config(p: Plan) -> dict:
  """The config the driver runs: the plan's, with the plan's calibrated noise multiplier where
  the driver would only calibrate the same number again (``REUSES_NOISE_MULTIPLIER``)."""
  cfg = dict(p.config)
  if (p.algorithm in REUSES_NOISE_MULTIPLIER and p.noise_multiplier is not None
      and cfg.get("noise_multiplier") is None):
    cfg["noise_multiplier"] = p.noise_multiplier
  return cfg


def _same_guarantee(a: PrivacyReport, b: PrivacyReport) -> bool:
  ea, eb = float(a.epsilon), float(b.epsilon)
  same_eps = (ea == eb) or (math.isfinite(ea) and math.isfinite(eb)
                            and abs(ea - eb) <= 1e-9 * max(1.0, abs(eb)))
  return same_eps and a.relation == b.relation and a.provenance == b.provenance


def fit(algorithm: str, config: Mapping | Any, loss_fn: Callable, params: Any, data: UserData,
        key: jax.Array, *, constants: ProblemConstants | dict | None = None,
        mesh: jax.sharding.Mesh | None = None,
        callback: Callable[[Progress], None] | None = None,
        data_placement: str = "auto", distributed: bool | None = None) -> Result:
  """``run(plan(algorithm, config, data.spec, ...), loss_fn, params, data, key, mesh=,
  callback=, data_placement=, distributed=)``."""
  if distributed is None:
    distributed = getattr(data, "shard_info", None) is not None or jax.process_count() > 1
  if distributed:   # a process whose plan fails still joins the handshake (no one waits)
    from dpsco_jax import distributed as _distributed
    return _distributed.fit(algorithm, config, loss_fn, params, data, key,
                            api=sys.modules[__name__], constants=constants, mesh=mesh,
                            callback=callback, data_placement=data_placement)
  p = plan(algorithm, config, data.spec, num_params=_num_params(params), constants=constants)
  return run(p, loss_fn, params, data, key, mesh=mesh, callback=callback,
             data_placement=data_placement, distributed=distributed)


def run_seeds(p: Plan, loss_fn: Callable, params: Any, datas: Sequence[UserData],
              keys: Sequence[jax.Array]) -> list[Result]:
  """``[run(p, loss_fn, params, data, key) for data, key in zip(datas, keys)]`` as one
  compiled program (a seed sweep, or one model on several same-shape data sets).

  The plan is executed once under ``jax.vmap`` over the stacked data and keys
  (:func:`dpsco_jax.sweep.run_stacked`): one compile and one launch for the whole group, the
  noise calibrated once (it is ``p``'s). Each result has its own params (equal to the
  one-by-one run's to float tolerance), its own copy of the privacy report (the plan's) and
  ``record['batched'] = True``; keys are the caller's, one per run, never shared. Every data
  set must have ``p.spec``'s users and items and the same shapes. Algorithms not in
  :data:`BATCHED` (or a driver that cannot trace) run one by one with ``batched: False``."""
  from dpsco_jax.sweep import run_stacked
  if not isinstance(p, Plan):
    raise TypeError(f"run_seeds needs a Plan (dpsco_jax.plan(...)), got {type(p).__name__}")
  datas, keys = list(datas), list(keys)
  if not datas or len(datas) != len(keys):
    raise ValueError(f"run_seeds needs one key per data set, got {len(datas)} data sets and "
                     f"{len(keys)} keys")
  if p.algorithm not in BATCHED:
    return [dataclasses.replace(r, record={**r.record, "batched": False})
            for r in (run(p, loss_fn, params, d, k) for d, k in zip(datas, keys))]
  for d in datas:
    if not isinstance(d, UserData):
      raise TypeError(f"datas must be UserData, got {type(d).__name__}")
    _check_data_for_plan(p, d, "a data set")
  level = "item" if p.algorithm in ITEM_LEVEL else "user"
  template = UserDataProblem(loss_fn, params, datas[0], level=level, constants=p.constants)
  if template.d != p.num_params:
    raise ValueError(f"the plan was made for {p.num_params} parameters, params has "
                     f"{template.d}")
  views = [d.user_view() if level == "user" else d.item_view() for d in datas]
  results = run_stacked(_entry(p.algorithm).driver, template, views, _driver_config(p), keys)
  if not _same_guarantee(results[0].privacy, p.privacy):
    raise RuntimeError(f"{p.algorithm}: the run's guarantee {results[0].privacy.epsilon!r} "
                       f"differs from its plan's {p.privacy.epsilon!r} (a library bug)")
  return [dataclasses.replace(r, params=template.unflatten(r.params)) for r in results]
