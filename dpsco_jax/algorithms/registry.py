"""The algorithm table: every algorithm registers itself where it is defined
(:func:`~dpsco_jax.algorithms.registration.register`, one level down, which the drivers
import).

This module imports the ``driver`` module of every package under ``dpsco_jax/algorithms/``
(:func:`algorithm_modules`), so :func:`algorithms` returns the whole table that the runner,
``dpsco list``, :func:`dpsco_jax.plan` / ``run`` / ``fit`` and the tests read: a new package is
found by being there. A module that fails to import raises here (it is never skipped); the
package-graph test adds the same edges (registry -> every ``driver``), so a cycle through the
registry is still seen.
"""

from __future__ import annotations

import importlib
import pathlib

from dpsco_jax.algorithms.registration import AlgorithmEntry, register, registered

__all__ = ["AlgorithmEntry", "register", "algorithms", "algorithm_modules", "ALGORITHM_MODULES"]

_HERE = pathlib.Path(__file__).resolve().parent


def algorithm_modules(root: pathlib.Path = _HERE) -> tuple[str, ...]:
  """The registering module of every algorithm package: ``<package>/driver.py``, for each
  direct subpackage of ``root`` (``dpsco_jax/algorithms``) that has one, sorted by name."""
  return tuple(f"dpsco_jax.algorithms.{d.name}.driver" for d in sorted(root.iterdir())
               if (d / "__init__.py").is_file() and (d / "driver.py").is_file())


#: Modules that define algorithms (each registers its drivers when imported, below).
ALGORITHM_MODULES: tuple[str, ...] = algorithm_modules()
for _name in ALGORITHM_MODULES:
  importlib.import_module(_name)


def algorithms() -> dict[str, AlgorithmEntry]:
  """Every registered algorithm (the shipped ones, and any a user's imported module added)."""
  return registered()
