"""What every algorithm driver returns."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from dpsco_jax.privacy.ledger import PrivacyReport

__all__ = ["Result", "FallbackRelease", "NonFiniteRelease", "nonfinite_leaves",
           "check_finite_params"]


class FallbackRelease(UserWarning):
  """The released params are a public fallback point, not the trained model: a private test
  halted the run (paper 000's AboveThreshold) or a stability test released ⊥ (paper 001). The
  guarantee still holds."""


class NonFiniteRelease(ValueError):
  """The released params, or a number computed from them (excess risk, a metric), hold NaN
  or infinity: the run failed and is never reported as a result. (Checking released values is
  post-processing: it reveals nothing the release does not.)"""


def nonfinite_leaves(params: Any) -> list[str]:
  """The paths of the leaves of ``params`` holding NaN or infinity (``[]``: all finite)."""
  import jax
  import jax.numpy as jnp
  bad = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      continue
    # a global array of several processes: each checks its own shards
    parts = ([s.data for s in leaf.addressable_shards]
             if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable else [leaf])
    if not all(bool(jnp.all(jnp.isfinite(x))) for x in parts):
      bad.append(jax.tree_util.keystr(path))   # "" for a bare array
  return bad


def check_finite_params(params: Any, algorithm: str) -> None:
  """Raises :class:`NonFiniteRelease` naming the leaves of ``params`` that are not finite."""
  bad = nonfinite_leaves(params)
  if bad:
    where = " in " + ", ".join(bad) if all(bad) else ""
    raise NonFiniteRelease(
        f"{algorithm}: the released params are not finite (NaN or infinity{where}): the loss "
        "or its gradient is not finite, or the steps diverge (a smaller learning_rate)")


def _fallback_of(record: dict) -> str | None:
  """Why the release is a fallback, from the driver's released record (``None``: it is not)."""
  phase = record.get("halted_phase")
  if phase is not None:
    return (f"AboveThreshold halted in phase {phase}: the released params are the public "
            "fallback point, not a trained model")
  if record.get("is_bottom") or record.get("bottom0"):
    return "the stability test released ⊥: the released params are the public point"
  bottoms = record.get("bottoms")
  if isinstance(bottoms, int) and not isinstance(bottoms, bool) and bottoms > 0:
    return f"{bottoms} phase(s) released ⊥ and kept their anchor"
  return None


@dataclasses.dataclass
class Result:
  """A released model and the guarantee that covers it.

  Attributes:
    params: the released parameters (the only data-dependent output).
    privacy: the (epsilon, delta) guarantee and its provenance.
    gradient_evaluations: per-item gradient evaluations spent (a compute measure).
    record: extra JSON-serializable, data-independent fields for the runner's records
      (e.g. ``num_steps``, calibrated noise multipliers).
    debug: data-dependent diagnostics (kept counts, scores, norms), NOT covered by the
      guarantee: filled only when the config sets ``debug: true``; otherwise None.
    fallback: ``None`` when the trained model was released; otherwise why the params are a
      public fallback point (Algorithms 1 and 3 halting, paper 001's ⊥), derived from the
      record if unset and announced with a :class:`FallbackRelease` warning.
    announced: whether the fallback warning was issued (internal; ``dataclasses.replace``
      copies it, so the warning comes once per release).
  """
  params: Any
  privacy: PrivacyReport
  gradient_evaluations: int
  record: dict = dataclasses.field(default_factory=dict)
  debug: dict | None = None
  fallback: str | None = None
  announced: bool = dataclasses.field(default=False, repr=False, compare=False)

  def __post_init__(self):
    if self.fallback is None:
      self.fallback = _fallback_of(self.record or {})
    if self.fallback is not None and not self.announced:
      warnings.warn(self.fallback, FallbackRelease, stacklevel=3)
      self.announced = True
