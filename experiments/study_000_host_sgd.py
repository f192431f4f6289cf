"""Issue 28: user-level DP-SGD at n = 1e6 on a CPU, for paper 000's FILTER-vs-DP-SGD cells.

Why a script of its own. The runner's DP-SGD draws its Poisson batch on the device from one
``[n]`` Bernoulli draw per step (``algorithms/common.sample_users``: user i's coin is the i-th
uniform, the property its neighbour tests rest on). That is O(n) per step: 30 ms a step at
n = 1e6 on one core of this box (2.7 ms at 1e5), and the curve's schedule (batch 200, 20 epochs)
has 1e5 steps at 1e6, about 50 min a seed. ``dp.fit(..., data_placement="host")`` samples the
same law on the host in O(q n) per step (``data.sampling.PoissonSampler``) and moves only the
sampled users' rows: same plan, same calibrated noise, same guarantee (the run checks that its
report equals the plan's), other users drawn than by the device sampler.

Each seed's problem is the runner's: the registered ``logistic_corrupted`` factory with the
runner's problem key for that seed (``runner.batch.run_keys``), so Algorithm 3's records from
``filter_curve.py`` and these pair seed by seed on the same data. The config is the curve's
(``experiments/configs_eval/filter_curve_1e6*.yaml``: epsilon 1, delta 1e-6, Poisson, batch
200, 20 epochs, clip 1, learning rate 1, the declared n_users). Records are appended in
``filter_curve.py``'s format, with ``"sampling_path": "host"``.

    python experiments/study_000_host_sgd.py --config experiments/configs_eval/filter_curve_1e6.yaml \\
        --corruption 0.05 --records experiments/results/filter_curve_records_cpu_1e6.jsonl
    python experiments/study_000_host_sgd.py --quick     # n = 2000, 2 seeds (smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import dpsco_jax as dp  # noqa: E402
from dpsco_jax.data.user_data import UserData  # noqa: E402
from dpsco_jax.problems.user_level import logistic_corrupted  # noqa: E402
from dpsco_jax.runner.batch import run_keys  # noqa: E402

ALG = "dp_sgd_user"
PROBLEM_KEYS = ("problem", "n_users", "m", "d", "radius", "corruption_mode")


def user_data(problem) -> UserData:
  """The problem's users as a UserData table (every user has all m items: weights 1)."""
  x, y = np.asarray(problem.data["x"]), np.asarray(problem.data["y"])
  n, m = y.shape
  return UserData.from_arrays({"x": x.reshape(n * m, -1), "y": y.reshape(-1)},
                              np.repeat(np.arange(n), m))


def run_seed(config: dict, row: dict, corruption: float, seed: int) -> dict:
  pcfg = {k: config[k] for k in PROBLEM_KEYS if k in config}
  pcfg.update(corruption=corruption, seed=seed, m=config["m"][0] if isinstance(
      config["m"], list) else config["m"])
  problem_key, driver_key = run_keys(seed)
  problem = logistic_corrupted(pcfg, problem_key)
  acfg = {k: v for k, v in row.items() if k not in ("algorithm", "seed")}
  acfg["n_users"] = pcfg["n_users"]
  start = time.perf_counter()
  res = dp.fit(ALG, acfg, problem.loss_fn, problem.init_params(), user_data(problem),
               driver_key, constants={"lipschitz": problem.lipschitz,
                                      "smoothness": problem.smoothness,
                                      "radius": problem.radius},
               data_placement="host")
  params = jax.block_until_ready(res.params)
  wall = time.perf_counter() - start
  return {"algorithm": ALG, "problem": pcfg["problem"], "n_users": pcfg["n_users"],
          "m": pcfg["m"], "d": pcfg["d"], "epsilon": float(res.privacy.epsilon),
          "target_epsilon": row["epsilon"], "delta": float(res.privacy.delta),
          "provenance": res.privacy.provenance, "relation": res.privacy.relation,
          "excess_risk": float(problem.excess_risk(params)),
          "excess_risk_f64": problem.excess_risk_f64(params), "seed": seed,
          "wall_time_s": wall, "sampling_path": "host",
          **{k: v for k, v in res.record.items() if isinstance(v, (int, float, str))},
          "config": {"corruption_mode": pcfg["corruption_mode"], "corruption": corruption,
                     "epochs": row.get("epochs")},
          "status": "ok"}


def _cell(config: dict, corruption: float) -> tuple:
  """The cell a run of ``config`` at ``corruption`` fills: its problem (every size, the
  corruption). Records of another m or d at the same n are another cell (a resume that keyed
  on n alone skipped them: 2026-11-28)."""
  m = config["m"][0] if isinstance(config["m"], list) else config["m"]
  return (config["problem"], int(config["n_users"]), int(m), int(config["d"]),
          config.get("corruption_mode", "huge"), float(corruption))


def _record_cell(r: dict) -> tuple:
  return (r["problem"], int(r["n_users"]), int(r["m"]), int(r["d"]),
          r["config"].get("corruption_mode"), float(r["config"].get("corruption")))


def main(argv: list[str] | None = None) -> list[dict]:
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default=os.path.join(HERE, "configs_eval", "filter_curve_1e6.yaml"))
  ap.add_argument("--corruption", type=float, default=0.05)
  ap.add_argument("--records", default=None, help="append the records here (JSON lines)")
  ap.add_argument("--max-seeds", type=int, default=10)
  ap.add_argument("--quick", action="store_true", help="n = 2000, 2 seeds, 2 epochs")
  args = ap.parse_args(argv)
  with open(args.config) as fh:
    config = yaml.safe_load(fh)
  row = dict(next(r for r in config["experiments"] if r["algorithm"] == ALG))
  seeds = list(row["seed"])[:args.max_seeds]
  if args.quick:
    config.update(n_users=2000)
    row.update(epochs=2)
    seeds = seeds[:2]
  if args.records and os.path.exists(args.records):   # resume: a seed already there is done
    cell = _cell(config, args.corruption)
    with open(args.records) as fh:
      done = {r["seed"] for r in map(json.loads, filter(str.strip, fh))
              if r["algorithm"] == ALG and _record_cell(r) == cell}
    seeds = [s for s in seeds if s not in done]
  out = []
  for seed in seeds:
    rec = run_seed(config, row, args.corruption, seed)
    out.append(rec)
    print(f"seed {seed}: excess risk {rec['excess_risk']:.4g}, {rec['wall_time_s']:.0f} s, "
          f"epsilon {rec['epsilon']:.6g}", flush=True)
    if args.records:
      with open(args.records, "a") as fh:
        fh.write(json.dumps(rec, default=float) + "\n")
  return out


if __name__ == "__main__":
  main()
