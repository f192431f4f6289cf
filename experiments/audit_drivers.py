"""Larger driver-level audits (``dpsco_jax.audit.drivers``): every driver end to end through its
audit hook, with a canary user, against the epsilon it reports; and each broken twin.

Usage: ``python experiments/audit_drivers.py [--scale 4] [--seed 0] [--driver NAME ...]``.
Trials per side: ``scale`` times each driver's CI count (``drivers.TRIALS``: 1e5, 4e5 for
fixed-size sampling). Prints the table (mechanism, relation, claimed epsilon, 95%-confidence
empirical lower bound at delta = 1e-5, each broken twin's claim and bound, the GDP-fit bound
for Gaussian claims) and, as the last line, one JSON object with every number.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dpsco_jax.audit import drivers  # noqa: E402
from dpsco_jax.audit.table import audit_table, print_report  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--scale", type=int, default=4, help="trials = scale x drivers.TRIALS")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--driver", action="append", choices=tuple(drivers.DRIVERS))
  args = ap.parse_args()
  if args.scale < 1:
    ap.error("--scale must be >= 1")
  t0 = time.perf_counter()
  rows = []
  for name in args.driver or drivers.DRIVERS:
    rows += audit_table(args.scale * drivers.TRIALS[name], args.seed, (name,),
                        include="drivers")
  print_report(f"driver audits: trials per side = {args.scale} x drivers.TRIALS; confidence "
               f"0.95; delta {drivers.DELTA:g}", rows,
               {"scale": args.scale, "seed": args.seed,
                "seconds": round(time.perf_counter() - t0, 1)})

if __name__ == "__main__":
  main()
