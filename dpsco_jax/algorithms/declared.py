"""Guarantees that rest on declared constants of the loss.

A user's loss comes with constants the user *declares* (:class:`~dpsco_jax.data.PublicFacts`,
``constants_declared = True``): L (``lipschitz``), beta (``smoothness``), R (``radius``), mu
(``strong_convexity``), which the library cannot verify. A constant that enters an algorithm's
*privacy* argument (a sensitivity, a noise calibration, a stability certificate) is either

* **enforced** whatever the loss does (clipping at the clip norm, FILTER's bounded kept sets,
  projection onto the declared ball, an exact stability test): provenance stays ``theorem`` /
  ``accountant``; or
* **declared**: the guarantee holds only if the declaration is true; provenance
  :attr:`~dpsco_jax.privacy.Provenance.DECLARED`, the notes name the constants
  (:func:`conditional_note`). A ``heuristic`` guarantee stays ``heuristic`` (weaker: outside
  any proof even when the constants are true) and gains the same note.

Synthetic problems (:mod:`dpsco_jax.problems`) hold their constants by construction (no
``constants_declared``) and keep their provenance.

Per-algorithm choices (each explained where it is implemented):

==========================================  ===============  ==========================
algorithm                                   privacy reads    enforced / declared
==========================================  ===============  ==========================
``naive_output_pert`` (001 baseline)        L, mu, beta      declared (convex loss too)
001 DelOutputPert family, certificate path  mu, beta, (L)    declared (convex loss too)
001 DelOutputPert family, exact test        none             enforced (Thm 3.3, any f)
``resque_private_sco`` (002)                L                declared (convex loss too)
``dp_loc_gd`` / ``dp_loc_sgd`` (004)        L -> clip C      enforced (clipping)
FILTER (000)                                none             enforced (the filter)
SRGD family (003)                           L -> clip C      enforced (clipping)
DP-SGD baselines                            L -> clip C      enforced (clipping)
==========================================  ===============  ==========================
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from dpsco_jax.privacy.ledger import Provenance

__all__ = ["declares_constants", "declared_constants", "conditional_note",
           "declared_provenance"]

#: The constants a problem may declare, with the attribute each is read from.
NAMES = ("lipschitz", "smoothness", "radius", "strong_convexity")


def declares_constants(problem: Any) -> bool:
  """True when ``problem``'s constants are a user's declaration (not held by construction)."""
  return bool(getattr(problem, "constants_declared", False))


def declared_constants(problem: Any, names: Iterable[str], *, convex: bool = False
                       ) -> tuple[tuple[str, float], ...]:
  """``((name, value), ...)``: the declared constants among ``names`` a guarantee rests on
  (``()`` when held by construction; vacuous ones, e.g. ``strong_convexity`` 0 or an infinite
  radius, left out). ``convex=True`` adds ``("convex", 1.0)``: a convex loss is declared too."""
  if not declares_constants(problem):
    return ()
  out = []
  for name in names:
    if name not in NAMES:
      raise ValueError(f"unknown constant {name!r}; one of {NAMES}")
    if name == "strong_convexity":
      v = float((getattr(problem, "meta", None) or {}).get(name, 0.0))
    else:
      v = float(getattr(problem, name))
    if v > 0 and math.isfinite(v):
      out.append((name, v))
  if convex:
    out.append(("convex", 1.0))
  return tuple(out)


def conditional_note(declared: tuple[tuple[str, float], ...], how: str = "") -> str:
  """The report's note for a guarantee conditional on ``declared`` (``""`` when empty)."""
  if not declared:
    return ""
  consts = [f"{n}={v:.6g}" for n, v in declared if n != "convex"]
  what = "the declared " + ", ".join(consts) if consts else ""
  if any(n == "convex" for n, _ in declared):
    what = (what + " and a convex loss") if what else "a convex loss"
  return (f"DECLARED: conditional on {what}: not verified or enforced by the library"
          + (f" ({how})" if how else ""))


def declared_provenance(provenance: str | Provenance,
                        declared: tuple[tuple[str, float], ...]) -> str:
  """``declared`` in place of ``theorem`` / ``accountant`` when ``declared`` is not empty."""
  p = Provenance(provenance).value
  if declared and p in (Provenance.THEOREM.value, Provenance.ACCOUNTANT.value):
    return Provenance.DECLARED.value
  return p
