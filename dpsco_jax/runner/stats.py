"""Statistics of the runner's tables: Student-t intervals over seeds and paired comparisons
on shared seeds (ratio of means with a seeded percentile bootstrap interval, win rate)."""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

import numpy as np

from dpsco_jax.runner.config import CompareSpec, baseline_indices, is_metric_value

#: the fields a row's baseline need not share with it (they say which row is the baseline)
_IDENTITY_FIELDS = ("algorithm", "label")


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
  """Student-t confidence interval for the mean (NaN bounds with fewer than 2 values)."""
  if len(values) < 2:
    return math.nan, math.nan
  from scipy.stats import t
  mean, sem = statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))
  half = float(t.ppf(0.5 + level / 2, len(values) - 1)) * sem
  return mean - half, mean + half


def record_metrics(records: list[dict]) -> list[str]:
  """The metrics a table summarizes: ``excess_risk`` where a successful record has it (or
  nothing succeeded and some record is not a user problem's), then every user metric."""
  ok = [r for r in records if r.get("status", "ok") == "ok"]
  out = []
  if any(is_metric_value(r.get("excess_risk")) for r in ok) or (
      not ok and not all(r.get("problem") == "user" for r in records)):
    out.append("excess_risk")
  for r in ok:
    out += [m for m in r.get("user_metrics") or () if m not in out]
  return out


def metric_stats(records: list[dict], metric: str) -> dict:
  """``<metric>_mean``, ``_std``, ``_ci95_lo``, ``_ci95_hi`` over the records that have it."""
  values = [float(r[metric]) for r in records if is_metric_value(r.get(metric))]
  if not values:
    return {}
  lo, hi = t_interval(values)
  return {f"{metric}_mean": statistics.fmean(values),
          f"{metric}_std": statistics.stdev(values) if len(values) > 1 else 0.0,
          f"{metric}_ci95_lo": lo, f"{metric}_ci95_hi": hi}


def row_metrics(rows: list[dict]) -> list[str]:
  """The metrics summarized in rows of :func:`dpsco_jax.runner.aggregate`, first seen first."""
  out: list[str] = []
  for row in rows:
    out += [k[:-len("_ci95_lo")] for k in row if k.endswith("_ci95_lo")
            and f"{k[:-len('_ci95_lo')]}_mean" in row and k[:-len("_ci95_lo")] not in out]
  return out


def group_records(records: list[dict], fields: list[str]) -> dict[tuple, list[dict]]:
  """Records grouped by their values of ``fields`` (top level first, then their ``config``)."""
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    key = tuple(r.get(f, r.get("config", {}).get(f)) for f in fields)
    groups.setdefault(key, []).append(r)
  return groups


def per_seed(records: list[dict], metric: str) -> dict[int, float]:
  """``{seed: metric}`` over the successful records that have it (a seed's mean)."""
  values: dict[int, list[float]] = {}
  for r in records:
    if r.get("status", "ok") == "ok" and isinstance(r.get(metric), (int, float)):
      values.setdefault(int(r["seed"]), []).append(float(r[metric]))
  return {s: statistics.fmean(v) for s, v in values.items()}


def paired_comparison(values: dict[int, float], baseline: dict[int, float], *,
                      resamples: int = 2000, seed: int = 0, level: float = 0.95,
                      better: str = "lower") -> dict:
  """Row vs baseline on the seeds both have: ``ratio`` = mean(row) / mean(baseline), its
  percentile bootstrap interval (seeds resampled jointly, keeping the pairs; NaN with fewer
  than 2 paired seeds), ``wins`` = seeds where the row is strictly better (``better``)."""
  if better not in ("lower", "higher"):
    raise ValueError(f"better must be 'lower' or 'higher', got {better!r}")
  seeds = sorted(set(values) & set(baseline))
  n = len(seeds)
  out: dict[str, Any] = {"paired_seeds": n, "ratio": math.nan, "ratio_ci95_lo": math.nan,
                         "ratio_ci95_hi": math.nan, "wins": 0, "win_rate": math.nan}
  if n == 0:
    return out
  x = np.array([values[s] for s in seeds])
  y = np.array([baseline[s] for s in seeds])
  with np.errstate(divide="ignore", invalid="ignore"):
    out["ratio"] = float(x.mean() / y.mean())
    if n >= 2:
      idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
      ratios = x[idx].mean(axis=1) / y[idx].mean(axis=1)
      lo, hi = np.percentile(ratios, [50 * (1 - level), 50 * (1 + level)])
      out["ratio_ci95_lo"], out["ratio_ci95_hi"] = float(lo), float(hi)
  out["wins"] = int((x < y).sum() if better == "lower" else (x > y).sum())
  out["win_rate"] = out["wins"] / n
  return out


def _row_values(group: list[dict]) -> dict:
  """A row's fields for baseline matching (``epsilon``: the requested one)."""
  rec = group[0]
  values = {**rec.get("config", {}), **{k: v for k, v in rec.items() if k != "config"}}
  values["epsilon"] = rec.get("target_epsilon", rec.get("config", {}).get("epsilon"))
  return values


def row_label(row: dict, fields: list[str]) -> str:
  if row.get("label"):
    return str(row["label"])
  return ", ".join(f"{f}={row[f]}" for f in fields if row.get(f) is not None)


def _baseline_for(i: int, rows: list[dict], bases: list[int], fields: list[str],
                  fixed: set[str]) -> int | str:
  """The baseline row of row ``i``: the only one, else the one that agrees with it on every
  field both set (identity and ``fixed`` fields excepted); else why not."""
  if len(bases) == 1:
    return bases[0]
  free = [f for f in fields if f not in _IDENTITY_FIELDS and f not in fixed]
  hits = [b for b in bases if all(rows[b].get(f) is None or rows[i].get(f) is None
                                  or rows[b].get(f) == rows[i].get(f) for f in free)]
  if len(hits) == 1:
    return hits[0]
  if not hits:
    return "no baseline row with the same values of " + ", ".join(free)
  return (f"ambiguous: {len(hits)} baseline rows match; give compare.baseline as a mapping of "
          "row fields")


def add_comparisons(rows: list[dict], records: list[dict], fields: list[str],
                    spec: CompareSpec, ignore: Iterable[str] = ()) -> list[dict]:
  """Adds the paired comparison with the baseline to every row of ``aggregate(records,
  fields)`` in place (a row's baseline need not share its ``ignore`` fields)."""
  groups = list(group_records(records, fields).values())
  assert len(groups) == len(rows), "rows must be aggregate(records, fields)"
  items = [_row_values(g) for g in groups]
  bases = baseline_indices(spec.baseline, items)
  fixed = set(ignore)
  if isinstance(spec.baseline, dict):
    fixed |= {"target_epsilon" if k == "epsilon" else k for k in spec.baseline}
  method = (f"percentile bootstrap over the paired seeds ({spec.resamples} joint resamples, "
            f"seed {spec.seed})")
  for i, row in enumerate(rows):
    row["compare_metric"] = spec.metric
    if i in bases:
      row["compare_role"] = "baseline"
      continue
    b = _baseline_for(i, rows, bases, fields, fixed)
    if isinstance(b, str):
      row["compare_note"] = b
      continue
    row.update({"compare_role": "compared", "compare_baseline": row_label(rows[b], fields),
                "ratio_ci_method": method})
    row.update(paired_comparison(per_seed(groups[i], spec.metric),
                                 per_seed(groups[b], spec.metric),
                                 resamples=spec.resamples, seed=spec.seed,
                                 better=spec.better))
  return rows


def compare_cells(row: dict) -> dict[str, str]:
  """The table's compact comparison cells: ``ratio [boot 95%]`` and ``wins/paired``."""
  if row.get("compare_role") == "baseline":
    return {"ratio[boot95]": "baseline", "wins": ""}
  if row.get("compare_role") != "compared":
    return {"ratio[boot95]": "n/a" if "compare_note" in row else "", "wins": ""}
  ratio, lo, hi = row["ratio"], row["ratio_ci95_lo"], row["ratio_ci95_hi"]
  text = f"{ratio:.3g}" + ("" if math.isnan(lo) else f" [{lo:.3g}, {hi:.3g}]")
  return {"ratio[boot95]": text, "wins": f"{row['wins']}/{row['paired_seeds']}"}


def compare_footnote(rows: list[dict], spec: CompareSpec) -> str:
  """What the comparison columns mean (printed under the table)."""
  lines = [f"(ratio: mean {spec.metric} of the row / of its baseline over the seeds both ran "
           f"(wins: of those paired seeds, how many had a {spec.better} {spec.metric}); [lo, hi]: "
           f"percentile bootstrap 95% interval, {spec.resamples} joint resamples of the paired "
           f"seeds, seed {spec.seed})"]
  for r in rows:
    if "compare_note" in r:
      lines.append(f"  no comparison for {r.get('label') or r.get('algorithm')}: "
                   f"{r['compare_note']}")
  return "\n".join(lines)
