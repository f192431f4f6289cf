"""Config -> sweep -> runs -> records, tables, plots.

A config is a YAML mapping. Any field whose value is a list is swept (Cartesian product,
seeds included). Optionally, ``experiments:`` holds a list of mappings, each merged over the
top-level fields key by key (so one file can compare algorithms with different
hyper-parameters).

**Sections.** The problem's keys may be grouped in a ``problem:`` (or ``data:``) section and
the algorithm's in an ``algorithm:`` section, at the top level and in each ``experiments``
entry; ``name`` in a section is the registered name (``dpsco list``):

    name: quickstart
    seed: [0, 1, 2]
    problem: {name: logistic, n_users: 1000, m: 8, d: 10}
    experiments:
      - algorithm: {name: nonprivate_sgd}
      - algorithm: {name: dp_sgd_user, epsilon: [0.5, 2.0], delta: 1.0e-6, clip_norm: 1.0}
        label: dp

Sections are flattened to the flat form (``problem: logistic, n_users: 1000, ...``), which
keeps working and may be mixed with them; lists inside sections are swept. A key inside a
section must be one of that section's schema (a problem key in ``algorithm:`` is a
:class:`ConfigError` naming the section it belongs to); runner keys (``seed``, ``debug``) and
``label`` stay outside the sections. ``label: TEXT`` names a row (kept in its records as
``label``; a table column when labels differ).

**Your model, loss and data** (:mod:`dpsco_jax.runner.user`): a ``problem:`` section may name
a factory or a model + loss + data file by import path; such runs have no known optimum and
report your metrics (``metric:``) instead of ``excess_risk``; ``algorithm: flax.DPTrainer``
trains an nnx model of such a problem step by step::

    problem: {factory: "experiments.digits_problem:make_digits", args: {n_users: 180}}
    select: {metric: test_accuracy, over: [learning_rate], rule: max_mean}
    compare: {baseline: nonprivate_sgd, metric: test_accuracy, better: higher}

Every expanded run is validated before any run starts
(:func:`dpsco_jax.config.schema.validate`): a key its algorithm and problem do not read
(``epsilonn``), a value of the wrong type (``epsilon: '1.0'``, ``epsilon: yes``,
``seed: 1.7``) or a missing required key is a :class:`ConfigError` naming the key, with a
suggestion. So a key shared by rows whose algorithms differ belongs in the rows that read it
(``delta`` in the private rows, not at the top level when a ``nonprivate_sgd`` row reads none).

Each run produces one record with at least ``algorithm, problem, n_users, m, d, epsilon,
epsilon_kind, delta, provenance, excess_risk, gradient_evaluations, wall_time_s, seed``
(``epsilon`` and ``delta`` are the *guaranteed* values from the result's privacy report, and
``epsilon_kind`` says whether that epsilon is ``exact`` or an ``upper_bound``; the requested
target is kept as ``target_epsilon``). The table (and the JSON ``summary``) has one row per
value of the swept fields: seeds, mean, std and Student-t 95% interval of ``excess_risk`` (and
of each user metric), the largest epsilon over the seeds and its ``epsilon_kind``.

**Paired comparison** (:mod:`dpsco_jax.runner.stats`)::

    compare: {baseline: nonprivate_sgd, metric: excess_risk, resamples: 2000, seed: 0}

``baseline`` is a row label, else an algorithm name, or a mapping of row fields
(``{algorithm: dp_sgd_user, epsilon: 1.0}``, ``epsilon`` being the requested one); ``metric``
(default ``excess_risk``; lower is better unless ``better: higher``) is any numeric record
field (checked: a name that is not one stops the run at the first record without it, listing
the fields). Each other row is paired with the baseline row (the only one, else the one that
agrees with it on the swept fields both set, e.g. the same epsilon; ``select``'s fields
excepted) and gets, over the seeds both ran successfully (``paired_seeds``): ``ratio`` = mean(row) / mean(baseline),
``ratio_ci95_lo`` / ``ratio_ci95_hi`` = percentile bootstrap 95% interval (``resamples``
resamples of the paired seeds drawn jointly, generator seeded by ``seed``: deterministic),
``wins`` / ``win_rate`` = seeds where the row's metric is strictly better; also
``compare_role`` (``baseline`` / ``compared``), ``compare_baseline``, ``compare_metric``,
``ratio_ci_method`` (or ``compare_note`` saying why a row has no baseline). The table shows
``ratio[boot95]`` and ``wins`` (= wins/paired seeds); ``--plot`` also draws the ratio with its
bootstrap interval as error bars.

**Seeds in one program** (:mod:`dpsco_jax.sweep`): runs that differ only in ``seed`` (also
across ``tuning_seeds`` / ``eval_seeds``) run as one ``vmap``-ed program when their algorithm
is in :data:`dpsco_jax.api.BATCHED` (DP-SGD family, ``nonprivate_sgd``, paper 003's drivers):
the plan and noise calibration once, one compile and one launch, each run with its own key
and privacy report; records equal the one-by-one runs' (params to float tolerance) and say
``batched: true`` (``wall_time_s`` is the group's time over its runs, ``batch_wall_time_s``
the group's). ``batch_seeds: false`` (a top-level key) runs every seed alone.
``devices: N`` (top-level) shards every run's users over N devices (:mod:`dpsco_jax.runner.mesh`).

**Tuning and evaluation seeds** (:mod:`dpsco_jax.runner.tuning`), instead of ``seed``::

    tuning_seeds: [0, 1, 2]
    eval_seeds: [100, 101, 102, 103, 104]
    select: {metric: excess_risk, over: [learning_rate], rule: min_mean}

The swept grid runs on ``tuning_seeds`` only; per group of the other swept fields (e.g. per
algorithm and epsilon), the value(s) of the ``over`` fields (swept fields) with the best mean
``metric`` (``rule``: ``min_mean`` or ``max_mean``; a candidate with a failed tuning run is not
eligible) are selected, and only the selected configs run on ``eval_seeds`` (disjoint from
``tuning_seeds``, else a ConfigError). Records carry ``phase: tuning|eval``; the table shows
the eval rows (with the selected values), the JSON keeps every record plus ``selection`` (the
per-group candidates and choice, number of tuning runs) and ``tuning_summary``. The selection
is **not** covered by the privacy guarantee (hyper-parameter search on private data costs
privacy unless accounted for); the output says so. Without ``select``, ``eval_seeds`` alone
means ``seed: eval_seeds``.
"""

from __future__ import annotations

import traceback
import itertools
import json
import math
import os
import statistics
import sys
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
from dpsco_jax.runner.plots import _draw, plot_ratio, plot_rows
from dpsco_jax.runner import batch as runner_batch, mesh as runner_mesh, user as runner_user
from dpsco_jax.runner.batch import (  # noqa: F401 (moved there; used and re-exported)
    ProblemCache, problem_bytes,
    _finish, _jsonable, _problem_cache_key, _result_record)
from dpsco_jax.runner.stats import (  # noqa: F401 (t_interval re-exported)
    add_comparisons, compare_cells, compare_footnote, group_records, metric_stats,
    record_metrics, row_metrics, t_interval)
from dpsco_jax.runner import tuning as tuning
from dpsco_jax.sweep import batch_seeds_option, seed_groups

RESERVED = RUNNER_ONLY


def registry() -> tuple[dict[str, Callable], dict[str, Callable]]:
  """``(algorithms, problems)``: every registered driver by name
  (:func:`dpsco_jax.algorithms.registry.algorithms`, which imports
  ``registry.ALGORITHM_MODULES``) and every problem factory
  (:func:`dpsco_jax.problems.problems`, plus ``user``: your code,
  :func:`dpsco_jax.runner.user.make_problem`). A config may also name the config-only
  algorithms (:data:`~dpsco_jax.config.families.CONFIG_ONLY_ALGORITHMS`: ``flax.DPTrainer``),
  which run on a user problem."""
  from dpsco_jax.algorithms.registry import algorithms
  from dpsco_jax.problems import problems
  return ({name: entry.driver for name, entry in algorithms().items()},
          {**problems(), USER_PROBLEM: runner_user.make_problem})


def expand(config: dict) -> list[dict]:
  """All run configs of a config file: sections flattened, experiments merged over defaults,
  lists swept."""
  config = flatten_sections(config)
  base = {k: v for k, v in config.items() if k not in RESERVED}
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
  """Fields that take more than one value across the expanded runs (seed excluded), e.g. a
  list-valued field, or a field that differs between ``experiments`` entries."""
  values: dict[str, set] = {}
  for run in expand(config):
    for k, v in run.items():
      values.setdefault(k, set()).add(repr(v))
  return sorted(k for k, vs in values.items() if len(vs) > 1 and k != "seed")


def _checked(cfg: dict, algorithms: dict, problems: dict) -> dict:
  """The run config validated against the registry and the schemas (normalized copy)."""
  return _checked_typed(cfg, algorithms, problems)[0]


def _checked_typed(cfg: dict, algorithms: dict, problems: dict) -> tuple[dict, Any]:
  """``(normalized copy, the algorithm's typed config)``: the run config validated once
  (:func:`dpsco_jax.config.schema.typed_run`), against the registry and the schemas."""
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
  """Run configs validated before any run (:func:`_validated`), with the plan of every row of
  a registered algorithm on a built-in problem (``plans``, by :func:`row_key`) and the
  problems built to plan them (``cache``): what :func:`execute` runs without validating,
  planning or building them again."""

  def __init__(self, runs: list[dict], plans: dict, cache: "ProblemCache"):
    super().__init__(runs)
    self.plans, self.cache = plans, cache


def row_key(cfg: dict) -> str:
  """The key of a run's row: everything but its seed (the seeds of a row share one plan)."""
  return repr(sorted((k, repr(v)) for k, v in cfg.items() if k != "seed"))


def run_one(cfg: dict, *, algorithms: dict, problems: dict, cache: dict | None = None,
            on_progress: Callable | None = None, mesh: jax.sharding.Mesh | None = None,
            driver_key: jax.Array | None = None, plan: Any = None,
            checked: bool = False) -> dict:
  """Validates one run config (:func:`dpsco_jax.config.schema.validate`; not again when
  ``checked``), runs it and returns its record. ``on_progress``: a
  :class:`dpsco_jax.api.Progress` callback of a user-problem run (steps done, epsilon so
  far). ``mesh``: the users mesh of the ``devices`` key (:mod:`dpsco_jax.runner.mesh`).
  ``driver_key``: the training key instead of the seed's (a private selection's candidates
  train on the seed's users with keys of their own). ``plan``: the row's plan, made when the
  sweep was validated (else it is made here)."""
  cfg = dict(cfg) if checked else _checked(cfg, algorithms, problems)
  label = cfg.pop("label", None)
  problem_key, seed_key = runner_batch.run_keys(cfg.get("seed", 0))
  driver_key = seed_key if driver_key is None else driver_key
  problem = runner_batch.cached_problem(runner_batch.problem_config(cfg), problems, cache,
                                        problem_key)
  if isinstance(problem, runner_user.UserProblem):
    with runner_mesh.mesh_context(mesh):
      record = runner_user.run(problem, cfg, driver_key, on_progress)
  else:
    if cfg["algorithm"] not in algorithms:
      raise ConfigError(f"{cfg['algorithm']} trains an nnx model of a user problem; this "
                        f"problem ({type(problem).__name__}) has none")
    record = _registered_record(runner_mesh.on_mesh(problem, mesh), cfg, driver_key,
                                algorithms, plan)
  if mesh is not None:
    record["devices"] = int(mesh.size)
  return _finish(record, cfg, label)


def _registered_record(problem: Any, cfg: dict, key: jax.Array, algorithms: dict,
                       plan: Any = None) -> dict:
  """A registered algorithm on a problem object with a known optimum (``key``: the driver's):
  its record. It runs as the API runs it: its data-free plan (``plan``, made when the sweep
  was validated, if it was made for this problem's public facts; else
  :func:`dpsco_jax.api.plan_problem` now), then that plan executed by the registered
  ``run(plan, problem, key)`` (``algorithms``: the table of runners, a test's stand-in
  included)."""
  from dpsco_jax import api
  start = time.perf_counter()
  p = _plan_for(cfg, problem, plan)
  p.check_unchanged()
  result = api.check_spent(p, algorithms[cfg["algorithm"]](p, problem, key))
  jax.block_until_ready(result.params)
  return _result_record(problem, cfg, result, time.perf_counter() - start)


def _progress(i: int, total: int, cfg: dict, t0: float, step=None, batch: int = 0) -> None:
  """The progress line: runs done, elapsed time, the current run, and (``step``, a
  :class:`dpsco_jax.api.Progress` of a user-problem run) its steps and epsilon so far."""
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


def _plan_for(cfg: dict, problem: Any, plan: Any = None) -> Any:
  """The plan a run of ``cfg`` on a built-in ``problem`` executes: its row's ``plan`` if that
  was made for the problem's public facts (sizes and constants: a row's plan serves every seed
  whose problem has the same facts), else the data-free plan made now (from the config's
  algorithm fields: the run's config also holds the runner's and the problem's keys)."""
  from dpsco_jax import api
  if plan is not None and (
      (plan.spec.n_users, plan.spec.max_items_per_user, plan.num_params)
      == (int(problem.n_users), int(problem.m), int(problem.d))
      and api.constants_of(problem) == plan.constants):
    return plan
  return api.plan_problem(cfg["algorithm"], api.algorithms()[cfg["algorithm"]].config.of(cfg),
                          problem)


def _failed_record(cfg: dict, err: Exception) -> dict:
  # target_epsilon as in an ok record, so a failed run is counted in its own row
  record = {"algorithm": cfg.get("algorithm"), "problem": cfg.get("problem"),
            "target_epsilon": cfg.get("epsilon"), "seed": cfg.get("seed", 0), "status": "failed",
            "error": f"{type(err).__name__}: {err}",
            "config": {k: v for k, v in cfg.items()
                       if k not in ("algorithm", "problem", "seed", "label")}}
  if cfg.get("label") is not None:
    record["label"] = cfg["label"]
  return _jsonable(record)


def _batch_records(cfgs: list[dict], algorithms: dict, problems: dict, cache: dict,
                   plans: dict | None = None) -> tuple[list[dict] | None, str | None]:
  """:func:`dpsco_jax.runner.batch.batch_records` with this module's validator (looked up at
  call time, so a test may replace ``_checked``; none for a :class:`Runs`' configs, validated
  already) and the rows' plans (``plans``: a :class:`Runs`' own; else planned here)."""
  return runner_batch.batch_records(
      cfgs, algorithms, problems, cache, checked=_checked if plans is None else None,
      plan_row=lambda cfg, problem: _plan_for(
          cfg, problem, None if plans is None else plans.get(row_key(cfg))))


def execute(runs: list[dict], *, algorithms: dict, problems: dict, progress: bool = True,
            on_record: Callable | None = None, phase: str | None = None,
            metrics: tuple[tuple[str, str], ...] = (), batch_seeds: bool = True,
            mesh: jax.sharding.Mesh | None = None) -> list[dict]:
  """Runs validated run configs; returns their records in the order of ``runs``. A run that
  raises becomes a record with ``status: failed`` and its error (the sweep goes on);
  ``on_record(records)`` is called after every run (or batch) with the records done so far;
  ``phase`` (if given) tags every record. ``metrics``: ``(where, field)`` pairs (the
  ``select.metric`` / ``compare.metric`` of the config) every successful record must have as
  a number, else a :class:`ConfigError` stops the sweep at the first record without it.

  ``batch_seeds``: runs that differ only in seed run as one vmapped program when their
  algorithm batches (:func:`_batch_records`); every record says ``batched: true|false`` (with
  ``batch_note`` saying why a group of seeds ran one by one). ``mesh``: every run shards its
  users over it (the ``devices`` key; seeds then run one by one). ``runs`` from
  :func:`_validated` (a :class:`Runs`) are neither validated nor planned again: each run
  executes its row's plan."""
  # validated and planned already (a Runs), with the problems built to plan it
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
        record = run_one(cfg, algorithms=algorithms, problems=problems, cache=cache,
                         on_progress=on_step, mesh=mesh, checked=plans is not None,
                         plan=None if plans is None else plans.get(row_key(cfg)))
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
  """Runs every expanded config; every run is validated before any runs. With
  ``tuning_seeds`` / ``eval_seeds`` / ``select``, both phases (:func:`run_phases`)."""
  check_runner_keys(config)
  return run_phases(tuning.parse_phases(config), progress=progress, on_record=on_record)[0]


def _validated(config: dict, algorithms: dict, problems: dict,
               cache: ProblemCache | None = None) -> Runs:
  """Every run of ``config`` validated, and every row planned, before any run (``cache``: the
  problems it builds to plan, kept for the runs; one cache may serve several phases)."""
  checked = [_checked_typed(cfg, algorithms, problems) for cfg in expand(config)]
  cache = ProblemCache() if cache is None else cache
  return Runs([cfg for cfg, _ in checked], _check_plans(checked, problems, cache), cache)


def _check_plans(checked: list[tuple[dict, Any]], problems: dict, cache: ProblemCache) -> dict:
  """Every row of a registered algorithm on a built-in problem planned before any run: its
  plan, by :func:`row_key` (the one the run executes). A plan reads no data, so its refusal
  (adaptive clipping with tree noise or at group level, ...) is the config's: one ConfigError
  naming the row, not a failed row after the others ran. One plan per distinct row (seeds
  share it), on the problem of the row's first seed (built into ``cache``, where its run finds
  it). ``checked``: each run's config and its typed algorithm config (validated; what the
  plan holds)."""
  from dpsco_jax import api
  from dpsco_jax.algorithms.registry import algorithms as table
  plans = {}
  for cfg, typed in checked:
    entry = table().get(cfg["algorithm"])
    row = row_key(cfg)
    if entry is None or cfg["problem"] == USER_PROBLEM or row in plans:
      continue
    problem = runner_batch.cached_problem(runner_batch.problem_config(cfg), problems, cache,
                                          runner_batch.run_keys(cfg.get("seed", 0))[0])
    try:
      plans[row] = api.plan_problem(entry.name, typed, problem)
    except (ValueError, PrivacyBudgetExceeded) as err:   # an explicit z over the budget too
      where = cfg["algorithm"] + (f" (label {cfg['label']})" if cfg.get("label") else "")
      raise ConfigError(f"{where}: {' '.join(str(err).split())}") from None
  return plans


def run_phases(phases: tuning.Phases, *, progress: bool = True,
               on_record: Callable | None = None, compare=None
               ) -> tuple[list[dict], dict | None]:
  """``(records, selection)``: one phase (selection None), or the grid on the tuning seeds,
  the selection (:func:`dpsco_jax.runner.tuning.choose`), and the selected configs on the
  evaluation seeds. Every run of both phases is validated before any runs; the metrics of
  ``select`` and of ``compare`` (a :class:`~dpsco_jax.runner.config.CompareSpec`) are checked
  against the first record that would lack them."""
  algorithms, problems = registry()
  metrics = tuple((where, spec.metric) for where, spec in (
      ("select.metric", phases.select), ("compare.metric", compare)) if spec is not None)
  devices = runner_mesh.devices_option(phases.config)
  kw = dict(algorithms=algorithms, problems=problems, progress=progress, metrics=metrics,
            batch_seeds=batch_seeds_option(phases.config),
            mesh=runner_mesh.make_mesh(devices))
  if phases.select is None:  # user errors in any run are reported before anything runs
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
                  evals.plans, evals.cache)
  evaluated = execute(selected, phase="eval", **kw,
                      on_record=None if on_record is None else (
                          lambda recs: on_record(tuned + recs)))
  info = {"tuning_seeds": list(phases.tuning_seeds), "eval_seeds": list(phases.eval_seeds),
          "tuning_runs": len(tune), "eval_runs": len(selected), "metric": spec.metric,
          "over": list(spec.over), "rule": spec.rule, "group_fields": fields,
          "groups": report, "privacy_note": tuning.PRIVACY_NOTE}
  for record in evaluated:   # each record says its row's choice is outside its guarantee
    record["selection_privacy"] = tuning.PRIVACY_NOTE
  return tuned + evaluated, _jsonable(info)


def _run_private(phases: tuning.Phases, fields: list[str], algorithms: dict, problems: dict,
                 metrics: tuple, on_record: Callable | None) -> tuple[list[dict], dict]:
  """``select.private`` (:mod:`dpsco_jax.runner.tuning`): every candidate validated and
  planned, the cost printed, then one private selection per eval seed and group. No progress
  line: its count of runs would show K."""
  runs = _validated(phases.with_seeds(phases.eval_seeds), algorithms, problems)
  runner_user.check_metrics(runs, metrics)
  cache = runs.cache
  problem_of = lambda cfg: runner_batch.cached_problem(
      runner_batch.problem_config(cfg), problems, cache,
      runner_batch.run_keys(cfg.get("seed", 0))[0])
  # the cost is the plans' the candidates run: their rows' (made when validated)
  plan_of = lambda cfg, problem: _plan_for(cfg, problem, runs.plans.get(row_key(cfg)))
  groups = tuning.group_candidates(runs, phases.select, fields)
  plans = tuning.private_plans(groups, phases.select, problem_of, plan_of)
  print("\n".join(tuning.cost_lines(plans, fields)), flush=True)

  def train(cfg: dict, key: jax.Array) -> dict:
    try:
      return {**run_one(cfg, algorithms=algorithms, problems=problems, cache=cache,
                        driver_key=key, checked=True, plan=runs.plans.get(row_key(cfg))),
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
  return records, _jsonable(tuning.private_info(phases, plans, fields))


def aggregate(records: list[dict], fields: list[str]) -> list[dict]:
  """Mean, std and 95% t-interval over seeds of every group of records sharing ``fields``
  (failed runs are counted in ``failed`` and left out of the statistics), for
  ``excess_risk`` and every user metric (:func:`dpsco_jax.runner.stats.record_metrics`):
  ``<metric>_mean``, ``_std``, ``_ci95_lo``, ``_ci95_hi``."""
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
  """The printed table: per metric (``excess_risk``, your metrics) its mean, std and
  Student-t interval (``ci95``; ``<metric>_ci95`` with several metrics); with a ``compare:``
  block, two compact columns: ``ratio[boot95]`` (ratio to the baseline [percentile bootstrap
  95%]) and ``wins`` (wins/paired seeds)."""
  metrics = row_metrics(rows)
  ci = {m: "ci95" if len(metrics) == 1 else f"{m}_ci95" for m in metrics}
  cols = fields + [c for m in metrics for c in (f"{m}_mean", f"{m}_std", ci[m])]
  first = f"{metrics[0]}_mean" if metrics else "result"
  cols += ["result"] if not metrics else []
  cols += ["epsilon", "epsilon_kind", "provenance", "gradient_evaluations", "wall_time_s",
           "seeds"]
  if any(r.get("failed") for r in rows):
    cols.append("failed")
  compared = any("compare_metric" in r for r in rows)
  if compared:
    cols += ["ratio[boot95]", "wins"]
  def fmt(v):
    if isinstance(v, float):
      return f"{v:.4g}"
    return "" if v is None else str(v)
  def cell(r, c):
    metric = next((m for m in metrics if ci[m] == c), None)
    if metric is not None:
      lo, hi = r.get(f"{metric}_ci95_lo"), r.get(f"{metric}_ci95_hi")
      return "" if lo is None or math.isnan(lo) else f"[{lo:.3g}, {hi:.3g}]"
    if c == first and "error" in r:
      return "FAILED"
    if c in ("ratio[boot95]", "wins"):
      return compare_cells(r)[c]
    return fmt(r.get(c))
  table = [[c for c in cols]] + [[cell(r, c) for c in cols] for r in rows]
  widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
  lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def plot(records: list[dict], x_field: str, fields: list[str], path: str) -> str:
  """Excess risk (mean and 95% t-interval over seeds) against ``x_field``, one line per other
  group (:func:`dpsco_jax.runner.plots.plot_rows`); without excess risk (a user problem), the
  first metric."""
  return _plot_metric(aggregate(records, fields), x_field, fields, path)


def _plot_metric(rows: list[dict], x: str, fields: list[str], path: str) -> str:
  metrics = row_metrics(rows)
  if not metrics or metrics[0] == "excess_risk":
    return plot_rows(rows, x, fields, path)
  m = metrics[0]
  rows = [r for r in rows if r.get("seeds") and r.get(x) is not None]
  return _draw(rows, x, fields, path, f"{m}_mean", f"{m}_ci95_lo", f"{m}_ci95_hi", m)


def load_config(path: str) -> dict:
  import yaml
  try:
    with open(path) as f:
      config = yaml.load(f, Loader=yaml_loader())  # noqa: S506 (a SafeLoader subclass)
  except OSError as err:
    raise ConfigError(f"{path}: {err.strerror}") from None
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
  """The table's rows (:func:`aggregate`), with the paired comparison of a ``compare:`` block
  (a :class:`dpsco_jax.runner.config.CompareSpec`) when given; a row's baseline need not
  share its ``ignore`` fields (the selected ones)."""
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
  with ``compare``, ``STEM_FIELD_ratio.png``, STEM being ``out`` without its extension
  (``results`` without ``out``)."""
  if not plot_field or _plot_x(plot_field, fields) not in fields:
    return []
  stem = os.path.splitext(out or "results")[0]
  return [stem + f"_{plot_field}.png"] + (
      [stem + f"_{plot_field}_ratio.png"] if compare is not None else [])


def _holds_only_quick_records(path: str) -> bool:
  """Whether the results file at ``path`` holds only ``--quick`` records (an unreadable or
  foreign file does not: it may be a full run's, cut short)."""
  try:
    with open(path) as f:
      records = json.load(f).get("results")
  except (OSError, ValueError, AttributeError):
    return False
  return isinstance(records, list) and all(
      isinstance(r, dict) and r.get("quick") is True for r in records)


def check_outputs(out: str | None, plots: list[str], *, quick: bool = False,
                  force: bool = False) -> None:
  """Refuses, before anything runs, to write over an existing file: the results file ``out``
  or a plot in ``plots``, unless ``force``. A quick run never replaces a results file holding
  records of a full run (or a file that is not a results file), ``force`` or not: a smoke
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


def _plots(rows: list[dict], fields: list[str], plot_field: str, out: str | None,
           compare, selected: tuple[str, ...] = ()) -> None:
  """The excess-risk plot (and the ratio plot with ``compare``); one line per value of the
  fields other than ``plot_field`` and the ``selected`` ones."""
  x = _plot_x(plot_field, fields)
  paths = plot_paths(plot_field, fields, out, compare)
  if not paths:
    print(f"plot: {plot_field!r} is not a swept field ({', '.join(fields)}); no plot")
    return
  fields = [f for f in fields if f not in selected or f == x]
  print(f"plot: {_plot_metric(rows, x, fields, paths[0])}")
  if compare is not None:
    print(f"plot: {plot_ratio(rows, x, fields, paths[1])}")


def main_run(path: str, out: str | None = None, plot_field: str | None = None,
             progress: bool = True, quick: bool = False, force: bool = False) -> list[dict]:
  """Runs a config file, prints its table, writes ``out`` as runs finish. Returns the records
  (failed runs included, with ``status: failed`` and their error; with ``select``, the tuning
  records too, ``phase: tuning``). ``quick``: the config at its smallest
  (:func:`dpsco_jax.runner.quick.quick_config`: first value of every sweep, one seed per
  phase, sizes capped), every record marked ``quick: true``.

  Outputs (:func:`check_outputs`, before anything runs): an existing ``out`` or plot file is
  replaced only with ``force`` (``--force``), else a :class:`ConfigError`; a ``quick`` run
  never replaces a results file holding a full run's records, even with ``force``."""
  config = load_config(path)
  check_runner_keys(config)
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
        json.dump({"config": _jsonable(config), "results": records, **extra}, f, indent=1)
  records, selection = run_phases(phases, progress=progress, on_record=write, compare=compare)
  fields = _table_fields(phases.config)
  shown = [r for r in records if r.get("phase") != "tuning"]
  selected = phases.select.over if phases.select else ()
  rows = summarize(shown, fields, compare, selected)
  _print_report(config.get("name", path), records, rows, fields, compare, selection)
  extra = {"summary": _jsonable(rows)}
  if selection is not None:
    tuned = [r for r in records if r.get("phase") == "tuning"]
    extra.update(selection=selection, tuning_summary=_jsonable(aggregate(tuned, fields)))
  if out:
    write(records, **extra)
    print(f"wrote {out}")
  if plot_field and any(r.get("status") == "ok" for r in shown):
    _plots(rows, fields, plot_field, out, compare, selected)
  return records
