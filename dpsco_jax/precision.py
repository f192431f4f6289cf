"""Matmul precision for the numbers a guarantee depends on.

By default XLA:GPU rounds float32 matmuls through TF32 and TPUs through bf16 passes (XLA:CPU
keeps float32). A number a privacy decision is taken on (paper 001's stability table, a
certificate, a clipped norm) must not be a relative 1e-3 away from the proof's, differently per
machine, so such functions run under :func:`at_guarantee_precision` (traced, with any user
function they call, at ``Precision.HIGHEST``; part of the jit cache key).
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
