"""Issue 28: paper 000's ``theory`` preset (the paper's constants, certified sensitivity) where
its preconditions hold, on the FILTER curve's problem and evaluation seeds.

Which theory presets can run (data-free plans, ``--admissible``): Algorithm 1
(``user_level_phased_sgd``) from n ~ 3e5 at m = 64, d = 5, eps = 1, delta = 1e-6 (Theorem B.1's
``n^(1-q) >= 100 log(n/delta) / ((1-2^-q) eps)``); Algorithm 3 at no n this library reaches:
Theorem C.3's phase-1 batch K_1 exceeds the phase's n_1 users by a factor that shrinks only
logarithmically (the plan refuses with ``K_i <= n_i violated``).

Each run is the runner's (``runner.run_one``: the registered ``logistic_corrupted`` factory
with the runner's problem key for the seed), so the records pair seed by seed with
``filter_curve.py``'s and ``study_000_host_sgd.py``'s on the same data. One seed at a time;
a record is appended as soon as its run ends.

    python experiments/study_000_theory.py --admissible
    python experiments/study_000_theory.py --n 1e6 --corruption 0.05 --seeds 300-309 \\
        --records experiments/results/filter_curve_records_cpu_1e6_theory.jsonl
    python experiments/study_000_theory.py --quick      # n = 3e5, one seed (smoke, ~90 s)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dpsco_jax import runner  # noqa: E402


def admissible(ns=(1e5, 3e5, 1e6, 1e7, 1e8), m: int = 64, d: int = 5) -> list[dict]:
  """Whether each algorithm's theory plan exists at each n (the plan, not a run)."""
  from dpsco_jax.algorithms.user_level_filter.plan import (PublicSpec, plan_accelerated_erm,
                                                            plan_phased_sgd)
  out = []
  for n in ns:
    # the curve's problem: logistic, R = 4, features of norm <= 1 (L = 1, beta = 1/4)
    spec = PublicSpec(int(n), m, d, 1.0, 4.0, 0.25)
    for name, plan in (("user_level_phased_sgd", plan_phased_sgd),
                       ("user_level_accelerated_erm", plan_accelerated_erm)):
      try:
        plan(spec, {"epsilon": 1.0, "delta": 1e-6, "preset": "theory"})
        out.append({"n_users": int(n), "algorithm": name, "plan": "ok"})
      except ValueError as err:
        out.append({"n_users": int(n), "algorithm": name, "plan": f"refused: {err}"})
  return out


def run(n: int, fraction: float, seeds: list[int], records: str | None,
        algorithm: str = "user_level_phased_sgd", mode: str = "huge") -> list[dict]:
  algos, problems = runner.registry()
  out = []
  for seed in seeds:
    cfg = {"algorithm": algorithm, "problem": "logistic_corrupted", "n_users": n, "m": 64,
           "d": 5, "radius": 4.0, "corruption": fraction, "corruption_mode": mode,
           "epsilon": 1.0, "delta": 1e-6, "preset": "theory", "seed": seed}
    t0 = time.perf_counter()
    record = runner.run_one(cfg, algorithms=algos, problems=problems)
    record.update(status="ok", batched=False, study="000_theory")
    out.append(record)
    if records:
      with open(records, "a") as fh:
        fh.write(json.dumps(record, default=float) + "\n")
    print(f"seed {seed}: excess {record['excess_risk']:.4g}, halted "
          f"{record.get('halted_phase')}, {time.perf_counter() - t0:.0f} s", flush=True)
  return out


def _seeds(text: str) -> list[int]:
  lo, _, hi = text.partition("-")
  return list(range(int(lo), int(hi or lo) + 1))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--n", type=float, default=1e6)
  ap.add_argument("--corruption", type=float, default=0.05)
  ap.add_argument("--mode", default="huge", choices=("huge", "flip"))
  ap.add_argument("--seeds", default="300-309")
  ap.add_argument("--records")
  ap.add_argument("--admissible", action="store_true")
  ap.add_argument("--quick", action="store_true")
  args = ap.parse_args()
  if args.admissible:
    for row in admissible():
      print(json.dumps(row))
    return
  if args.quick:
    args.n, args.seeds = 3e5, "300"
  run(int(args.n), args.corruption, _seeds(args.seeds), args.records, mode=args.mode)


if __name__ == "__main__":
  main()
