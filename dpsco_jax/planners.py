"""The data-free planners behind :func:`dpsco_jax.plan`, read from the algorithm table.

A planner (registered next to its driver, ``register(..., planner=...)``) reads a
:class:`~dpsco_jax.data.PublicFacts` (sizes and declared constants, never data) and the config
and returns a :class:`~dpsco_jax.algorithms.registration.Planned`: the plan the driver runs
(``dpsco_jax.run`` checks they agree). Its report comes from a fresh ledger charged with the
plan's events, so a plan over budget raises before any data is read.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

from dpsco_jax.algorithms.registration import Planned
from dpsco_jax.algorithms.registry import algorithms
from dpsco_jax.config.schema import ConfigError
from dpsco_jax.data.problem import PublicFacts

__all__ = ["planner_for", "PLANNED", "Planned"]

#: The planners that read a ``PublicFacts``, by name (read-only); ``unsupported`` algorithms
#: plan only a built-in problem.
PLANNED: Mapping[str, Callable[[PublicFacts, dict], Planned]] = MappingProxyType(
    {n: e.planner for n, e in algorithms().items() if e.unsupported is None})


def planner_for(algorithm: str) -> Callable[[PublicFacts, dict], Planned]:
  """The planner of ``algorithm`` (a ConfigError names the algorithms that have one)."""
  entry = algorithms().get(algorithm)
  if entry is None or entry.unsupported is not None:
    planned = sorted(PLANNED)
    raise ConfigError(f"{algorithm} has no data-free planner in dpsco_jax.plan"
                      + (f" ({entry.unsupported})" if entry is not None else "")
                      + "; planned: " + ", ".join(planned))
  return entry.planner
