"""Argument validation shared by every public constructor.

Each check raises ``ValueError`` whose message names the offending parameter, so a bad
configuration fails at construction, before any data is touched or any noise is drawn.
"""

from __future__ import annotations

import math
from typing import Any


def _traced(x: Any) -> bool:
  """Hyper-parameters passed as traced values (to share one compilation across a sweep) were
  validated by the caller while still concrete; they cannot be inspected here."""
  import jax
  return isinstance(x, jax.core.Tracer)


def _is_real(x: Any) -> bool:
  try:
    return math.isfinite(float(x))
  except (TypeError, ValueError):
    return False


def check_positive(x: Any, name: str) -> float:
  if _traced(x):
    return x
  if not _is_real(x) or float(x) <= 0:
    raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
  return float(x)


def check_nonnegative(x: Any, name: str) -> float:
  if _traced(x):
    return x
  if not _is_real(x) or float(x) < 0:
    raise ValueError(f"{name} must be a finite number >= 0, got {x!r}")
  return float(x)


def check_epsilon(x: Any, name: str = "epsilon") -> float:
  return check_positive(x, name)


def check_delta(x: Any, name: str = "delta") -> float:
  if _traced(x):
    return x
  if not _is_real(x) or not 0.0 < float(x) < 1.0:
    raise ValueError(f"{name} must lie in the open interval (0, 1), got {x!r}")
  return float(x)


def check_probability(x: Any, name: str) -> float:
  if _traced(x):
    return x
  if not _is_real(x) or not 0.0 < float(x) <= 1.0:
    raise ValueError(f"{name} must lie in (0, 1], got {x!r}")
  return float(x)


def check_int(x: Any, name: str, minimum: int = 1) -> int:
  if isinstance(x, bool) or not isinstance(x, (int,)) and not (
      _is_real(x) and float(x).is_integer()):
    raise ValueError(f"{name} must be an integer >= {minimum}, got {x!r}")
  if int(x) < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {x!r}")
  return int(x)


def check_choice(x: Any, name: str, choices: tuple[str, ...]) -> str:
  if x not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {x!r}")
  return x
