"""``python -m dpsco_jax.audit [--trials N] [--seed S] [--mechanism NAME ...]``: prints the
audit table (claim, empirical lower bound at 95% confidence, each broken twin's bound)."""

from __future__ import annotations

import argparse

from dpsco_jax.audit import mechanisms
from dpsco_jax.audit.table import audit_table, format_table, registry


def add_arguments(ap: argparse.ArgumentParser) -> None:
  """The audit options (shared with the ``dpsco audit`` verb)."""
  ap.add_argument("--trials", type=int, default=None,
                  help="runs per side (default: each mechanism's own, 2e4 for stages, "
                       "1e5-4e5 for drivers)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--mechanism", action="append", choices=tuple(registry()),
                  help="restrict to these stage mechanisms / drivers (repeatable)")


def run(args: argparse.Namespace, ap: argparse.ArgumentParser) -> list[dict]:
  if args.trials is not None and args.trials < 2:
    ap.error("--trials must be >= 2")
  rows = audit_table(args.trials, args.seed,
                     tuple(args.mechanism) if args.mechanism else None, include="all")
  trials = "each mechanism's default" if args.trials is None else f"{args.trials}"
  print(f"empirical epsilon lower bounds, {trials} trials per side, 95% confidence, "
        f"delta = {mechanisms.DELTA:g}")
  print(format_table(rows))
  return rows


def main(argv: list[str] | None = None) -> list[dict]:
  ap = argparse.ArgumentParser(prog="python -m dpsco_jax.audit", description=__doc__)
  add_arguments(ap)
  return run(ap.parse_args(argv), ap)


if __name__ == "__main__":
  main()
