"""Larger audit of every stage-level mechanism and its broken twins (``dpsco_jax.audit``).

Usage: ``python experiments/audit_mechanisms.py [--trials 200000] [--seed 0]``. Prints the
table (claimed epsilon, 95%-confidence empirical lower bound at delta = 1e-5 for the honest
stage and for each broken twin, GDP-fit bound beside it) and, as the last line, one JSON
object with every number.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dpsco_jax.audit.table import audit_table, print_report  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--trials", type=int, default=200_000)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  t0 = time.perf_counter()
  rows = audit_table(args.trials, args.seed)
  print_report(f"trials per side: {args.trials}; confidence 0.95; delta 1e-5", rows,
               {"trials": args.trials, "seed": args.seed,
                "seconds": round(time.perf_counter() - t0, 1)})

if __name__ == "__main__":
  main()
