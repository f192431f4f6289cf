"""Config -> sweep -> runs -> records, tables, plots.

A config is a YAML mapping. Any field whose value is a list is swept (Cartesian product,
seeds included). Optionally, ``experiments:`` holds a list of mappings, each merged over the
top-level fields (so one file can compare algorithms with different hyper-parameters):

    problem: logistic
    n_users: 1000
    m: 8
    d: 10
    seed: [0, 1, 2]
    experiments:
      - {algorithm: nonprivate_sgd}
      - {algorithm: dp_sgd_user, clip: 1.0, epsilon: [1.0, 4.0], delta: 1.0e-6}

Every expanded run is validated before any run starts
(:func:`dpsco_jax.config_schema.validate`): a key its algorithm and problem do not read
(``epsilonn``, ``clip_norm`` where the driver reads ``clip``), a value of the wrong type
(``epsilon: '1.0'``, ``epsilon: yes``, ``seed: 1.7``) or a missing required key is a
:class:`ConfigError` naming the key, with a suggestion. So a key shared by rows whose algorithms
differ belongs in the rows that read it (``delta`` in the private rows, not at the top level
when a ``nonprivate_sgd`` row reads none).

Each run produces one record with at least ``algorithm, problem, n_users, m, d, epsilon,
delta, provenance, excess_risk, gradient_evaluations, wall_time_s, seed`` (``epsilon`` and
``delta`` are the *guaranteed* values from the result's privacy report; the requested target
is kept as ``target_epsilon``).
"""

from __future__ import annotations

import difflib
import importlib
import traceback
import itertools
import json
import math
import statistics
import sys
import time
from typing import Any, Callable, Iterable

import jax
import numpy as np

from dpsco_jax.config_schema import ConfigError, validate  # noqa: F401 (re-exported)

ALGORITHM_MODULES = (
    "dpsco_jax.algorithms.baselines",
    "dpsco_jax.algorithms.user_level_filter",
    "dpsco_jax.algorithms.output_perturbation",
    "dpsco_jax.algorithms.resque",
    "dpsco_jax.algorithms.srgd",
    "dpsco_jax.algorithms.bilevel",
    "dpsco_jax.algorithms.localized_gd",
)
RESERVED = ("experiments", "name", "description")


def registry() -> tuple[dict[str, Callable], dict[str, Callable]]:
  """Merges ``ALGORITHMS`` and ``PROBLEMS`` of every algorithm module."""
  from dpsco_jax import problems as core_problems
  algorithms: dict[str, Callable] = {}
  problems: dict[str, Callable] = {
      name: (lambda cfg, key, _n=name: core_problems.make_problem({**cfg, "problem": _n}, key))
      for name in core_problems.PROBLEM_NAMES}
  for mod_name in ALGORITHM_MODULES:
    mod = importlib.import_module(mod_name)  # a module that fails to import is a bug: raise
    algorithms.update(getattr(mod, "ALGORITHMS", {}))
    problems.update(getattr(mod, "PROBLEMS", {}))
  return algorithms, problems


def expand(config: dict) -> list[dict]:
  """All run configs of a config file: experiments merged over defaults, lists swept."""
  base = {k: v for k, v in config.items() if k not in RESERVED}
  variants = config.get("experiments") or [{}]
  runs = []
  for variant in variants:
    if not isinstance(variant, dict):
      raise ConfigError(f"experiments: every entry must be a mapping, got {variant!r}")
    merged = {**base, **variant}
    for k, v in merged.items():
      if isinstance(v, list) and not v:
        raise ConfigError(f"{k}: an empty list sweeps nothing; give at least one value")
    keys = list(merged)
    values = [v if isinstance(v, list) else [v] for v in (merged[k] for k in keys)]
    for combo in itertools.product(*values):
      runs.append(dict(zip(keys, combo)))
  return runs


def swept_fields(config: dict) -> list[str]:
  """Fields that take more than one value across the expanded runs (seed excluded), e.g. a
  list-valued field, or a field that differs between ``experiments`` entries."""
  values: dict[str, set] = {}
  for run in expand(config):
    for k, v in run.items():
      values.setdefault(k, set()).add(repr(v))
  return sorted(k for k, vs in values.items() if len(vs) > 1 and k != "seed")


def _problem_cache_key(cfg: dict) -> tuple:
  """Runs that share this key share one problem instance (and its data)."""
  from dpsco_jax.problems import PROBLEM_KEYS, PROBLEM_NAMES
  if cfg["problem"] in PROBLEM_NAMES:
    fields = ("problem", "seed") + PROBLEM_KEYS
    return tuple((k, repr(cfg.get(k))) for k in fields)
  # a module's own problem may read any key: only the algorithm's identity is excluded
  return tuple(sorted((k, repr(v)) for k, v in cfg.items() if k != "algorithm"))


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.generic, jax.Array)) and np.ndim(x) == 0:
    x = x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  if isinstance(x, (str, int, float, bool)) or x is None:
    return x
  return repr(x)


def _checked(cfg: dict, algorithms: dict, problems: dict) -> dict:
  """The run config validated against the registry and the schemas (normalized copy)."""
  if not isinstance(cfg, dict):
    raise ConfigError(f"a run config must be a mapping, got {type(cfg).__name__}")
  for field in ("algorithm", "problem"):
    if field not in cfg:
      raise ConfigError(f"config is missing the field {field!r}")
  for field, known in (("algorithm", algorithms), ("problem", problems)):
    if not isinstance(cfg[field], str) or cfg[field] not in known:
      hint = difflib.get_close_matches(str(cfg[field]), list(known), n=1)
      raise ConfigError(f"unknown {field} {cfg[field]!r}"
                        + (f" (did you mean {hint[0]!r}?)" if hint else "")
                        + f"; known: {', '.join(sorted(known))}")
  from dpsco_jax.config_schema import ALGORITHM_SCHEMAS, PROBLEM_SCHEMAS
  for field, schemas in (("algorithm", ALGORITHM_SCHEMAS), ("problem", PROBLEM_SCHEMAS)):
    if cfg[field] not in schemas:  # a bug of the library, not of the config
      raise ConfigError(f"{field} {cfg[field]!r} is registered but has no config schema; add "
                        "one to dpsco_jax/config_schema.py")
  return validate(cfg)


def run_one(cfg: dict, *, algorithms: dict, problems: dict, cache: dict | None = None) -> dict:
  """Validates one run config (:func:`dpsco_jax.config_schema.validate`), runs it and returns
  its record."""
  cfg = _checked(cfg, algorithms, problems)
  seed = int(cfg.get("seed", 0))
  key = jax.random.key(seed)
  cache_key = _problem_cache_key(cfg)
  if cache is not None and cache_key in cache:
    problem = cache[cache_key]
  else:
    problem = problems[cfg["problem"]](cfg, jax.random.fold_in(key, 0))
    if cache is not None:
      cache[cache_key] = problem
  start = time.perf_counter()
  result = algorithms[cfg["algorithm"]](problem, cfg, jax.random.fold_in(key, 1))
  params = jax.block_until_ready(result.params)
  wall = time.perf_counter() - start
  record = {
      "algorithm": cfg["algorithm"], "problem": cfg["problem"],
      "n_users": int(problem.n_users), "m": int(problem.m), "d": int(problem.d),
      "epsilon": result.privacy.epsilon, "delta": result.privacy.delta,
      "target_epsilon": cfg.get("epsilon"), "provenance": result.privacy.provenance,
      "privacy_level": result.privacy.level, "relation": result.privacy.relation,
      "paper_epsilon": result.privacy.paper_epsilon,
      "excess_risk": float(problem.excess_risk(params)),
      "gradient_evaluations": int(result.gradient_evaluations),
      "wall_time_s": wall, "seed": seed,
  }
  for name in ("radius", "lipschitz", "smoothness"):  # R, L, beta of the problem
    if hasattr(problem, name):
      record[name] = getattr(problem, name)
  record.update({k: v for k, v in result.record.items() if k not in record})
  if result.privacy.notes:
    record["privacy_notes"] = result.privacy.notes
  if cfg.get("debug") is True and result.debug is not None:
    record["debug"] = result.debug
  extras = {k: v for k, v in cfg.items() if k not in record}
  record["config"] = extras
  return _jsonable(record)


def _progress(i: int, total: int, cfg: dict, t0: float) -> None:
  width = 24
  done = int(width * i / total)
  elapsed = time.perf_counter() - t0
  desc = f"{cfg['algorithm']} seed={cfg.get('seed', 0)}" if cfg else "done"
  sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{total} {elapsed:6.1f}s {desc:40.40s}")
  sys.stderr.flush()


def run_config(config: dict, *, progress: bool = True, on_record: Callable | None = None
               ) -> list[dict]:
  """Runs every expanded config. A run that raises becomes a record with ``status: failed``
  and its error (the sweep goes on); ``on_record(records)`` is called after every run so a
  caller can write results as they finish."""
  algorithms, problems = registry()
  # user errors in any run are reported before anything runs
  runs = [_checked(cfg, algorithms, problems) for cfg in expand(config)]
  cache: dict = {}
  records = []
  t0 = time.perf_counter()
  for i, cfg in enumerate(runs):
    if progress:
      _progress(i, len(runs), cfg, t0)
    try:
      record = run_one(cfg, algorithms=algorithms, problems=problems, cache=cache)
      record["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - one bad run must not lose the others
      record = _jsonable({"algorithm": cfg.get("algorithm"), "problem": cfg.get("problem"),
                          "seed": cfg.get("seed", 0), "status": "failed",
                          "error": f"{type(err).__name__}: {err}",
                          "config": {k: v for k, v in cfg.items()
                                     if k not in ("algorithm", "problem", "seed")}})
      if not isinstance(err, ConfigError) and progress:
        sys.stderr.write("\n" + traceback.format_exc(limit=3))
    records.append(record)
    if on_record is not None:
      on_record(records)
  if progress:
    _progress(len(runs), len(runs), {}, t0)
    sys.stderr.write("\n")
  return records


def _group_key(record: dict, fields: Iterable[str]) -> tuple:
  out = []
  for f in fields:
    v = record.get(f, record.get("config", {}).get(f))
    out.append(v)
  return tuple(out)


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
  """Student-t confidence interval for the mean (NaN bounds with fewer than 2 values)."""
  if len(values) < 2:
    return math.nan, math.nan
  from scipy.stats import t
  mean, sem = statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))
  half = float(t.ppf(0.5 + level / 2, len(values) - 1)) * sem
  return mean - half, mean + half


def aggregate(records: list[dict], fields: list[str]) -> list[dict]:
  """Mean, std and 95% t-interval over seeds of every group of records sharing ``fields``
  (failed runs are counted in ``failed`` and left out of the statistics)."""
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    groups.setdefault(_group_key(r, fields), []).append(r)
  rows = []
  for key, group in groups.items():
    rs = [r for r in group if r.get("status", "ok") == "ok"]
    row = {**dict(zip(fields, key)), "seeds": len(rs), "failed": len(group) - len(rs)}
    if rs:
      risks = [float(r["excess_risk"]) for r in rs]
      lo, hi = t_interval(risks)
      row.update({
          "excess_risk_mean": statistics.fmean(risks),
          "excess_risk_std": statistics.stdev(risks) if len(risks) > 1 else 0.0,
          "excess_risk_ci95_lo": lo, "excess_risk_ci95_hi": hi,
          "epsilon": max(float(r["epsilon"]) for r in rs),
          "provenance": ",".join(sorted({r["provenance"] for r in rs})),
          "gradient_evaluations": statistics.fmean(r["gradient_evaluations"] for r in rs),
          "wall_time_s": statistics.fmean(r["wall_time_s"] for r in rs)})
    else:
      row["error"] = group[0].get("error", "")
    rows.append(row)
  return rows


def format_table(rows: list[dict], fields: list[str]) -> str:
  cols = fields + ["excess_risk_mean", "excess_risk_std", "ci95", "epsilon", "provenance",
                   "gradient_evaluations", "wall_time_s", "seeds"]
  if any(r.get("failed") for r in rows):
    cols.append("failed")
  def fmt(v):
    if isinstance(v, float):
      return f"{v:.4g}"
    return "" if v is None else str(v)
  def cell(r, c):
    if c == "ci95":
      lo, hi = r.get("excess_risk_ci95_lo"), r.get("excess_risk_ci95_hi")
      return "" if lo is None or math.isnan(lo) else f"[{lo:.3g}, {hi:.3g}]"
    if c == "excess_risk_mean" and "error" in r:
      return "FAILED"
    return fmt(r.get(c))
  table = [[c for c in cols]] + [[cell(r, c) for c in cols] for r in rows]
  widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
  lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def plot(records: list[dict], x_field: str, fields: list[str], path: str) -> str:
  """Excess risk (mean and 95% t-interval over seeds) against ``x_field``, one line per other
  group."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as err:  # optional extra
    raise RuntimeError("plotting needs matplotlib: pip install 'dpsco_jax[plot]'") from err
  others = [f for f in fields if f != x_field]
  rows = [r for r in aggregate(records, fields) if r["seeds"]]
  lines: dict[tuple, list[dict]] = {}
  for r in rows:
    lines.setdefault(tuple(r[f] for f in others), []).append(r)
  fig, ax = plt.subplots(figsize=(6, 4))
  for key, rs in sorted(lines.items(), key=lambda kv: str(kv[0])):
    rs = sorted(rs, key=lambda r: r[x_field])
    xs = [r[x_field] for r in rs]
    means = [r["excess_risk_mean"] for r in rs]
    # 95% t-interval of the mean where there are >= 2 seeds, else no bar
    lo = [m - r["excess_risk_ci95_lo"] if math.isfinite(r["excess_risk_ci95_lo"]) else 0.0
          for m, r in zip(means, rs)]
    hi = [r["excess_risk_ci95_hi"] - m if math.isfinite(r["excess_risk_ci95_hi"]) else 0.0
          for m, r in zip(means, rs)]
    ax.errorbar(xs, means, yerr=[lo, hi],
                label=", ".join(f"{f}={v}" for f, v in zip(others, key)), marker="o",
                capsize=3)
  ax.set_xlabel(x_field)
  ax.set_ylabel("excess risk")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


def _yaml_loader():
  """A SafeLoader that also reads scientific notation without a dot (``1e-5``, ``2E+3``) as a
  float: PyYAML follows YAML 1.1, where such a scalar is a string, so ``delta: 1e-5`` would be
  refused as "not a number" (or, in a driver that parses strings, read loosely)."""
  import re
  import yaml

  class Loader(yaml.SafeLoader):
    pass

  Loader.add_implicit_resolver(
      "tag:yaml.org,2002:float",
      re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
      list("-+0123456789"))
  return Loader


def load_config(path: str) -> dict:
  import yaml
  try:
    with open(path) as f:
      config = yaml.load(f, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
  except OSError as err:
    raise ConfigError(f"{path}: {err.strerror}") from None
  except yaml.YAMLError as err:
    raise ConfigError(f"{path}: not valid YAML ({err})") from None
  if not isinstance(config, dict):
    raise ConfigError(f"{path}: a config must be a YAML mapping")
  return config


def main_run(path: str, out: str | None = None, plot_field: str | None = None,
             progress: bool = True) -> list[dict]:
  """Runs a config file, prints its table, writes ``out`` as runs finish. Returns the records
  (failed runs included, with ``status: failed`` and their error)."""
  config = load_config(path)
  def write(records):
    if out:
      with open(out, "w") as f:
        json.dump({"config": _jsonable(config), "results": records}, f, indent=1)
  records = run_config(config, progress=progress, on_record=write)
  # group by the *requested* epsilon; the table's epsilon column is the guaranteed one
  fields = ["algorithm"] + [("target_epsilon" if f == "epsilon" else f)
                            for f in swept_fields(config) if f != "algorithm"]
  rows = aggregate(records, fields)
  title = config.get("name", path)
  print(f"\n== {title}: {len(records)} runs ==")
  print(format_table(rows, fields))
  print("(ci95: Student-t 95% interval of the mean over seeds)")
  for r in records:
    if r.get("status") == "failed":
      print(f"FAILED {r['algorithm']} seed={r['seed']}: {r['error']}")
  if out:
    with open(out, "w") as f:
      json.dump({"config": _jsonable(config), "results": records,
                 "summary": _jsonable(rows)}, f, indent=1)
    print(f"wrote {out}")
  ok = [r for r in records if r.get("status") == "ok"]
  if plot_field and ok:
    png = (out or "results").rsplit(".", 1)[0] + f"_{plot_field}.png"
    print(f"plot: {plot(ok, plot_field, fields, png)}")
  return records
