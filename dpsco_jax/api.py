"""One shape for every algorithm on your own model and data: ``plan`` then ``run`` (or ``fit``).

::

    data = UserData.from_arrays({"x": X, "y": y}, user_ids, max_items_per_user=32)
    config = {"epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.5,
              "num_steps": 200, "batch_size": 64}
    p = dpsco_jax.plan("dp_sgd_user", config, data.spec)      # no data read: epsilon, noise,
    print(p.privacy.epsilon, p.noise_multiplier)              # schedule, events
    result = dpsco_jax.run(p, loss_fn, params, data, key)     # Result: params (your pytree),
                                                              # privacy, record

:func:`plan` reads only the data's public ``spec``, the declared ``constants`` and the config
(validated once, :func:`algorithm_config`): ``Plan.privacy`` is the guarantee the run will
spend, from a fresh ledger, before any data is read. :func:`run` executes the plan through the
algorithm's registered ``run(plan, problem, key)``, which plans nothing again; the runner does
the same on a built-in problem (:func:`plan_problem`, :func:`execute`). An undeclared constant
raises :class:`~dpsco_jax.data.MissingConstant`; an algorithm that cannot run on a loss and
``UserData`` is refused with the reason (``UNSUPPORTED``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from dpsco_jax._checks import check_int, check_key
from dpsco_jax.algorithms.common import auto_axes, mesh_context, replicated_on
from dpsco_jax.algorithms.registration import Planned, missing_plan_members
from dpsco_jax.algorithms.registry import algorithms
from dpsco_jax.config.schema import ConfigError, check_name, check_known_keys
from dpsco_jax.data.problem import ProblemConstants, PublicFacts, UserDataProblem
from dpsco_jax.data.user_data import DataSpec, UserData
from dpsco_jax.privacy.ledger import PrivacyReport
from dpsco_jax.result import Result, check_finite_params
from dpsco_jax.smoothing import num_params

__all__ = ["Plan", "plan", "run", "fit", "plan_problem", "execute", "solve", "algorithm_config",
           "ITEM_LEVEL", "ITEM_GUARANTEE", "READS_M", "MESH_READY", "MESH_UNSUPPORTED", "BATCHED", "UNSUPPORTED",
           "HOST_STREAMING", "run_seeds",
           "UndeclaredFact", "Progress", "print_progress"]


class UndeclaredFact(ConfigError):
  """A plan needs a public fact that was measured on the (private) data, not declared.

  Args:
    message: what was measured rather than declared, and how to declare it.
  """

# The shipped algorithms' traits, read from the one table (each is a keyword of its
# ``register(...)``; AlgorithmEntry documents them): for ``dpsco list``, the README, the tests.
_TABLE = algorithms()
#: Algorithms whose rows are items (the item view of the data: weight 1 per real item).
ITEM_LEVEL = frozenset(n for n, e in _TABLE.items() if e.level == "item")
#: Item-level guarantees: they hold only if every item is kept (adding or removing one item of
#: a user truncated to ``max_items_per_user`` can change several of its kept items).
ITEM_GUARANTEE = frozenset(n for n, e in _TABLE.items() if e.item_guarantee)
#: Algorithms whose guarantee reads ``m``, the items per user. A *measured* ``m`` is a function
#: of the private data (one added item can double it and halve the noise), so these refuse it;
#: every other plan is the same for ``m`` and ``m + 1`` (``tests/test_plan_invariance.py``).
READS_M = frozenset(n for n, e in _TABLE.items() if e.reads_m)
#: Algorithms whose per-user gradient step shards users over a mesh; the others refuse a mesh
#: (rather than ignore it), with the reason.
MESH_READY = frozenset(n for n, e in _TABLE.items() if e.mesh is True)
MESH_UNSUPPORTED = {n: e.mesh for n, e in _TABLE.items() if e.mesh is not True}
#: Algorithms that run a group of seeds as one ``vmap``-ed program (:func:`run_seeds`).
BATCHED = frozenset(n for n, e in _TABLE.items() if e.batched)
#: Algorithms that need more than ``loss_fn`` + data, with the reason.
UNSUPPORTED = {n: e.unsupported for n, e in _TABLE.items() if e.unsupported is not None}


def _entry(algorithm: str, user_data: bool = True):
  """The registered entry of ``algorithm`` (``user_data``: refuse one that cannot run on a
  ``loss_fn`` and ``UserData``)."""
  table = algorithms()
  entry = table.get(algorithm) if isinstance(algorithm, str) else None
  if entry is None:   # a plan's name is known: only a user's name is checked
    check_name("algorithm", algorithm, table)
  if user_data and entry.unsupported is not None:
    raise ConfigError(f"{algorithm} cannot run on a loss_fn and UserData: {entry.unsupported}")
  return entry


def algorithm_config(algorithm: str, config: Mapping | Any) -> Any:
  """The validated, typed config of ``algorithm``: an instance of its frozen schema (read as
  attributes or as a read-only mapping of its set fields), what its planner reads.

  Args:
    algorithm: a registered algorithm name (``python -m dpsco_jax list``).
    config: a mapping of the algorithm's keys (a runner config's ``algorithm``, ``problem``
      and ``seed`` are ignored), or an instance of its config dataclass (returned as it is).

  Returns:
    The frozen config dataclass instance of ``algorithm``'s schema.

  Raises:
    ConfigError: ``algorithm`` is unknown; ``config`` is neither a mapping nor the schema's
      dataclass; a key is unknown (with a suggestion), of the wrong type, out of range or
      missing (the message names the key).
  """
  from dpsco_jax.config.schema import specs
  entry = _entry(algorithm, user_data=False)
  if isinstance(config, entry.config):
    return config
  if dataclasses.is_dataclass(config) and not isinstance(config, type):
    config = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
  if not isinstance(config, Mapping):
    raise ConfigError(f"config must be a mapping or {entry.config.__name__}, got "
                      f"{type(config).__name__}")
  given = {k: v for k, v in config.items() if k not in ("algorithm", "problem", "seed")}
  check_known_keys(given, specs(entry.config, "algorithm"), f"algorithm {algorithm!r}")
  return entry.config.of(given)   # types, ranges, required keys: the schema's own checks


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything a run will release under, computed before any data is read.

  Attributes:
    algorithm: the registered name.
    config: the validated config, an instance of the algorithm's schema.
    spec: the public facts about the data the plan was made for.
    constants: the declared constants of the loss class.
    privacy: the guarantee the run spends (epsilon, delta, relation, provenance).
    noise_multiplier: the (first) calibrated noise multiplier, if the family has one.
    schedule: public schedule numbers (steps, batch sizes, phases...).
    num_params: the number of parameters the plan was made for.
    detail: the family's plan object (a
      :class:`~dpsco_jax.algorithms.registration.FamilyPlan`), what the run executes.
    planned: the digest of the planned facts; a plan edited afterwards
      (``dataclasses.replace``) keeps it and refuses to run.
  """
  algorithm: str
  config: Any
  spec: DataSpec
  constants: ProblemConstants
  privacy: PrivacyReport
  noise_multiplier: float | None
  schedule: dict
  num_params: int
  detail: Any = None
  planned: str | None = dataclasses.field(default=None, repr=False)

  def __post_init__(self):
    if self.planned is None:
      object.__setattr__(self, "planned", _plan_digest(self))

  @property
  def stages(self) -> tuple:
    """The plan's :class:`~dpsco_jax.privacy.GaussianStage` noise stages (``detail.stages``)."""
    return tuple(self.detail.stages)

  def check_unchanged(self) -> None:
    """Raises ``ValueError`` when the plan no longer is what was planned (see ``planned``).

    Raises:
      ValueError: a field of the plan was changed after it was planned (plan again).
    """
    if _plan_digest(self) != self.planned:
      raise ValueError(f"this {self.algorithm} plan was changed after it was planned (its "
                       "config, spec, constants or guarantee differ from the planner's): its "
                       "guarantee is not the edited plan's; plan again with the new config "
                       "(dpsco_jax.plan)")


def _plan_digest(p: Plan) -> str:
  """SHA-256 of a plan's planned facts (not ``detail``: derived from them)."""
  import hashlib
  import json
  facts = [p.algorithm, p.config, p.spec, p.constants, p.privacy, p.noise_multiplier,
           p.schedule, p.num_params]
  text = json.dumps(facts, sort_keys=True, default=_digest_value)
  return hashlib.sha256(text.encode()).hexdigest()


def _digest_value(x: Any) -> Any:
  """The JSON form of a value in a plan's digest: dataclasses by field, sets sorted."""
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
  if isinstance(x, (set, frozenset)):
    return sorted(map(repr, x))
  return repr(x)


def plan(algorithm: str, config: Mapping | Any, spec: DataSpec, *, num_params: int,
         constants: ProblemConstants | dict | None = None) -> Plan:
  """The data-free plan of ``algorithm`` for data described by ``spec`` and a model with
  ``num_params`` parameters.

  Args:
    algorithm: a registered algorithm name (``python -m dpsco_jax list``).
    config: the algorithm's keys (a mapping or its config dataclass; see
      :func:`algorithm_config`), with the target ``epsilon`` / ``delta`` or an explicit
      ``noise_multiplier``.
    spec: the public facts about the data (``UserData.spec``, or a ``DataSpec`` you build as a
      declaration).
    num_params: the model's parameter count.
    constants: the declared constants of the loss class (a
      :class:`~dpsco_jax.data.ProblemConstants` or a dict); ``None``: none declared.

  Returns:
    The :class:`Plan`: the guarantee, calibrated noise and schedule, computed without data.

  Raises:
    ConfigError: an unknown algorithm, or a bad config key (named in the message).
    UndeclaredFact: the guarantee reads ``m`` and ``spec``'s ``m`` was measured, not declared.
    MissingConstant: the algorithm needs a constant that ``constants`` does not declare.
    TypeError: ``spec`` is not a ``DataSpec``.
  """
  entry = _entry(algorithm)
  cfg = algorithm_config(algorithm, config)
  if not isinstance(spec, DataSpec):
    raise TypeError(f"spec must be a DataSpec (UserData.spec), got {type(spec).__name__}")
  if entry.reads_m and not spec.declared("max_items_per_user"):
    raise UndeclaredFact(
        f"{entry.name}'s guarantee reads m, the items per user, and this data's m = "
        f"{spec.max_items_per_user} was measured (the largest user's item count: one added item"
        " can change it, and with it the noise). Declare the contribution bound: "
        "UserData.from_arrays(..., max_items_per_user=m), or plan with a DataSpec you "
        "build (a declaration)")
  # int() would plan 2.5 as 2, -1 or "5" as counts: refused here, naming the parameter
  num_params = check_int(num_params, "num_params", 0)
  facts = PublicFacts(spec, constants, num_params, entry.level)
  privacy, z, schedule, detail = _planned(entry, facts, cfg)
  return Plan(entry.name, cfg, spec, facts.constants, privacy, z, schedule, num_params,
              detail)


def plan_problem(algorithm: str, config: Mapping | Any, problem: Any) -> Plan:
  """The data-free plan of ``algorithm`` on a built-in problem (the runner's path), whose
  sizes and constants are declared by construction. Execute it with :func:`execute`.

  Args:
    algorithm: a registered algorithm name.
    config: the algorithm's keys (a mapping or its config dataclass).
    problem: a built-in problem: its ``n_users``, ``m``, ``d`` and constants are read.

  Returns:
    The :class:`Plan` for ``problem``'s sizes and constants.

  Raises:
    ConfigError: an unknown algorithm or a bad config key (named in the message).
    MissingConstant: the algorithm needs a constant the problem does not hold.
  """
  entry = _entry(algorithm, user_data=False)
  cfg = algorithm_config(algorithm, config)
  spec = DataSpec(int(problem.n_users), int(problem.m))   # built: nothing measured
  privacy, z, schedule, detail = _planned(entry, problem, cfg)
  return Plan(entry.name, cfg, spec, constants_of(problem), privacy, z, schedule,
              int(problem.d), detail)


def _planned(entry: Any, facts: Any, cfg: Any) -> Planned:
  """The entry's planner on ``facts``; a plan object outside the
  :class:`~dpsco_jax.algorithms.registration.FamilyPlan` protocol is refused, naming what it
  lacks."""
  planned = entry.planner(facts, cfg)
  missing = missing_plan_members(planned.detail)
  if missing:
    raise TypeError(f"{entry.name}'s planner returned a plan object "
                    f"({type(planned.detail).__name__}) without {', '.join(missing)}: a "
                    "family's plan follows dpsco_jax.algorithms.registration.FamilyPlan "
                    "(its noise stages, its events, charge())")
  return planned


def constants_of(problem: Any) -> ProblemConstants:
  """The constants a built-in problem holds (those it has and that are positive numbers)."""
  found = {}
  for name in ("lipschitz", "smoothness", "radius", "strong_convexity"):
    try:
      v = getattr(problem, name, None)
      if v is None and name == "strong_convexity":
        v = (getattr(problem, "meta", None) or {}).get(name)
    except Exception:  # noqa: BLE001 - a problem without the constant (MissingConstant)
      continue
    if isinstance(v, (int, float, np.floating)) and not isinstance(v, bool) and v > 0:
      found[name] = float(v)
  return ProblemConstants(**found)


def execute(p: Plan, problem: Any, key: jax.Array) -> Result:
  """Runs plan ``p`` on ``problem`` (a built-in one, or the :class:`UserDataProblem` that
  :func:`run` builds) through the algorithm's registered ``run(plan, problem, key)``.

  Args:
    p: the plan (:func:`plan_problem`, or :func:`plan` for a ``UserDataProblem``).
    problem: the problem to run on; its users, items per user and parameter count must be
      the plan's.
    key: the run's JAX PRNG key (``jax.random.key(seed)``), the source of all its noise.

  Returns:
    The :class:`~dpsco_jax.Result`: released params and the privacy report (the plan's).

  Raises:
    TypeError: ``p`` is not a :class:`Plan`.
    ValueError: the problem's sizes are not the plan's, or the plan was edited after planning.
    NonFiniteRelease: the released params hold NaN or infinity (the run failed).
    RuntimeError: the run reported a guarantee other than the plan's (a library bug).
  """
  if not isinstance(p, Plan):
    raise TypeError(f"execute needs a Plan (dpsco_jax.plan / plan_problem), got "
                    f"{type(p).__name__}")
  facts = (int(problem.n_users), int(problem.m), int(problem.d))
  planned = (p.spec.n_users, p.spec.max_items_per_user, p.num_params)
  if facts != planned:
    raise ValueError(f"the plan was made for {planned[0]} users x {planned[1]} items and "
                     f"{planned[2]} parameters, the problem has {facts[0]} x {facts[1]} and "
                     f"{facts[2]}: plan again for it")
  p.check_unchanged()
  return check_spent(p, _entry(p.algorithm, user_data=False).driver(p, problem, key))


def solve(algorithm: str, config: Mapping | Any, problem: Any, key: jax.Array) -> Result:
  """``execute(plan_problem(algorithm, config, problem), problem, key)``."""
  return execute(plan_problem(algorithm, config, problem), problem, key)


def check_spent(p: Plan, result: Result) -> Result:
  """``result`` when its run spent exactly plan ``p``'s guarantee (epsilon to 1e-9, relation,
  provenance), else ``RuntimeError`` (a library bug); params that are not finite raise
  :class:`~dpsco_jax.result.NonFiniteRelease`. Every path that executes a plan checks it."""
  got, want = result.privacy, p.privacy
  ea, eb = float(got.epsilon), float(want.epsilon)
  same_eps = (ea == eb) or (math.isfinite(ea) and math.isfinite(eb)
                            and abs(ea - eb) <= 1e-9 * max(1.0, abs(eb)))
  if not (same_eps and got.relation == want.relation and got.provenance == want.provenance):
    raise RuntimeError(f"{p.algorithm}: the run's guarantee {result.privacy.epsilon!r} differs "
                       f"from its plan's {p.privacy.epsilon!r} (a library bug)")
  check_finite_params(result.params, p.algorithm)
  return result


def _mesh(algorithm: str, mesh: Any) -> Any:
  """``mesh``, else the one set with ``jax.set_mesh`` (if any); refused for an algorithm
  that cannot use it."""
  from dpsco_jax.algorithms.common import mesh_users_axis
  if mesh is None:
    current = jax.sharding.get_mesh()
    mesh = current if isinstance(current, jax.sharding.Mesh) and not current.empty else None
  if mesh is None:
    return None
  mesh_users_axis(mesh)
  entry = algorithms()[algorithm]
  if entry.mesh is not True:   # refused, never ignored (a set_mesh context included)
    ready = sorted(n for n, e in algorithms().items() if e.mesh is True)
    raise ValueError(f"{algorithm} does not take a mesh: {entry.mesh} (mesh-ready: "
                     f"{', '.join(ready)})")
  return mesh


class Progress(NamedTuple):
  """What a run's ``callback`` receives, every ``ceil(num_steps / 20)`` steps and at the end
  (``step`` strictly increasing, the last with ``step == num_steps``; a run without a step
  loop reports once with ``step == num_steps == 1``). ``epsilon`` is the accountant's epsilon
  of the steps done where the family has a per-step event (DP-SGD), else ``None`` until the
  last report, which has the run's. Computed from the step count and the plan only.

  Attributes:
    step: the steps done.
    num_steps: the run's planned steps.
    epsilon: the epsilon spent so far, or None (see above).
  """
  step: int
  num_steps: int
  epsilon: float | None


def _epsilon_after(p: Plan, steps: int, total: int | None = None) -> float | None:
  """The epsilon of the first ``steps`` steps of a DP-SGD plan; for the other families the
  plan's once all ``total`` steps are done, else None."""
  from dpsco_jax.algorithms.dpsgd.plan import DpSgdPlan
  from dpsco_jax.privacy.ledger import epsilon_of
  d = p.detail
  if not isinstance(d, DpSgdPlan) or d.event is None or d.level == "group":
    done = total is not None and steps >= total
    return float(p.privacy.epsilon) if done else None
  return epsilon_of(d.event_after(steps), delta=d.delta, relation=d.relation)


def _progress(p: Plan, callback: Callable[[Progress], None] | None):
  """The host function a driver calls with the steps done (and its step count), wrapping the
  user's callback; :func:`_close_progress` ends it."""
  if callback is None:
    return None
  if not callable(callback):
    raise TypeError(f"callback must be callable, got {type(callback).__name__}")
  planned = int(p.schedule.get("num_steps") or 0)
  seen: list[Progress] = []

  def on_step(step: int, total: int | None = None) -> None:
    total = int(total or planned)
    seen.append(Progress(int(step), total, _epsilon_after(p, int(step), total)))
    callback(seen[-1])
  on_step.seen = seen
  on_step.callback = callback
  return on_step


def _close_progress(p: Plan, progress: Callable | None) -> None:
  """The last report of a run whose driver did not end at its last step (no step loop, or a
  run that stopped early)."""
  if progress is None:
    return
  last = progress.seen[-1] if progress.seen else None
  if last is not None and last.step == last.num_steps:
    return
  total = last.num_steps if last is not None else int(p.schedule.get("num_steps") or 1)
  progress.seen.append(Progress(total, total, _epsilon_after(p, total, total)))
  progress.callback(progress.seen[-1])


def print_progress(progress: Progress) -> None:
  """A ready callback: one line per report (steps, epsilon so far).

  Args:
    progress: the report a run passes to its ``callback``.
  """
  eps = "" if progress.epsilon is None else f", epsilon so far {progress.epsilon:.4g}"
  print(f"step {progress.step}/{progress.num_steps}{eps}", flush=True)


PLACEMENTS = ("auto", "device", "host")
#: the drivers that stream Poisson-sampled rows from the host (users, or item slots)
HOST_STREAMING = frozenset(n for n, e in _TABLE.items() if e.host_streaming)


def _placement(p: Plan, data: UserData, placement: str, mesh: Any) -> str:
  """``auto``: host when the table is memory-mapped (``UserData.open``), else device."""
  if placement not in PLACEMENTS:
    raise ValueError(f"data_placement must be one of {PLACEMENTS}, got {placement!r}")
  streams = algorithms()[p.algorithm].host_streaming
  if placement == "auto":
    mapped = any(isinstance(x, np.memmap) for x in jax.tree.leaves(data.examples))
    placement = "host" if mapped and streams else "device"
  if placement == "host":
    if not streams or (p.schedule or {}).get("sampling") != "poisson":
      ready = " or ".join(sorted(n for n, e in algorithms().items() if e.host_streaming))
      raise ValueError(f"data_placement='host' streams Poisson-sampled rows: {ready} with "
                       f"sampling='poisson' (got {p.algorithm}, sampling="
                       f"{(p.schedule or {}).get('sampling')!r})")
  return placement



def _check_data_for_plan(p: "Plan", data: UserData, what: str) -> None:
  """``data`` has ``p``'s users, items and (where the spec states them) item shapes, and is
  whole at item level."""
  if (data.spec.n_users, data.spec.max_items_per_user) != (p.spec.n_users,
                                                           p.spec.max_items_per_user):
    raise ValueError(f"the plan was made for {p.spec.n_users} users x "
                     f"{p.spec.max_items_per_user} items, {what} states {data.spec.n_users} x "
                     f"{data.spec.max_items_per_user}: plan again with its spec")
  if p.spec.item_shapes and tuple(data.spec.item_shapes) != tuple(p.spec.item_shapes):
    raise ValueError(f"the plan was made for items {_shapes(p.spec.item_shapes)}, {what}'s "
                     f"items are {_shapes(data.spec.item_shapes)}: plan again with its spec")
  if _entry(p.algorithm).item_guarantee:
    data.require_all_items(p.algorithm)

def run(p: Plan, loss_fn: Callable, params: Any, data: UserData, key: jax.Array, *,
        mesh: jax.sharding.Mesh | None = None,
        callback: Callable[[Progress], None] | None = None,
        data_placement: str = "auto", distributed: bool | None = None) -> Result:
  """Executes plan ``p`` on ``data``: ``Result.params`` has the structure of ``params``.

  Args:
    p: the plan (:func:`plan`) made for ``data.spec`` and ``params``' parameter count.
    loss_fn: ``loss_fn(params, item) -> scalar``, the loss of one item (a pytree leaf per
      item field, no leading axis); it is differentiated per user.
    params: the initial parameters (any pytree of float arrays).
    data: the user-keyed data the plan was made for (:class:`~dpsco_jax.data.UserData`).
    key: the run's JAX PRNG key, the source of all its noise and sampling.
    mesh: a ``jax.sharding.Mesh`` with a ``"users"`` axis (default: the one set with
      ``jax.set_mesh``, if any; ``MESH_READY``). Each device clips its own users, the sums
      are reduced and the noise drawn once from the one key, so the plan does not depend on
      the mesh and the params equal the one-device run's to float tolerance. A mesh with
      explicit axes runs on its auto-typed twin (params come back replicated over it); arrays
      ``loss_fn`` closes over must not be typed with an explicit mesh.
    callback: called with a :class:`Progress` about 20 times during the run
      (:func:`print_progress` prints them); default ``None``.
    data_placement: ``"device"`` (the table on the device, one jitted scan; on a CPU backend
      an unaligned leaf is copied once, item-level rows once more), ``"host"`` (Poisson
      ``dp_sgd_user`` / ``dp_sgd_item``: rows sampled on the host, ``O(q n)`` per step, only
      theirs moved, so the table may be ``UserData.open``'s memory map; same law and
      guarantee) or ``"auto"`` (default: host for a memory-mapped table, else device).
    distributed: run with the other ``jax.distributed`` processes on this process's
      ``data.shard(...)`` (:mod:`dpsco_jax.distributed`, a handshake first); default when
      ``jax.process_count() > 1`` or ``data`` is a shard.

  Returns:
    The :class:`~dpsco_jax.Result`: ``params`` with the structure of the input ``params``, the
    privacy report (the plan's guarantee), the run's record.

  Raises:
    TypeError: ``p`` is not a :class:`Plan`, ``data`` not a ``UserData`` or ``callback`` not
      callable.
    ValueError: ``data``'s users, items or item shapes, or ``params``' parameter count, are
      not the plan's; a bad ``data_placement`` or one the algorithm cannot stream; a mesh for
      an algorithm that does not take one, or a mesh without a ``"users"`` axis; a plan edited
      after planning.
    NonFiniteRelease: the released params hold NaN or infinity (the run failed).
  """
  if not isinstance(p, Plan):
    raise TypeError(f"run needs a Plan (dpsco_jax.plan(...)), got {type(p).__name__}")
  if not isinstance(data, UserData):
    raise TypeError(f"data must be a UserData, got {type(data).__name__}")
  check_key(key, "key")   # here: an int seed would fail deep in the driver, in JAX's words
  if distributed is None:
    distributed = data.shard_info is not None or jax.process_count() > 1
  if distributed:
    from dpsco_jax import distributed as _distributed
    return _distributed.run(p, loss_fn, params, data, key, api=sys.modules[__name__],
                            callback=callback, mesh=mesh, data_placement=data_placement)
  _check_data_for_plan(p, data, "the data")
  caller_mesh = _mesh(p.algorithm, mesh)
  run_mesh = auto_axes(caller_mesh)   # jax.make_mesh's explicit axes: run on an auto twin
  with mesh_context(run_mesh):   # over a caller's explicit jax.set_mesh context
    params, key = replicated_on((params, key), run_mesh, caller_mesh)
    problem = UserDataProblem(loss_fn, params, data, level=_entry(p.algorithm).level,
                              constants=p.constants)
    problem.mesh = run_mesh
    problem.placement = _placement(p, data, data_placement, problem.mesh)
    problem.progress = _progress(p, callback)
    if problem.d != p.num_params:
      raise ValueError(f"the plan was made for {p.num_params} parameters, params has "
                       f"{problem.d}")
    result = execute(p, problem, key)
    released = problem.unflatten(result.params)
  _close_progress(p, problem.progress)
  return dataclasses.replace(result, params=replicated_on(released, caller_mesh, caller_mesh))


def _shapes(item_shapes: Sequence) -> str:
  """``{x: (3,) float32, y: () int32}``: one item's leaves, as a message shows them."""
  return "{" + ", ".join(f"{path}: {tuple(shape)} {dtype}"
                         for path, shape, dtype in item_shapes) + "}"


def fit(algorithm: str, config: Mapping | Any, loss_fn: Callable, params: Any, data: UserData,
        key: jax.Array, *, constants: ProblemConstants | dict | None = None,
        mesh: jax.sharding.Mesh | None = None,
        callback: Callable[[Progress], None] | None = None,
        data_placement: str = "auto", distributed: bool | None = None) -> Result:
  """``run(plan(algorithm, config, data.spec, ...), loss_fn, params, data, key, ...)``.

  Args:
    algorithm: a registered algorithm name.
    config: the algorithm's keys (a mapping or its config dataclass; see :func:`plan`).
    loss_fn: ``loss_fn(params, item) -> scalar``, the loss of one item.
    params: the initial parameters (a pytree).
    data: the user-keyed data (its ``spec`` is what is planned for).
    key: the run's JAX PRNG key.
    constants: the declared constants of the loss class (see :func:`plan`); default none.
    mesh: a device mesh with a ``"users"`` axis (see :func:`run`).
    callback: called with a :class:`Progress` during the run (see :func:`run`).
    data_placement: ``"auto"`` (default), ``"device"`` or ``"host"`` (see :func:`run`).
    distributed: run with the other ``jax.distributed`` processes (see :func:`run`).

  Returns:
    The :class:`~dpsco_jax.Result` of the run.

  Raises:
    As :func:`plan` and :func:`run`.
  """
  if distributed is None:
    distributed = getattr(data, "shard_info", None) is not None or jax.process_count() > 1
  if distributed:   # a process whose plan fails still joins the handshake (no one waits)
    from dpsco_jax import distributed as _distributed
    return _distributed.fit(algorithm, config, loss_fn, params, data, key,
                            api=sys.modules[__name__], constants=constants, mesh=mesh,
                            callback=callback, data_placement=data_placement)
  p = plan(algorithm, config, data.spec, num_params=num_params(params), constants=constants)
  return run(p, loss_fn, params, data, key, mesh=mesh, callback=callback,
             data_placement=data_placement, distributed=distributed)


def run_seeds(p: Plan, loss_fn: Callable, params: Any, datas: Sequence[UserData],
              keys: Sequence[jax.Array]) -> list[Result]:
  """``[run(p, loss_fn, params, data, key) for data, key in zip(datas, keys)]`` as one
  compiled program under ``jax.vmap`` (:func:`dpsco_jax.sweep.run_stacked`): each result has
  its own params (the one-by-one run's to float tolerance), the plan's report and
  ``record['batched'] = True``. Algorithms not in :data:`BATCHED` run one by one
  (``batched: False``).

  Args:
    p: the plan, made for every data set's spec.
    loss_fn: ``loss_fn(params, item) -> scalar``, the loss of one item.
    params: the initial parameters (a pytree), shared by every run.
    datas: the data sets, one per run, all with ``p.spec``'s users, items and item shapes.
    keys: the runs' JAX PRNG keys, one per data set.

  Returns:
    One :class:`~dpsco_jax.Result` per data set, in order.

  Raises:
    ValueError: ``datas`` is empty or its length differs from ``keys``'; else as :func:`run`.
  """
  if not isinstance(p, Plan):
    raise TypeError(f"run_seeds needs a Plan (dpsco_jax.plan(...)), got {type(p).__name__}")
  datas, keys = list(datas), list(keys)
  if not datas or len(datas) != len(keys):
    raise ValueError(f"run_seeds needs one key per data set, got {len(datas)} data sets and "
                     f"{len(keys)} keys")
  if not _entry(p.algorithm).batched:
    return [dataclasses.replace(r, record={**r.record, "batched": False})
            for r in (run(p, loss_fn, params, d, k) for d, k in zip(datas, keys))]
  return _run_stacked([p], loss_fn, params, datas, keys)


def _run_stacked(plans: list[Plan], loss_fn: Callable, params: Any, datas: list,
                 keys: list, grid: Any = None) -> list[Result]:
  """The batched body of :func:`run_seeds` and :func:`run_grid` (``grid``: the step sizes the
  plans differ in): data checked against the first plan, every guarantee against its plan."""
  from dpsco_jax.sweep import run_stacked
  first = plans[0]
  entry = _entry(first.algorithm)
  for i, (d, k) in enumerate(zip(datas, keys)):
    if not isinstance(d, UserData):
      raise TypeError(f"datas must be UserData, got {type(d).__name__}")
    _check_data_for_plan(first, d, "a data set")
    check_key(k, f"keys[{i}]")
  template = UserDataProblem(loss_fn, params, datas[0], level=entry.level,
                             constants=first.constants)
  if template.d != first.num_params:
    raise ValueError(f"the plan was made for {first.num_params} parameters, params has "
                     f"{template.d}")
  views = [d.user_view() if entry.level == "user" else d.item_view() for d in datas]
  for p in plans:
    p.check_unchanged()
  results = run_stacked(entry.driver, template, views, first if grid is None else plans, keys,
                        grid=grid)
  for p, r in zip(plans if len(plans) == len(results) else plans * len(results), results):
    check_spent(p, r)
  return [dataclasses.replace(r, params=template.unflatten(r.params)) for r in results]


def run_grid(plans: Sequence[Plan], loss_fn: Callable, params: Any, datas: Sequence[UserData],
             keys: Sequence[jax.Array]) -> list[Result]:
  """``[run(plans[i], loss_fn, params, datas[i], keys[i]) for i]`` as one compiled program
  under ``jax.vmap``, for plans of one algorithm, spec, constants, parameter count and
  guarantee whose configs differ only in the algorithm's grid keys
  (:data:`dpsco_jax.sweep.GRID`: ``learning_rate``; SRGD also ``beta``, ``beta_scale``),
  which become inputs of the traced program; anything else raises
  :class:`dpsco_jax.sweep.NotBatchable` naming the key. Equal plans of an algorithm without
  a grid run one by one (``batched: False``).

  Args:
    plans: one plan per run, of one algorithm and spec, differing only in step sizes.
    loss_fn: ``loss_fn(params, item) -> scalar``, the loss of one item.
    params: the initial parameters (a pytree), shared by every run.
    datas: one data set per run (repeat one data set for a grid on one data set).
    keys: one JAX PRNG key per run.

  Returns:
    One :class:`~dpsco_jax.Result` per run, in the order of ``plans``.

  Raises:
    ValueError: ``plans``, ``datas`` and ``keys`` are empty or of different lengths; else as
      :func:`run`.
    NotBatchable: the plans differ in more than step sizes (a ``ValueError`` naming the key).
  """
  from dpsco_jax.sweep import check_grid_plans
  plans, datas, keys = list(plans), list(datas), list(keys)
  if not plans or not len(plans) == len(datas) == len(keys):
    raise ValueError(f"run_grid needs one plan, one data set and one key per run, got "
                     f"{len(plans)} plans, {len(datas)} data sets and {len(keys)} keys")
  for p in plans:
    if not isinstance(p, Plan):
      raise TypeError(f"run_grid needs Plans (dpsco_jax.plan(...)), got {type(p).__name__}")
  grid = check_grid_plans(plans)
  if grid is None:
    return [dataclasses.replace(r, record={**r.record, "batched": False})
            for r in (run(p, loss_fn, params, d, k) for p, d, k in zip(plans, datas, keys))]
  return _run_stacked(plans, loss_fn, params, datas, keys, grid)
