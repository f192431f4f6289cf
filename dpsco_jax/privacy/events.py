"""Privacy events: the vocabulary a mechanism describes itself in, validated and serializable.

A mechanism's privacy is a tree of ``dp_accounting`` events built from its public
configuration (never from data), plus :class:`PureDpEvent`, :class:`ApproxDpEvent` and
:class:`ApproxRdpEvent`, which the accountant cannot express. :func:`validate_event` refuses
unknown nodes (their relation conversion is unknown); :func:`for_accountant` adapts the
library's convention ``z = sigma / C`` to each accountant.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import dp_accounting
import numpy as np

from dpsco_jax.privacy.relations import accountant_relation


def _finite(x: Any, name: str, *, positive: bool = True, allow_zero: bool = False) -> float:
  if isinstance(x, bool) or not isinstance(x, (int, float)) and not hasattr(x, "__float__"):
    raise TypeError(f"{name} must be a number, got {x!r}")
  v = float(x)
  if not math.isfinite(v) or v < 0 or (positive and not allow_zero and v == 0):
    raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, "
                     f"got {x!r}")
  return v


@dataclasses.dataclass(frozen=True)
class PureDpEvent:
  """An arbitrary epsilon-DP mechanism (AboveThreshold, a Laplace test, a truncated discrete
  Laplace release), composed by basic composition. Not a ``dp_accounting`` Laplace event: that
  does not dominate every eps-DP mechanism (it would under-count AboveThreshold).

  Attributes:
    epsilon: the mechanism's epsilon (a finite number > 0).
  """
  epsilon: float

  def __post_init__(self):
    _finite(self.epsilon, "PureDpEvent.epsilon")


@dataclasses.dataclass(frozen=True)
class ApproxDpEvent:
  """An (epsilon, delta)-DP block whose guarantee is a theorem (e.g. paper 001's DelOutputPert);
  epsilons and deltas add.

  Attributes:
    epsilon: the block's epsilon, finite and > 0.
    delta: the block's delta, in ``[0, 1)``.
  """
  epsilon: float
  delta: float

  def __post_init__(self):
    _finite(self.epsilon, "ApproxDpEvent.epsilon")
    d = _finite(self.delta, "ApproxDpEvent.delta", allow_zero=True)
    if d >= 1:
      raise ValueError(f"ApproxDpEvent.delta must be < 1, got {self.delta!r}")


@dataclasses.dataclass(frozen=True)
class ApproxRdpEvent:
  """``(alpha, epsilon_rdp, delta_tv)``-approximate RDP (paper 002, Definition 2 / Lemma 3).

  Entries with the same ``alpha`` and ``delta_prime`` add up (Lemma 3) and are converted once
  by Corollary 1: ``(eps_rdp + log(1/delta')/(alpha-1), delta' + (1 + e^eps) delta_tv)``.

  Attributes:
    alpha: the Renyi order (> 1).
    epsilon_rdp: the RDP epsilon at ``alpha``.
    delta_tv: the total-variation slack ``delta`` of the definition.
    delta_prime: the ``delta'`` of the conversion to (epsilon, delta), in ``(0, 1)``.
  """
  alpha: float
  epsilon_rdp: float
  delta_tv: float
  delta_prime: float

  def __post_init__(self):
    if _finite(self.alpha, "ApproxRdpEvent.alpha") <= 1:
      raise ValueError(f"ApproxRdpEvent.alpha must be > 1, got {self.alpha!r}")
    _finite(self.epsilon_rdp, "ApproxRdpEvent.epsilon_rdp", allow_zero=True)
    _finite(self.delta_tv, "ApproxRdpEvent.delta_tv", allow_zero=True)
    if not 0 < _finite(self.delta_prime, "ApproxRdpEvent.delta_prime") < 1:
      raise ValueError(f"ApproxRdpEvent.delta_prime must be in (0, 1), got "
                       f"{self.delta_prime!r}")


OUTSIDE_ACCOUNTANT = (PureDpEvent, ApproxDpEvent, ApproxRdpEvent)


def pure_dp_event(epsilon: float) -> PureDpEvent:
  """An epsilon-DP event (see :class:`PureDpEvent`).

  Args:
    epsilon: the mechanism's epsilon, a finite number > 0.

  Returns:
    A :class:`PureDpEvent`.
  """
  return PureDpEvent(epsilon)


def check_count(c: Any, name: str) -> int:
  """A positive int (a numpy integer read as one), else ``ValueError`` naming ``name``."""
  if isinstance(c, np.integer):   # e.g. steps computed with numpy
    c = int(c)
  if isinstance(c, bool) or not isinstance(c, int) or c < 1:
    raise ValueError(f"{name} must be a positive int, got {c!r}")
  return c


def validate_event(event: Any) -> Any:
  """Returns ``event`` if every node is a known type with valid parameters.

  Args:
    event: the event to check. Known nodes: Gaussian, Laplace, SelfComposed, Composed,
      PoissonSampled, SampledWithoutReplacement, SampledWithReplacement,
      SingleEpochTreeAggregation, NoOp, and the library's three.

  Returns:
    ``event`` itself (else ``ValueError``, naming the node or parameter).
  """
  d = dp_accounting
  if isinstance(event, OUTSIDE_ACCOUNTANT):
    return event  # checked in __post_init__
  if isinstance(event, (d.GaussianDpEvent, d.LaplaceDpEvent)):
    _finite(event.noise_multiplier, f"{type(event).__name__}.noise_multiplier")
  elif isinstance(event, d.SelfComposedDpEvent):
    check_count(event.count, "SelfComposedDpEvent.count")
    validate_event(event.event)
  elif isinstance(event, d.ComposedDpEvent):
    if not isinstance(event.events, (list, tuple)):
      raise ValueError("ComposedDpEvent.events must be a list")
    for e in event.events:
      validate_event(e)
  elif isinstance(event, d.PoissonSampledDpEvent):
    q = _finite(event.sampling_probability, "PoissonSampledDpEvent.sampling_probability")
    if q > 1:
      raise ValueError(f"PoissonSampledDpEvent.sampling_probability must be <= 1, got {q}")
    validate_event(event.event)
  elif isinstance(event, (d.SampledWithoutReplacementDpEvent, d.SampledWithReplacementDpEvent)):
    n = check_count(event.source_dataset_size, f"{type(event).__name__}.source_dataset_size")
    if check_count(event.sample_size, f"{type(event).__name__}.sample_size") > n:
      raise ValueError(f"{type(event).__name__}.sample_size must be <= source_dataset_size")
    validate_event(event.event)
  elif isinstance(event, d.SingleEpochTreeAggregationDpEvent):
    _finite(event.noise_multiplier, "SingleEpochTreeAggregationDpEvent.noise_multiplier")
    steps = event.step_counts if isinstance(event.step_counts, (list, tuple)) else [
        event.step_counts]
    for s in steps:
      check_count(s, "SingleEpochTreeAggregationDpEvent.step_counts")
  elif isinstance(event, d.NoOpDpEvent):
    pass
  else:
    raise ValueError(f"unsupported privacy event {type(event).__name__}: the ledger accounts "
                     "only events whose relation conversion it knows (see "
                     "dpsco_jax.privacy.events.validate_event)")
  return event


def _steps(step_counts: Any) -> Any:
  return list(step_counts) if isinstance(step_counts, (list, tuple)) else int(step_counts)


#: The JSON fields of each known dp_accounting node, in order, with their conversion
#: (``"event"`` / ``"events"``: the child event(s)).
_FIELDS = {
    dp_accounting.GaussianDpEvent: (("noise_multiplier", float),),
    dp_accounting.LaplaceDpEvent: (("noise_multiplier", float),),
    dp_accounting.SelfComposedDpEvent: (("count", int), ("event", None)),
    dp_accounting.ComposedDpEvent: (("events", None),),
    dp_accounting.PoissonSampledDpEvent: (("sampling_probability", float), ("event", None)),
    dp_accounting.SampledWithoutReplacementDpEvent: (
        ("source_dataset_size", int), ("sample_size", int), ("event", None)),
    dp_accounting.SampledWithReplacementDpEvent: (
        ("source_dataset_size", int), ("sample_size", int), ("event", None)),
    dp_accounting.SingleEpochTreeAggregationDpEvent: (("noise_multiplier", float),
                                                      ("step_counts", _steps)),
    dp_accounting.NoOpDpEvent: (),
}


def _map_node(event: Any, child, value) -> dict:
  """``{field: ...}`` of a known dp_accounting node: ``child`` of each child event, ``value(x,
  conversion)`` of the other fields."""
  cls = next(c for c in _FIELDS if isinstance(event, c))
  out = {}
  for name, conv in _FIELDS[cls]:
    v = getattr(event, name)
    out[name] = (child(v) if name == "event" else [child(e) for e in v] if name == "events"
                 else value(v, conv))
  return out


def for_accountant(event: Any, kind: str, relation: str) -> Any:
  """Rewrites ``event`` so that accountant ``kind`` reads ``z = sigma / C`` (``C`` add/remove).

  dp_accounting's PLD doubles the sensitivity under replace-one itself; its RDP ignores the
  relation for Gaussians and Laplaces (also inside sampling without replacement), so under
  replace-one RDP gets every multiplier halved (else it would under-report epsilon). RDP also
  reads a Gaussian multiplier above :data:`RDP_MAX_MULTIPLIER` as that one (an upper bound).

  Args:
    event: a ``dp_accounting`` event (or one of the library's own events).
    kind: the accountant, ``"pld"`` or ``"rdp"``.
    relation: the neighbouring relation the guarantee is stated under.

  Returns:
    The event the accountant should read (``event`` itself for PLD).
  """
  validate_event(event)
  rel = accountant_relation(relation, event)
  if kind != "rdp":
    return event
  if rel != dp_accounting.NeighboringRelation.REPLACE_ONE:
    return _capped_gaussians(event)

  def rewrite(ev):
    if isinstance(ev, (dp_accounting.GaussianDpEvent, dp_accounting.LaplaceDpEvent)):
      return type(ev)(ev.noise_multiplier / 2.0)
    if isinstance(ev, dp_accounting.NoOpDpEvent):
      return ev
    # SingleEpochTreeAggregation: dp_accounting supports it only under REPLACE_SPECIAL
    if isinstance(ev, (dp_accounting.SingleEpochTreeAggregationDpEvent, *OUTSIDE_ACCOUNTANT)):
      raise ValueError(f"no replace-one conversion for {type(ev).__name__} under RDP")
    return type(ev)(**_map_node(ev, rewrite, lambda v, conv: v))

  return _capped_gaussians(rewrite(event))


#: dp_accounting's RDP squares a Gaussian's multiplier as a python float (OverflowError past
#: ~1.3e154); a larger one is accounted as this one, a less noisy Gaussian (so an upper
#: bound), whose RDP ``alpha / (2 z^2) <= 1e-298`` is already float zero beside any other part
RDP_MAX_MULTIPLIER = 1e150


def _capped_gaussians(event: Any) -> Any:
  """``event`` with every Gaussian multiplier above :data:`RDP_MAX_MULTIPLIER` lowered to it."""
  if isinstance(event, dp_accounting.GaussianDpEvent):
    return (event if float(event.noise_multiplier) <= RDP_MAX_MULTIPLIER
            else dp_accounting.GaussianDpEvent(RDP_MAX_MULTIPLIER))
  if not hasattr(event, "event") and not hasattr(event, "events"):
    return event
  return type(event)(**_map_node(event, _capped_gaussians, lambda v, conv: v))


def event_to_json(event: Any) -> dict:
  """A canonical JSON-able dict of an event (round-trips with :func:`event_from_json`).

  Args:
    event: a known, valid event (else ``ValueError``).

  Returns:
    A dict with a ``"type"`` key and the event's fields.
  """
  validate_event(event)
  if isinstance(event, OUTSIDE_ACCOUNTANT):
    return {"type": type(event).__name__, **dataclasses.asdict(event)}
  return {"type": type(event).__name__,
          **_map_node(event, event_to_json, lambda v, conv: conv(v))}


def event_from_json(obj: dict) -> Any:
  """Inverse of :func:`event_to_json`.

  Args:
    obj: a dict from :func:`event_to_json`.

  Returns:
    The event, validated (``ValueError`` for an unknown type, ``KeyError`` a missing field).
  """
  t = obj.get("type")
  simple = {c.__name__: c for c in OUTSIDE_ACCOUNTANT}
  known = {c.__name__: c for c in _FIELDS}
  if t in simple:
    fields = {f.name for f in dataclasses.fields(simple[t])}
    ev = simple[t](**{k: v for k, v in obj.items() if k in fields})
  elif t in known:
    kids = lambda name, v: (event_from_json(v) if name == "event"
                            else [event_from_json(e) for e in v] if name == "events" else v)
    ev = known[t](**{name: kids(name, obj[name]) for name, _ in _FIELDS[known[t]]})
  else:
    raise ValueError(f"unknown privacy event type {t!r}")
  return validate_event(ev)


def event_key(event: Any) -> str:
  """A canonical string identifying an event (equal events, equal keys)."""
  return json.dumps(event_to_json(event), sort_keys=True)
