"""The privacy ledger: the one place where privacy events are composed and budgets enforced.

Mechanisms describe themselves as events (:mod:`dpsco_jax.privacy.events`) built from public
configuration. The ledger composes them (:mod:`dpsco_jax.privacy.accountant`), adds pure-DP,
(epsilon, delta) and approximate-RDP blocks by basic composition, and enforces a budget
*before* a release (:meth:`PrivacyLedger.spend` raises and records nothing). Events of
different ``group`` names act on disjoint users (paper 000's phases): ``epsilon = max_g
epsilon(ungrouped + group_g)``.

Identical events are one entry with a count; :meth:`spend` / :meth:`epsilon` round counts up
to the grid ``1, 2, 3, 4, ceil(4 r^k)``, ``r = 2^(1/4)`` (``O(log T)`` evaluations, at most ~9%
above DP-SGD's exact epsilon), labelled ``upper_bound``. A budget is refused only on a lower
bound (:func:`epsilon_lower_bound`) or the exact epsilon, never on the grid bound.
``epsilon(exact=True)``, :meth:`report` and the calibrator are exact. State dicts carry a
SHA-256 digest that :meth:`PrivacyLedger.from_state_dict` checks.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from typing import Any

import dp_accounting

from dpsco_jax._checks import check_choice, check_delta, check_epsilon, check_nonnegative
from dpsco_jax.cache import ByKey, bounded_cache
from dpsco_jax.privacy.events import (OUTSIDE_ACCOUNTANT, ApproxDpEvent, ApproxRdpEvent,
                                      PureDpEvent, check_count, event_from_json, event_key,
                                      event_to_json, for_accountant, pure_dp_event,
                                      validate_event)
from dpsco_jax.privacy.relations import RELATIONS, check_relation
# the stateless accountant (re-exported: its callers read it here)
from dpsco_jax.privacy.accountant import (  # noqa: F401
    ACCOUNTANTS, EPSILON_KINDS, GRID_RATIO, PLD_DISCRETIZATION, Epsilon, accountant_epsilon,
    epsilon_lower_bound, gaussian_epsilon, grid_count, grid_floor, make_accountant)

__all__ = ["ACCOUNTANTS", "EPSILON_KINDS", "PLD_DISCRETIZATION", "ApproxDpEvent",
           "ApproxRdpEvent", "Epsilon", "PrivacyBudgetExceeded", "PrivacyLedger",
           "PrivacyReport", "Provenance", "PureDpEvent", "epsilon_lower_bound", "epsilon_of",
           "for_accountant", "pure_dp_event"]


class Provenance(str, enum.Enum):
  """Where a guarantee comes from: a paper's ``theorem`` (constants and preconditions hold),
  the ``accountant`` (exact composition of bounded-sensitivity mechanisms), a ``heuristic``,
  ``declared`` (holds only if the loss's declared constants, named in the notes, are true:
  neither verified nor enforced), or ``none`` (non-private runs, level ``none``)."""
  THEOREM = "theorem"
  ACCOUNTANT = "accountant"
  HEURISTIC = "heuristic"
  DECLARED = "declared"
  NONE = "none"


class PrivacyBudgetExceeded(RuntimeError):
  """Raised before a release that would take the ledger past its epsilon budget."""


class LedgerIntegrityError(ValueError):
  """A serialized ledger whose digest, configuration or events do not match."""


@bounded_cache(256)
def _shared_epsilon(parts: ByKey, delta: float, relation: str, accountant: str) -> Epsilon:
  """:func:`accountant_epsilon`, memoized across ledgers on the parts' canonical JSON."""
  return accountant_epsilon(list(parts.value), delta, relation=relation, accountant=accountant)


def epsilon_of(event: Any, *, delta: float, relation: str = "add_remove",
               accountant: str = "auto") -> float:
  """Exact epsilon of one (possibly composed) event at ``delta`` (a fresh ledger's).

  Args:
    event: the event (see :meth:`PrivacyLedger.compose`).
    delta: the delta, in ``(0, 1)``.
    relation: the neighbouring relation (default ``"add_remove"``).
    accountant: ``"pld"``, ``"rdp"`` or ``"auto"`` (default).

  Returns:
    The exact epsilon, a float.
  """
  ledger = PrivacyLedger(delta=delta, relation=relation, accountant=accountant)
  return ledger.compose(event, label="event").epsilon(exact=True)


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
  """What a result's privacy guarantee is and where it comes from.

  Attributes:
    epsilon: the guarantee's epsilon.
    delta: the guarantee's delta.
    provenance: a :class:`Provenance` value.
    level: ``"user"``, ``"item"`` or ``"none"`` (a non-private run).
    relation: the neighbouring relation (``add_remove``, ``replace_one``, ``zero_out``).
    mechanisms: the mechanisms composed.
    paper_epsilon: the paper's stated epsilon, when it differs from ``epsilon``.
    notes: free text (e.g. the declared constants the guarantee rests on).
    epsilon_kind: ``"exact"`` (the default: the epsilon of exactly what ran) or
      ``"upper_bound"`` (a cheaper number at or above it).
  """
  epsilon: float
  delta: float
  provenance: str
  level: str = "user"
  relation: str = "add_remove"
  mechanisms: tuple[str, ...] = ()
  paper_epsilon: float | None = None
  notes: str = ""
  epsilon_kind: str = "exact"

  def __post_init__(self):
    check_choice(self.provenance, "provenance", tuple(p.value for p in Provenance))
    check_choice(self.level, "level", ("user", "item", "none"))
    check_choice(self.relation, "relation", RELATIONS)
    check_choice(self.epsilon_kind, "epsilon_kind", EPSILON_KINDS)
    if (self.provenance == "none") != (self.level == "none"):
      raise ValueError("provenance 'none' is reserved for non-private results (level 'none')")

  def to_dict(self) -> dict:
    """Returns:
      The report as a JSON-able dict (``dataclasses.asdict``).
    """
    return dataclasses.asdict(self)

  def __str__(self) -> str:
    kind = self.epsilon_kind.replace("_", " ")
    paper = "" if self.paper_epsilon is None else f", paper epsilon {self.paper_epsilon:.4g}"
    return (f"({self.epsilon:.6g}, {self.delta:.3g})-DP, epsilon {kind}{paper} "
            f"[{self.provenance}; {self.level} level, {self.relation}]")


@dataclasses.dataclass
class _Entry:
  label: str
  event: Any
  group: str | None
  count: int
  key: str


class PrivacyLedger:
  """Host-side record of every privatized release of a run.

  Args:
    delta: the target delta at which epsilon is reported.
    epsilon_budget: optional cap; :meth:`spend` raises before exceeding it.
    relation: ``add_remove``, ``replace_one`` or ``zero_out``
      (:mod:`dpsco_jax.privacy.relations`).
    accountant: ``pld`` (tight), ``rdp``, or ``auto`` (PLD when it supports every event).
  """

  def __init__(self, *, delta: float, epsilon_budget: float | None = None,
               relation: str = "add_remove", accountant: str = "auto"):
    self.delta = check_delta(delta)
    self.epsilon_budget = None if epsilon_budget is None else check_epsilon(
        epsilon_budget, "epsilon_budget")
    self.relation = check_relation(relation)
    self.accountant = check_choice(accountant, "accountant", ACCOUNTANTS)
    self._entries: list[_Entry] = []
    self._lower_cache: dict[tuple, float] = {}

  @property
  def events(self) -> list[tuple[str, Any, str | None, int]]:
    return [(e.label, e.event, e.group, e.count) for e in self._entries]

  def _with(self, event: Any, label: str, group: str | None, count: int) -> list[_Entry]:
    count = check_count(count, "count")
    if not isinstance(label, str):
      raise TypeError(f"label must be a str, got {label!r}")
    # a name: groups are sorted (an int beside a str crashed there) and saved as JSON
    if group is not None and not isinstance(group, str):
      raise TypeError(f"group must be a str (the group's name) or None, got {group!r}")
    key = event_key(validate_event(event))  # refuses unknown or malformed events
    entries = [dataclasses.replace(e) for e in self._entries]
    for e in entries:
      if e.key == key and e.group == group:  # composition is commutative: merge counts
        e.count += count
        return entries
    return entries + [_Entry(label, event, group, count, key)]

  def compose(self, event: Any, *, label: str, group: str | None = None,
              count: int = 1) -> "PrivacyLedger":
    """Records ``count`` self-compositions of ``event`` (no budget check).

    Args:
      event: a ``dp_accounting`` event or a :class:`PureDpEvent`, :class:`ApproxDpEvent` or
        :class:`ApproxRdpEvent`.
      label: what the event is (shown in reports).
      group: the event's group: groups act on disjoint users (default none: every user).
      count: how many times ``event`` ran (default 1).

    Returns:
      This ledger (calls chain).
    """
    self._entries = self._with(event, label, group, count)
    return self

  def check(self, event: Any, *, label: str = "planned", group: str | None = None,
            count: int = 1) -> Epsilon:
    """The epsilon that spending ``event`` ``count`` times would reach; records nothing.

    Args:
      event: the event to be spent (see :meth:`compose`).
      label: what the event is (default ``"planned"``).
      group: its group (see :meth:`compose`).
      count: how many times it would run (default 1).

    Returns:
      The :class:`Epsilon` the ledger would reach (as :meth:`spend`, which raises alike).
    """
    return self._checked(self._with(event, label, group, count), label)

  def _lower_bound(self, entries: list[_Entry]) -> float:
    """:func:`epsilon_lower_bound` of the largest entry, counts rounded *down* to the grid."""
    best = 0.0
    for e in entries:
      if isinstance(e.event, OUTSIDE_ACCOUNTANT):
        continue
      key = (e.key, grid_floor(e.count), self.delta)
      if key not in self._lower_cache:
        self._lower_cache[key] = epsilon_lower_bound(e.event, delta=self.delta,
                                                     relation=self.relation, count=key[1])
      best = max(best, self._lower_cache[key])
    return best

  def _refuse(self, label: str, eps: float, what: str) -> None:
    raise PrivacyBudgetExceeded(
        f"releasing {label!r} would bring epsilon to {what}{eps:.4g} > budget "
        f"{self.epsilon_budget:.4g} at delta={self.delta:g}; nothing was released")

  def _checked(self, candidate: list[_Entry], label: str) -> Epsilon:
    """Grid bound of ``candidate``'s epsilon; the lower bound, then the exact value, decide."""
    over = lambda x: self.epsilon_budget is not None and x > self.epsilon_budget * (1 + 1e-9)
    if self.epsilon_budget is not None:
      low = self._lower_bound(candidate)
      if over(low):
        self._refuse(label, low, "at least ")
    eps = self._grid_epsilon(candidate, self.delta)
    if over(eps):
      eps = Epsilon(*self._epsilon(candidate, self.delta, rounded=False)[::2])
      if over(eps):
        self._refuse(label, eps, "")
    return eps

  def _grid_epsilon(self, entries: list[_Entry], delta: float) -> Epsilon:
    """The grid bound, labelled exact when rounding changed no count."""
    rounded = any(grid_count(e.count) != e.count for e in entries
                  if not isinstance(e.event, OUTSIDE_ACCOUNTANT))
    eps, _, kind = self._epsilon(entries, delta, rounded=True)
    return Epsilon(eps, "upper_bound" if rounded else kind)

  def spend(self, event: Any, *, label: str, group: str | None = None,
            count: int = 1) -> Epsilon:
    """Checks the budget, then records. Call it *before* releasing.

    Args:
      event: the event released (see :meth:`compose`).
      label: what was released (shown in reports).
      group: its group (see :meth:`compose`).
      count: how many times it ran (default 1).

    Returns:
      The new :class:`Epsilon`: the grid bound (``epsilon(exact=True)``: the exact value).

    Raises:
      PrivacyBudgetExceeded: the epsilon would exceed ``epsilon_budget``; nothing recorded.
    """
    candidate = self._with(event, label, group, count)  # validated once
    eps = self._checked(candidate, label)
    self._entries = candidate
    return eps

  def _group_eps(self, chosen: list[_Entry], delta: float, rounded: bool
                 ) -> tuple[float, float, str]:
    cnt = (lambda c: grid_count(c)) if rounded else (lambda c: c)
    parts = [(e.event, cnt(e.count)) for e in chosen
             if not isinstance(e.event, OUTSIDE_ACCOUNTANT)]
    key = tuple((event_key(ev), int(c)) for ev, c in parts)
    eps, extra_delta = _shared_epsilon(ByKey(parts, key), delta, self.relation,
                                       self.accountant), 0.0
    kind = eps.kind
    rdp: dict[tuple[float, float], list[float]] = {}
    for e in chosen:
      ev = e.event
      if isinstance(ev, PureDpEvent):
        eps += ev.epsilon * e.count
      elif isinstance(ev, ApproxDpEvent):
        eps += ev.epsilon * e.count
        extra_delta += ev.delta * e.count
      elif isinstance(ev, ApproxRdpEvent):
        acc = rdp.setdefault((ev.alpha, ev.delta_prime), [0.0, 0.0])
        acc[0] += ev.epsilon_rdp * e.count
        acc[1] += ev.delta_tv * e.count
    for (alpha, dprime), (eps_rdp, dtv) in rdp.items():  # paper 002, Corollary 1
      # -log(delta'): 1/delta' overflows to inf for a subnormal delta'
      e_conv = eps_rdp - math.log(dprime) / (alpha - 1.0)
      eps += e_conv
      extra_delta += dprime + (1.0 + math.exp(min(e_conv, 700.0))) * dtv
    return float(eps), extra_delta, kind

  def _epsilon(self, entries: list[_Entry], delta: float, rounded: bool
               ) -> tuple[float, float, str]:
    """(epsilon, extra delta of the blocks, kind) of ``entries``, max over groups."""
    if not entries:
      return 0.0, 0.0, "exact"
    groups = sorted({e.group for e in entries if e.group is not None}) or [None]
    best = (0.0, 0.0, "exact")
    for g in groups:
      chosen = [e for e in entries if e.group is None or e.group == g]
      eps, extra, kind = self._group_eps(chosen, delta, rounded)
      best = (max(best[0], eps), max(best[1], extra),
              "upper_bound" if "upper_bound" in (best[2], kind) else "exact")
    return best

  def epsilon(self, delta: float | None = None, *, exact: bool = False) -> Epsilon:
    """Epsilon of everything recorded so far.

    Args:
      delta: the delta to report epsilon at, in ``(0, 1)`` (default: the ledger's).
      exact: compose the exact counts rather than the cached grid bound (default False).

    Returns:
      An :class:`Epsilon` whose ``kind`` is ``"exact"`` or ``"upper_bound"``.
    """
    d = self.delta if delta is None else check_delta(delta)
    if exact:  # exact counts; still a bound where the accountant could not answer
      return Epsilon(*self._epsilon(self._entries, d, rounded=False)[::2])
    return self._grid_epsilon(self._entries, d)

  def extra_delta(self) -> float:
    """Delta contributed by (epsilon, delta) and approximate-RDP blocks.

    Returns:
      The sum of those blocks' deltas.
    """
    return self._epsilon(self._entries, self.delta, rounded=False)[1]

  def composed_event(self, group: str | None = None) -> dp_accounting.DpEvent:
    """The ungrouped accountant events plus those of ``group`` (blocks left out).

    Args:
      group: the group whose events join the ungrouped ones (default ``None``: ungrouped only).

    Returns:
      A ``dp_accounting.ComposedDpEvent``.
    """
    parts = [dp_accounting.SelfComposedDpEvent(e.event, e.count) if e.count > 1 else e.event
             for e in self._entries if (e.group is None or e.group == group)
             and not isinstance(e.event, OUTSIDE_ACCOUNTANT)]
    return dp_accounting.ComposedDpEvent(parts)

  def report(self, *, provenance: Provenance | str, level: str = "user",
             mechanisms: tuple[str, ...] = (), paper_epsilon: float | None = None,
             notes: str = "", extra_delta: float = 0.0,
             tv_distance: float = 0.0) -> PrivacyReport:
    """A :class:`PrivacyReport` for the recorded events (exact epsilon).

    Delta: the ledger's (when accountant events were recorded) + the blocks' + ``extra_delta``
    + ``(1 + e^eps) tv``, for a run within total variation ``tv`` of the accounted mechanism
    ``M'`` (e.g. truncated Poisson sampling): ``P[M(D) in S] <= P[M'(D) in S] + tv <= e^eps
    P[M(D') in S] + delta + (1 + e^eps) tv``.

    Args:
      provenance: where the guarantee comes from (a :class:`Provenance` or its value).
      level: ``"user"`` (default), ``"item"`` or ``"none"``.
      mechanisms: the mechanisms' names (default: the recorded events' labels).
      paper_epsilon: the epsilon the paper's theorem states, when it differs (default none).
      notes: free text for the report (e.g. the declared constants it rests on).
      extra_delta: a delta to add, >= 0 (default 0).
      tv_distance: the total variation distance to the accounted mechanism, >= 0 (default 0).

    Returns:
      The :class:`PrivacyReport`.
    """
    # checked python floats: a NaN passed "< 0" into a NaN delta, a float16 one rounded the
    # whole delta in float16 (below the true sum)
    tv_distance = check_nonnegative(tv_distance, "tv_distance")
    extra_delta = check_nonnegative(extra_delta, "extra_delta")
    eps, blocks_delta, kind = self._epsilon(self._entries, self.delta, rounded=False)
    spent = any(not isinstance(e.event, OUTSIDE_ACCOUNTANT) for e in self._entries)
    delta = ((self.delta if spent else 0.0) + blocks_delta + extra_delta
             + (1.0 + math.exp(min(eps, 700.0))) * tv_distance)
    return PrivacyReport(epsilon=eps, delta=delta,
                         provenance=Provenance(provenance).value, level=level,
                         relation=self.relation,
                         mechanisms=tuple(mechanisms) or tuple(e.label for e in self._entries),
                         paper_epsilon=paper_epsilon, notes=notes, epsilon_kind=kind)

  def config(self) -> dict:
    """Returns:
      The configuration :meth:`state_dict` records: ``{"delta", "epsilon_budget",
      "relation", "accountant"}``.
    """
    return {"delta": self.delta, "epsilon_budget": self.epsilon_budget,
            "relation": self.relation, "accountant": self.accountant}

  def state_dict(self) -> dict:
    """Returns:
      JSON-able ``{"config", "entries", "digest"}``, a SHA-256 digest over the first two.
    """
    body = {"config": self.config(),
            "entries": [{"label": e.label, "event": event_to_json(e.event), "group": e.group,
                         "count": e.count} for e in self._entries]}
    return {**body, "digest": _digest(body)}

  @classmethod
  def from_state_dict(cls, state: dict, *, expect_config: dict | None = None
                      ) -> "PrivacyLedger":
    """Rebuilds a ledger from :meth:`state_dict`, refusing any edited state.

    Args:
      state: a dict from :meth:`state_dict`.
      expect_config: the configuration the ledger must have (see :meth:`config`), e.g. to
        refuse a raised budget; default ``None``: not checked.

    Returns:
      The rebuilt :class:`PrivacyLedger` (else :class:`LedgerIntegrityError`).
    """
    try:
      body = {"config": state["config"], "entries": state["entries"]}
      digest = state["digest"]
    except (KeyError, TypeError) as err:
      raise LedgerIntegrityError(f"malformed ledger state: missing {err}") from None
    if _digest(body) != digest:
      raise LedgerIntegrityError("ledger state does not match its digest: it was edited")
    if expect_config is not None and body["config"] != expect_config:
      raise LedgerIntegrityError(f"ledger configuration {body['config']} differs from the "
                                 f"expected {expect_config}")
    ledger = cls(**body["config"])
    for e in body["entries"]:
      ledger.compose(event_from_json(e["event"]), label=e["label"], group=e["group"],
                     count=e["count"])
    return ledger


def _digest(body: dict) -> str:
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
