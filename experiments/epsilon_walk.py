"""The walk of ``epsilon`` from a YAML file to the noise draw (issue 25 "Measure", issue 47.5).

Runs one config through the CLI's own path (``runner.run_config``, the quickstart's three seeds
as one vmapped program, under ``jax.disable_jit`` so that the std reaches the draw as a number)
with its ``epsilon`` replaced by a sentinel float, and records with ``sys.setprofile`` every call
of a ``dpsco_jax`` function whose arguments hold the value: directly, or one level inside a
mapping or a dataclass / NamedTuple field. The value is followed under every name it takes: the
sentinel ``epsilon``; the ``z`` the calibrator returns for it (:data:`CONVERSIONS`); the ``std``
formed from that ``z`` by ``gaussian_noise_std``; the walk ends at the draw (:data:`DRAW`).
It reports

* ``stays``: distinct functions the value passes through (file:function);
* ``climbs``: call edges along which it travels *up* the layering (a callee in a higher layer
  than its caller: privacy < transforms < algorithms < planners/api < runner);
* ``names``: the distinct names it is held under (argument names and key/field names);
* ``files``: the distinct files of those functions.

The numbers depend on the config (the quickstart's ``dp_sgd_user`` by default) and on this
definition; the measured history is in ``experiments/README.md``. Last line: JSON.

    .venv/bin/python experiments/epsilon_walk.py [config.yaml] [--algorithm dp_sgd_user]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping

import yaml

SENTINEL = 1.8765432109876
#: where the value changes name and number: the calibrator turns epsilon into the noise
#: multiplier ``z``, the one place a noise std is formed turns ``z`` into ``std``; the walk then
#: follows the std until the noise is drawn (:data:`DRAW`)
CONVERSIONS = {"calibrate_noise_multiplier": "z", "gaussian_noise_std": "std"}
DRAW = "tree_gaussian_like"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "dpsco_jax") + os.sep
#: layer of a module path prefix (the longest matching prefix wins); higher = further from data
LAYERS = (("privacy/", 1), ("transforms/", 2), ("grads", 2), ("data/", 2), ("flax/", 3),
          ("algorithms/", 3), ("planners", 4), ("api", 4), ("sweep", 4), ("distributed", 4),
          ("result", 4), ("runner", 5), ("__main__", 5), ("config", 0), ("_checks", 0))


def layer(path: str) -> int:
  rel = path[len(PKG):]
  best = (0, 3)
  for prefix, lay in LAYERS:
    if rel.startswith(prefix) and len(prefix) > best[0]:
      best = (len(prefix), lay)
  return best[1]


def _number(value) -> float | None:
  """``value`` as a float when it is one concrete number (a float, a numpy or a concrete JAX
  scalar; never a tracer), else None."""
  if isinstance(value, bool):
    return None
  if isinstance(value, float):
    return value
  import jax
  import numpy as np
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, (np.floating, np.ndarray, jax.Array)) and np.ndim(value) == 0:
    try:
      return float(value)
    except Exception:   # noqa: BLE001 - not a concrete number
      return None
  return None


def _is_tracked(x: float, tracked: dict) -> bool:
  # float32 copies of a tracked float (a std handed to the noise draw) count as the value
  return any(x == t or abs(x - t) <= 1e-6 * abs(t) for t in tracked)


def _held(value, tracked: dict, depth: int = 0) -> list[str]:
  """Names under which ``value`` holds a tracked number (itself: ``""``), one container
  deep."""
  try:
    return _held_unsafe(value, tracked, depth)
  except Exception:   # noqa: BLE001 - an object half-built in its own __init__: not holding it
    return []


def _held_unsafe(value, tracked: dict, depth: int) -> list[str]:
  x = _number(value)
  if x is not None:
    return [""] if _is_tracked(x, tracked) else []
  if depth >= 1:
    return []
  out = []
  items = ()
  if isinstance(value, Mapping):
    items = value.items()
  elif dataclasses.is_dataclass(value) and not isinstance(value, type):
    items = ((f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value))
  elif isinstance(value, tuple) and hasattr(value, "_fields"):
    items = zip(value._fields, value)
  for k, v in items:
    if isinstance(k, str) and _held(v, tracked, depth + 1):
      out.append(k)
  return out


def trace(config: dict) -> dict:
  """Runs ``config`` (under ``jax.disable_jit``, so the noise std reaches the draw as a
  number) and follows the sentinel epsilon, then the ``z`` the calibrator returns for it,
  then the ``std`` formed from that ``z``, until the noise is drawn."""
  import jax
  from dpsco_jax import runner
  tracked = {SENTINEL: "epsilon"}
  calls: dict[str, set[str]] = {}
  edges: set[tuple[str, str]] = set()
  stack: list[str | None] = []
  after: dict[str, set[str]] = {}   # calls once the noise is drawn (records, ledger)
  done = []

  def prof(frame, event, arg):
    code = frame.f_code
    mine = code.co_filename.startswith(PKG)
    if event == "return" and mine and not done and code.co_qualname in CONVERSIONS:
      x = _number(arg)
      holds = any(_held(frame.f_locals.get(v), tracked) for v in
                  code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
      if x is not None and holds and x > 0:
        tracked[x] = CONVERSIONS[code.co_qualname]
    if event == "call":
      where = None
      if mine:
        names = set()
        for var in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
          if var in frame.f_locals:
            for key in _held(frame.f_locals[var], tracked):
              names.add(key or var)
        if names:
          where = f"{code.co_filename[len(PKG):]}:{code.co_qualname}"
          (after if done else calls).setdefault(where, set()).update(names)
          caller = next((s for s in reversed(stack) if s is not None), None)
          if caller is not None and not done:
            edges.add((caller, where))
          if code.co_qualname == DRAW:
            done.append(True)   # the walk's end: the noise is drawn with the std
      stack.append(where)
    elif event == "return" and stack:
      stack.pop()

  sys.setprofile(prof)
  try:
    with jax.disable_jit():
      records = runner.run_config(config, progress=False)
  finally:
    sys.setprofile(None)
  bad = [r.get("error") for r in records if r.get("status") != "ok"]
  if bad:
    raise RuntimeError(f"the traced run failed: {bad[0]}")
  if not done:
    raise RuntimeError("the walk never reached the noise draw")
  climbs = sorted((a, b) for a, b in edges
                  if layer(PKG + b.split(":")[0]) > layer(PKG + a.split(":")[0]))
  names = sorted({n for v in calls.values() for n in v})
  return {"stays": len(calls), "climbs": len(climbs), "names": names, "n_names": len(names),
          "files": len({c.split(":")[0] for c in calls}),
          "values": sorted(set(tracked.values()), key=list(tracked.values()).index),
          "functions": {k: sorted(v) for k, v in sorted(calls.items())},
          "climb_edges": [f"{a} -> {b}" for a, b in climbs],
          "after_noise": {k: sorted(v) for k, v in sorted(after.items()) if k not in calls}}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("config", nargs="?", default=os.path.join(ROOT, "configs", "quickstart.yaml"))
  ap.add_argument("--algorithm", default="dp_sgd_user")
  args = ap.parse_args()
  with open(args.config) as f:
    cfg = yaml.safe_load(f)
  # one run of one algorithm, its epsilon the sentinel
  entry = next(e for e in cfg["experiments"]
               if (e["algorithm"]["name"] if isinstance(e["algorithm"], dict)
                   else e["algorithm"]) == args.algorithm)
  alg = dict(entry["algorithm"]) if isinstance(entry["algorithm"], dict) else {
      "name": entry["algorithm"]}
  alg["epsilon"] = SENTINEL
  one = {k: v for k, v in cfg.items() if k not in ("experiments", "compare", "seed",
                                                     "tuning_seeds", "eval_seeds", "select")}
  # the seeds as the quickstart runs them (a seed batch: one vmapped program)
  one.update(seed=cfg.get("seed", 0), experiments=[dict(entry, algorithm=alg)])
  out = trace(one)
  for fn, names in out["functions"].items():
    print(f"  {fn}  [{', '.join(names)}]")
  for fn, names in out["after_noise"].items():
    print(f"  (after the noise std) {fn}  [{', '.join(names)}]")
  for edge in out["climb_edges"]:
    print(f"  climb: {edge}")
  print(f"stays {out['stays']}, climbs {out['climbs']}, names {out['n_names']} "
        f"({', '.join(out['names'])}), files {out['files']}; after the noise std "
        f"{len(out['after_noise'])} more")
  print(json.dumps({k: out[k] for k in ("stays", "climbs", "n_names", "names", "files")}
                   | {"after_noise": len(out["after_noise"])}))


if __name__ == "__main__":
  main()
