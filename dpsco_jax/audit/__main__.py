"""``python -m dpsco_jax.audit [--trials N] [--seed S] [--mechanism NAME ...]``: prints the
audit table (mechanism, relation, claimed epsilon, empirical lower bound at 95% confidence,
each broken twin's bound)."""

from __future__ import annotations

import argparse

from dpsco_jax.audit import mechanisms
from dpsco_jax.audit.table import audit_table, format_table


def main(argv: list[str] | None = None) -> list[dict]:
  ap = argparse.ArgumentParser(prog="python -m dpsco_jax.audit", description=__doc__)
  ap.add_argument("--trials", type=int, default=20_000, help="runs per side (default 2e4)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--mechanism", action="append", choices=tuple(mechanisms.MECHANISMS),
                  help="restrict to these mechanisms (repeatable)")
  args = ap.parse_args(argv)
  if args.trials < 2:
    ap.error("--trials must be >= 2")
  rows = audit_table(args.trials, args.seed,
                     tuple(args.mechanism) if args.mechanism else None)
  print(f"empirical epsilon lower bounds, {args.trials} trials per side, 95% confidence, "
        f"delta = {mechanisms.DELTA:g}")
  print(format_table(rows))
  return rows


if __name__ == "__main__":
  main()
