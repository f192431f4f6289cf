"""A 10-seed sweep batched (one vmapped program per row) vs one by one (issue 24, part 4).

For each config, the runner runs every row on ``--seeds`` seeds twice: with ``batch_seeds:
true`` (the default: the seeds of a row run as one program, :mod:`dpsco_jax.sweep`) and with
``batch_seeds: false`` (one run per seed, as before). ``cold`` is the first pass of each mode
in a fresh process per mode (compiles, noise calibrations and problem caches included; nothing
carried over from the other mode), ``warm`` a second pass in that process (compiled programs
and cached calibrations reused). Also checked: the two modes' records agree (``excess_risk``
to ``max_abs_risk_diff``, ``epsilon`` and every other field exactly).

Configs: ``configs/quickstart.yaml`` as written (4 rows: nonprivate SGD, user-level DP-SGD at
three epsilons) and ``configs/srgd.yaml`` at one of its sizes and epsilons
(``--srgd-n`` users, epsilon 1; its 7 rows), each on seeds ``0 .. seeds-1``.

Where the time goes on CPU: a one-by-one private run calibrates its noise multiplier (a
bisection on the PLD accountant, seconds) and dispatches its program; a batch calibrates once
per row and dispatches once. On an accelerator the per-seed launch is the bottleneck the
issue names; this script has not been run on one.

Usage: ``python experiments/bench_sweep.py [--seeds 10] [--srgd-n 10000] [--no-warm]
[--only quickstart|srgd]``. The last line of output is the JSON summary.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from dpsco_jax import runner  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("wall_time_s", "batched", "batch_runs", "batch_wall_time_s", "batch_note")


def _configs(args) -> dict[str, dict]:
  out = {}
  if args.only in (None, "quickstart"):
    q = runner.load_config(os.path.join(ROOT, "configs", "quickstart.yaml"))
    q.pop("compare", None)
    q["seed"] = list(range(args.seeds))
    out["quickstart"] = q
  if args.only in (None, "srgd"):
    s = runner.load_config(os.path.join(ROOT, "configs", "srgd.yaml"))
    s.update(n_users=args.srgd_n, epsilon=1.0, seed=list(range(args.seeds)))
    out[f"srgd (n={args.srgd_n}, eps=1)"] = s
  return out


def _timed(cfg: dict, batch: bool) -> tuple[float, list[dict]]:
  start = time.perf_counter()
  records = runner.run_config({**copy.deepcopy(cfg), "batch_seeds": batch}, progress=False)
  return time.perf_counter() - start, records


def _agreement(batched: list[dict], alone: list[dict]) -> tuple[float, bool]:
  """(largest |excess_risk| difference, every other field identical)."""
  worst, same = 0.0, len(batched) == len(alone)
  for b, a in zip(batched, alone):
    if b.get("status") != "ok" or a.get("status") != "ok":
      same = same and b.get("status") == a.get("status")
      continue
    worst = max(worst, abs(b["excess_risk"] - a["excess_risk"]))
    rest = [{k: v for k, v in r.items() if k not in TIMING + ("excess_risk",)} for r in (b, a)]
    same = same and rest[0] == rest[1]
  return worst, same


def worker(name: str, batch: bool, warm: bool, args) -> dict:
  """One mode in a fresh process: a cold pass (compiles, calibrations and caches of this mode
  only) and a warm pass."""
  cfg = _configs(args)[name]
  cold, records = _timed(cfg, batch)
  out = {"cold_s": cold, "records": records}
  if warm:
    out["warm_s"] = _timed(cfg, batch)[0]
  return out


def _spawn(name: str, batch: bool, args) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", name,
         "--mode", "batched" if batch else "alone", "--seeds", str(args.seeds),
         "--srgd-n", str(args.srgd_n)] + (["--no-warm"] if args.no_warm else [])
  out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def bench(name: str, cfg: dict, args) -> dict:
  b, a = _spawn(name, True, args), _spawn(name, False, args)
  rec_b, rec_a = b["records"], a["records"]
  worst, same = _agreement(rec_b, rec_a)
  row = {"config": name, "seeds": len(cfg["seed"]), "runs": len(rec_b),
         "rows": len(rec_b) // len(cfg["seed"]),
         "batched_runs": sum(bool(r.get("batched")) for r in rec_b),
         "failed": sum(r.get("status") != "ok" for r in rec_b + rec_a),
         "cold_batched_s": b["cold_s"], "cold_one_by_one_s": a["cold_s"],
         "cold_speedup": a["cold_s"] / b["cold_s"], "max_abs_risk_diff": worst,
         "records_identical_but_risk": same}
  if "warm_s" in b:
    row.update(warm_batched_s=b["warm_s"], warm_one_by_one_s=a["warm_s"],
               warm_speedup=a["warm_s"] / b["warm_s"])
  return row


def _lines(rows: list[dict]) -> list[str]:
  head = (f"{'config':28s} {'runs':>5s} {'cold batched':>13s} {'cold 1-by-1':>12s} "
          f"{'x':>6s} {'warm batched':>13s} {'warm 1-by-1':>12s} {'x':>6s} {'max|dRisk|':>10s}")
  out = [head, "-" * len(head)]
  for r in rows:
    warm = (f"{r['warm_batched_s']:12.1f}s {r['warm_one_by_one_s']:11.1f}s "
            f"{r['warm_speedup']:5.2f}x" if "warm_speedup" in r else f"{'':13s} {'':12s} {'':6s}")
    out.append(f"{r['config']:28s} {r['runs']:5d} {r['cold_batched_s']:12.1f}s "
               f"{r['cold_one_by_one_s']:11.1f}s {r['cold_speedup']:5.2f}x {warm} "
               f"{r['max_abs_risk_diff']:10.1e}")
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seeds", type=int, default=10)
  ap.add_argument("--srgd-n", type=int, default=10000)
  ap.add_argument("--no-warm", action="store_true")
  ap.add_argument("--only", choices=("quickstart", "srgd"))
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--mode", choices=("batched", "alone"), help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    print(json.dumps(worker(args.worker, args.mode == "batched", not args.no_warm, args)))
    return
  rows = [bench(name, cfg, args) for name, cfg in _configs(args).items()]
  print("\n".join(_lines(rows)))
  device = jax.devices()[0]
  print(json.dumps({"bench": "sweep", "device": f"{device.platform}:{device.device_kind}",
                    "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
                    "rows": rows}))


if __name__ == "__main__":
  main()
