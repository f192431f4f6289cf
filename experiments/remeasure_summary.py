"""Issue 17 item 3: the numbers behind the README's re-measured claims of papers 000 (m-sweep),
001, 002 and 004, from the evaluation runs of ``experiments/configs_eval/*_eval.yaml``.

    python -m dpsco_jax run experiments/configs_eval/<name>_eval.yaml \
        --out experiments/results/<name>_eval.json          # for each name below
    python experiments/remeasure_summary.py [--markdown]

The runner's own table gives each cell's mean excess risk with its Student-t 95% interval and,
with a ``compare:`` block, the paired ratio to the baseline (percentile bootstrap 95%, win
rate). This script adds what a claim needs beyond that: halting counts (paper 000), the
noise scale against the naive baseline's (001), the query depth to the target (002) and the
chosen penalty's distance to the optimum (004), each as mean and t 95% interval over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def t_ci(values) -> tuple[float, float, float]:
  """Mean and Student-t 95% interval (the runner's) of the finite values."""
  from dpsco_jax.runner.stats import t_interval
  x = [float(v) for v in values if v is not None and np.isfinite(v)]
  if not x:
    return math.nan, math.nan, math.nan
  return (float(np.mean(x)), *t_interval(x))


def fmt(stat: tuple[float, float, float], digits: int = 3) -> str:
  m, lo, hi = stat
  return f"{m:.{digits}g} [{lo:.{digits}g}, {hi:.{digits}g}]"


def _load(name: str) -> dict | None:
  path = os.path.join(RESULTS, f"{name}_eval.json")
  if not os.path.exists(path):
    return None
  with open(path) as fh:
    return json.load(fh)


def _cells(records: list[dict], keys) -> dict:
  out = defaultdict(list)
  for r in records:
    if r.get("status", "ok") == "ok":
      out[tuple(keys(r))].append(r)
  return out


def _summary_rows(data: dict) -> list[str]:
  """The runner's per-cell summary: mean [t 95%] and the paired ratio where there is one."""
  lines = []
  for row in data.get("summary", []):
    fields = {k: v for k, v in row.items()
              if not k.startswith(("excess_risk", "ratio", "compare", "wins", "win_rate",
                                   "paired", "epsilon", "provenance", "gradient", "wall",
                                   "failed", "seeds", "delta"))}
    ratio = ""
    if "ratio" in row:
      ratio = (f"  ratio {row['ratio']:.3g} [{row['ratio_ci95_lo']:.3g}, "
               f"{row['ratio_ci95_hi']:.3g}], wins {row['wins']}/{row['paired_seeds']}")
    lines.append(f"  {fields}  seeds {row['seeds']}  excess "
                 f"{row['excess_risk_mean']:.3g} [{row['excess_risk_ci95_lo']:.3g}, "
                 f"{row['excess_risk_ci95_hi']:.3g}]  ({row.get('provenance')}){ratio}")
  return lines


def user_level(data: dict) -> list[str]:
  """Paper 000, m-sweep at n = 2000: halting counts of Algorithms 1 and 3 per m."""
  lines = _summary_rows(data)
  cells = _cells(data["results"], lambda r: (r["algorithm"], r["problem"], r["m"],
                                             r.get("sensitivity")))
  for (alg, prob, m, sens), rs in sorted(cells.items(), key=lambda kv: str(kv[0])):
    if "halted_phase" in rs[0]:
      k = sum(r.get("halted_phase") is not None for r in rs)
      kept = [r["excess_risk"] for r in rs if r.get("halted_phase") is None]
      lines.append(f"  {alg} {prob} m={m} {sens}: halted {k}/{len(rs)}; not halted "
                   f"{fmt(t_ci(kept))}")
  return lines


def output_perturbation(data: dict) -> list[str]:
  """Paper 001: noise std against the naive baseline's at the same (n, m, eps)."""
  lines = _summary_rows(data)
  cells = _cells(data["results"], lambda r: (r["algorithm"], r["n_users"], r["m"],
                                             r["target_epsilon"]))
  for (alg, n, m, eps), rs in sorted(cells.items(), key=lambda kv: str(kv[0])):
    naive = cells.get(("naive_output_pert", n, m, eps))
    sig = [r.get("sigma") for r in rs if isinstance(r.get("sigma"), (int, float))]
    bottom = [r["is_bottom"] for r in rs if "is_bottom" in r]
    if bottom:   # the mechanism released "bottom" (no model); the runner scores it as w = 0
      lines.append(f"  {alg} n={n} m={m} eps={eps}: released bottom on {sum(bottom)}/"
                   f"{len(bottom)} seeds")
    if alg != "naive_output_pert" and naive and sig:
      base = [r.get("sigma") for r in naive if isinstance(r.get("sigma"), (int, float))]
      if base:
        lines.append(f"  {alg} n={n} m={m} eps={eps}: sigma {np.mean(sig):.3g} = "
                     f"{np.mean(sig) / np.mean(base):.3g} x naive's {np.mean(base):.3g}")
  failed = [r for r in data["results"] if r.get("status", "ok") != "ok"]
  if failed:
    lines.append(f"  {len(failed)} runs did not finish: "
                 + "; ".join(sorted({f"{r['algorithm']}: {str(r.get('error'))[:80]}"
                                     for r in failed})))
  return lines


def resque(data: dict) -> list[str]:
  """Paper 002: (a) query depth to 0.1x the initial gap; (b) private SCO excess risk."""
  lines = _summary_rows(data)
  cells = _cells(data["results"], lambda r: (r["algorithm"], r["d"], r["n_users"]))
  for (alg, d, n), rs in sorted(cells.items(), key=lambda kv: str(kv[0])):
    if rs[0].get("depth_to_target") is not None:
      depth = [r["depth_to_target"] for r in rs]
      queries = [r.get("queries_to_target") for r in rs]
      lines.append(f"  {alg} d={d}: depth {fmt(t_ci(depth), 4)} (range {min(depth)}-"
                   f"{max(depth)}), queries {fmt(t_ci(queries), 4)}, seeds {len(rs)}")
  return lines


def bilevel(data: dict) -> list[str]:
  """Paper 004: validation-loss gap, distance of the chosen penalty to the optimum, and how
  often it sits on a boundary of [omega_min, 5]."""
  lines = _summary_rows(data)
  cells = _cells(data["results"], lambda r: (r["algorithm"], r["config"].get("dataset"),
                                             r.get("target_epsilon")))
  for (alg, ds, eps), rs in sorted(cells.items(), key=lambda kv: str(kv[0])):
    dist = [(r.get("debug") or {}).get("metrics", {}).get("dist_to_opt") for r in rs]
    x = [float(np.ravel(r["x_out"])[0]) for r in rs if r.get("x_out") is not None]
    edge = sum(v <= 1.001e-3 or v >= 4.999 for v in x)
    lines.append(f"  {alg} {ds} eps={eps}: |omega - omega*| {fmt(t_ci(dist))}, on a "
                 f"boundary {edge}/{len(x)}, seeds {len(rs)}")
  return lines


SECTIONS = {"user_level": user_level, "output_perturbation": output_perturbation,
            "resque": resque, "bilevel_ridge": bilevel}


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.parse_args(argv)
  for name, fn in SECTIONS.items():
    data = _load(name)
    print(f"== {name}_eval.json" + ("" if data else ": not run"))
    if data:
      print("\n".join(fn(data)))


if __name__ == "__main__":
  import sys
  sys.path.insert(0, os.path.dirname(HERE))
  main()
