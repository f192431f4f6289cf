"""Config -> sweep -> runs -> records, tables, plots: the YAML runner (``dpsco run``).

A config is a YAML mapping; a list value is swept (Cartesian product, seeds included),
``experiments:`` entries are merged over the top-level fields, and keys may be grouped in
``problem:`` (or ``data:``) / ``algorithm:`` sections (:mod:`dpsco_jax.runner.config`). Every
run is validated, and every row planned, before any run starts: a bad key, type or value is
one :class:`ConfigError` naming the key. The syntax, ``compare:``, ``select:``, seeds in one
program and ``devices``: ``docs/guides/sweeps_and_selection.md``; your model, loss and data:
:mod:`dpsco_jax.runner.user`.

A record's ``epsilon`` and ``delta`` are the *guaranteed* values of the run's privacy report
(``epsilon_kind``: ``exact`` or ``upper_bound``); the requested target is ``target_epsilon``.
A selection without ``private:`` is **not** covered by the guarantee; the output says so.
"""

from __future__ import annotations

import traceback
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import jax

from dpsco_jax.config.families import CONFIG_ONLY_ALGORITHMS, USER_PROBLEM
from dpsco_jax.privacy.ledger import PrivacyBudgetExceeded
from dpsco_jax.config.schema import (  # noqa: F401 (ConfigError, validate re-exported)
    ConfigError, check_name, typed_run, validate)
from dpsco_jax.runner.config import (RUNNER_ONLY, check_baseline, check_record_metric,
                                     check_runner_keys, flatten_sections, parse_compare,
                                     yaml_loader)
from dpsco_jax.runner.plots import plot_metric, plot_ratio
from dpsco_jax.runner import batch as runner_batch, mesh as runner_mesh, user as runner_user
from dpsco_jax.runner.batch import (  # noqa: F401 (problem_bytes re-exported)
    ProblemCache, finish_record, jsonable, problem_bytes, result_record)
from dpsco_jax.runner.stats import (  # noqa: F401 (t_interval re-exported)
    add_comparisons, compare_cells, compare_footnote, group_records, metric_stats,
    record_metrics, row_metrics, t_interval)
from dpsco_jax.runner import tuning as tuning
from dpsco_jax.sweep import batch_seeds_option, seed_groups


def registry() -> tuple[dict[str, Callable], dict[str, Callable]]:
  """``(algorithms, problems)``: every registered driver and every problem factory by name
  (``user``: your code, :func:`dpsco_jax.runner.user.make_problem`)."""
  from dpsco_jax.algorithms.registry import algorithms
  from dpsco_jax.problems import problems
  return ({name: entry.driver for name, entry in algorithms().items()},
          {**problems(), USER_PROBLEM: runner_user.make_problem})


def expand(config: dict) -> list[dict]:
  """All run configs of a config file: sections flattened, experiments merged over defaults,
  lists swept."""
  config = flatten_sections(config)
  base = {k: v for k, v in config.items() if k not in RUNNER_ONLY}
  variants = config.get("experiments") or [{}]   # flatten_sections checked its entries
  runs = []
  for variant in variants:
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
  """Fields that take more than one value across the expanded runs (seed excluded)."""
  values: dict[str, set] = {}
  for run in expand(config):
    for k, v in run.items():
      values.setdefault(k, set()).add(repr(v))
  return sorted(k for k, vs in values.items() if len(vs) > 1 and k != "seed")


def _checked(cfg: dict, algorithms: dict, problems: dict) -> dict:
  """The run config validated against the registry and the schemas (normalized copy)."""
  return _checked_typed(cfg, algorithms, problems)[0]


def _checked_typed(cfg: dict, algorithms: dict, problems: dict) -> tuple[dict, Any]:
  """``(normalized copy, the algorithm's typed config)``: the run config validated once."""
  if not isinstance(cfg, dict):
    raise ConfigError(f"a run config must be a mapping, got {type(cfg).__name__}")
  for field, section in (("algorithm", "algorithm:"), ("problem", "problem: (or data:)")):
    if field not in cfg:   # a section without its name too: say where the name goes
      raise ConfigError(f"config is missing the field {field!r}: give {field}: NAME, or name: "
                        f"NAME in the {section} section (`dpsco list`)")
  for field, known in (("algorithm", {**algorithms, **CONFIG_ONLY_ALGORITHMS}),
                       ("problem", problems)):
    check_name(field, cfg[field], known)
  from dpsco_jax.config.schema import CONFIG_ALGORITHM_SCHEMAS, PROBLEM_SCHEMAS
  for field, schemas in (("algorithm", CONFIG_ALGORITHM_SCHEMAS), ("problem", PROBLEM_SCHEMAS)):
    if cfg[field] not in schemas:  # a bug of the library, not of the config
      raise ConfigError(f"{field} {cfg[field]!r} is registered but has no config schema; add "
                        "one to dpsco_jax/config/schema.py")
  label = cfg.get("label")
  if label is not None and not isinstance(label, str):
    raise ConfigError(f"label must be a string (one row label), got {label!r}")
  out, typed, _ = typed_run({k: v for k, v in cfg.items() if k != "label"})
  if out["problem"] == USER_PROBLEM:
    runner_user.check(out)  # imports, arguments, data files and columns
  elif out["algorithm"] in CONFIG_ONLY_ALGORITHMS:
    raise ConfigError(f"{out['algorithm']} trains your nnx model: it runs on a user problem "
                      "(problem: {factory: ...} or model, loss and data), not on "
                      f"{out['problem']!r}")
  return (out if label is None else {**out, "label": label}), typed


class Runs(list):
  """Run configs validated before any run: every row's validated algorithm config
  (``configs``, by :func:`row_key`), the plans of the built-in problems' rows (``plans``; a
  user row is planned by its run, once its problem is built) and the problems built to plan
  them (``cache``): :func:`execute` runs them without validating, planning or building them
  again."""

  def __init__(self, runs: list[dict], plans: dict, configs: dict, cache: "ProblemCache"):
    super().__init__(runs)
    self.plans, self.configs, self.cache = plans, configs, cache


def row_key(cfg: dict) -> str:
  """The key of a run's row: everything but its seed (the seeds of a row share one plan)."""
  return repr(sorted((k, repr(v)) for k, v in cfg.items() if k != "seed"))


def _run_key(cfg: dict) -> tuple[str, str]:
  """The key of one run: its row and its seed (two runs with one key give one result)."""
  return row_key(cfg), repr(cfg.get("seed", 0))


def run_one(cfg: dict, *, algorithms: dict, problems: dict, cache: dict | None = None,
            on_progress: Callable | None = None, mesh: jax.sharding.Mesh | None = None,
            driver_key: jax.Array | None = None, plan: Any = None, typed: Any = None,
            checked: bool = False) -> dict:
  """Validates one run config (not again when ``checked``), runs it and returns its record.
  ``on_progress``: a :class:`dpsco_jax.api.Progress` callback of a user-problem run;
  ``mesh``: the users mesh of the ``devices`` key; ``driver_key``: the training key instead of
  the seed's (a private selection's candidates); ``plan``: the row's plan (else made here);
  ``typed``: its validated algorithm config (with ``checked``; see :class:`Runs`)."""
  cfg, typed = (dict(cfg), typed) if checked else _checked_typed(cfg, algorithms, problems)
  label = cfg.pop("label", None)
  problem_key, seed_key = runner_batch.run_keys(cfg.get("seed", 0))
  driver_key = seed_key if driver_key is None else driver_key
  problem = runner_batch.cached_problem(runner_batch.problem_config(cfg), problems, cache,
                                        problem_key)
  if isinstance(problem, runner_user.UserProblem):
    with runner_mesh.mesh_context(mesh):
      record = runner_user.run(problem, cfg, driver_key, on_progress, typed)
  else:
    if cfg["algorithm"] not in algorithms:
      raise ConfigError(f"{cfg['algorithm']} trains an nnx model of a user problem; this "
                        f"problem ({type(problem).__name__}) has none")
    from dpsco_jax import api
    problem = runner_mesh.on_mesh(problem, mesh)
    start = time.perf_counter()
    p = _plan_for(cfg, problem, plan, typed)
    p.check_unchanged()
    result = api.check_spent(p, algorithms[cfg["algorithm"]](p, problem, driver_key))
    jax.block_until_ready(result.params)
    record = result_record(problem, cfg, result, time.perf_counter() - start)
  if mesh is not None:
    record["devices"] = int(mesh.size)
  return finish_record(record, cfg, label)


def _progress(i: int, total: int, cfg: dict, t0: float, step=None, batch: int = 0) -> None:
  """The progress line: runs done, elapsed time, the current run (and its ``step``)."""
  width = 24
  done = int(width * i / total)
  elapsed = time.perf_counter() - t0
  desc = f"{cfg['algorithm']} seed={cfg.get('seed', 0)}" if cfg else "done"
  if batch:
    desc = f"{cfg['algorithm']} {batch} seeds in one program"
  if step is not None:
    desc += f" step {step.step}" + (f"/{step.num_steps}" if step.num_steps else "") + (
        "" if step.epsilon is None else f" eps {step.epsilon:.3g}")
  sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{total} {elapsed:6.1f}s "
                   f"{desc:60.60s}")
  sys.stderr.flush()


def _plan_for(cfg: dict, problem: Any, plan: Any = None, typed: Any = None) -> Any:
  """The plan a run of ``cfg`` on a built-in ``problem`` executes: its row's ``plan`` if made
  for the problem's public facts (sizes and constants), else one made now from the config
  already validated (the row plan's, or ``typed``)."""
  from dpsco_jax import api
  if plan is not None:
    if ((plan.spec.n_users, plan.spec.max_items_per_user, plan.num_params)
        == (int(problem.n_users), int(problem.m), int(problem.d))
        and api.constants_of(problem) == plan.constants):
      return plan
    typed = plan.config
  return api.plan_problem(cfg["algorithm"], typed, problem)


def _failed_record(cfg: dict, err: Exception) -> dict:
  # target_epsilon as in an ok record, so a failed run is counted in its own row
  record = {"algorithm": cfg.get("algorithm"), "problem": cfg.get("problem"),
            "target_epsilon": cfg.get("epsilon"), "seed": cfg.get("seed", 0), "status": "failed",
            "error": f"{type(err).__name__}: {err}",
            "config": {k: v for k, v in cfg.items()
                       if k not in ("algorithm", "problem", "seed", "label")}}
  if cfg.get("label") is not None:
    record["label"] = cfg["label"]
  return jsonable(record)


def _batch_records(cfgs: list[dict], algorithms: dict, problems: dict, cache: dict,
                   plans: dict | None = None) -> tuple[list[dict] | None, str | None]:
  """:func:`dpsco_jax.runner.batch.batch_records` with this module's validator (looked up at
  call time; none for a :class:`Runs`, validated already) and the rows' plans."""
  return runner_batch.batch_records(
      cfgs, algorithms, problems, cache, checked=_checked_typed if plans is None else None,
      plan_row=lambda cfg, typed, problem: _plan_for(
          cfg, problem, None if plans is None else plans.get(row_key(cfg)), typed))


def execute(runs: list[dict], *, algorithms: dict, problems: dict, progress: bool = True,
            on_record: Callable | None = None, phase: str | None = None,
            metrics: tuple[tuple[str, str], ...] = (), batch_seeds: bool = True,
            mesh: jax.sharding.Mesh | None = None) -> list[dict]:
  """Runs validated run configs (a :class:`Runs` is not validated or planned again); returns
  their records in order. A run that raises becomes a ``status: failed`` record (the sweep
  goes on); ``on_record(records)`` is called after every run or batch; ``phase`` tags every
  record. ``metrics``: ``(where, field)`` pairs every successful record must have as a
  number. ``batch_seeds``: runs that differ only in seed run as one vmapped program where
  their algorithm batches (``batched``, else ``batch_note``); ``mesh``: every run shards its
  users over it (seeds then run one by one)."""
  plans = runs.plans if isinstance(runs, Runs) else None
  cache = runs.cache if isinstance(runs, Runs) else ProblemCache()
  records: list[dict | None] = [None] * len(runs)
  t0 = time.perf_counter()
  count = 0

  def finish(i: int, record: dict) -> None:
    nonlocal count
    if phase is not None:
      record["phase"] = phase
    records[i] = record
    count += 1
    if on_record is not None:
      on_record([r for r in records if r is not None])
    if record["status"] == "ok":
      for where, metric in metrics:
        check_record_metric(record, metric, where)

  groups = seed_groups(runs) if batch_seeds else [[i] for i in range(len(runs))]
  for group in groups:
    batch, note = None, (runner_mesh.BATCH_NOTE if mesh is not None and len(group) > 1
                         else None)
    if len(group) > 1 and mesh is None:
      if progress:
        _progress(count, len(runs), runs[group[0]], t0, batch=len(group))
      batch, note = _batch_records([runs[i] for i in group], algorithms, problems, cache,
                                   plans)
    if batch is not None:
      for i, record in zip(group, batch):
        record["status"] = "ok"
        finish(i, record)
      continue
    for i in group:
      cfg = runs[i]
      if progress:
        _progress(count, len(runs), cfg, t0)
      on_step = ((lambda p, c=count, cfg=cfg: _progress(c, len(runs), cfg, t0, p))
                 if progress else None)
      try:
        row = row_key(cfg)
        record = run_one(cfg, algorithms=algorithms, problems=problems, cache=cache,
                         on_progress=on_step, mesh=mesh, checked=plans is not None,
                         plan=None if plans is None else plans.get(row),
                         typed=None if plans is None else runs.configs[row])
        record["status"] = "ok"
      except Exception as err:  # noqa: BLE001 - one bad run must not lose the others
        record = _failed_record(cfg, err)
        if not isinstance(err, ConfigError) and progress:
          sys.stderr.write("\n" + traceback.format_exc(limit=3))
      record["batched"] = False
      if note is not None:
        record["batch_note"] = note
      finish(i, record)
  if progress:
    _progress(len(runs), len(runs), {}, t0)
    sys.stderr.write("\n")
  return records


def run_config(config: dict, *, progress: bool = True, on_record: Callable | None = None
               ) -> list[dict]:
  """Runs every expanded config (both phases with ``select``); every run is validated before
  any runs."""
  check_runner_keys(config)
  phases = tuning.parse_phases(config)
  check_repeats(phases)
  return run_phases(phases, progress=progress, on_record=on_record)[0]


def check_repeats(phases: tuning.Phases) -> None:
  """Refuses a run given twice (a seed listed twice, or two experiments entries that expand to
  the same runs): the same seed gives the same result, and the table would count it as two
  seeds (a mean and an interval over copies). (A ``--quick`` config may collapse distinct
  runs into one: it is checked before it is shrunk, and :func:`_validated` runs a repeat
  once.)"""
  for config in ([phases.with_seeds(s) for s in (phases.tuning_seeds, phases.eval_seeds)
                  if s is not None] if phases.select else [phases.config]):
    seen = set()
    for cfg in expand(config):
      key = _run_key(cfg)
      if key in seen:
        where = f"{cfg.get('algorithm')}" + (f" (label {cfg['label']})" if cfg.get("label")
                                             else "")
        raise ConfigError(f"{where}: the run with seed {cfg.get('seed', 0)} is given twice (a "
                          "seed listed twice, or two experiments entries with the same runs); "
                          "it would count as two seeds: give each seed once, or label the "
                          "entries")
      seen.add(key)


def _validated(config: dict, algorithms: dict, problems: dict,
               cache: ProblemCache | None = None) -> Runs:
  """Every run of ``config`` validated, and every row planned (on the problem of its first
  seed, kept in ``cache`` for the runs), before any run. A plan reads no data, so its refusal
  is one ConfigError naming the row; a user row, planned once its problem is built, holds its
  validated algorithm config (:class:`Runs`)."""
  from dpsco_jax import api
  checked = [_checked_typed(cfg, algorithms, problems) for cfg in expand(config)]
  # a run given twice (a --quick config's collapsed runs; see check_repeats) runs once
  checked = list({_run_key(c): (c, t) for c, t in checked}.values())
  cache = ProblemCache() if cache is None else cache
  plans, configs = {}, {}
  for cfg, typed in checked:
    row = row_key(cfg)
    if row in configs:
      continue
    configs[row] = typed
    if cfg["problem"] == USER_PROBLEM:
      continue
    problem = runner_batch.seed_problem(cfg, problems, cache)
    try:
      plans[row] = api.plan_problem(cfg["algorithm"], typed, problem)
    except (ValueError, PrivacyBudgetExceeded) as err:   # an explicit z over the budget too
      where = cfg["algorithm"] + (f" (label {cfg['label']})" if cfg.get("label") else "")
      raise ConfigError(f"{where}: {' '.join(str(err).split())}") from None
  return Runs([cfg for cfg, _ in checked], plans, configs, cache)


def run_phases(phases: tuning.Phases, *, progress: bool = True,
               on_record: Callable | None = None, compare=None
               ) -> tuple[list[dict], dict | None]:
  """``(records, selection)``: one phase (selection None), or the grid on the tuning seeds,
  the selection and the selected configs on the evaluation seeds (or a private selection).
  Every run of both phases is validated before any runs."""
  algorithms, problems = registry()
  metrics = tuple((where, spec.metric) for where, spec in (
      ("select.metric", phases.select), ("compare.metric", compare)) if spec is not None)
  devices = runner_mesh.devices_option(phases.config)
  kw = dict(algorithms=algorithms, problems=problems, progress=progress, metrics=metrics,
            batch_seeds=batch_seeds_option(phases.config),
            mesh=runner_mesh.make_mesh(devices))
  if phases.select is None:
    runs = _validated(phases.config, algorithms, problems)
    runner_user.check_metrics(runs, metrics)
    runner_mesh.check_runs(runs, devices)
    return execute(runs, on_record=on_record, **kw), None
  spec = phases.select
  swept = swept_fields(phases.config)
  tuning.check_over(spec, swept)
  fields = tuning.group_fields(spec, swept)
  if spec.private is not None:
    return _run_private(phases, fields, algorithms, problems, metrics, on_record)
  cache = ProblemCache()   # one bound on the problems of both phases
  tune = _validated(phases.with_seeds(phases.tuning_seeds), algorithms, problems, cache)
  evals = _validated(phases.with_seeds(phases.eval_seeds), algorithms, problems, cache)
  runner_user.check_metrics(tune + evals, metrics)
  runner_mesh.check_runs(tune + evals, devices)
  tuned = execute(tune, on_record=on_record, phase="tuning", **kw)
  chosen, report = tuning.choose(tune, tuned, spec, fields)
  selected = Runs([c for c in evals if tuning.is_selected(c, chosen, spec, fields)],
                  evals.plans, evals.configs, evals.cache)
  evaluated = execute(selected, phase="eval", **kw,
                      on_record=None if on_record is None else (
                          lambda recs: on_record(tuned + recs)))
  info = {"tuning_seeds": list(phases.tuning_seeds), "eval_seeds": list(phases.eval_seeds),
          "tuning_runs": len(tune), "eval_runs": len(selected), "metric": spec.metric,
          "over": list(spec.over), "rule": spec.rule, "group_fields": fields,
          "groups": report, "privacy_note": tuning.PRIVACY_NOTE}
  for record in evaluated:   # each record says its row's choice is outside its guarantee
    record["selection_privacy"] = tuning.PRIVACY_NOTE
  return tuned + evaluated, jsonable(info)


def _run_private(phases: tuning.Phases, fields: list[str], algorithms: dict, problems: dict,
                 metrics: tuple, on_record: Callable | None) -> tuple[list[dict], dict]:
  """``select.private``: every candidate validated and planned, the cost printed, then one
  private selection per eval seed and group (no progress line: it would show K)."""
  runs = _validated(phases.with_seeds(phases.eval_seeds), algorithms, problems)
  runner_user.check_metrics(runs, metrics)
  cache = runs.cache
  problem_of = lambda cfg: runner_batch.seed_problem(cfg, problems, cache)

  def plan_of(cfg: dict, problem: Any) -> Any:
    # the cost is the plans' the candidates run: their rows' (made when validated)
    row = row_key(cfg)
    if isinstance(problem, runner_user.UserProblem):
      return runner_user.plan_run(problem, cfg, runs.configs[row])
    return _plan_for(cfg, problem, runs.plans.get(row))

  groups = tuning.group_candidates(runs, phases.select, fields)
  plans = tuning.private_plans(groups, phases.select, problem_of, plan_of)
  print("\n".join(tuning.cost_lines(plans, fields)), flush=True)

  def train(cfg: dict, key: jax.Array) -> dict:
    try:
      row = row_key(cfg)
      return {**run_one(cfg, algorithms=algorithms, problems=problems, cache=cache,
                        driver_key=key, checked=True, plan=runs.plans.get(row),
                        typed=runs.configs[row]),
              "status": "ok"}
    except ConfigError:
      raise
    except Exception as err:  # noqa: BLE001 - a failed candidate is not eligible
      return _failed_record(cfg, err)

  records = []
  for gkey, cands in groups.items():
    try:
      record = tuning.select_privately(cands, plans[gkey], phases.select, gkey[0], train)
    except RuntimeError as err:
      record = _failed_record({k: v for k, v in cands[0].items()
                               if k not in phases.select.over}, err)
    records.append({**record, "phase": "eval", "batched": False})
    if on_record is not None:
      on_record(records)
  return records, jsonable(tuning.private_info(phases, plans, fields))


def aggregate(records: list[dict], fields: list[str]) -> list[dict]:
  """Mean, std and 95% t-interval over seeds (``<metric>_mean``, ``_std``, ``_ci95_lo``,
  ``_ci95_hi``) of every group of records sharing ``fields``, for ``excess_risk`` and every
  user metric; failed runs are counted in ``failed`` and left out."""
  rows = []
  metrics = record_metrics(records)
  for key, group in group_records(records, fields).items():
    rs = [r for r in group if r.get("status", "ok") == "ok"]
    row = {**dict(zip(fields, key)), "seeds": len(rs), "failed": len(group) - len(rs)}
    if rs:
      for metric in metrics:
        row.update(metric_stats(rs, metric))
      work = [r["gradient_evaluations"] for r in rs if r.get("gradient_evaluations") is not None]
      # a private selection's record holds no time (tuning.UNCOVERED)
      walls = [r["wall_time_s"] for r in rs if r.get("wall_time_s") is not None]
      row.update({
          "epsilon": max(float(r["epsilon"]) for r in rs),
          "epsilon_kind": ",".join(sorted({r.get("epsilon_kind", "exact") for r in rs})),
          "provenance": ",".join(sorted({r["provenance"] for r in rs})),
          "gradient_evaluations": statistics.fmean(work) if work else None,
          "wall_time_s": statistics.fmean(walls) if walls else None})
    else:
      row["error"] = group[0].get("error", "")
    rows.append(row)
  return rows


def format_table(rows: list[dict], fields: list[str]) -> str:
  """The printed table: per metric its mean, std and Student-t interval (``ci95``;
  ``<metric>_ci95`` with several); with ``compare:``, ``ratio[boot95]`` and ``wins``."""
  metrics = row_metrics(rows)
  ci = {m: "ci95" if len(metrics) == 1 else f"{m}_ci95" for m in metrics}
  cols = fields + [c for m in metrics for c in (f"{m}_mean", f"{m}_std", ci[m])]
  first = f"{metrics[0]}_mean" if metrics else "result"
  cols += ["result"] if not metrics else []
  cols += ["epsilon", "epsilon_kind", "provenance", "gradient_evaluations", "wall_time_s",
           "seeds"]
  if any(r.get("failed") for r in rows):
    cols.append("failed")
  if any("compare_metric" in r for r in rows):
    cols += ["ratio[boot95]", "wins"]

  def cell(r, c):
    metric = next((m for m in metrics if ci[m] == c), None)
    if metric is not None:
      lo, hi = r.get(f"{metric}_ci95_lo"), r.get(f"{metric}_ci95_hi")
      return "" if lo is None or math.isnan(lo) else f"[{lo:.3g}, {hi:.3g}]"
    if c == first and "error" in r:
      return "FAILED"
    if c in ("ratio[boot95]", "wins"):
      return compare_cells(r)[c]
    v = r.get(c)
    return f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)

  table = [list(cols)] + [[cell(r, c) for c in cols] for r in rows]
  widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
  lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def plot(records: list[dict], x_field: str, fields: list[str], path: str) -> str:
  """Excess risk (or a user problem's first metric) against ``x_field``, one line per other
  group (:func:`dpsco_jax.runner.plots.plot_metric`)."""
  return plot_metric(aggregate(records, fields), x_field, fields, path)


def load_config(path: str) -> dict:
  import yaml
  try:
    with open(path) as f:
      config = yaml.load(f, Loader=yaml_loader())  # noqa: S506 (a SafeLoader subclass)
  except OSError as err:
    raise ConfigError(f"{path}: {err.strerror}") from None
  except UnicodeDecodeError as err:
    raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
  except yaml.YAMLError as err:
    raise ConfigError(f"{path}: not valid YAML ({err})") from None
  if not isinstance(config, dict):
    raise ConfigError(f"{path}: a config must be a YAML mapping")
  return config


def _table_fields(config: dict) -> list[str]:
  # group by the *requested* epsilon; the table's epsilon column is the guaranteed one
  return ["algorithm"] + [("target_epsilon" if f == "epsilon" else f)
                          for f in swept_fields(config) if f != "algorithm"]


def summarize(records: list[dict], fields: list[str], compare=None,
              ignore: tuple[str, ...] = ()) -> list[dict]:
  """The table's rows (:func:`aggregate`) with the paired comparison of ``compare`` (a row's
  baseline need not share its ``ignore`` fields)."""
  rows = aggregate(records, fields)
  if compare is not None:
    add_comparisons(rows, records, fields, compare, ignore)
  return rows


def _print_report(title: str, records: list[dict], rows: list[dict], fields: list[str],
                  compare, selection: dict | None) -> None:
  shown = [r for r in records if r.get("phase") != "tuning"]
  runs = f"{len(shown)} runs" + (f" on eval seeds (+{selection['tuning_runs']} tuning runs)"
                                 if selection and "tuning_runs" in selection else "")
  print(f"\n== {title}: {runs} ==")
  if selection:
    print("\n".join(tuning.selection_lines(selection)))
  print(format_table(rows, fields))
  print("(ci95: Student-t 95% interval of the mean over seeds; epsilon: the guaranteed "
        "epsilon, max over seeds; epsilon_kind: exact = the accountant's or theorem's value "
        "for what ran, upper_bound = a cheaper bound at or above it)")
  if compare is not None:
    print(compare_footnote(rows, compare))
  for r in records:
    if r.get("status") == "failed":
      phase = f" ({r['phase']})" if "phase" in r else ""
      print(f"FAILED {r['algorithm']} seed={r['seed']}{phase}: {r['error']}")


def _plot_x(plot_field: str, fields: list[str]) -> str:
  return "target_epsilon" if plot_field == "epsilon" and plot_field not in fields else plot_field


def plot_paths(plot_field: str | None, fields: list[str], out: str | None, compare
               ) -> list[str]:
  """The files ``--plot FIELD`` writes (none when FIELD is not swept): ``STEM_FIELD.png`` and,
  with ``compare``, ``STEM_FIELD_ratio.png`` (STEM: ``out`` without extension, or
  ``results``)."""
  if not plot_field or _plot_x(plot_field, fields) not in fields:
    return []
  stem = os.path.splitext(out or "results")[0]
  return [stem + f"_{plot_field}.png"] + (
      [stem + f"_{plot_field}_ratio.png"] if compare is not None else [])


def _holds_only_quick_records(path: str) -> bool:
  """Whether the results file at ``path`` holds only ``--quick`` records (an unreadable or
  foreign file does not)."""
  try:
    with open(path) as f:
      records = json.load(f).get("results")
  except (OSError, ValueError, AttributeError):
    return False
  return isinstance(records, list) and all(
      isinstance(r, dict) and r.get("quick") is True for r in records)


def check_outputs(out: str | None, plots: list[str], *, quick: bool = False,
                  force: bool = False) -> None:
  """Refuses, before anything runs, to write over ``out`` or a plot in ``plots`` unless
  ``force``. A quick run never replaces a full run's results file, ``force`` or not: a smoke
  must not cost the measurement it precedes."""
  for path in [out] * bool(out) + plots:
    if os.path.isdir(path):
      raise ConfigError(f"{path} is a directory: --out and --plot write files")
  if quick and out and os.path.exists(out) and not _holds_only_quick_records(out):
    raise ConfigError(f"{out} holds the records of a full run (or is not a --quick results "
                      "file): a --quick run never replaces it, even with --force; write the "
                      "smoke elsewhere (--out other.json)")
  existing = [p for p in [out] * bool(out) + plots if os.path.exists(p)]
  if existing and not force:
    raise ConfigError(f"{', '.join(existing)} already exist{'s' * (len(existing) == 1)}: "
                      "pass --force to replace, or write elsewhere (--out other.json)")
  for folder in {os.path.dirname(os.path.abspath(p)) for p in [out] * bool(out) + plots}:
    try:   # records are written as runs finish: an unwritable place would lose the first
      tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
      raise ConfigError(f"cannot write the outputs in {folder} ({err.strerror}): --out and "
                        "--plot need a folder you can write") from None


def _plots(rows: list[dict], fields: list[str], plot_field: str, out: str | None,
           compare, selected: tuple[str, ...] = ()) -> None:
  """The metric plot (and the ratio plot with ``compare``), one line per value of the fields
  other than ``plot_field`` and the ``selected`` ones."""
  x = _plot_x(plot_field, fields)
  paths = plot_paths(plot_field, fields, out, compare)
  if not paths:
    print(f"plot: {plot_field!r} is not a swept field ({', '.join(fields)}); no plot")
    return
  fields = [f for f in fields if f not in selected or f == x]
  print(f"plot: {plot_metric(rows, x, fields, paths[0])}")
  if compare is not None:
    print(f"plot: {plot_ratio(rows, x, fields, paths[1])}")


def main_run(path: str, out: str | None = None, plot_field: str | None = None,
             progress: bool = True, quick: bool = False, force: bool = False) -> list[dict]:
  """Runs a config file, prints its table, writes ``out`` as runs finish; returns the records
  (failed runs and, with ``select``, the tuning records included). ``quick``: the config at
  its smallest (:func:`dpsco_jax.runner.quick.quick_config`), records marked ``quick: true``.
  Existing outputs are replaced only with ``force`` (:func:`check_outputs`)."""
  config = load_config(path)
  check_runner_keys(config)
  phases = tuning.parse_phases(config)
  check_repeats(phases)   # the full config's: --quick may collapse runs
  if quick:
    from dpsco_jax.runner.quick import quick_config
    config = quick_config(config)
    config["name"] = f"{config.get('name', path)} (--quick: a smoke, not a measurement)"
    phases = tuning.parse_phases(config)
  compare = parse_compare(config)
  if compare is not None:  # a baseline that matches no run is refused before anything runs
    check_baseline(compare, expand(phases.with_seeds(phases.eval_seeds) if phases.select
                                   else phases.config))
  plots = plot_paths(plot_field, _table_fields(phases.config), out, compare) if plot_field else []
  check_outputs(out, plots, quick=quick, force=force)
  def write(records, **extra):
    if quick:
      for r in records:
        r["quick"] = True
    if out:
      with open(out, "w") as f:
        json.dump({"config": jsonable(config), "results": records, **extra}, f, indent=1)
  records, selection = run_phases(phases, progress=progress, on_record=write, compare=compare)
  fields = _table_fields(phases.config)
  shown = [r for r in records if r.get("phase") != "tuning"]
  selected = phases.select.over if phases.select else ()
  rows = summarize(shown, fields, compare, selected)
  _print_report(config.get("name", path), records, rows, fields, compare, selection)
  extra = {"summary": jsonable(rows)}
  if selection is not None:
    tuned = [r for r in records if r.get("phase") == "tuning"]
    extra.update(selection=selection, tuning_summary=jsonable(aggregate(tuned, fields)))
  if out:
    write(records, **extra)
    print(f"wrote {out}")
  if plot_field and any(r.get("status") == "ok" for r in shown):
    _plots(rows, fields, plot_field, out, compare, selected)
  return records
