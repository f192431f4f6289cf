"""Seed sweeps as one compiled program (issue 24, part 4).

A sweep of ten seeds of a small problem is ten dispatches of a tiny program; on an accelerator
that is launch-bound. Runs that differ only in their seed share everything public: the config,
the shapes, the plan (schedule, calibrated noise, privacy events). Only the data (a synthetic
problem is drawn from the seed) and the key differ. So the driver runs **once**, under
``jax.vmap`` over the stacked data and the stacked keys:

* the plan, the calibration and the ledger are Python on public facts: they run once per
  group (a sweep no longer calibrates the same noise multiplier ten times);
* the jitted ``lax.scan`` the driver calls is traced with a leading seed axis: one executable,
  one launch per group;
* each run keeps its own key (``jax.random.key(seed)``, folded exactly as the one-by-one run
  folds it; JAX's threefry gives every key of a ``vmap`` the bits it gives it alone) and its
  own privacy report (a copy of the group's, which is the one each run would have computed).

Released params equal the one-by-one runs' to float tolerance (a batched matmul may sum in
another order); epsilons, reports and records are identical.

Only drivers known to trace cleanly are batched (:data:`dpsco_jax.api.BATCHED`): no Python
control flow on the data, nothing read from the problem but its public facts, ``loss_fn`` and
``data``. A driver that does anything else raises under ``vmap`` (a concretization error),
and :func:`run_stacked`'s callers fall back to one run per seed; nothing of the failed attempt
is released.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax.config.schema import ConfigError
from dpsco_jax.result import Result

__all__ = ["NotBatchable", "run_stacked", "refusal", "seed_groups", "batch_seeds_option",
           "stack_keys"]

#: per-seed fields of a synthetic problem used only to score the released params (the
#: optimum, the risk): a batched driver must not read them, so its view of the problem has
#: them blanked (reading one raises, and the group falls back to one run per seed)
EVALUATION_FIELDS = ("x_opt", "risk_fn", "opt_risk", "meta")
#: attributes that make a run something other than one device scan of ``problem.data``
_UNBATCHED_ATTRS = ("mesh", "progress")


class NotBatchable(ValueError):
  """A group of runs that cannot run as one program (the message says why)."""


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


def run_stacked(driver: Callable, template: Any, datas: Sequence[Any], cfg: dict,
                keys: Sequence[jax.Array]) -> list[Result]:
  """``[driver(problem_i, cfg, keys[i]) for i]`` as one program, where ``problem_i`` is
  ``template`` with ``data = datas[i]``.

  The driver runs once, under ``jax.vmap`` over the stacked data and keys: its plan, noise
  calibration and ledger are computed once (they read only public facts, the same for every
  run), its jitted loop is compiled once for the whole group and launched once. Returns one
  :class:`~dpsco_jax.result.Result` per run with its own params (a slice of the batch), its
  own copy of the privacy report, and ``record['batched'] = True``.

  Raises :class:`NotBatchable` when the datas differ in shape, or when the driver returns
  something that depends on the data outside ``params`` (it would be one value for all runs);
  any exception of the driver propagates (the caller may then run the seeds one by one)."""
  if len(datas) != len(keys) or not datas:
    raise NotBatchable(f"{len(datas)} data sets for {len(keys)} keys")
  shapes = _shapes(datas[0])
  if any(_shapes(d) != shapes for d in datas[1:]):
    raise NotBatchable("the data sets differ in shape or dtype")
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *datas)
  stacked_keys = stack_keys(keys)
  out: dict[str, Result] = {}

  def one(data, key):
    result = driver(_view(template, data), dict(cfg), key)
    out["result"] = result
    return result.params

  params = jax.block_until_ready(jax.vmap(one)(stacked, stacked_keys))
  shared = out["result"]
  # everything but params is computed once for the group: it must not hold a traced value
  # (a per-run, data-dependent number would be silently one number for every run)
  if (_is_traced(shared.record) or _is_traced(shared.debug)
      or _is_traced(shared.gradient_evaluations) or _is_traced(dataclasses.asdict(shared.privacy))):
    raise NotBatchable("the driver returns data-dependent values besides params")
  results = []
  for i in range(len(datas)):
    results.append(dataclasses.replace(
        shared, params=jax.tree.map(lambda x, i=i: x[i], params),
        privacy=copy.deepcopy(shared.privacy), record={**copy.deepcopy(shared.record),
                                                       "batched": True},
        debug=copy.deepcopy(shared.debug)))
  return results


def seed_groups(runs: Sequence[dict]) -> list[list[int]]:
  """Indices of ``runs`` grouped by everything but ``seed`` (first-appearance order): the
  runs of a group differ only in their seed."""
  groups: dict[str, list[int]] = {}
  for i, cfg in enumerate(runs):
    key = repr(sorted((str(k), repr(v)) for k, v in cfg.items() if k != "seed"))
    groups.setdefault(key, []).append(i)
  return list(groups.values())


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
