"""The algorithm registry: every algorithm registers itself where it is defined.

::

    @register("dp_sgd_user", config=DpSgdConfig, paper="baseline")
    def dp_sgd_user(problem, cfg, key) -> Result: ...

``config`` is the algorithm's frozen config dataclass (its typed vocabulary, from
:mod:`dpsco_jax.config_families`); ``paper`` names the source (``"000"`` .. ``"004"`` or
``"baseline"``). :func:`algorithms` imports every algorithm module once and returns the
registry, so the runner, the CLI's ``dpsco list``, :func:`dpsco_jax.fit` and the tests all read
one table. A module that fails to import is a bug and raises (it is never skipped).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

__all__ = ["AlgorithmEntry", "register", "algorithms", "ALGORITHM_MODULES"]

#: Modules that define algorithms (imported by :func:`algorithms`).
ALGORITHM_MODULES: tuple[str, ...] = (
    "dpsco_jax.algorithms.dpsgd.driver",
    "dpsco_jax.algorithms.user_level_filter.driver",
    "dpsco_jax.algorithms.output_perturbation.driver",
    "dpsco_jax.algorithms.resque.driver",
    "dpsco_jax.algorithms.srgd.driver",
    "dpsco_jax.algorithms.bilevel.driver",
    "dpsco_jax.algorithms.bilevel.localized_gd",
)


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


def algorithms() -> dict[str, AlgorithmEntry]:
  """Every registered algorithm (imports the algorithm modules on first use)."""
  for mod in ALGORITHM_MODULES:
    importlib.import_module(mod)
  return dict(_REGISTRY)
