"""The privacy ledger: one host-side accountant layer on top of ``dp_accounting``.

Mechanisms describe themselves as ``dp_accounting.DpEvent`` objects built from their static
configuration (noise multiplier, sampling, steps), never from data. The ledger composes them,
converts to (epsilon, delta) with the PLD accountant (tight) or the RDP accountant (for events
PLD does not support, e.g. sampling without replacement or tree aggregation), calibrates noise
for a target epsilon, and enforces a budget *before* a release.

Pure-DP pieces (AboveThreshold, Laplace tests) enter as :class:`PureDpEvent` and are added by
basic composition on top of the accountant's epsilon (sound for any eps-DP mechanism).

Parallel composition. Events tagged with different ``group`` names act on disjoint sets of
users (e.g. the disjoint phases of paper 000); a user is touched by the ungrouped events and by
at most one group, so ``epsilon = max_g epsilon(ungrouped + group_g)``.

Provenance. Every result states how its guarantee was obtained: ``theorem`` (paper constants and
preconditions hold), ``accountant`` (this ledger, exact composition of mechanisms with bounded
sensitivity), ``heuristic`` (constants outside any proof).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Callable

import dp_accounting
from dp_accounting import mechanism_calibration
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpsco_jax._checks import check_choice, check_delta, check_epsilon, check_int

# RDP drops orders whose series does not converge and says so once per order: noise, not news.
logging.getLogger("absl").setLevel(logging.ERROR)

RELATIONS = {
    "add_remove": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    "replace_one": dp_accounting.NeighboringRelation.REPLACE_ONE,
    "replace_special": dp_accounting.NeighboringRelation.REPLACE_SPECIAL,
}
ACCOUNTANTS = ("pld", "rdp", "auto")
# PLD discretization of the privacy-loss values. dp_accounting's PLD is pessimistic (rounds
# losses up), so a coarser grid still yields a valid upper bound on epsilon; 1e-3 changes
# epsilon in the 5th digit on DP-SGD workloads and is ~10x faster than the 1e-4 default.
PLD_DISCRETIZATION = 1e-3


class Provenance(str, enum.Enum):
  THEOREM = "theorem"
  ACCOUNTANT = "accountant"
  HEURISTIC = "heuristic"
  NONE = "none"  # non-private reference runs only (level "none"): no guarantee at all


class PrivacyBudgetExceeded(RuntimeError):
  """Raised before a release that would take the ledger past its epsilon budget."""


def for_accountant(event: dp_accounting.DpEvent, kind: str, relation: str
                   ) -> dp_accounting.DpEvent:
  """Rewrites ``event`` so that ``kind``'s accountant reads the library's convention.

  Convention: a Gaussian noise multiplier is ``z = sigma / C`` with ``C`` the add/remove
  sensitivity (the clip norm), whatever the neighbouring relation. dp_accounting 0.6.0's PLD
  accountant follows it (under replace-one it doubles the sensitivity itself); its RDP
  accountant ignores the relation for Gaussians (also inside sampling-without-replacement,
  whose Wang et al. bound is stated for the replace-one sensitivity ``2C``), so under
  replace-one every Gaussian (and Laplace) multiplier is halved before RDP sees it — else RDP
  would under-report epsilon (e.g. ~2x at z = 2)."""
  if kind != "rdp" or relation != "replace_one":
    return event
  def rewrite(ev):
    if isinstance(ev, dp_accounting.GaussianDpEvent):
      return dp_accounting.GaussianDpEvent(ev.noise_multiplier / 2.0)
    if isinstance(ev, dp_accounting.LaplaceDpEvent):
      return dp_accounting.LaplaceDpEvent(ev.noise_multiplier / 2.0)
    if isinstance(ev, dp_accounting.SelfComposedDpEvent):
      return dp_accounting.SelfComposedDpEvent(rewrite(ev.event), ev.count)
    if isinstance(ev, dp_accounting.ComposedDpEvent):
      return dp_accounting.ComposedDpEvent([rewrite(e) for e in ev.events])
    if isinstance(ev, dp_accounting.PoissonSampledDpEvent):
      return dp_accounting.PoissonSampledDpEvent(ev.sampling_probability, rewrite(ev.event))
    if isinstance(ev, dp_accounting.SampledWithoutReplacementDpEvent):
      return dp_accounting.SampledWithoutReplacementDpEvent(
          ev.source_dataset_size, ev.sample_size, rewrite(ev.event))
    if isinstance(ev, dp_accounting.SampledWithReplacementDpEvent):
      return dp_accounting.SampledWithReplacementDpEvent(
          ev.source_dataset_size, ev.sample_size, rewrite(ev.event))
    return ev
  return rewrite(event)


def _make_accountant(kind: str, relation: str, event: dp_accounting.DpEvent | None = None):
  rel = RELATIONS[relation]
  if kind == "auto":
    pld = pld_privacy_accountant.PLDAccountant(rel)
    kind = "pld" if event is None or pld.supports(event) else "rdp"
  if kind == "pld":
    return pld_privacy_accountant.PLDAccountant(rel, PLD_DISCRETIZATION)
  return rdp_privacy_accountant.RdpAccountant(neighboring_relation=rel)


def epsilon_of(event: dp_accounting.DpEvent, *, delta: float, relation: str = "add_remove",
               accountant: str = "auto") -> float:
  """Epsilon of one (possibly composed) event at ``delta``."""
  check_delta(delta)
  check_choice(relation, "relation", tuple(RELATIONS))
  check_choice(accountant, "accountant", ACCOUNTANTS)
  if isinstance(event, PureDpEvent):
    return event.epsilon
  acc = _make_accountant(accountant, relation, event)
  kind = "pld" if isinstance(acc, pld_privacy_accountant.PLDAccountant) else "rdp"
  event = for_accountant(event, kind, relation)
  if not acc.supports(event):
    raise ValueError(f"accountant {type(acc).__name__} does not support {event} under "
                     f"relation={relation!r}")
  acc.compose(event)
  return float(acc.get_epsilon(delta))


@dataclasses.dataclass(frozen=True)
class PureDpEvent:
  """An arbitrary epsilon-DP mechanism (AboveThreshold, a one-shot Laplace test, a truncated
  discrete Laplace release, ...).

  It is deliberately *not* a ``dp_accounting`` event: a Laplace event of scale ``1/eps`` has a
  privacy-loss distribution that does not dominate every eps-DP mechanism (it would
  under-count AboveThreshold), and dp_accounting 0.6.0's randomized-response event — the
  dominating pair — is only supported under replace-one and ignores composition counts. The
  ledger therefore adds pure-DP epsilons by basic composition on top of the accountant's
  epsilon, which is sound for any mix: ``(eps_a, delta) + (eps_1, 0) + ... = (eps_a + sum
  eps_i, delta)``."""
  epsilon: float


def pure_dp_event(epsilon: float) -> PureDpEvent:
  """An epsilon-DP event (composed by basic composition; see :class:`PureDpEvent`)."""
  return PureDpEvent(check_epsilon(epsilon))


def calibrate_noise_multiplier(make_event: Callable[[float], dp_accounting.DpEvent], *,
                               epsilon: float, delta: float, relation: str = "add_remove",
                               accountant: str = "auto", lower: float = 0.3) -> float:
  """Smallest noise multiplier ``z`` with ``epsilon(make_event(z)) <= epsilon`` at ``delta``.

  ``lower`` is the smallest multiplier searched: below ~0.3 the PLD of many composed
  steps becomes enormous, and such tiny noise is never the answer for a useful budget."""
  check_epsilon(epsilon)
  check_delta(delta)
  check_choice(relation, "relation", tuple(RELATIONS))
  probe = make_event(1.0)
  kind = accountant
  if kind == "auto":
    kind = "pld" if _make_accountant("pld", relation).supports(probe) else "rdp"

  def solve(k: str, bracket) -> float:
    return float(mechanism_calibration.calibrate_dp_mechanism(
        lambda: _make_accountant(k, relation),
        lambda z: for_accountant(make_event(z), k, relation), epsilon, delta,
        bracket_interval=bracket))

  wide = mechanism_calibration.LowerEndpointAndGuess(lower, max(2 * lower, 1.0))
  if not _make_accountant("rdp", relation).supports(probe):
    return solve(kind, wide)  # e.g. a plain Gaussian under replace-one: PLD only
  z_rdp = solve("rdp", wide)
  if kind == "rdp":
    return z_rdp
  # PLD is tighter than RDP, so its answer lies below z_rdp: bracket there (cheap PLDs only).
  try:
    return solve("pld", mechanism_calibration.ExplicitBracketInterval(0.5 * z_rdp, 1.01 * z_rdp))
  except ValueError:
    return solve("pld", mechanism_calibration.LowerEndpointAndGuess(lower, z_rdp))


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
  """What a result's privacy guarantee is and where it comes from."""
  epsilon: float
  delta: float
  provenance: str
  level: str = "user"
  relation: str = "add_remove"
  mechanisms: tuple[str, ...] = ()
  paper_epsilon: float | None = None
  notes: str = ""

  def __post_init__(self):
    check_choice(self.provenance, "provenance", tuple(p.value for p in Provenance))
    check_choice(self.level, "level", ("user", "item", "none"))
    if (self.provenance == "none") != (self.level == "none"):
      raise ValueError("provenance 'none' is reserved for non-private results (level 'none')")

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class _Entry:
  label: str
  event: dp_accounting.DpEvent
  group: str | None
  count: int


class PrivacyLedger:
  """Host-side record of every privatized release of a run.

  Args:
    delta: the target delta at which epsilon is reported.
    epsilon_budget: optional cap; :meth:`spend` raises before exceeding it.
    relation: the neighbouring relation (``add_remove`` or ``replace_one``); user-level papers
      000 and 001 use replace-one.
    accountant: ``pld`` (tight), ``rdp``, or ``auto`` (PLD when it supports every event).
  """

  def __init__(self, *, delta: float, epsilon_budget: float | None = None,
               relation: str = "add_remove", accountant: str = "auto"):
    self.delta = check_delta(delta)
    self.epsilon_budget = None if epsilon_budget is None else check_epsilon(
        epsilon_budget, "epsilon_budget")
    self.relation = check_choice(relation, "relation", tuple(RELATIONS))
    self.accountant = check_choice(accountant, "accountant", ACCOUNTANTS)
    self._entries: list[_Entry] = []

  @property
  def events(self) -> list[tuple[str, dp_accounting.DpEvent, str | None, int]]:
    return [(e.label, e.event, e.group, e.count) for e in self._entries]

  def compose(self, event: dp_accounting.DpEvent, *, label: str, group: str | None = None,
              count: int = 1) -> "PrivacyLedger":
    """Records ``count`` self-compositions of ``event`` (no budget check)."""
    check_int(count, "count", minimum=1)
    self._entries.append(_Entry(label, event, group, int(count)))
    return self

  def spend(self, event: dp_accounting.DpEvent, *, label: str, group: str | None = None,
            count: int = 1) -> float:
    """Checks the budget, then records. Call it *before* releasing; returns the new epsilon.

    Raises:
      PrivacyBudgetExceeded: when the composed epsilon would exceed ``epsilon_budget``.
    """
    check_int(count, "count", minimum=1)
    candidate = self._entries + [_Entry(label, event, group, int(count))]
    eps = self._epsilon(candidate, self.delta)
    if self.epsilon_budget is not None and eps > self.epsilon_budget * (1 + 1e-9):
      raise PrivacyBudgetExceeded(
          f"releasing {label!r} would bring epsilon to {eps:.4g} > budget "
          f"{self.epsilon_budget:.4g} at delta={self.delta:g}; nothing was released")
    self._entries = candidate
    return eps

  def composed_event(self, group: str | None = None) -> dp_accounting.DpEvent:
    """The ungrouped accountant events plus those of ``group`` as one ``ComposedDpEvent``
    (pure-DP entries are not dp_accounting events and are left out)."""
    parts = [dp_accounting.SelfComposedDpEvent(e.event, e.count) if e.count > 1 else e.event
             for e in self._entries if (e.group is None or e.group == group)
             and not isinstance(e.event, PureDpEvent)]
    return dp_accounting.ComposedDpEvent(parts)

  def _epsilon(self, entries: list[_Entry], delta: float) -> float:
    if not entries:
      return 0.0
    groups = sorted({e.group for e in entries if e.group is not None}) or [None]
    best = 0.0
    for g in groups:
      chosen = [e for e in entries if e.group is None or e.group == g]
      pure = sum(e.event.epsilon * e.count for e in chosen if isinstance(e.event, PureDpEvent))
      selected = [e for e in chosen if not isinstance(e.event, PureDpEvent)]
      if not selected:
        best = max(best, pure)
        continue
      kind = self.accountant
      if kind == "auto":
        pld = _make_accountant("pld", self.relation)
        kind = "pld" if all(pld.supports(e.event) for e in selected) else "rdp"
      acc = _make_accountant(kind, self.relation)
      for e in selected:
        event = for_accountant(e.event, kind, self.relation)
        if not acc.supports(event):
          raise ValueError(f"{type(acc).__name__} cannot account for {e.label!r} "
                           f"({e.event}) under relation={self.relation!r}")
        acc.compose(event, e.count)
      best = max(best, float(acc.get_epsilon(delta)) + pure)
    return best

  def epsilon(self, delta: float | None = None) -> float:
    """Epsilon of everything recorded so far at ``delta`` (default: the ledger's)."""
    return self._epsilon(self._entries, self.delta if delta is None else check_delta(delta))

  def report(self, *, provenance: Provenance | str, level: str = "user",
             mechanisms: tuple[str, ...] = (), paper_epsilon: float | None = None,
             notes: str = "", extra_delta: float = 0.0) -> PrivacyReport:
    """A :class:`PrivacyReport` for the recorded events (``extra_delta`` adds e.g. a
    truncation probability that sits outside the accountant)."""
    return PrivacyReport(epsilon=self.epsilon(), delta=self.delta + extra_delta,
                         provenance=Provenance(provenance).value, level=level,
                         relation=self.relation,
                         mechanisms=tuple(mechanisms) or tuple(e.label for e in self._entries),
                         paper_epsilon=paper_epsilon, notes=notes)
