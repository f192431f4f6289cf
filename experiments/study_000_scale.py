"""Issue 28, paper 000 as n grows: FILTER (Algorithms 1 and 3) against user-level DP-SGD.

Reads every FILTER-curve record (``experiments/results/filter_curve_records*.jsonl``: the CPU
runs at n = 1e4 and 5e4, the H100 runs at n = 1e5 and 3e5, ``experiments/gpu/study_filter.sh``,
and the CPU runs at n = 1e6: Algorithm 3 through ``filter_curve.py``, DP-SGD through
``study_000_host_sgd.py``, host-streamed sampling, records marked ``"sampling_path": "host"``),
keeps the huge-gradient cells at m = 64 on the evaluation seeds 300-309 (the seeds every cell
shares; none was used to set anything), and prints per (n, corrupted fraction f):

* each algorithm's mean excess risk with its Student-t 95% interval and, for the FILTER
  algorithms, the halting count with its Clopper-Pearson interval;
* the paired ratio mean(A) / mean(DP-SGD) with the runner's percentile bootstrap 95% interval
  (:func:`dpsco_jax.runner.stats.paired_comparison`) and A's wins, and beside it the same
  interval Bonferroni-corrected for every cell the study has looked at (issue 28's rule for a
  headline picked from many cells: level ``1 - 0.05 / K``, ``K`` = the FILTER-vs-DP-SGD cells
  on these seeds over every n, f, m and corruption mode in the records, :func:`cells_looked`);
* per (algorithm, f), the log-log slope of mean excess risk against n with its bootstrap interval
  (:func:`study_slopes.fit_slope`), beside the theorem's exponents: -0.5 (Theorem 3.2's
  ``1/sqrt(mn)`` term, convex) and -1 to -2 (Remark 3.6, strongly convex: ``1/(nm)`` and
  ``d log(1/delta)/(eps^2 n^2 m)``).

It also writes the selected records as one runner-shaped JSON (``--out``) so that
``study_pairs.py`` / ``study_slopes.py`` can be run on them. Last line: JSON of the table.

    python experiments/study_000_scale.py [--out experiments/results/study/filter_scale.json]
        [--seeds 600-609]   # the confirmation run on seeds named before it ran
        [--mode flip]       # label-flipping users instead of huge gradients
        [--m-slope 100000]  # slope against m (16, 64, ...) at that n, per algorithm and f
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from filter_curve import ALG1, ALG3, DPSGD, clopper_pearson, t_ci  # noqa: E402
from study_slopes import fit_slope  # noqa: E402

RECORDS = os.path.join(HERE, "results", "filter_curve_records*.jsonl")
OUT = os.path.join(HERE, "results", "study", "filter_scale.json")
SEEDS = range(300, 310)
ALGS = (ALG3, DPSGD, ALG1)


def _read(pattern: str):
  """Every record of every file matching ``pattern``, in file order."""
  for path in sorted(glob.glob(pattern)):
    with open(path) as fh:
      for line in fh:
        if line.strip():
          yield json.loads(line)


def _kept(r: dict, seeds) -> bool:
  """A finished record of a FILTER-curve algorithm on ``seeds``."""
  return r["algorithm"] in ALGS and r.get("status", "ok") == "ok" and r["seed"] in seeds


def load(pattern: str = RECORDS, m: int = 64, mode: str = "huge", seeds=SEEDS,
         risk: str = "excess_risk") -> list[dict]:
  """One record per (algorithm, n, f, seed) on ``seeds``, the first one found that has the
  field ``risk`` (``excess_risk_f64``: only the records that carry the float64 value)."""
  out, seen = [], set()
  for r in _read(pattern):
    cfg = r.get("config", {})
    if (not _kept(r, seeds) or r["m"] != m or cfg.get("corruption_mode", "huge") != mode
        or r.get(risk) is None):
      continue
    key = (r["algorithm"], r["n_users"], cfg["corruption"], r["seed"])
    if key not in seen:
      seen.add(key)
      out.append({**r, "corruption": cfg["corruption"]})
  return out


def cells_looked(pattern: str = RECORDS, seeds=SEEDS) -> int:
  """How many FILTER-vs-DP-SGD cells the records hold on ``seeds``: distinct (mode, m, n, f,
  FILTER algorithm) with DP-SGD on at least two of the same seeds, whatever ``--m`` /
  ``--mode`` a table shows (every one of them was looked at before a headline was picked)."""
  seen: dict = {}
  for r in _read(pattern):
    if _kept(r, seeds):
      cfg = r.get("config", {})
      seen.setdefault((cfg.get("corruption_mode", "huge"), r["m"], r["n_users"],
                       cfg["corruption"], r["algorithm"]), set()).add(r["seed"])
  return sum(1 for (mode, m, n, f, alg), s in seen.items() if alg != DPSGD
             and len(s & seen.get((mode, m, n, f, DPSGD), set())) >= 2)


#: resamples of the Bonferroni-corrected interval (its tails hold 0.025 / K of them each)
CORRECTED_RESAMPLES = 20_000


def table(records: list[dict], looked: int = 1, risk: str = "excess_risk") -> dict:
  """Per (n, f): each algorithm's mean and interval, FILTER's halting and its paired ratio to
  DP-SGD (95%, and at ``1 - 0.05 / looked`` when more than one cell was looked at), of the
  record field ``risk``."""
  from dpsco_jax.runner.stats import paired_comparison
  cells: dict = {}
  for r in records:
    cells.setdefault((r["n_users"], r["corruption"]), {}).setdefault(
        r["algorithm"], {})[r["seed"]] = r
  rows = []
  for (n, f) in sorted(cells):
    c = cells[(n, f)]
    row: dict = {"n_users": n, "corruption": f}
    for alg in ALGS:
      if alg not in c:
        continue
      vals = [c[alg][s][risk] for s in sorted(c[alg])]
      mean, lo, hi = t_ci(vals)
      entry = {"seeds": len(vals), "mean": mean, "ci95_t": [lo, hi]}
      if alg != DPSGD:
        k = sum(c[alg][s].get("halted_phase") is not None for s in c[alg])
        entry.update(halted=k, halting_ci95=list(clopper_pearson(k, len(vals))))
        if DPSGD in c:
          pc = paired_comparison({s: r[risk] for s, r in c[alg].items()},
                                 {s: r[risk] for s, r in c[DPSGD].items()})
          entry.update(vs_dp_sgd=[pc["ratio"], pc["ratio_ci95_lo"], pc["ratio_ci95_hi"]],
                       wins=pc["wins"], paired=pc["paired_seeds"])
          if looked > 1:
            bc = paired_comparison({s: r[risk] for s, r in c[alg].items()},
                                   {s: r[risk] for s, r in c[DPSGD].items()},
                                   level=1 - 0.05 / looked, resamples=CORRECTED_RESAMPLES)
            entry["vs_dp_sgd_bonferroni"] = [bc["ratio_ci95_lo"], bc["ratio_ci95_hi"]]
      row[alg] = entry
    rows.append(row)
  slopes = {}
  for alg in ALGS:
    for f in sorted({f for (_, f) in cells}):
      # a cell where most runs halted releases the public fallback point: not the rate
      pts = {float(n): [r[risk] for r in cells[(n, f)][alg].values()]
             for (n, g) in cells if g == f and alg in cells[(n, f)]
             and len(cells[(n, f)][alg]) >= 2 and n >= 10_000
             and 2 * sum(r.get("halted_phase") is not None
                         for r in cells[(n, f)][alg].values()) <= len(cells[(n, f)][alg])}
      if len(pts) >= 2 and all(min(v) > 0 for v in pts.values()):
        s, lo, hi = fit_slope(pts)
        slopes[f"{alg} f={f:g}"] = {"slope": s, "ci95": [lo, hi], "n": sorted(pts)}
  return {"rows": rows, "slopes": slopes, "cells_looked": looked}


def _fmt(e: dict | None) -> str:
  if e is None:
    return "—"
  s = f"{e['mean']:.2e}"
  if "halted" in e:
    s += f" (halted {e['halted']}/{e['seeds']})"
  if "vs_dp_sgd" in e:
    r, lo, hi = e["vs_dp_sgd"]
    s += f"; ×{r:.3g} [{lo:.3g}, {hi:.3g}] {e['wins']}/{e['paired']}"
    if "vs_dp_sgd_bonferroni" in e:
      s += " (Bonferroni [{:.3g}, {:.3g}])".format(*e["vs_dp_sgd_bonferroni"])
  return s


def m_slopes(pattern: str, n: int, mode: str, seeds, ms=(16, 64, 256)) -> dict:
  """Slope of log mean excess risk against log m at ``n`` users, per (algorithm, f) with at
  least two m's of 10 seeds, and its bootstrap interval over seeds (``fit_slope``)."""
  points: dict = {}
  for m in ms:
    for r in load(pattern, m=m, mode=mode, seeds=seeds):
      if r["n_users"] == n:
        points.setdefault((r["algorithm"], r["corruption"]), {}).setdefault(m, []).append(
            r["excess_risk"])
  out = {}
  for (alg, f), by_m in sorted(points.items()):
    by_m = {m: v for m, v in by_m.items() if len(v) >= 10}
    if len(by_m) >= 2:
      s, lo, hi = fit_slope(by_m)
      out[f"{alg} f={f:g}"] = {"slope": s, "ci95": [lo, hi], "m": sorted(by_m)}
  return out


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser()
  ap.add_argument("--records", default=RECORDS, help="glob of the FILTER-curve record files")
  ap.add_argument("--out", default=None, help="write the selected records as runner JSON")
  ap.add_argument("--mode", default="huge", choices=("huge", "flip"),
                  help="the corruption: huge gradients or label flips")
  ap.add_argument("--m", type=int, default=64, help="items per user (16: the m = 16 cells)")
  ap.add_argument("--seeds", default="300-309",
                  help="first-last seeds (600-609: the fresh confirmation seeds)")
  ap.add_argument("--risk", default="excess_risk", choices=("excess_risk", "excess_risk_f64"),
                  help="the record field compared: the float32 excess risk (every record) or "
                       "the float64 one (records since 2026-11-27 only: below ~1e-6 the "
                       "float32 one is ulps of 6e-8)")
  ap.add_argument("--m-slope", type=int, default=None, metavar="N",
                  help="report the slope against m at N users instead of the table")
  args = ap.parse_args(argv)
  lo, hi = (int(v) for v in args.seeds.split("-"))
  if args.m_slope:
    out = m_slopes(args.records, args.m_slope, args.mode, range(lo, hi + 1))
    print(f"slope of mean excess risk against m at n = {args.m_slope:.0e} (theory: Thm 3.2 "
          "-0.5; Remark 3.6, strongly convex, -1)")
    for name, v in out.items():
      print(f"  {name:40s} {v['slope']:6.2f} [{v['ci95'][0]:6.2f}, {v['ci95'][1]:6.2f}]  "
            f"m = {', '.join(map(str, v['m']))}")
    print(json.dumps(out))
    return out
  records = load(args.records, m=args.m, mode=args.mode, seeds=range(lo, hi + 1),
                 risk=args.risk)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
      json.dump({"results": records}, fh, default=float)
  looked = cells_looked(args.records, range(lo, hi + 1))
  out = table(records, looked, risk=args.risk)
  print(f"Bonferroni intervals: level 1 - 0.05 / {looked} ({looked} FILTER-vs-DP-SGD cells on "
        f"seeds {args.seeds} in the records)")
  print("| n | f | Algorithm 3 (× DP-SGD, wins) | DP-SGD | Algorithm 1 (× DP-SGD, wins) |")
  print("|---|---|---|---|---|")
  for row in out["rows"]:
    print(f"| {row['n_users']:.0e} | {row['corruption']:g} | {_fmt(row.get(ALG3))} | "
          f"{_fmt(row.get(DPSGD))} | {_fmt(row.get(ALG1))} |")
  print("\nslope of mean excess risk against n (theory: -0.5 convex; -1 to -2 strongly convex)")
  for name, s in out["slopes"].items():
    flag = "" if -2.15 <= s["slope"] <= -0.35 else "   <- outside [-2, -0.5] by > 0.15"
    print(f"  {name:40s} {s['slope']:6.2f} [{s['ci95'][0]:6.2f}, {s['ci95'][1]:6.2f}]  "
          f"n = {', '.join(f'{v:.0e}' for v in s['n'])}{flag}")
  print(json.dumps(out, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))
  return out


if __name__ == "__main__":
  main()
