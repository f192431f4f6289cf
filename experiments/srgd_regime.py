"""Paper 003's regime table (issue 17 item 4): reads the runner's JSON outputs of
experiments/configs_eval/srgd_regime_{iso,ill}.yaml and prints, per (problem, n, eps), each
algorithm's mean excess risk with its Student-t 95% interval and three paired ratios of means
(percentile bootstrap 95% interval over the paired seeds, 2000 joint resamples, generator seed
0: the runner's ``compare:`` statistic, dpsco_jax.runner.stats.paired_comparison) with win
rates: accelerated / single-epoch DP-SGD, unaccelerated / single-epoch DP-SGD, accelerated /
unaccelerated. Writes experiments/results/srgd_regime.json (the table) and prints markdown.

    python experiments/srgd_regime.py
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dpsco_jax.runner.stats import paired_comparison, per_seed, t_interval  # noqa: E402

ACC, UNACC, SGD = "accelerated_dp_srgd", "dp_srgd_unaccelerated", "single_epoch_dp_sgd"
FILES = {"least_squares": "srgd_regime_iso.json",
         "ill_conditioned_least_squares": "srgd_regime_ill.json"}


def main() -> list[dict]:
  table = []
  for problem, fname in FILES.items():
    with open(os.path.join(HERE, "results", fname)) as fh:
      records = [r for r in json.load(fh)["results"] if r.get("status", "ok") == "ok"]
    cells = sorted({(r["n_users"], r["target_epsilon"]) for r in records})
    for n, eps in cells:
      by = {a: [r for r in records if r["algorithm"] == a and r["n_users"] == n
                and r["target_epsilon"] == eps] for a in (ACC, UNACC, SGD)}
      row = {"problem": problem, "n": n, "epsilon": eps}
      for a, rs in by.items():
        x = [r["excess_risk"] for r in rs]
        lo, hi = t_interval(x)
        row[a] = {"seeds": len(x), "mean": sum(x) / len(x), "ci95_t": [lo, hi]}
      for name, (a, b) in {"acc/sgd": (ACC, SGD), "unacc/sgd": (UNACC, SGD),
                           "acc/unacc": (ACC, UNACC)}.items():
        row[name] = paired_comparison(per_seed(by[a], "excess_risk"),
                                      per_seed(by[b], "excess_risk"), resamples=2000, seed=0)
      table.append(row)
  with open(os.path.join(HERE, "results", "srgd_regime.json"), "w") as fh:
    json.dump({"source": list(FILES.values()),
               "ratio": "mean(row)/mean(other) over paired seeds; percentile bootstrap 95%, "
                        "2000 joint resamples, seed 0; wins = seeds where row is lower",
               "table": table}, fh, indent=1)
  fmt = lambda v: f"{v:.2e}"  # noqa: E731
  print("| problem | n | ε | accelerated | unaccelerated | single-epoch DP-SGD | acc/SGD [boot95] wins "
        "| unacc/SGD [boot95] wins | acc/unacc [boot95] wins |")
  print("|---|---|---|---|---|---|---|---|---|")
  for row in table:
    cells = [f"{fmt(row[a]['mean'])} [{fmt(row[a]['ci95_t'][0])}, {fmt(row[a]['ci95_t'][1])}]"
             for a in (ACC, UNACC, SGD)]
    ratios = [f"{row[k]['ratio']:.2f} [{row[k]['ratio_ci95_lo']:.2f}, "
              f"{row[k]['ratio_ci95_hi']:.2f}] {row[k]['wins']}/{row[k]['paired_seeds']}"
              for k in ("acc/sgd", "unacc/sgd", "acc/unacc")]
    prob = "isotropic" if row["problem"] == "least_squares" else "ill-cond."
    print(f"| {prob} | {row['n']:.0e} | {row['epsilon']} | " + " | ".join(cells + ratios) + " |")
  return table


if __name__ == "__main__":
  main()
