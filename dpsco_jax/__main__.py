"""Command line: ``python -m dpsco_jax run CONFIG.yaml [--out FILE.json] [--plot FIELD]
[--quick] [--force]``,
``python -m dpsco_jax list``, ``python -m dpsco_jax audit [--mechanism NAME] [--trials N]``."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="dpsco", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  run = sub.add_parser("run", help="run a YAML config (lists are swept; problem:/algorithm: "
                                   "sections, compare:, tuning_seeds/eval_seeds + select: see "
                                   "dpsco_jax/runner/__init__.py; your own model, loss and data: "
                                   "dpsco_jax/runner/user.py) and print a table")
  run.add_argument("config")
  run.add_argument("--out", help="write {'results': [...]} JSON here (an existing file is "
                                 "replaced only with --force)")
  run.add_argument("--plot", metavar="FIELD",
                   help="plot excess risk against a swept FIELD (needs matplotlib); with "
                        "compare:, also the ratio to the baseline with bootstrap error bars")
  run.add_argument("--quick", action="store_true",
                   help="a smoke of the whole config before a long run: the first value of "
                        "every sweep, one seed per phase, sizes capped (n_users <= 2000, "
                        "num_steps <= 20); "
                        "records say quick: true (dpsco_jax/runner/quick.py)")
  run.add_argument("--force", action="store_true",
                   help="replace an existing --out file and --plot images (without it the "
                        "run stops before it starts); a --quick run never replaces a results "
                        "file of a full run, even with --force: write the smoke elsewhere")
  run.add_argument("--quiet", action="store_true",
                   help="no progress line (runs done; in a run on your model: steps and "
                        "epsilon so far)")
  sub.add_parser("list", help="list the registered algorithms and problems")
  audit = sub.add_parser("audit", help="empirical privacy audit: claimed epsilon vs lower "
                                       "bound of stage mechanisms and drivers (with broken "
                                       "twins)")
  from dpsco_jax.audit import __main__ as audit_cli
  audit_cli.add_arguments(audit)
  args = parser.parse_args(argv)

  if args.command == "audit":
    audit_cli.run(args, audit)
    return 0

  from dpsco_jax import runner
  if args.command == "list":
    algorithms, problems = runner.registry()
    print("algorithms:", ", ".join(sorted([*algorithms, *runner.CONFIG_ONLY_ALGORITHMS])))
    print("problems:  ", ", ".join(sorted(problems)),
          f"({runner.USER_PROBLEM}: your factory, or model + loss + data file)")
    return 0
  try:
    if args.out and os.path.dirname(args.out):
      try:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
      except OSError as err:  # a parent that is a file, an unwritable place
        raise runner.ConfigError(f"--out {args.out}: cannot make its folder "
                                 f"({err.strerror}: {err.filename})") from None
    records = runner.main_run(args.config, out=args.out, plot_field=args.plot,
                              progress=not args.quiet, quick=args.quick, force=args.force)
  except runner.ConfigError as err:  # a user error: one line, no traceback
    print(f"dpsco: error: {err}", file=sys.stderr)
    return 2
  failed = sum(r.get("status") == "failed" for r in records)
  if failed:
    print(f"dpsco: {failed} of {len(records)} runs failed", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
