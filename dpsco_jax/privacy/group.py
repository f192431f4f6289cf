"""Group privacy: lift an item-level accountant guarantee to groups of ``k`` items (users).

An ``(eps_i, delta_i)``-DP mechanism for one item is ``(k eps_i, k e^{(k-1) eps_i}
delta_i)``-DP for ``k`` items (Dwork & Roth 2014, Thm 2.2; Vadhan 2017, Lemma 2.2), so at a
target ``delta``: ``eps = k min { eps_i(delta_i) : k e^{(k-1) eps_i} delta_i' <= delta }``,
``delta_i' = delta_i + (1 + e^{eps_i}) tv``, ``eps_i`` the smaller of PLD's and RDP's answers
(``inf`` when no ``delta_i`` is feasible).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from dpsco_jax._checks import check_delta, check_epsilon, check_int, check_nonnegative
from dpsco_jax.privacy.accountant import pld_step_blocked
from dpsco_jax.privacy.events import for_accountant, validate_event
from dpsco_jax.privacy.ledger import PrivacyBudgetExceeded, make_accountant
from dpsco_jax.privacy.relations import check_relation

__all__ = ["GroupPrivacy", "group_privacy_epsilon"]

_LOG_DELTA_FLOOR = math.log(1e-300)  # below this the item delta underflows float64


@dataclasses.dataclass(frozen=True)
class GroupPrivacy:
  """A group-level guarantee and the item-level point it was lifted from.

  Attributes:
    epsilon: the group-level epsilon (``inf`` when no item delta meets ``delta``).
    delta: the group-level delta.
    item_epsilon: the item-level epsilon it was lifted from.
    item_delta: the item-level delta it was lifted from.
    accountant: the accountant that computed the item-level point.
    group_size: ``k``, the items per group.
  """
  epsilon: float
  delta: float
  item_epsilon: float
  item_delta: float
  accountant: str
  group_size: int


def _item_curve(event: Any, relation: str):
  """``delta_i -> (eps_i, accountant)``: min over the accountants that support ``event``."""
  accs = []
  for kind in ("pld", "rdp"):
    acc = make_accountant(kind, relation, event)
    converted = for_accountant(event, kind, relation)
    # PLD's grid of a tiny z or Laplace scale cannot be built (OverflowError, or memory the
    # process is killed for)
    if kind == "pld" and pld_step_blocked(event, relation):
      continue
    if acc.supports(converted):
      accs.append((kind, acc.compose(converted)))
  if not accs:
    raise ValueError(f"no accountant supports {event} under relation={relation!r}")

  def curve(delta_i: float) -> tuple[float, str]:
    best = (math.inf, accs[0][0])
    for kind, acc in accs:
      try:
        with np.errstate(all="ignore"):  # PLD overflows to inf below its tail mass: no bound
          eps = float(acc.get_epsilon(delta_i))
      except (ValueError, OverflowError):  # outside an accountant's range: not a bound
        continue
      if math.isfinite(eps) and eps < best[0]:
        best = (eps, kind)
    return best

  return curve


def _lifted_log_delta(eps_i: float, log_delta_i: float, k: int, tv: float) -> float:
  """``log(k e^{(k-1) eps_i} (delta_i + (1 + e^{eps_i}) tv))`` without overflow."""
  log_d = log_delta_i
  if tv > 0:
    log_d = float(np.logaddexp(log_d, np.logaddexp(0.0, eps_i) + math.log(tv)))
  return math.log(k) + (k - 1) * eps_i + log_d


def group_privacy_epsilon(event: Any, *, group_size: int, delta: float,
                          relation: str = "add_remove", tv_distance: float = 0.0,
                          epsilon_budget: float | None = None,
                          candidates: Sequence[float] = (), grid: int = 120
                          ) -> GroupPrivacy:
  """The smallest group-of-``group_size`` epsilon at ``delta`` of an item-level ``event``.

  Args:
    event: a dp_accounting event of the item-level mechanism.
    group_size: ``k >= 1`` items per group (user).
    delta: the group-level delta to meet.
    relation: the neighbouring relation of ``event``, applied to ``k`` items for the group
      (default ``"add_remove"``).
    tv_distance: total-variation distance between the run and ``event``.
    epsilon_budget: when set, the lifted epsilon must not exceed it.
    candidates: item deltas to try besides the grid (e.g. the calibration's target).
    grid: number of log-spaced item deltas in ``[1e-300, delta / k]``.

  Returns:
    :class:`GroupPrivacy`; ``epsilon = inf`` (with ``item_delta = 0``) when no item delta
    makes the lifted delta ``<= delta``.

  Raises:
    PrivacyBudgetExceeded: the lifted epsilon exceeds ``epsilon_budget``.
  """
  validate_event(event)
  k = check_int(group_size, "group_size")
  delta = check_delta(delta)
  relation = check_relation(relation)
  tv = check_nonnegative(tv_distance, "tv_distance")
  if epsilon_budget is not None:
    check_epsilon(epsilon_budget, "epsilon_budget")
  check_int(grid, "grid", minimum=2)
  curve = _item_curve(event, relation)
  log_target = math.log(delta)

  def feasible(log_di: float) -> tuple[bool, float, str]:
    eps_i, kind = curve(math.exp(log_di))
    ok = math.isfinite(eps_i) and _lifted_log_delta(eps_i, log_di, k, tv) <= log_target
    return ok, eps_i, kind

  logs = sorted(set(np.linspace(log_target - math.log(k), _LOG_DELTA_FLOOR, grid).tolist())
                | {math.log(c) for c in candidates if 0 < c < delta}, reverse=True)
  points = [feasible(log_di) for log_di in logs]
  best, j_best = (math.inf, 0.0, "pld"), None  # (eps_i, log delta_i, accountant)
  for j, (ok, eps_i, kind) in enumerate(points):
    if ok and eps_i < best[0]:
      best, j_best = (eps_i, logs[j], kind), j
  if j_best is not None and j_best > 0 and not points[j_best - 1][0]:
    lo, hi = logs[j_best], logs[j_best - 1]  # refine up to the feasibility boundary
    for _ in range(40):
      mid = 0.5 * (lo + hi)
      ok, eps_i, kind = feasible(mid)
      if ok and eps_i <= best[0]:
        best, lo = (eps_i, mid, kind), mid
      else:
        hi = mid
  eps = k * best[0]
  if epsilon_budget is not None and not eps <= epsilon_budget * (1 + 1e-9):
    raise PrivacyBudgetExceeded(
        f"group privacy over {k} items gives epsilon={eps:.4g} > budget "
        f"{epsilon_budget:.4g} at delta={delta:g}; nothing was released")
  item_delta = math.exp(best[1]) if math.isfinite(eps) else 0.0
  return GroupPrivacy(epsilon=eps, delta=delta, item_epsilon=best[0], item_delta=item_delta,
                      accountant=best[2], group_size=k)
