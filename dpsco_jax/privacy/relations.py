"""Neighbouring relations: the contract every mechanism states and the accountant reads.

* ``add_remove``: one user (item, at item level) is added or removed. The number of users
  ``n`` is **private**: a mechanism normalizes by a declared, data-independent denominator
  (e.g. ``q * n_declared`` under Poisson sampling, Abadi et al. 2016), never the realized
  count, and its sampling rate ``q`` is public. Clipped-sum sensitivity ``C``.
* ``replace_one``: one user's data is replaced; ``n`` is **public**. Clipped-sum sensitivity
  ``2C``. Papers 000 and 001 state their guarantees under it for ordered tuples of users:
  users are ordered by id and a replaced user keeps its id (the roster is public, not the
  data). Slot-based schedules (cyclic batches, 001's phase blocks, mesh shards) and 001's
  deletion-stability test rest on it.
* ``zero_out``: one user's data is replaced by a record that contributes nothing (Kairouz et
  al. 2021); ``n`` is **public**, so a full-batch mean over ``n`` is allowed. Clipped-sum
  sensitivity ``C``; dp_accounting reads it as add/remove, except inside sampling without
  replacement (replace-one's bound).

Convention: a Gaussian noise multiplier is ``z = sigma / C``, ``C`` the add/remove (zero-out)
sensitivity; under replace-one the accountant accounts for ``2C`` itself
(:func:`dpsco_jax.privacy.events.for_accountant`), so no stage doubles its noise.
"""

from __future__ import annotations

import dp_accounting

RELATIONS = ("add_remove", "replace_one", "zero_out")

#: What each relation treats as public (stated in reports and the README).
PUBLIC = {
    "add_remove": "the declared sampling rate and denominators; not the number of users",
    "replace_one": "the number of users n (and m items per user) and the roster of user ids "
                   "(a replaced user keeps its id and slot)",
    "zero_out": "the number of users n (and m items per user) and the roster of user ids; a "
                "zeroed user keeps its slot and contributes 0",
}


def check_relation(relation: object, *, supported: tuple[str, ...] = RELATIONS,
                   mechanism: str = "this mechanism") -> str:
  """Returns ``relation`` if it is one of ``supported``, else raises ``ValueError``.

  Args:
    relation: the relation to check.
    supported: the relations the caller honours (default: all of :data:`RELATIONS`).
    mechanism: the caller's name, for the message.

  Returns:
    ``relation``.
  """
  if not isinstance(relation, str) or relation not in RELATIONS:
    raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
  if relation not in supported:
    raise ValueError(f"{mechanism} cannot honour relation={relation!r}; supported: "
                     f"{supported}")
  return relation


def gaussian_sensitivity_factor(relation: str) -> float:
  """Sensitivity of a sum of contributions clipped at ``C``, in units of ``C`` (the one place
  the relation's factor is coded).

  Args:
    relation: ``add_remove``, ``replace_one`` or ``zero_out``.

  Returns:
    2.0 under ``replace_one``, else 1.0.
  """
  return 2.0 if check_relation(relation) == "replace_one" else 1.0


def contains(event: object, kind: type) -> bool:
  """Whether ``event`` (a dp_accounting event tree) contains a ``kind`` node."""
  if isinstance(event, kind):
    return True
  inner = getattr(event, "event", None)
  if inner is not None and contains(inner, kind):
    return True
  return any(contains(e, kind) for e in getattr(event, "events", ()) or ())


def accountant_relation(relation: str, event: object = None
                        ) -> dp_accounting.NeighboringRelation:
  """The dp_accounting relation that soundly accounts ``event`` under ``relation``."""
  relation = check_relation(relation)
  if relation == "replace_one":
    return dp_accounting.NeighboringRelation.REPLACE_ONE
  if relation == "zero_out" and event is not None and contains(
      event, dp_accounting.SampledWithoutReplacementDpEvent):
    return dp_accounting.NeighboringRelation.REPLACE_ONE
  return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
