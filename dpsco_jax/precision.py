"""Matmul precision for the numbers a guarantee depends on.

Backends round float32 matmuls differently by default: XLA:GPU uses TF32 (10-bit mantissa
inputs) and TPUs bf16 passes, while XLA:CPU computes in full float32. A number that a privacy
guarantee is decided on (a stability table of paper 001, a certificate, a clipped norm) must not
depend on that default: the decision would be taken on a value a relative 1e-3 away from the one
the proof speaks of, and differently on each machine. Functions that compute such numbers run
under :func:`at_guarantee_precision`, which traces them (and any user function they call) at
``Precision.HIGHEST``. The choice is part of the jit cache key (JAX's trace context), so the
same function called elsewhere at the default precision compiles separately.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import jax

GUARANTEE_PRECISION = "highest"
F = TypeVar("F", bound=Callable)


def at_guarantee_precision(fn: F) -> F:
  """``fn`` called (and therefore traced) under ``jax.default_matmul_precision("highest")``."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.default_matmul_precision(GUARANTEE_PRECISION):
      return fn(*args, **kwargs)
  return wrapped  # type: ignore[return-value]
