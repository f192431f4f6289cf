"""The audit table: every registered mechanism and relation, honest and broken twins.

Both registries (:data:`~dpsco_jax.audit.mechanisms.MECHANISMS`,
:data:`~dpsco_jax.audit.drivers.DRIVERS`) map ``name -> (builder, relations, broken twins)``."""

from __future__ import annotations

import time

from dpsco_jax.audit import drivers, mechanisms, matrix_factorization as mf_audit
from dpsco_jax.audit.harness import run_audit

__all__ = ["INCLUDE", "STAGE_TRIALS", "audit_table", "format_table", "registry"]

STAGE_TRIALS = 20_000
INCLUDE = ("stages", "drivers", "all")


def registry(include: str = "all") -> dict:
  """``name -> (builder, relations, twins, default trials, gaussian claim?)`` of the stage
  mechanisms and / or the driver audits (``include``: one of ``INCLUDE``)."""
  if include not in INCLUDE:
    raise ValueError(f"include must be one of {INCLUDE}, got {include!r}")
  out = {}
  if include in ("stages", "all"):
    out.update({name: (b, rels, twins, STAGE_TRIALS, name in mechanisms.GAUSSIAN)
                for name, (b, rels, twins) in mechanisms.MECHANISMS.items()})
    # the correlated-noise stages: 5e4 trials catch their twins
    out.update({name: (b, rels, twins, 50_000, True)
                for name, (b, rels, twins) in mf_audit.MECHANISMS.items()})
  if include in ("drivers", "all"):
    out.update({name: (b, rels, twins, drivers.TRIALS[name], name in drivers.GAUSSIAN)
                for name, (b, rels, twins) in drivers.DRIVERS.items()})
    # numbers a guarantee rests on: item-level DP-SGD's m, a declared Lipschitz constant
    from dpsco_jax.audit import declared_constants, declared_facts
    out["dp_sgd_item_declared_m"] = (declared_facts.item_count_driver, ("add_remove",),
                                     declared_facts.TWINS, 100_000, False)
    out["naive_output_pert_declared_L"] = (declared_constants.declared_lipschitz_driver,
                                           ("replace_one",), declared_constants.TWINS,
                                           declared_constants.TRIALS, True)
  return out


def audit_table(trials: int | None = None, seed: int = 0,
                names: tuple[str, ...] | None = None, include: str = "stages"
                ) -> list[dict]:
  """One row per (mechanism, relation): the honest claim and lower bound, and each twin's
  claim, bound and whether it was flagged. ``trials`` per side defaults to each mechanism's."""
  rows = []
  for name, (build, relations, twins, default, gaussian) in registry(include).items():
    if names is not None and name not in names:
      continue
    n_trials = default if trials is None else trials
    for relation in relations:
      t0 = time.perf_counter()
      honest = run_audit(build(relation), trials=n_trials, key=seed)
      row = {"mechanism": name, "relation": relation, "claimed_epsilon": honest.claimed_epsilon,
             "lower_bound": honest.lower_bound,
             "gdp_lower_bound": honest.gdp_lower_bound if gaussian else None,
             "trials": n_trials, "confidence": honest.confidence, "delta": honest.delta,
             "twins": {}}
      for i, twin in enumerate(twins):
        try:
          spec = build(relation, twin)
        except ValueError:  # the bug does not exist under this relation
          continue
        res = run_audit(spec, trials=n_trials, key=seed + 1 + i)
        row["twins"][twin] = {"claimed_epsilon": res.claimed_epsilon,
                              "lower_bound": res.lower_bound, "flagged": res.violated}
      row["seconds"] = time.perf_counter() - t0
      rows.append(row)
  return rows


def format_table(rows: list[dict]) -> str:
  head = (f"{'mechanism':22s} {'relation':12s} {'claim':>6s} {'lower':>6s}  "
          f"{'broken twin':24s} {'claim':>6s} {'lower':>6s} flagged")
  lines = [head, "-" * len(head)]
  for r in rows:
    first = True
    for twin, t in (r["twins"].items() or [("-", None)]):
      left = (f"{r['mechanism']:22s} {r['relation']:12s} {r['claimed_epsilon']:6.2f} "
              f"{r['lower_bound']:6.2f}  ") if first else " " * 51
      right = (f"{twin:24s} {t['claimed_epsilon']:6.2f} {t['lower_bound']:6.2f} "
               f"{'yes' if t['flagged'] else 'NO'}") if t else ""
      lines.append(left + right)
      first = False
  return "\n".join(lines)


def print_report(header: str, rows: list[dict], summary: dict) -> None:
  """The experiments' output: a header, the table, the GDP-fit line, then one JSON line."""
  import json
  print(header)
  print(format_table(rows))
  print("GDP-fit bounds (valid against Gaussian claims only): " + ", ".join(
      f"{r['mechanism']}/{r['relation']}={r['gdp_lower_bound']:.2f}" for r in rows
      if r["gdp_lower_bound"] is not None))
  print(json.dumps({**summary, "rows": rows}))
