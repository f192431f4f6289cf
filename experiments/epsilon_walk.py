"""The walk of ``epsilon`` from a YAML file to the noise (issue 25, "Measure"), traced.

Runs one config through the CLI's own path (``runner.run_config``) with its ``epsilon`` replaced
by a sentinel float nobody else would produce, and records, with ``sys.setprofile``, every call
of a ``dpsco_jax`` function whose arguments hold the sentinel: directly, or one level inside a
mapping, a dataclass / NamedTuple field (a typed config is both a mapping and a dataclass). From the
calls it reports

* ``stays``: distinct functions the value passes through (file:function);
* ``climbs``: call edges along which it travels *up* the layering (a callee in a higher layer
  than its caller: privacy < transforms < algorithms < planners/api < runner);
* ``names``: the distinct names it is held under (argument names and key/field names);
* ``files``: the distinct files of those functions.

The numbers depend on the config (the quickstart's ``dp_sgd_user`` by default) and on this
definition; the issue's goal is ≤ 8 stays, ≤ 2 climbs, one name. Last line: JSON.

Measured on the quickstart: 48 stays, 0 climbs, 8 names, 13 files before the noise stages
carried their sensitivity (acb3bff); 44 stays, 0 climbs, 6 names (epsilon, epsilon_budget,
target_epsilon, v, value, x), 13 files after (307ef60: DP-SGD's sampling helpers take numbers,
not the config; the plan holds its target as ``epsilon``): the DP-SGD package 9 stays (its
driver entry, plan, budget charge and calibration input), privacy 3 (calibrator, ledger), and
outside them the runner 12, the config checks and ``ConfigView`` 13, the problem factory 2,
``_checks`` 5 (name ``x``). 38 stays, 0 climbs, 6 names, 11 files after 3a77664 (the problem
cache and factory take the problem's keys, ``run_keys`` the seed, the schema's name and
epsilon-given checks only what they check): the runner 10, the config checks and ``ConfigView``
11, ``_checks`` 5, the DP-SGD package 8, privacy 3, ``required_delta`` 1. 39 after 7e7c222:
the memoized calibration (``dpsgd.plan._calibrated_z``) is one more function the target
passes through. 2026-11-27 (issue 25: the typed config is what runs; ``ConfigView``
removed): the walk now ends where the issue ends it, at the noise standard deviation
(:data:`NOISE_STD`); the budget charge and the record's echo of the target come after it and
are listed apart. On the quickstart: 33 stays to the noise std (+7 after it: the ledger's
``epsilon_budget``, the records' ``target_epsilon``), 0 climbs, 4 names (epsilon and the
generic validators' v, value, x), 11 files. The whole run, counted as before, is 40.
2026-11-28 (the runner plans a built-in problem with ``dpsco_jax.plan_problem`` and runs the
plan through ``dpsco_jax.execute``, as ``dpsco_jax.run`` does): 34 stays to the noise std
(``api.plan_problem`` is the new one; 9 after it), 0 climbs, 4 names, 11 files. Of the 34,
16 are generic validators and accessors that every key of every config passes
(``config/types.py`` and ``config/schema.py`` 11, ``_checks.py`` 5; the names v, value, x are
theirs), 6 the runner's section, problem-key and dispatch code, 2 the API's plan entry, and
10 the DP-SGD planner and the calibrator.
Later on 2026-11-28 (number keys range-checked where the config is built, so the planner no
longer checks epsilon again; DP-SGD calibrates through the calibrator's own keyed memo
instead of a second one; ``required_delta`` takes the field, not the config; the calibrator's
root finder sees a gap function, not the target): 32 stays, 0 climbs, 4 names, 10 files. Of
the 32: 17 generic validation and plumbing that every key of every config passes
(``config/`` 10 with the new range check, ``_checks.py`` 5 for the calibrator's own check of
its argument, ``runner/config.py`` 2), the runner 4, the API 2, the DP-SGD planner 5, the
calibrator 4.

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
#: the walk ends where the noise standard deviation is formed (``z`` times the stage's
#: sensitivity): calls after it (the budget charge, the record's echo of the target) are
#: listed apart, "after the noise std"
NOISE_STD = "gaussian_noise_std"
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


def _held(value, depth: int = 0) -> list[str]:
  """Names under which ``value`` holds the sentinel (itself: ``""``), one container deep."""
  try:
    return _held_unsafe(value, depth)
  except Exception:   # noqa: BLE001 - an object half-built in its own __init__: not holding it
    return []


def _held_unsafe(value, depth: int) -> list[str]:
  if isinstance(value, float) and value == SENTINEL:
    return [""]
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
    if isinstance(k, str) and _held(v, depth + 1):
      out.append(k)
  return out


def trace(config: dict) -> dict:
  from dpsco_jax import runner
  calls: dict[str, set[str]] = {}
  edges: set[tuple[str, str]] = set()
  stack: list[str | None] = []

  after: dict[str, set[str]] = {}   # calls once the noise std exists (records, ledger)
  done = []

  def prof(frame, event, arg):
    if event == "return" and not done and frame.f_code.co_qualname == NOISE_STD and (
        frame.f_code.co_filename.startswith(PKG)):
      done.append(True)   # the walk's end: the noise std is formed
    if event == "call":
      code = frame.f_code
      where = None
      if code.co_filename.startswith(PKG):
        names = set()
        for var in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
          if var in frame.f_locals:
            for key in _held(frame.f_locals[var]):
              names.add(key or var)
        if names:
          where = f"{code.co_filename[len(PKG):]}:{code.co_qualname}"
          (after if done else calls).setdefault(where, set()).update(names)
          caller = next((s for s in reversed(stack) if s is not None), None)
          if caller is not None:
            edges.add((caller, where))
      stack.append(where)
    elif event == "return" and stack:
      stack.pop()

  sys.setprofile(prof)
  try:
    records = runner.run_config(config, progress=False)
  finally:
    sys.setprofile(None)
  bad = [r.get("error") for r in records if r.get("status") != "ok"]
  if bad:
    raise RuntimeError(f"the traced run failed: {bad[0]}")
  climbs = sorted((a, b) for a, b in edges
                  if layer(PKG + b.split(":")[0]) > layer(PKG + a.split(":")[0]))
  names = sorted({n for v in calls.values() for n in v})
  return {"stays": len(calls), "climbs": len(climbs), "names": names, "n_names": len(names),
          "files": len({c.split(":")[0] for c in calls}),
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
  one.update(seed=0, experiments=[dict(entry, algorithm=alg)])
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
