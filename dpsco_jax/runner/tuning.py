"""Tuning and evaluation seeds: ``tuning_seeds``, ``eval_seeds`` and ``select`` of a config.

The grid runs on the tuning seeds; per group of the other swept fields the ``over`` values with
the best mean metric are selected and only those run on the (disjoint) evaluation seeds. That
selection reads the tuning results, so it is *not* covered by the guarantee
(:data:`PRIVACY_NOTE`, in every eval record).

**Private selection** (``select: {..., private: {distribution, eta, gamma}}``, eval seeds
only): :mod:`dpsco_jax.tuning`'s, per eval seed and group, with the privacy of training *and*
selection; its cost is printed before anything runs. The metric must be public (a built-in
problem's ``excess_risk``, or a user metric on ``eval_data`` declared public:
:func:`check_private_metric`), and candidates must expose their privacy event (DP-SGD).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

from dpsco_jax._checks import MAX_SEED
from dpsco_jax.config.schema import ConfigError
from dpsco_jax.privacy.ledger import PrivacyBudgetExceeded
from dpsco_jax.privacy.selection import SelectionCost, SelectionLaw, law_for_grid
from dpsco_jax.runner import user as runner_user
from dpsco_jax.runner.config import check_keys, check_metric_name
from dpsco_jax.tuning import best_of_k, plans_cost

PHASE_KEYS = ("tuning_seeds", "eval_seeds", "select")
RULES = ("min_mean", "max_mean")
PRIVACY_NOTE = ("the selection is not covered by the privacy guarantee: choosing "
                "hyper-parameters on the results of private runs (hyper-parameter search on "
                "private data) costs privacy unless it is accounted for; each row's epsilon "
                "is that of one run")
#: a built-in problem's fields computed without the training users (population risk)
PUBLIC_METRICS = ("excess_risk", "excess_risk_f64")
PRIVATE_KEYS = ("distribution", "eta", "gamma")


@dataclasses.dataclass(frozen=True)
class PrivateSpec:
  """``select.private``: the law of the number of runs (``gamma`` None: sized to the grid)."""
  distribution: str = "truncated_negative_binomial"
  eta: float | None = None
  gamma: float | None = None

  def law(self, candidates: int) -> SelectionLaw:
    try:
      return law_for_grid(candidates, self.distribution, eta=self.eta, gamma=self.gamma)
    except ValueError as err:
      raise ConfigError(f"select.private.{err}") from None


@dataclasses.dataclass(frozen=True)
class SelectSpec:
  """``select: {metric: excess_risk, over: [learning_rate], rule: min_mean}``."""
  over: tuple[str, ...]
  metric: str = "excess_risk"
  rule: str = "min_mean"
  private: PrivateSpec | None = None


@dataclasses.dataclass(frozen=True)
class Phases:
  """A config split into what runs: ``config`` (phase keys removed), the tuning / evaluation
  seeds and the rule when it selects."""
  config: dict
  tuning_seeds: tuple[int, ...] | None = None
  eval_seeds: tuple[int, ...] | None = None
  select: SelectSpec | None = None

  def with_seeds(self, seeds: tuple[int, ...]) -> dict:
    return {**self.config, "seed": list(seeds)}


def _seeds(config: dict, key: str) -> tuple[int, ...] | None:
  v = config.get(key)
  if v is None:
    return None
  seeds = v if isinstance(v, list) else [v]
  if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
    raise ConfigError(f"{key} must be a non-empty list of integers, got {v!r}")
  bad = [s for s in seeds if not 0 <= s <= MAX_SEED]
  if bad:  # outside it, two seeds give one key: "disjoint" lists could share noise
    raise ConfigError(f"{key}: seeds must lie in [0, {MAX_SEED}] (the key derivation keeps 32 "
                      f"bits of a seed, so {bad[0]!r} would give the key of another seed)")
  if len(set(seeds)) != len(seeds):
    raise ConfigError(f"{key} lists a seed twice: {v!r}")
  return tuple(seeds)


def _parse_select(spec: Any) -> SelectSpec:
  if not isinstance(spec, dict):
    raise ConfigError(f"select: must be a mapping {{metric: ..., over: [...], rule: ...}}, got "
                      f"{spec!r}")
  check_keys(spec, ("over", "metric", "rule", "private"), "select")
  over = spec.get("over")
  over = [over] if isinstance(over, str) else over
  if not over or not isinstance(over, list) or not all(isinstance(f, str) for f in over):
    raise ConfigError(f"select.over must name the swept field(s) to choose, got {over!r}")
  if "seed" in over:
    raise ConfigError("select.over: seed cannot be selected (seeds are the repetitions)")
  rule = spec.get("rule", "min_mean")
  if rule not in RULES:
    raise ConfigError(f"select.rule must be one of {', '.join(RULES)}, got {rule!r}")
  metric = check_metric_name(spec.get("metric", "excess_risk"), "select.metric")
  private = _parse_private(spec["private"]) if "private" in spec else None
  return SelectSpec(tuple(over), metric, rule, private)


def _parse_private(spec: Any) -> PrivateSpec:
  if not isinstance(spec, dict):
    raise ConfigError("select.private must be a mapping {distribution: "
                      f"truncated_negative_binomial, eta: ..., gamma: ...}}, got {spec!r}")
  check_keys(spec, PRIVATE_KEYS, "select.private")
  out = PrivateSpec(spec.get("distribution", "truncated_negative_binomial"), spec.get("eta"),
                    spec.get("gamma"))
  out.law(2)   # every parameter checked now, before anything runs
  return out


def _seed_given(config: dict) -> bool:
  entries = [config] + [e for e in (config.get("experiments") or []) if isinstance(e, dict)]
  return any("seed" in e for e in entries)


def parse_phases(config: dict) -> Phases:
  """Checks ``tuning_seeds`` / ``eval_seeds`` / ``select`` and splits the config."""
  tuning, evals = _seeds(config, "tuning_seeds"), _seeds(config, "eval_seeds")
  rest = {k: v for k, v in config.items() if k not in PHASE_KEYS}
  if isinstance(config.get("select"), dict) and "private" in config["select"]:
    if tuning is not None or evals is None or _seed_given(config):
      raise ConfigError("select.private selects inside each private run, on each eval seed's "
                        "own users: give eval_seeds (not seed, not tuning_seeds)")
    return Phases(rest, None, evals, _parse_select(config["select"]))
  if tuning is None and evals is None:
    if "select" in config:
      raise ConfigError("select needs tuning_seeds and eval_seeds (disjoint lists of seeds)")
    return Phases(rest)
  if _seed_given(config):
    raise ConfigError("give seed, or tuning_seeds / eval_seeds, not both (remove seed)")
  if tuning is not None and evals is not None and set(tuning) & set(evals):
    raise ConfigError("tuning_seeds and eval_seeds must be disjoint; both list "
                      + ", ".join(map(str, sorted(set(tuning) & set(evals)))))
  if "select" not in config:
    if tuning is not None:
      raise ConfigError("tuning_seeds without select tunes nothing; add select: {metric: ..., "
                        "over: [...]} or use seed")
    return Phases({**rest, "seed": list(evals)})
  if tuning is None or evals is None:
    raise ConfigError("select needs both tuning_seeds and eval_seeds")
  return Phases(rest, tuning, evals, _parse_select(config["select"]))


def check_over(spec: SelectSpec, swept: list[str]) -> None:
  for f in spec.over:
    if f not in swept:
      raise ConfigError(f"select.over: {f!r} is not swept (nothing to choose from); swept: "
                        + (", ".join(swept) or "(none)"))


def group_fields(spec: SelectSpec, swept: list[str]) -> list[str]:
  """The fields a selection is made per (every swept field but the selected ones)."""
  return [f for f in dict.fromkeys(["algorithm"] + swept) if f not in spec.over and f != "seed"]


def _key(run: dict, fields: list[str] | tuple[str, ...]) -> tuple:
  return tuple(repr(run.get(f)) for f in fields)


def _candidates(runs: list[dict], records: list[dict], spec: SelectSpec,
                fields: list[str]) -> dict[tuple, dict]:
  """Per group: its field values and, per value of the ``over`` fields, the tuning metrics."""
  groups: dict[tuple, dict] = {}
  for run, rec in zip(runs, records):
    g = groups.setdefault(_key(run, fields), {"values": {f: run.get(f) for f in fields},
                                              "options": {}})
    opt = g["options"].setdefault(_key(run, spec.over), {
        "values": {f: run.get(f) for f in spec.over}, "metric": [], "seeds": [], "failed": 0})
    value = rec.get(spec.metric)
    if rec.get("status", "ok") == "ok" and isinstance(value, (int, float)):
      opt["metric"].append(float(value))
      opt["seeds"].append(rec["seed"])
    else:
      opt["failed"] += 1
  return groups


def choose(runs: list[dict], records: list[dict], spec: SelectSpec, fields: list[str]
           ) -> tuple[dict[tuple, tuple], list[dict]]:
  """The selected ``over`` values per group (for :func:`is_selected`) and a report row per
  group; a candidate with a failed tuning run (or no metric) is not eligible."""
  chosen, report = {}, []
  pick = min if spec.rule == "min_mean" else max
  for gkey, g in _candidates(runs, records, spec, fields).items():
    options = [{**o["values"], "mean": statistics.fmean(o["metric"]) if o["metric"] else None,
                "seeds": sorted(o["seeds"]), "failed": o["failed"]}
               for o in g["options"].values()]
    eligible = [(okey, opt) for okey, opt in zip(g["options"], options)
                if opt["mean"] is not None and not opt["failed"]]
    row = {**g["values"], "metric": spec.metric, "rule": spec.rule, "candidates": options}
    if eligible:
      okey, best = pick(eligible, key=lambda kv: kv[1]["mean"])
      chosen[gkey] = okey
      row.update({"selected": {f: best[f] for f in spec.over}, "tuning_mean": best["mean"]})
    else:
      row.update({"selected": None, "note": "no eligible candidate (failed tuning runs)"})
    report.append(row)
  return chosen, report


def is_selected(run: dict, chosen: dict[tuple, tuple], spec: SelectSpec,
                fields: list[str]) -> bool:
  return chosen.get(_key(run, fields)) == _key(run, spec.over)


def selection_lines(info: dict) -> list[str]:
  """The printed account of a selection: what ran, what was chosen, the privacy caveat."""
  if info.get("private"):
    return [f"selection: private ({info['rule']} of {info['metric']} over "
            f"{', '.join(info['over'])}, a {info['metric_source']} metric), inside each run "
            f"on eval seeds {list(info['eval_seeds'])}; each row's epsilon covers training "
            "and selection", *info["cost"]]
  lines = [f"selection: {info['tuning_runs']} tuning runs on tuning seeds "
           f"{list(info['tuning_seeds'])}; per group of {', '.join(info['group_fields'])}, "
           f"{info['rule']} of {info['metric']} over {', '.join(info['over'])}; the table "
           f"shows the selected configs on eval seeds {list(info['eval_seeds'])} only "
           f"({info['eval_runs']} eval runs)"]
  for g in info["groups"]:
    where = ", ".join(f"{f}={g[f]}" for f in info["group_fields"] if g.get(f) is not None)
    if g["selected"] is None:
      lines.append(f"  {where}: nothing selected ({g['note']})")
      continue
    chosen = ", ".join(f"{k}={v}" for k, v in g["selected"].items())
    lines.append(f"  {where}: {chosen} (tuning mean {info['metric']} {g['tuning_mean']:.4g}, "
                 f"{len(g['candidates'])} candidates)")
  lines.append(f"NOTE: {PRIVACY_NOTE}.")
  return lines


def group_candidates(runs: list[dict], spec: SelectSpec, fields: list[str]
                      ) -> dict[tuple, list[dict]]:
  """Per (seed, group): its candidates, one run config per value of the ``over`` fields."""
  out: dict[tuple, list[dict]] = {}
  for run in runs:
    out.setdefault((run.get("seed", 0),) + _key(run, fields), []).append(run)
  return out


def check_private_metric(spec: SelectSpec, problem: Any) -> None:
  """The metric of a private selection on ``problem`` is public (see the module docstring),
  else one ConfigError line."""
  if isinstance(problem, runner_user.UserProblem):
    runner_user.check_selection_metric(problem, spec.metric)
  elif spec.metric not in PUBLIC_METRICS:
    raise ConfigError(f"select.metric: a private selection reads a public metric, and "
                      f"{spec.metric!r} is not known to be computed without the private "
                      f"training users; use {' or '.join(PUBLIC_METRICS)} (the population risk "
                      "of a built-in problem)")


def candidate_plan(cfg: dict, problem: Any, plan_of: Callable) -> Any:
  """One candidate's data-free plan, the one its run executes (``plan_of(cfg, problem)``). An
  unregistered algorithm (``flax.DPTrainer``) is refused: it has no event to bound ``Q``'s
  curve."""
  from dpsco_jax.algorithms.registry import algorithms as table
  if cfg["algorithm"] not in table():
    raise ConfigError(f"select.private: {cfg['algorithm']} has no data-free plan exposing its "
                      "privacy event; private selection runs the DP-SGD family")
  try:
    return plan_of(cfg, problem)
  except (ValueError, PrivacyBudgetExceeded) as err:   # an explicit z over the budget too
    if not isinstance(problem, runner_user.UserProblem):
      raise
    # the sweep's validation plans no user row: a refused plan is the config's, here
    raise ConfigError(f"select.private: {cfg['algorithm']}: {' '.join(str(err).split())}"
                      ) from None


def private_plans(groups: dict[tuple, list[dict]], spec: SelectSpec, problem_of: Callable,
                  plan_of: Callable) -> dict[tuple, SelectionCost]:
  """Per (seed, group): the cost of its selection (:func:`dpsco_jax.tuning.plans_cost`) from
  the candidates' plans, without training; each candidate's metric is checked first."""
  out = {}
  for gkey, cands in groups.items():
    problems = [problem_of(c) for c in cands]
    for problem in problems:
      check_private_metric(spec, problem)
    plans = [candidate_plan(c, problem, plan_of) for c, problem in zip(cands, problems)]
    try:
      out[gkey] = plans_cost(plans, spec.private.law(len(cands)))
    except ConfigError as err:
      raise ConfigError(f"select.private: {err}") from None
  return out


def cost_lines(plans: dict[tuple, SelectionCost], fields: list[str]) -> list[str]:
  """What the private selection costs, per group of the first seed (E[K], never K)."""
  seed = next(iter(plans))[0]
  return [cost.line(", ".join(f"{f}={v}" for f, v in zip(fields, gkey[1:])) + ", per eval seed")
          for gkey, cost in plans.items() if gkey[0] == seed]


#: dropped from a private selection's released record: not covered by the guarantee (the
#: winner's time says whether it compiled, i.e. whether it was its candidate's first draw)
UNCOVERED = ("wall_time_s", "batch_wall_time_s", "batch_note", "debug")
#: where the released record says its selection metric was computed (check_private_metric)
POPULATION_SOURCE = ("public (the population risk of the problem's known distribution; no "
                     "training user is read)")
EVAL_DATA_SOURCE = ("public (declared: the problem's eval_data, eval_data_public: true; its "
                    "users are not the training users and are not covered by the guarantee)")


def select_privately(cands: list[dict], cost: SelectionCost, spec: SelectSpec, seed: int,
                     train: Callable[[dict, Any], dict]) -> dict:
  """One private selection (:func:`dpsco_jax.tuning.best_of_k` over ``train(cfg,
  driver_key)``): the best run's record with the selection's privacy, without
  :data:`UNCOVERED`."""
  import jax

  def one(i: int, key: Any) -> tuple[float | None, dict]:
    record = train(cands[i], key)
    value = record.get(spec.metric)
    ok = record.get("status", "ok") == "ok" and isinstance(value, (int, float))
    return (float(value) if ok else None), record

  seed_key = jax.random.key(seed)   # fold 2: the selection's own stream, 3: the runs' keys
  best = best_of_k(cost.law, len(cands), jax.random.fold_in(seed_key, 2),
                   jax.random.fold_in(seed_key, 3), one, spec.rule.removesuffix("_mean"))
  if best is None:
    raise RuntimeError("private selection: no candidate run succeeded")
  report = cost.report
  released = {k: v for k, v in best.items() if k not in UNCOVERED}
  released.update({
      "epsilon": report.epsilon, "epsilon_kind": report.epsilon_kind, "delta": report.delta,
      "provenance": report.provenance, "privacy_notes": report.notes,
      "candidate_epsilon": cost.candidate_epsilon, "selection": "private",
      "selection_metric": spec.metric,
      # a user run's record lists its metrics (runner_user.run), all read on eval_data
      "selection_metric_source": (EVAL_DATA_SOURCE if spec.metric in best.get("user_metrics", ())
                                  else POPULATION_SOURCE),
      "expected_runs": cost.expected_runs})
  return released


def private_info(phases: Phases, plans: dict[tuple, SelectionCost], fields: list[str]) -> dict:
  """The JSON ``selection`` block of a private selection (no K)."""
  spec = phases.select
  return {"private": True, "eval_seeds": list(phases.eval_seeds), "metric": spec.metric,
          "over": list(spec.over), "rule": spec.rule, "group_fields": fields,
          "metric_source": "public", "eval_runs": len(plans),
          "cost": cost_lines(plans, fields),
          "laws": [p.law.describe() for p in plans.values()][:1]}
