"""The check of every ``test_plan_is_what_runs_*`` file (issue 47.1): once a plan is made, the
family's planning, charging, calibrating and config-building functions raise when called, and
the plan still runs. One helper, so the families' checks differ only in what they name."""

from __future__ import annotations

from typing import Any, Iterable


def forbid_planning(monkeypatch: Any, modules: Iterable[Any], names: Iterable[str], *,
                    schemas: Iterable[type] = ()) -> None:
  """Makes ``module.name`` raise for every one of ``names`` that a module of ``modules`` holds
  (each name must be in at least one: a misspelt name would forbid nothing), and
  ``schema.of`` for every one of ``schemas``."""
  def planned_again(*args, **kwargs):
    raise AssertionError("the run planned, charged, calibrated or read its config again")
  modules = list(modules)
  for name in names:
    holders = [m for m in modules if hasattr(m, name)]
    assert holders, f"{name} is in none of {[m.__name__ for m in modules]}"
    for module in holders:
      monkeypatch.setattr(module, name, planned_again)
  for schema in schemas:
    monkeypatch.setattr(schema, "of", classmethod(planned_again))
