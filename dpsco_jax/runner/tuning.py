"""Tuning and evaluation seeds: ``tuning_seeds``, ``eval_seeds`` and ``select`` of a config
(see :mod:`dpsco_jax.runner`'s docstring).

The swept grid runs on the tuning seeds only; per group of the other swept fields (e.g. per
algorithm and epsilon) the values of the ``over`` fields with the best mean metric are
selected; only the selected run configs then run on the (disjoint) evaluation seeds. The
selection reads the tuning runs' results, so it is *not* covered by any run's privacy
guarantee (:data:`PRIVACY_NOTE`).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from dpsco_jax._checks import MAX_SEED
from dpsco_jax.config.schema import ConfigError
from dpsco_jax.runner.config import check_metric_name

PHASE_KEYS = ("tuning_seeds", "eval_seeds", "select")
RULES = ("min_mean", "max_mean")
PRIVACY_NOTE = ("the selection is not covered by the privacy guarantee: choosing "
                "hyper-parameters on the results of private runs (hyper-parameter search on "
                "private data) costs privacy unless it is accounted for; each row's epsilon "
                "is that of one run")


@dataclasses.dataclass(frozen=True)
class SelectSpec:
  """``select: {metric: excess_risk, over: [learning_rate], rule: min_mean}``."""
  over: tuple[str, ...]
  metric: str = "excess_risk"
  rule: str = "min_mean"


@dataclasses.dataclass(frozen=True)
class Phases:
  """A config split into what runs: ``config`` (phase keys removed; with ``seed`` set when
  there is a single phase), and the tuning / evaluation seeds and rule when it selects."""
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
  unknown = set(spec) - {"over", "metric", "rule"}
  if unknown:
    raise ConfigError(f"select: unknown key(s) {', '.join(sorted(map(str, unknown)))}; it "
                      "reads over, metric, rule")
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
  return SelectSpec(tuple(over), metric, rule)


def _seed_given(config: dict) -> bool:
  entries = [config] + [e for e in (config.get("experiments") or []) if isinstance(e, dict)]
  return any("seed" in e for e in entries)


def parse_phases(config: dict) -> Phases:
  """Checks ``tuning_seeds`` / ``eval_seeds`` / ``select`` and splits the config."""
  tuning, evals = _seeds(config, "tuning_seeds"), _seeds(config, "eval_seeds")
  rest = {k: v for k, v in config.items() if k not in PHASE_KEYS}
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
  """The selected ``over`` values per group (keyed for :func:`is_selected`) and a report row
  per group. A candidate with a failed tuning run (or no metric) is not eligible."""
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
  """The printed account of a selection: what ran on which seeds, what was chosen, and the
  privacy caveat."""
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
