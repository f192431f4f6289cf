"""Study 004 on the interior-optimum ridge task (issue 28): tables of the eval-seed runs of
``configs/study/bilevel_interior*.yaml``.

Per (n, epsilon): the selected hyper-parameters, the validation-loss gap ``F(x_out) - F*`` (mean,
Student-t 95% interval, median), where the runs end (interior vs within 1% of the box's width
of an edge, and ``|omega - omega*|``), and the paired ratio of the private gap to the gap of a
fixed default penalty (the start ``omega0 = 1`` and the box midpoint 2.5), bootstrap 95%
interval over the evaluation seeds and its Bonferroni correction for the number of
(cell, default) pairs in the table. The defaults' gaps and ``omega*`` come from the problems
rebuilt with the runs' keys (non-private evaluation oracles; nothing here is released).

Run: ``.venv/bin/python experiments/study_004_interior.py`` (reads
experiments/results/study/bilevel_interior{,_1e5,_ref}.json).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the repo's package

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dpsco_jax.problems.ridge_tuning import ridge_tuning  # noqa: E402
from dpsco_jax.runner.stats import paired_comparison, t_interval  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "study"
FILES = ("bilevel_interior.json", "bilevel_interior_1e5.json", "bilevel_interior_ref.json",
         "bilevel_interior_lam.json")   # the last: lam grid extension at n = 1e4
DEFAULTS = (1.0, 2.5)
PROBLEM_KEYS = ("dataset", "d", "n_train", "n_val", "label_noise", "input_noise",
                "omega_bounds", "omega0")


def _problem(rec: dict):
  cfg = {k: v for k, v in rec.get("config", {}).items() if k in PROBLEM_KEYS}
  return ridge_tuning(cfg, jax.random.fold_in(jax.random.key(int(rec["seed"])), 0))


def _fmt(x: float) -> str:
  return f"{x:.2g}" if abs(x) < 1e-2 else f"{x:.3f}"


def main() -> None:
  records = []
  for name in FILES:
    path = RESULTS / name
    if path.exists():
      records += [dict(r, _source=path.stem.replace("bilevel_interior", "") or "main")
                  for r in json.loads(path.read_text())["results"]
                  if r.get("phase", "eval") == "eval" and r.get("status") == "ok"]
  cells: dict[tuple, list[dict]] = {}
  for r in records:
    eps = r.get("target_epsilon")
    alg = r["algorithm"] + ("" if r["_source"] in ("main", "_1e5", "_ref") else r["_source"])
    cells.setdefault((r["config"]["n_train"], alg,
                      "inf" if eps is None or eps == float("inf") else eps), []).append(r)
  looks = len(DEFAULTS) * sum(alg.startswith("dp_bilevel") for _, alg, _ in cells)
  defaults: dict[int, dict[int, dict]] = {}   # n -> seed -> {omega*, gap at each default}
  print("| n | method | eps | lam, eta | gap mean [95% CI] | median | end: low / in / high | "
        "mean abs(omega - omega*) | ratio to omega=1 [boot95] (Bonferroni), wins | "
        "ratio to omega=2.5 |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for (n, alg, eps), rows in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                   str(kv[0][2]))):
    per = defaults.setdefault(n, {})
    gaps, dists, low, high = {}, [], 0, 0
    for r in rows:
      s = int(r["seed"])
      if s not in per:
        p = _problem(r)
        per[s] = {"omega_star": p.meta["omega_star"], "bounds": p.meta["omega_bounds"],
                  **{om: p.excess_risk(np.array([om])) for om in DEFAULTS}}
      lo, hi = per[s]["bounds"]
      x = float(np.asarray(r["x_out"] if "x_out" in r else r.get("params", [np.nan]))
                .reshape(-1)[0]) if ("x_out" in r or "params" in r) else np.nan
      gaps[s] = r["excess_risk"]
      if np.isfinite(x):
        dists.append(abs(x - per[s]["omega_star"]))
        low += int(x <= lo + 0.01 * (hi - lo))
        high += int(x >= hi - 0.01 * (hi - lo))
    vals = list(gaps.values())
    lo_ci, hi_ci = t_interval(vals)
    hp = f"{rows[0].get('lam')}, {rows[0].get('learning_rate')}" if alg.startswith("dp") else "-"
    cmp = []
    for om in DEFAULTS:
      base = {s: per[s][om] for s in gaps}
      c = paired_comparison(gaps, base)
      # Bonferroni over every private cell x default looked at (the headline is picked
      # from them): the same bootstrap at level 1 - 0.05 / looks
      cb = paired_comparison(gaps, base, level=1 - 0.05 / looks, resamples=40000)
      cmp.append(f"{_fmt(c['ratio'])} [{_fmt(c['ratio_ci95_lo'])}, {_fmt(c['ratio_ci95_hi'])}]"
                 f" (Bonf. [{_fmt(cb['ratio_ci95_lo'])}, {_fmt(cb['ratio_ci95_hi'])}])"
                 f", {c['wins']}/{c['paired_seeds']}")
    where = f"{low} / {len(dists) - low - high} / {high}" if dists else "-"
    print(f"| {n:.0e} | {alg} | {eps} | {hp} | {_fmt(statistics.fmean(vals))} "
          f"[{_fmt(lo_ci)}, {_fmt(hi_ci)}] | {_fmt(statistics.median(vals))} | {where} | "
          f"{_fmt(statistics.fmean(dists)) if dists else '-'} | {cmp[0]} | {cmp[1]} |")
  print()
  print("| n | omega* range (eval seeds) | gap of omega=1: mean [95% CI] | gap of omega=2.5 |")
  print("|---|---|---|---|")
  for n, per in sorted(defaults.items()):
    om = [v["omega_star"] for v in per.values()]
    row = [f"{n:.0e}", f"[{min(om):.3f}, {max(om):.3f}]"]
    for d in DEFAULTS:
      g = [v[d] for v in per.values()]
      a, b = t_interval(g)
      row.append(f"{_fmt(statistics.fmean(g))} [{_fmt(a)}, {_fmt(b)}]")
    print("| " + " | ".join(row) + " |")
  for path in (RESULTS / f for f in FILES if "ref" not in f):
    sel = json.loads(path.read_text()).get("selection") if path.exists() else None
    for g in (sel or {}).get("groups", []):   # the tuning-seed choice per (n, epsilon)
      means = ", ".join(f"{c['lam']:g}/{c['learning_rate']:g}: {_fmt(c['mean'])}"
                        for c in g["candidates"])
      print(f"selected ({path.name}) eps={g['epsilon']}, n_train={g.get('n_train', 'all')}: "
            f"{g['selected']} "
            f"(tuning means lam/eta: {means})")

if __name__ == "__main__":
  main()
