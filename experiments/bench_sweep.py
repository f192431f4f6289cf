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

Step-size grids (``... x3 lr``): the same two configs with every row's step size on a grid of
three (``--lr-factors``, default 1/4, 1/2, 1 times the config's value; SRGD rows: their
``learning_rate``, ``beta`` or ``beta_scale``, whichever the row sets), so ``seeds x 3`` runs
per row. Three modes: ``batched`` (the default runner: each row's seeds x step sizes are one
vmapped program, :func:`dpsco_jax.sweep.run_stacked` with a grid), ``one by one``
(``batch_seeds: false``), and ``seeds only`` (the config split into one config per step size,
each with its seeds batched: one program per row and step size, the runner before step-size
grids).

Where the time goes on CPU: a one-by-one private run calibrates its noise multiplier (a
bisection on the PLD accountant, seconds) and dispatches its program; a batch calibrates once
per row and dispatches once. On an accelerator the per-seed launch is the bottleneck the
issue names; this script has not been run on one.

Usage: ``python experiments/bench_sweep.py [--seeds 10] [--srgd-n 10000] [--no-warm]
[--only quickstart|srgd|quickstart-grid|srgd-grid] [--no-grid]``. The last line of output is
the JSON summary.
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
TIMING = ("wall_time_s", "batched", "batch_runs", "batch_wall_time_s", "batch_note",
          "batch_grid")
#: the step-size key of a row, in the order they are looked for
STEP_KEYS = ("learning_rate", "beta", "beta_scale")


def _base_configs(args) -> dict[str, dict]:
  out = {}
  q = runner.load_config(os.path.join(ROOT, "configs", "quickstart.yaml"))
  q.pop("compare", None)
  q["seed"] = list(range(args.seeds))
  out["quickstart"] = q
  s = runner.load_config(os.path.join(ROOT, "configs", "srgd.yaml"))
  s.update(n_users=args.srgd_n, epsilon=1.0, seed=list(range(args.seeds)))
  out["srgd"] = s
  return out


def _step_key(entry: dict) -> tuple[dict, str]:
  """The section of an experiments entry that holds its step size, and the key."""
  section = entry["algorithm"] if isinstance(entry.get("algorithm"), dict) else entry
  for key in STEP_KEYS:
    if key in section:
      return section, key
  raise ValueError(f"no step size in {entry}")


def _with_steps(cfg: dict, factors: list[float]) -> dict:
  """``cfg`` with every row's step size replaced by its value times ``factors`` (a list: the
  runner expands it)."""
  cfg = copy.deepcopy(cfg)
  for entry in cfg["experiments"]:
    section, key = _step_key(entry)
    value = section[key]
    section[key] = [float(value) * f for f in factors] if len(factors) > 1 else (
        float(value) * factors[0])
  return cfg


def _configs(args) -> dict[str, dict]:
  """``{name: config}``: the configs of ``--only`` (the plain ones and the x3 grids)."""
  base = _base_configs(args)
  names = {"quickstart": "quickstart", f"srgd (n={args.srgd_n}, eps=1)": "srgd"}
  out = {}
  for name, which in names.items():
    if args.only in (None, which):
      out[name] = base[which]
    if not args.no_grid and args.only in (None, f"{which}-grid"):
      out[f"{name} x{len(args.lr_factors)} lr"] = _with_steps(base[which], args.lr_factors)
  return out


def _split(cfg: dict, factors: list[float]) -> list[dict]:
  """A grid config as one config per step size (each: its seeds batched, as before grids)."""
  cfg = copy.deepcopy(cfg)
  out = []
  for i in range(len(factors)):
    one = copy.deepcopy(cfg)
    for entry in one["experiments"]:
      section, key = _step_key(entry)
      section[key] = section[key][i]
    out.append(one)
  return out


def _timed(cfg: dict, batch: bool | str, factors: list[float] | None = None
           ) -> tuple[float, list[dict]]:
  """Seconds and records of ``cfg`` run batched (``True``), one by one (``False``) or, for a
  grid config, ``"seeds"``: one config per step size, seeds batched."""
  start = time.perf_counter()
  if batch == "seeds":
    records = []
    for one in _split(cfg, factors):
      records += runner.run_config({**one, "batch_seeds": True}, progress=False)
  else:
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


def worker(name: str, mode: str, warm: bool, args) -> dict:
  """One mode in a fresh process: a cold pass (compiles, calibrations and caches of this mode
  only) and a warm pass."""
  cfg = _configs(args)[name]
  batch = {"batched": True, "alone": False, "seeds": "seeds"}[mode]
  cold, records = _timed(cfg, batch, args.lr_factors)
  out = {"cold_s": cold, "records": records}
  if warm:
    out["warm_s"] = _timed(cfg, batch, args.lr_factors)[0]
  return out


def _spawn(name: str, mode: str, args) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--mode", mode,
         "--seeds", str(args.seeds), "--srgd-n", str(args.srgd_n),
         "--lr-factors", *map(str, args.lr_factors)] + (["--no-warm"] if args.no_warm else [])
  out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def bench(name: str, cfg: dict, args) -> dict:
  b, a = _spawn(name, "batched", args), _spawn(name, "alone", args)
  rec_b, rec_a = b["records"], a["records"]
  worst, same = _agreement(rec_b, rec_a)
  grid = " lr" in name
  row = {"config": name, "seeds": len(cfg["seed"]), "runs": len(rec_b),
         "rows": len(rec_b) // (len(cfg["seed"]) * (len(args.lr_factors) if grid else 1)),
         "batched_runs": sum(bool(r.get("batched")) for r in rec_b),
         "programs": len({(r.get("batch_wall_time_s"), r.get("algorithm")) for r in rec_b
                          if r.get("batched")}),
         "failed": sum(r.get("status") != "ok" for r in rec_b + rec_a),
         "cold_batched_s": b["cold_s"], "cold_one_by_one_s": a["cold_s"],
         "cold_speedup": a["cold_s"] / b["cold_s"], "max_abs_risk_diff": worst,
         "records_identical_but_risk": same}
  if "warm_s" in b:
    row.update(warm_batched_s=b["warm_s"], warm_one_by_one_s=a["warm_s"],
               warm_speedup=a["warm_s"] / b["warm_s"])
  if grid:   # the runner before step-size grids: one program per row and step size
    s = _spawn(name, "seeds", args)
    row.update(cold_seeds_only_s=s["cold_s"], cold_speedup_vs_seeds_only=s["cold_s"] / b["cold_s"])
    if "warm_s" in s:
      row.update(warm_seeds_only_s=s["warm_s"],
                 warm_speedup_vs_seeds_only=s["warm_s"] / b["warm_s"])
  return row


def _lines(rows: list[dict]) -> list[str]:
  head = (f"{'config':34s} {'runs':>5s} {'cold batched':>13s} {'cold 1-by-1':>12s} "
          f"{'x':>6s} {'warm batched':>13s} {'warm 1-by-1':>12s} {'x':>6s} {'max|dRisk|':>10s}"
          f" {'seeds only (cold / warm)':>25s}")
  out = [head, "-" * len(head)]
  for r in rows:
    warm = (f"{r['warm_batched_s']:12.1f}s {r['warm_one_by_one_s']:11.1f}s "
            f"{r['warm_speedup']:5.2f}x" if "warm_speedup" in r else f"{'':13s} {'':12s} {'':6s}")
    seeds = ""
    if "cold_seeds_only_s" in r:
      seeds = f"{r['cold_seeds_only_s']:.1f}s"
      if "warm_seeds_only_s" in r:
        seeds += f" / {r['warm_seeds_only_s']:.1f}s"
    out.append(f"{r['config']:34s} {r['runs']:5d} {r['cold_batched_s']:12.1f}s "
               f"{r['cold_one_by_one_s']:11.1f}s {r['cold_speedup']:5.2f}x {warm} "
               f"{r['max_abs_risk_diff']:10.1e} {seeds:>25s}")
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seeds", type=int, default=10)
  ap.add_argument("--srgd-n", type=int, default=10000)
  ap.add_argument("--no-warm", action="store_true")
  ap.add_argument("--only", choices=("quickstart", "srgd", "quickstart-grid", "srgd-grid"))
  ap.add_argument("--no-grid", action="store_true", help="skip the step-size grid configs")
  ap.add_argument("--lr-factors", type=float, nargs="+", default=[0.25, 0.5, 1.0],
                  help="the step-size grid: factors of each row's configured step size")
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--mode", choices=("batched", "alone", "seeds"), help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    print(json.dumps(worker(args.worker, args.mode, not args.no_warm, args)))
    return
  rows = [bench(name, cfg, args) for name, cfg in _configs(args).items()]
  print("\n".join(_lines(rows)))
  device = jax.devices()[0]
  print(json.dumps({"bench": "sweep", "device": f"{device.platform}:{device.device_kind}",
                    "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
                    "rows": rows}))


if __name__ == "__main__":
  main()
