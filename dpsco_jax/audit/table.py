"""The audit table: every registered mechanism and relation, honest and broken twins."""

from __future__ import annotations

import time

from dpsco_jax.audit import mechanisms
from dpsco_jax.audit.harness import run_audit

__all__ = ["audit_table", "format_table"]


def audit_table(trials: int = 20_000, seed: int = 0, names: tuple[str, ...] | None = None
                ) -> list[dict]:
  """One row per (mechanism, relation): claim and lower bound of the honest stage, and for
  every broken twin its claim, its lower bound and whether the audit flagged it."""
  rows = []
  for name, (_, relations, twins) in mechanisms.MECHANISMS.items():
    if names is not None and name not in names:
      continue
    for relation in relations:
      t0 = time.perf_counter()
      honest = run_audit(mechanisms.build(name, relation), trials=trials, key=seed)
      row = {"mechanism": name, "relation": relation, "claimed_epsilon": honest.claimed_epsilon,
             "lower_bound": honest.lower_bound,
             "gdp_lower_bound": (honest.gdp_lower_bound if name in mechanisms.GAUSSIAN
                                 else None),
             "trials": trials, "confidence": honest.confidence, "delta": honest.delta,
             "twins": {}}
      for i, twin in enumerate(twins):
        try:
          spec = mechanisms.build(name, relation, twin)
        except ValueError:  # the bug does not exist under this relation
          continue
        res = run_audit(spec, trials=trials, key=seed + 1 + i)
        row["twins"][twin] = {"claimed_epsilon": res.claimed_epsilon,
                              "lower_bound": res.lower_bound, "flagged": res.violated}
      row["seconds"] = time.perf_counter() - t0
      rows.append(row)
  return rows


def format_table(rows: list[dict]) -> str:
  head = (f"{'mechanism':20s} {'relation':12s} {'claim':>6s} {'lower':>6s}  "
          f"{'broken twin':24s} {'claim':>6s} {'lower':>6s} flagged")
  lines = [head, "-" * len(head)]
  for r in rows:
    first = True
    for twin, t in (r["twins"].items() or [("-", None)]):
      left = (f"{r['mechanism']:20s} {r['relation']:12s} {r['claimed_epsilon']:6.2f} "
              f"{r['lower_bound']:6.2f}  ") if first else " " * 49
      right = (f"{twin:24s} {t['claimed_epsilon']:6.2f} {t['lower_bound']:6.2f} "
               f"{'yes' if t['flagged'] else 'NO'}") if t else ""
      lines.append(left + right)
      first = False
  return "\n".join(lines)
