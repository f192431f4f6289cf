"""Paired ratios between algorithms of a runner JSON, cell by cell (the study's tables).

For each cell (the values of ``--by``), each pair ``A:B`` gives mean(A)/mean(B) of the metric
over the evaluation seeds both ran, with the runner's percentile bootstrap 95% interval
(:func:`dpsco_jax.runner.stats.paired_comparison`: 2000 joint resamples, seed 0) and A's wins.
Used where the runner's ``compare:`` cannot pair rows (e.g. rows whose tuned step parameters or
clip norms differ). Last line JSON.

    python experiments/study_pairs.py experiments/results/study/srgd_scale.json \
        --by problem,n_users,target_epsilon \
        --pairs accelerated_dp_srgd:single_epoch_dp_sgd,accelerated_dp_srgd:dp_srgd_unaccelerated
"""

from __future__ import annotations

import argparse
import collections
import json

from dpsco_jax.runner.stats import paired_comparison


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("results")
  ap.add_argument("--by", required=True, help="comma-separated cell fields")
  ap.add_argument("--pairs", required=True, help="comma-separated A:B algorithm pairs")
  ap.add_argument("--metric", default="excess_risk")
  args = ap.parse_args()
  by = args.by.split(",")
  data = json.load(open(args.results))
  recs = [r for r in (data["results"] if isinstance(data, dict) else data)
          if r.get("status", "ok") == "ok" and r.get("phase", "eval") == "eval"]
  cells: dict[tuple, dict[str, dict[int, float]]] = collections.defaultdict(
      lambda: collections.defaultdict(dict))
  for r in recs:
    cells[tuple(r.get(k) for k in by)][r["algorithm"]][r["seed"]] = float(r[args.metric])
  out = {}
  for cell in sorted(cells, key=str):
    algos = cells[cell]
    label = ", ".join(f"{k}={v}" for k, v in zip(by, cell))
    parts = []
    for pair in args.pairs.split(","):
      a, b = pair.split(":")
      if a not in algos or b not in algos:
        continue
      c = paired_comparison(algos[a], algos[b])
      out[f"{label} | {a}/{b}"] = c
      parts.append(f"{a}/{b} {c['ratio']:.2f} [{c['ratio_ci95_lo']:.2f}, "
                   f"{c['ratio_ci95_hi']:.2f}] {c['wins']}/{c['paired_seeds']}")
    print(f"{label}: " + " | ".join(parts))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
