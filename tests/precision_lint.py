"""Finds matmuls and convolutions left at the backend's default precision in a jaxpr.

XLA:CPU computes float32 dots in full float32 whatever they ask for, so a CPU test cannot see
what TF32 (GPU) or bf16 passes (TPU) do to a number. It can see what the program asks for: a
``dot_general`` / ``conv_general_dilated`` on float32 operands with ``precision=None`` (or
DEFAULT) runs at TF32 on a GPU. Used by the tests of functions whose outputs a guarantee is
decided on (paper 001's table and certificate, the fast clipped sum)."""

from __future__ import annotations

import jax.extend.core as jcore
from jax import lax

_OPS = ("dot_general", "conv_general_dilated")


def _sub_jaxprs(value):
  if isinstance(value, jcore.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jcore.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def low_precision_eqns(jaxpr, where: str = "top") -> list[tuple]:
  """``(where, primitive, precision, dtypes)`` of every matmul/conv in ``jaxpr`` (recursively
  into pjit, scan, cond, custom_vjp, remat...) not at ``Precision.HIGHEST`` on both operands,
  unless all its operands are float64."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  bad = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _OPS:
      prec = eqn.params.get("precision")
      precs = prec if isinstance(prec, tuple) else (prec, prec)
      dtypes = tuple(str(v.aval.dtype) for v in eqn.invars)
      if (not all(d == "float64" for d in dtypes)
          and not all(p == lax.Precision.HIGHEST for p in precs)):
        bad.append((where, eqn.primitive.name, prec, dtypes))
    for name, value in eqn.params.items():
      for sub in _sub_jaxprs(value):
        bad += low_precision_eqns(sub, f"{where}/{eqn.primitive.name}.{name}")
  return bad


def default_precision_dots(jaxpr) -> list[str]:
  """:func:`low_precision_eqns` as one readable line each (empty: all pinned)."""
  return [f"{w}: {p} precision={prec} dtypes={d}" for w, p, prec, d in low_precision_eqns(jaxpr)]
