"""Finds matmuls and convolutions left at the backend's default precision in a jaxpr.

XLA:CPU computes float32 dots in full float32 whatever they ask for, so a CPU test cannot see
what TF32 (GPU) or bf16 passes (TPU) do to a number. It can see what the program asks for: a
``dot_general`` / ``conv_general_dilated`` on float32 operands with ``precision=None`` (or
DEFAULT) will run at TF32 on a GPU. Used by the tests of functions whose outputs a guarantee
is decided on."""

from __future__ import annotations

import jax
import jax.extend.core as jcore
from jax import lax

_OPS = ("dot_general", "conv_general_dilated")


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    vs = v if isinstance(v, (list, tuple)) else (v,)
    for x in vs:
      if isinstance(x, jcore.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jcore.Jaxpr):
        yield x


def _is_highest(prec) -> bool:
  if prec is None:
    return False
  ps = prec if isinstance(prec, tuple) else (prec, prec)
  return all(p in (lax.Precision.HIGHEST, "highest") for p in ps)


def default_precision_dots(jaxpr) -> list[str]:
  """Descriptions of the float32 dots/convolutions in ``jaxpr`` (recursively) not at HIGHEST."""
  out = []
  todo = [jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr]
  while todo:
    j = todo.pop()
    for eqn in j.eqns:
      if eqn.primitive.name in _OPS:
        dts = {str(v.aval.dtype) for v in eqn.invars}
        if "float64" not in dts and not _is_highest(eqn.params.get("precision")):
          out.append(f"{eqn.primitive.name}{[tuple(v.aval.shape) for v in eqn.invars]} "
                     f"precision={eqn.params.get('precision')}")
      todo.extend(_sub_jaxprs(eqn))
  return out
