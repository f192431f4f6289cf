"""The runner's seed batching: runs that differ only in seed (and, for the algorithms of
:data:`dpsco_jax.sweep.GRID`, in their step sizes) run as one ``vmap``-ed program
(:func:`batch_records`); plus the record helpers it shares with the one-by-one path."""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any, Callable

import jax
import numpy as np

from dpsco_jax.runner import user as runner_user
from dpsco_jax.config.families import PROBLEM_SCHEMAS, USER_PROBLEM
from dpsco_jax.result import NonFiniteRelease


def problem_config(cfg: dict) -> dict:
  """The keys of ``cfg`` a registered problem's factory is given: its schema's fields and
  ``problem`` / ``seed``, never the algorithm's (a sweep over them shares one problem); a user
  problem gets the whole config."""
  if cfg["problem"] == USER_PROBLEM:
    return cfg
  names = {f.name for f in dataclasses.fields(PROBLEM_SCHEMAS[cfg["problem"]])}
  return {k: v for k, v in cfg.items() if k in names or k in ("problem", "seed")}


def _problem_cache_key(pcfg: dict) -> tuple:
  """Runs that share this key share one problem instance: its own keys and the seed."""
  if pcfg["problem"] == USER_PROBLEM:
    return runner_user.cache_key(pcfg)
  return tuple(sorted((k, repr(v)) for k, v in pcfg.items()))


def run_keys(seed: int) -> tuple[jax.Array, jax.Array]:
  """``(problem key, driver key)`` of a run: ``key(seed)`` folded with 0 and 1 (a batched
  seed gets exactly the keys it gets alone)."""
  key = jax.random.key(int(seed))
  return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


def cached_problem(pcfg: dict, problems: dict, cache: dict | None, key: jax.Array) -> Any:
  """The problem of ``pcfg`` (:func:`problem_config`) built with ``key``, through ``cache``."""
  ck = _problem_cache_key(pcfg)
  if cache is not None and ck in cache:
    return cache[ck]
  problem = problems[pcfg["problem"]](pcfg, key)
  if cache is not None:
    cache[ck] = problem
  return problem


def seed_problem(cfg: dict, problems: dict, cache: dict | None) -> Any:
  """The problem of a run config, built with its seed's problem key (through ``cache``)."""
  return cached_problem(problem_config(cfg), problems, cache, run_keys(cfg.get("seed", 0))[0])


def jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {str(k): jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  if isinstance(x, (np.generic, jax.Array)) and np.ndim(x) == 0:
    x = x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  if isinstance(x, (str, int, float, bool)) or x is None:
    return x
  return repr(x)


def _check_released_numbers(record: dict) -> None:
  """Raises :class:`NonFiniteRelease` when a released number (excess risk, a user metric) is
  NaN or infinite: such a run failed, and a NaN mean would hide it in the table."""
  names = ["excess_risk", *record.get("user_metrics", ())]
  bad = [f"{n} = {record[n]}" for n in names
         if isinstance(record.get(n), float) and not math.isfinite(record[n])]
  if bad:
    raise NonFiniteRelease(f"{record.get('algorithm')}: {', '.join(bad)} at the released "
                           "params: the loss is not finite there, or the steps diverged")


def finish_record(record: dict, cfg: dict, label: str | None) -> dict:
  """The record with its row label and the config keys it does not already hold (JSON-safe);
  raises when its released numbers are not finite."""
  _check_released_numbers(record)
  if label is not None:
    record["label"] = label
  extras = {k: v for k, v in cfg.items() if k not in record}
  record["config"] = extras
  return jsonable(record)


def result_record(problem: Any, cfg: dict, result: Any, wall: float) -> dict:
  """The record of a registered driver's ``result`` on ``problem`` (``wall``: its seconds)."""
  params = result.params
  scores = {"excess_risk": float(problem.excess_risk(params))}
  f64 = getattr(problem, "excess_risk_f64", None)  # float64 where the problem has it
  facts = {} if f64 is None or (v := f64(params)) is None else {"excess_risk_f64": v}
  facts.update({name: getattr(problem, name) for name in ("radius", "lipschitz", "smoothness")
                if hasattr(problem, name)})  # R, L, beta of the problem
  sizes = {"n_users": int(problem.n_users), "m": int(problem.m), "d": int(problem.d)}
  return runner_user.run_record(
      cfg, sizes=sizes, privacy=result.privacy, scores=scores,
      gradient_evaluations=int(result.gradient_evaluations), wall=wall, facts=facts,
      extras=result.record, fallback=getattr(result, "fallback", None), debug=result.debug)


def batch_records(cfgs: list[dict], algorithms: dict, problems: dict, cache: dict, *,
                  checked: Callable[[dict, dict, dict], tuple[dict, Any]] | None,
                  plan_row: Callable[[dict, Any, Any], Any]
                  ) -> tuple[list[dict] | None, str | None]:
  """The records of runs that differ only in seed (or a GRID algorithm's step sizes), run as
  one vmapped program (:func:`dpsco_jax.sweep.run_stacked`), or ``(None, why)`` when they run
  one by one (nothing of the attempt is released). ``checked``: the validator of one run config, ``(normalized copy, typed
  config)`` (``None``: validated already); ``plan_row(cfg, typed, problem)``: a row's plan.
  A grid group's records say ``batch_grid``."""
  from dpsco_jax import api
  from dpsco_jax.api import BATCHED
  from dpsco_jax.sweep import grid_for, grid_of, grid_refusal, refusal, run_stacked
  first = cfgs[0]
  if first.get("algorithm") not in BATCHED:
    return None, f"{first.get('algorithm')} does not batch seeds yet"
  if first.get("problem") == USER_PROBLEM or first.get("debug") is True:
    return None, "user problems and debug runs go one by one"
  try:
    pairs = ([(cfg, None) for cfg in cfgs] if checked is None else
             [checked(cfg, algorithms, problems) for cfg in cfgs])
    checked = [cfg for cfg, _ in pairs]
    why = grid_refusal(first["algorithm"], checked, ignore=("seed", "label"))
    if why is not None:
      return None, why
    grid = grid_of(checked, ignore=("seed", "label"))
    keys = [run_keys(cfg.get("seed", 0)) for cfg in checked]   # per seed, as run_one has them
    insts = [cached_problem(problem_config(cfg), problems, cache, pk)
             for cfg, (pk, _) in zip(checked, keys)]
    why = refusal(insts)
    if why is not None:
      return None, why
    start = time.perf_counter()
    driver = algorithms[first["algorithm"]]
    # the data-free plans, one per grid point
    plans = [plan_row(c, typed, insts[0]) for c, typed in (pairs if grid else pairs[:1])]
    results = run_stacked(driver, insts[0], [p.data for p in insts],
                          plans if grid else plans[0], [dk for _, dk in keys],
                          grid=grid_for(first["algorithm"]))
    wall = time.perf_counter() - start
    for i, result in enumerate(results):   # as dpsco_jax.execute checks
      api.check_spent(plans[i if grid else 0], result)
    # inside the try: a seed whose released numbers are not finite fails alone, one by one
    return [_batched_record(cfg, problem, result, wall, len(cfgs), grid)
            for cfg, problem, result in zip(checked, insts, results)], None
  except Exception as err:  # noqa: BLE001 - the one-by-one runs report any real error
    return None, f"batching failed ({type(err).__name__}); ran one by one"


def _batched_record(cfg: dict, problem: Any, result: Any, wall: float, runs: int,
                    grid: dict | None) -> dict:
  """One seed's record of a batch (``wall``: the batch's seconds, over ``runs`` runs)."""
  cfg = dict(cfg)
  label = cfg.pop("label", None)
  record = result_record(problem, cfg, result, wall / runs)
  record.update(batched=True, batch_runs=runs, batch_wall_time_s=wall)
  if grid:
    record["batch_grid"] = grid
  return finish_record(record, cfg, label)


class ProblemCache(collections.OrderedDict):
  """The problems of the most recent ``maxsize`` distinct (problem config, seed) keys (least
  recently used evicted first) holding at most ``max_bytes`` of arrays (default: a quarter of
  the machine's memory; the most recent always kept): a problem keeps its drivers'
  executables alive."""

  def __init__(self, maxsize: int = 16, max_bytes: int | None = None):
    super().__init__()
    self.maxsize = maxsize
    self.max_bytes = _default_max_bytes() if max_bytes is None else int(max_bytes)
    self._bytes: dict = {}

  def __getitem__(self, key):
    self.move_to_end(key)
    return super().__getitem__(key)

  def __setitem__(self, key, value):
    super().__setitem__(key, value)
    self._bytes[key] = problem_bytes(value)
    self.move_to_end(key)
    while len(self) > 1 and (len(self) > self.maxsize
                             or sum(self._bytes.values()) > self.max_bytes):
      old, _ = self.popitem(last=False)
      self._bytes.pop(old, None)


def problem_bytes(problem: Any) -> int:
  """Bytes of the arrays a problem holds (its data and any other array attribute)."""
  leaves = jax.tree.leaves(getattr(problem, "__dict__", problem))
  return int(sum(getattr(x, "nbytes", 0) for x in leaves if hasattr(x, "shape")))


def _default_max_bytes() -> int:
  try:
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
  except (ValueError, OSError, AttributeError):
    return 4 << 30
