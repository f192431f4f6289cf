"""Seed sweeps and step-size grids as one compiled program.

Runs that differ only in their seed share everything public (config, shapes, plan), so the
driver runs once under ``jax.vmap`` over the stacked data and keys (one executable, one
launch); each run keeps its own key and its own copy of the plan's report. Released params
equal the one-by-one runs' to float tolerance; reports and records are identical. Only
:data:`dpsco_jax.api.BATCHED` drivers are batched; one that does not trace raises and its
callers run the seeds one by one (nothing of the attempt is released).

Runs that also differ in a number the jitted step reads only as a number (:data:`GRID`: the
learning rate, SRGD's ``beta``) run as one program too, the driver reading them through
:func:`dpsco_jax.algorithms.common.hparam`: every grid point must trace to the same jaxpr with
equal privacy reports, else :class:`NotBatchable` names the key (:func:`grid_refusal`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax.algorithms.registration import Grid
from dpsco_jax.algorithms.registry import algorithms
from dpsco_jax.config.schema import ConfigError
from dpsco_jax.result import Result

__all__ = ["NotBatchable", "run_stacked", "refusal", "seed_groups", "batch_seeds_option",
           "stack_keys", "Grid", "GRID", "grid_for", "grid_refusal", "grid_of",
           "check_grid_plans"]

#: per-seed fields of a synthetic problem used only to score the released params (the
#: optimum, the risk): a batched driver must not read them, so its view of the problem has
#: them blanked (reading one raises, and the group falls back to one run per seed)
EVALUATION_FIELDS = ("x_opt", "risk_fn", "opt_risk", "meta", "risk_fn64", "_opt_risk64")
#: attributes that make a run something other than one device scan of ``problem.data``
_UNBATCHED_ATTRS = ("mesh", "progress")


class NotBatchable(ValueError):
  """A group of runs that cannot run as one program (the message says why)."""


#: Per algorithm, the step-size keys its runs may differ in and still run as one program: the
#: ``grid=`` trait of each registration.
GRID: dict[str, Grid] = {n: e.grid for n, e in algorithms().items() if e.grid is not None}


def grid_for(algorithm: Any) -> Grid | None:
  """The ``grid=`` trait of ``algorithm``'s registration (``None``: it batches no step size),
  read from the table at call time (an algorithm registered later included)."""
  entry = algorithms().get(algorithm) if isinstance(algorithm, str) else None
  return None if entry is None else entry.grid


class _Traced:
  """The traced per-run numbers a driver of a grid sweep reads (``problem.traced_hparams``);
  ``taken`` keeps the value each name would have had in the run alone. Drivers read it through
  :func:`dpsco_jax.algorithms.common.hparam`."""

  def __init__(self, values: dict[str, Any]):
    self.values = values
    self.taken: dict[str, Any] = {}

  def take(self, name: str, value: Any) -> Any:
    self.taken[name] = value
    return self.values[name]


_MISSING = object()


def _differing(cfgs: Sequence[Mapping]) -> list[str]:
  """The keys whose values (or presence) differ across ``cfgs`` (first-appearance order)."""
  keys = list(dict.fromkeys(k for c in cfgs for k in c))
  first = cfgs[0]
  return [k for k in keys
          if any(not _same(c.get(k, _MISSING), first.get(k, _MISSING)) for c in cfgs[1:])]


def grid_of(cfgs: Sequence[Mapping], ignore: Sequence[str] = ("seed",)) -> dict[str, list]:
  """``{key: its distinct values}`` of the keys that differ across ``cfgs`` (``ignore``
  excepted): the grid a group of runs spans."""
  out = {}
  for k in _differing([{a: b for a, b in c.items() if a not in ignore} for c in cfgs]):
    values: list = []
    for c in cfgs:
      v = c.get(k)
      if not any(_same(v, w) for w in values):
        values.append(v)
    out[k] = values
  return out


def grid_refusal(algorithm: str, cfgs: Sequence[Mapping], ignore: Sequence[str] = ("seed",)
                 ) -> str | None:
  """Why runs of ``algorithm`` with configs ``cfgs`` cannot run as one program (``None`` when
  they can): a key other than ``ignore`` and :data:`GRID`'s keys of the algorithm differs.
  The message names the key."""
  grid = grid_for(algorithm)
  allowed = grid.keys if grid is not None else frozenset()
  for key in grid_of(cfgs, ignore):
    if key not in allowed:
      can = (f"only in {', '.join(sorted(allowed))} (numbers its jitted step reads)"
             if allowed else "in no hyper-parameter (each config is its own program)")
      return (f"the runs differ in {key!r}: {algorithm} runs as one program runs that differ "
              f"{can}; {key} changes the privacy plan, the noise, the schedule or the "
              "program, so these runs are planned and run apart")
  return None


def stack_keys(keys: Sequence[jax.Array]) -> jax.Array:
  """The typed keys stacked along a leading run axis (the keys themselves, not re-derived)."""
  keys = [k if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(k)
          for k in keys]
  return jnp.stack(keys)


def _same(a: Any, b: Any) -> bool:
  if isinstance(a, (jax.Array, np.ndarray)) or isinstance(b, (jax.Array, np.ndarray)):
    return (np.shape(a) == np.shape(b) and np.asarray(a).dtype == np.asarray(b).dtype
            and bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)))
  if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
    return True
  try:
    return bool(a == b)
  except Exception:  # noqa: BLE001 - an uncomparable value is not the same value
    return a is b


def _public(problem: Any) -> dict:
  """What a batched driver may read of ``problem`` besides ``data``: it must agree across
  the group (checked by :func:`refusal`)."""
  if dataclasses.is_dataclass(problem):
    return {f.name: getattr(problem, f.name) for f in dataclasses.fields(problem)
            if f.name != "data" and f.name not in EVALUATION_FIELDS}
  return {"describe": problem.describe(), "loss_fn": getattr(problem, "loss_fn", None)}


def _shapes(tree: Any) -> tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((tuple(np.shape(x)), np.asarray(x).dtype if not hasattr(x, "dtype")
                         else x.dtype) for x in leaves)


def refusal(problems: Sequence[Any]) -> str | None:
  """Why ``problems`` cannot run as one batch (``None`` when they can): different types,
  public facts (``n_users``, ``m``, ``d``, ``radius``, ``L``, ``beta``, the loss), data
  shapes, or a run that shards over a mesh / reports progress."""
  if len(problems) < 1:
    return "no runs"
  first = problems[0]
  for p in problems:
    for attr in _UNBATCHED_ATTRS:
      if getattr(p, attr, None) is not None:
        return f"a run sets {attr}"
    if getattr(p, "placement", "device") != "device":
      return "a run streams its data from the host"
    if type(p) is not type(first):
      return f"different problem types ({type(first).__name__}, {type(p).__name__})"
  facts = _public(first)
  shapes = _shapes(first.data)
  for p in problems[1:]:
    other = _public(p)
    for k, v in facts.items():
      if k not in other or not _same(v, other[k]):
        return f"the problems differ in {k}"
    if _shapes(p.data) != shapes:
      return "the problems' data differ in shape or dtype"
  return None


def _view(template: Any, data: Any) -> Any:
  """The problem a batched driver sees: ``template`` with the (traced, per-seed) ``data`` and
  its per-seed evaluation fields blanked."""
  view = copy.copy(template)
  for name in EVALUATION_FIELDS:
    if hasattr(view, name):
      setattr(view, name, None)
  view.data = data
  return view


def _is_traced(tree: Any) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def run_stacked(driver: Callable, template: Any, datas: Sequence[Any],
                plans: Any, keys: Sequence[jax.Array], *,
                grid: Grid | None = None) -> list[Result]:
  """``[driver(plan_i, problem_i, keys[i]) for i]`` as one program, ``problem_i`` being
  ``template`` with ``data = datas[i]``. ``plans``: one :class:`dpsco_jax.Plan` for every run
  (a seed sweep: the driver runs once, under ``jax.vmap`` over the stacked data and keys), or
  one per run (a grid: their configs may differ only in ``grid.keys``, :func:`_run_grid`).
  Each :class:`~dpsco_jax.result.Result` has its own params (a slice of the batch), its own
  copy of its plan's privacy report and record, and ``record['batched'] = True``.

  Raises :class:`NotBatchable` when the datas differ in shape, the configs in a key other
  than ``grid.keys``, or the driver returns something that depends on the data outside
  ``params``; any exception of the driver propagates (the caller may then run the seeds one
  by one)."""
  if len(datas) != len(keys) or not datas:
    raise NotBatchable(f"{len(datas)} data sets for {len(keys)} keys")
  plans = list(plans) if isinstance(plans, (list, tuple)) else [plans] * len(datas)
  if len(plans) != len(datas):
    raise NotBatchable(f"{len(plans)} plans for {len(datas)} data sets")
  cfgs = [p.config for p in plans]   # typed configs read as mappings (no copy)
  shapes = _shapes(datas[0])
  if any(_shapes(d) != shapes for d in datas[1:]):
    raise NotBatchable("the data sets differ in shape or dtype")
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *datas)
  stacked_keys = stack_keys(keys)
  differ = _differing(cfgs)
  if differ:
    if grid is None:
      raise NotBatchable(f"the runs' configs differ in {differ[0]!r} and no grid was given")
    bad = [k for k in differ if k not in grid.keys]
    if bad:
      raise NotBatchable(f"the runs differ in {bad[0]!r}, which is not a step size of this "
                         f"driver (a grid may differ only in {', '.join(sorted(grid.keys))})")
    return _run_grid(driver, template, datas, plans, keys, stacked, stacked_keys, grid)
  out: dict[str, Result] = {}

  def one(data, key):
    result = driver(plans[0], _view(template, data), key)
    out["result"] = result
    return result.params

  params = jax.block_until_ready(jax.vmap(one)(stacked, stacked_keys))
  shared = out["result"]
  _check_public(shared)
  return [_own(shared, jax.tree.map(lambda x, i=i: x[i], params)) for i in range(len(datas))]


def _check_public(result: Result) -> None:
  """Everything but params is computed once per program: it must not hold a traced value
  (a per-run, data-dependent number would be silently one number for every run)."""
  if (_is_traced(result.record) or _is_traced(result.debug)
      or _is_traced(result.gradient_evaluations)
      or _is_traced(dataclasses.asdict(result.privacy))):
    raise NotBatchable("the driver returns data-dependent values besides params")


def _own(shared: Result, params: Any) -> Result:
  """One run's result: ``params`` and its own copies of the shared report, record, debug."""
  return dataclasses.replace(
      shared, params=params, privacy=copy.deepcopy(shared.privacy),
      record={**copy.deepcopy(shared.record), "batched": True},
      debug=copy.deepcopy(shared.debug))


class _Probe(NamedTuple):
  """One grid point traced: its program, its result (report, record) and its numbers."""
  jaxpr: Any          # ClosedJaxpr of (data leaves, key, hparams) -> params leaves
  out_tree: Any
  result: Result
  taken: dict


def _probe(driver: Callable, template: Any, data: Any, key: jax.Array, plan: Any,
           names: tuple) -> _Probe:
  """The driver on ``plan`` traced with the numbers ``names`` as inputs (no compile, no
  run)."""
  out: dict = {}

  def one(data, key, hp):
    view = _view(template, data)
    view.traced_hparams = traced = _Traced(hp)
    result = driver(plan, view, key)
    out.update(result=result, taken=dict(traced.taken))
    return result.params

  dtype = jnp.result_type(float)
  hp0 = {name: jnp.zeros((), dtype) for name in names}
  closed, shape = jax.make_jaxpr(one, return_shape=True)(data, key, hp0)
  return _Probe(closed, jax.tree.structure(shape), out["result"], out["taken"])


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _consts(closed: Any) -> list:
  """The constants of a closed jaxpr and of every jaxpr nested in its equations."""
  from jax.extend import core as jcore
  found = list(closed.consts)

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      for sub in jcore.jaxprs_in_params(eqn.params):
        walk(sub)
      for value in eqn.params.values():
        for v in (value if isinstance(value, (tuple, list)) else (value,)):
          if isinstance(v, jcore.ClosedJaxpr):
            found.extend(v.consts)
  walk(closed.jaxpr)
  return found


def _same_program(a: Any, b: Any) -> bool:
  """Two traced grid points are one program: the same jaxpr text (object addresses aside)
  and the same constants."""
  if _ADDRESS.sub("", str(a.jaxpr)) != _ADDRESS.sub("", str(b.jaxpr)):
    return False
  ca, cb = _consts(a), _consts(b)
  return len(ca) == len(cb) and all(_same(x, y) for x, y in zip(ca, cb))


def _run_grid(driver: Callable, template: Any, datas: Sequence[Any], plans: list,
              keys: Sequence[jax.Array], stacked: Any, stacked_keys: jax.Array,
              grid: Grid) -> list[Result]:
  """Runs whose plans' configs differ only in ``grid.keys``, as one vmapped program.

  Each distinct plan (a grid point) is traced once (:func:`_probe`): its report is its own.
  The points' programs must be one program with ``grid.hparams`` as inputs and their reports
  equal (else :class:`NotBatchable`); then the first point's program runs once under
  ``jax.vmap`` over every run's data, key and numbers."""
  points: list = []
  point_plans: list = []
  index: list[int] = []
  for plan in plans:
    c = plan.config
    j = next((j for j, p in enumerate(points) if not _differing([p, c])), None)
    if j is None:
      points.append(c)
      point_plans.append(plan)
      j = len(points) - 1
    index.append(j)
  probes = [_probe(driver, template, datas[0], keys[0], p, grid.hparams) for p in point_plans]
  first = probes[0]
  for p, pr in zip(points, probes):
    _check_public(pr.result)
    if _is_traced(pr.taken) or not all(
        isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
        and math.isfinite(float(v)) for v in pr.taken.values()):
      raise NotBatchable(f"the driver's step sizes are not finite numbers: {pr.taken!r}")
    if pr.result.privacy != first.result.privacy:
      raise NotBatchable(f"the privacy reports of the grid points differ ({points[0]} vs {p}): "
                         "a grid batches only runs with one guarantee")
    if pr.out_tree != first.out_tree or not _same_program(pr.jaxpr, first.jaxpr):
      what = {k: (points[0].get(k), p.get(k)) for k in _differing([points[0], p])}
      raise NotBatchable(f"the driver's programs for {what} differ beyond its traced step "
                         f"sizes {grid.hparams}: they cannot run as one program")
  dtype = jnp.result_type(float)
  hp = {name: jnp.asarray([float(probes[j].taken.get(name, math.nan)) for j in index], dtype)
        for name in grid.hparams}
  flat = jax.tree.leaves((stacked, stacked_keys, hp))
  from jax.extend import core as jcore
  program = jcore.jaxpr_as_fun(first.jaxpr)
  outs = jax.block_until_ready(jax.vmap(lambda *xs: program(*xs))(*flat))
  params = jax.tree.unflatten(first.out_tree, outs)
  return [_own(probes[j].result, jax.tree.map(lambda x, i=i: x[i], params))
          for i, j in enumerate(index)]


def seed_groups(runs: Sequence[dict]) -> list[list[int]]:
  """Indices of ``runs`` grouped by everything but ``seed`` and the algorithm's step sizes
  (:data:`GRID`; first-appearance order): the runs of a group differ only in their seed and,
  for an algorithm that batches them, their ``learning_rate`` (SRGD: also ``beta`` /
  ``beta_scale``)."""
  groups: dict[str, list[int]] = {}
  for i, cfg in enumerate(runs):
    grid = grid_for(cfg.get("algorithm"))
    skip = {"seed"} | (set(grid.keys) if grid is not None else set())
    key = repr(sorted((str(k), repr(v)) for k, v in cfg.items() if k not in skip))
    groups.setdefault(key, []).append(i)
  return list(groups.values())


def check_grid_plans(plans: Sequence[Any]) -> Grid | None:
  """The :data:`GRID` entry under which ``plans`` (:class:`dpsco_jax.Plan` objects, one per
  run) run as one program (:func:`dpsco_jax.run_grid`), or ``None`` when their algorithm has
  none and their configs are the same (then they run plan by plan).

  The plans must be of one algorithm, one :class:`~dpsco_jax.data.DataSpec`, one set of
  constants and parameter count; their configs may differ only in the algorithm's grid keys
  (:func:`grid_refusal`); their privacy reports and noise multipliers must be equal and their
  schedules may differ only in the step sizes. Else :class:`NotBatchable`, naming the key."""
  first = plans[0]
  for p in plans[1:]:
    for attr in ("algorithm", "spec", "constants", "num_params"):
      if not _same(getattr(p, attr), getattr(first, attr)):
        raise NotBatchable(f"the plans differ in {attr} ({getattr(first, attr)!r} vs "
                           f"{getattr(p, attr)!r}): a grid is one algorithm on one data shape")
  why = grid_refusal(first.algorithm, [p.config for p in plans])
  if why is not None:
    raise NotBatchable(why)
  grid = grid_for(first.algorithm)
  step = set(grid.keys) | set(grid.hparams) if grid is not None else set()
  for p in plans[1:]:
    if p.privacy != first.privacy or not _same(p.noise_multiplier, first.noise_multiplier):
      raise NotBatchable(f"the plans' privacy reports differ (epsilon {first.privacy.epsilon!r} "
                         f"vs {p.privacy.epsilon!r}, noise multiplier "
                         f"{first.noise_multiplier!r} vs {p.noise_multiplier!r}): a grid "
                         "batches only runs with one guarantee")
    for k in _differing([first.schedule or {}, p.schedule or {}]):
      if k not in step:
        raise NotBatchable(f"the plans' schedules differ in {k!r}: a grid batches only runs "
                           "with one schedule")
  return grid


def batch_seeds_option(config: dict) -> bool:
  """The runner key ``batch_seeds`` (default ``true``): run the runs that differ only in seed
  as one program. A top-level key only; anything but ``true`` / ``false`` is a ConfigError."""
  value = config.get("batch_seeds", True)
  if not isinstance(value, bool):
    raise ConfigError(f"batch_seeds must be true or false (run the seeds of a row as one "
                      f"vmapped program, or one by one), got {value!r}")
  for entry in config.get("experiments") or []:
    if isinstance(entry, dict) and "batch_seeds" in entry:
      raise ConfigError("batch_seeds is a top-level runner key (it applies to the whole "
                        "sweep); move it out of the experiments entry")
  return value
