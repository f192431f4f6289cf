"""The registration decorator and the table it fills (the bottom of the algorithm layer).

::

    @register("dp_sgd_user", config=DpSgdConfig, paper="baseline")
    def dp_sgd_user(problem, cfg, key) -> Result: ...

``config`` is the algorithm's frozen config dataclass (its typed vocabulary, from
:mod:`dpsco_jax.config.families`); ``paper`` names the source (``"000"`` .. ``"004"`` or
``"baseline"``). Every driver module imports this module and nothing imports the drivers from
here: :mod:`dpsco_jax.algorithms.registry`, one level up, imports every algorithm module and
returns the filled table (so the import graph has no cycle through the registry).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["AlgorithmEntry", "register", "registered"]


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
  """One registered algorithm: its driver ``driver(problem, cfg, key) -> Result``, its typed
  config class and the paper it comes from."""
  name: str
  driver: Callable[..., Any]
  config: type
  paper: str


_REGISTRY: dict[str, AlgorithmEntry] = {}


def register(name: str, *, config: type, paper: str) -> Callable[[Callable], Callable]:
  """Decorator: registers ``driver`` under ``name`` (a second registration of a name is a
  bug and raises) and returns the driver unchanged."""
  if not dataclasses.is_dataclass(config):
    raise TypeError(f"register({name!r}): config must be a config dataclass, got {config!r}")

  def deco(driver: Callable) -> Callable:
    old = _REGISTRY.get(name)
    if old is not None and old.driver is not driver:
      raise ValueError(f"algorithm {name!r} is registered twice ({old.driver.__module__} and "
                       f"{driver.__module__})")
    _REGISTRY[name] = AlgorithmEntry(name, driver, config, str(paper))
    return driver

  return deco


def registered() -> dict[str, AlgorithmEntry]:
  """The algorithms registered so far (only those whose modules are imported: read the whole
  table through :func:`dpsco_jax.algorithms.registry.algorithms`)."""
  return dict(_REGISTRY)
