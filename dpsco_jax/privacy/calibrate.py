"""The one calibrator: the smallest noise multiplier whose ledger epsilon meets a target.

It searches on the epsilon a fresh :class:`~dpsco_jax.privacy.ledger.PrivacyLedger` reports
for the mechanism's events, so a run spends exactly what its calibration promised. RDP
(cheap) finds the answer to 1% when it can and PLD refines it (a bracketing secant search on
``(log z, log epsilon)``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Sequence

import dp_accounting

from dpsco_jax.cache import ByKey, bounded_cache

from dpsco_jax._checks import (check_choice, check_delta, check_epsilon, check_int,
                               check_positive, check_probability)
from dpsco_jax.privacy.accountant import supports
from dpsco_jax.privacy.events import OUTSIDE_ACCOUNTANT, event_key
from dpsco_jax.privacy.ledger import ACCOUNTANTS, PrivacyLedger
from dpsco_jax.privacy.relations import check_relation

__all__ = ["calibrate_noise_multiplier", "calibrate_poisson_sgd", "ledger_epsilon"]


def _as_list(x: Any) -> list:
  return list(x) if isinstance(x, (list, tuple)) else [x]


def ledger_epsilon(events: Sequence[Any], *, delta: float, relation: str,
                   accountant: str = "auto") -> float:
  """Exact epsilon of ``events`` composed by a fresh ledger (the calibrator's objective).

  Args:
    events: the events to compose.
    delta: the delta, in ``(0, 1)``.
    relation: the neighbouring relation.
    accountant: ``"pld"``, ``"rdp"`` or ``"auto"`` (default).

  Returns:
    The exact epsilon, a float.
  """
  ledger = PrivacyLedger(delta=delta, relation=relation, accountant=accountant)
  for i, e in enumerate(events):
    ledger.compose(e, label=f"event {i}")
  return ledger.epsilon(exact=True)


# The calibrator stops at a feasible z that spends the target to EPS_RTOL (relative), or
# within RTOL of the smallest feasible z (where epsilon moves in steps).
RTOL = 1e-6
EPS_RTOL = 1e-6


def _log_gap(eps_fn: Callable[[float], float], epsilon: float) -> Callable[[float], float]:
  """``z -> log(eps_fn(z) / epsilon)``, nearly linear in ``log z``; feasible where <= 0."""
  def gap(z: float) -> float:
    eps = eps_fn(z)
    if math.isnan(eps):
      raise ValueError("the accountant returned epsilon = NaN; no noise multiplier is "
                       "calibrated")
    if eps <= 0.0:
      return -50.0
    # a difference of logs: eps / epsilon overflows for a subnormal target
    return 50.0 if math.isinf(eps) else math.log(eps) - math.log(epsilon)
  return gap


def _solve(gap: Callable[[float], float], lo: float, guess: float | None = None,
           rtol: float = RTOL, slope: float | None = None) -> tuple[float, float | None]:
  """``(z, slope)``: the smallest z >= lo with ``gap(z) <= 0`` (``gap`` decreasing), to the
  tolerances; every returned z was evaluated and met the target. ``guess``: where to look
  first; ``slope``: a hint for d log eps / d log z; the returned slope is the final bracket's.
  Each step evaluates a little past the secant's root, narrowing the bracket ~10x."""
  tol, xlo, close = math.log1p(rtol), math.log(lo), math.log1p(-EPS_RTOL)
  a: tuple[float, float] | None = None   # infeasible: (log z, log(eps / epsilon) > 0)
  b: tuple[float, float] | None = None   # feasible
  last: list[tuple[float, float]] = []
  widths: list[float] = []
  x = math.log(max(lo, 1.0 if guess is None else guess))
  ups = 0
  for _ in range(200):
    fx = gap(math.exp(x))
    last = (last + [(x, fx)])[-2:]
    if fx <= 0.0:
      b = (x, fx)
      if x <= xlo:
        return lo, None
    else:
      a = (x, fx)
    if b is not None and (b[1] >= close or (a is not None and b[0] - a[0] <= tol)):
      break
    if a is not None and b is not None:
      s = (b[1] - a[1]) / (b[0] - a[0])
    elif len(last) == 2 and last[0][0] != last[1][0]:
      s = (last[1][1] - last[0][1]) / (last[1][0] - last[0][0])
    else:
      s = -1.0 if slope is None else slope   # a Gaussian's epsilon goes like 1/z
    s = min(s, -0.05)                    # decreasing; bounds the step
    x0, f0 = min((p for p in (a, b) if p is not None), key=lambda p: abs(p[1]))
    xp = x0 - f0 / s
    m = max(0.5 * tol, 0.1 * abs(xp - x0))
    if b is None:                        # only too little noise so far: up, at most x16
      ups += 1
      if ups > 10:                       # z up to ~1e12, as far as any budget needs
        raise ValueError(f"epsilon: no noise multiplier up to {math.exp(a[0]):.3g} reaches "
                         "the target epsilon (too small to calibrate for at this delta)")
      x = min(max(xp + m, a[0] + tol), a[0] + math.log(16.0))
    elif a is None:                      # only enough noise so far: down, not below lo
      x = max(xp - m, xlo, b[0] - math.log(16.0))
    else:
      w = b[0] - a[0]
      widths.append(w)
      m = max(m, 0.01 * w)               # an end on a flat PLD step predicts itself
      x = xp - m if fx <= 0.0 else xp + m   # past the prediction, toward the other end
      # a narrow bracket whose prediction is within the tolerance of an end: 0.9 tol in from
      # that end, so that landing on the other side closes the bracket at once
      if w <= 16 * tol and xp - a[0] < tol:
        x = a[0] + 0.9 * tol
      elif w <= 16 * tol and b[0] - xp < tol:
        x = b[0] - 0.9 * tol
      # the secant stalls where the curve is flat (a PLD step): bisect when two steps did not
      # halve the bracket
      if not a[0] < x < b[0] or (len(widths) >= 3 and w > 0.5 * widths[-3]):
        x = 0.5 * (a[0] + b[0])
  final = None if a is None else (b[1] - a[1]) / (b[0] - a[0])
  return math.exp(b[0]), final


def calibrate_noise_multiplier(make_event: Callable[[float], Any], *, epsilon: float,
                               delta: float, relation: str = "add_remove",
                               accountant: str = "auto", lower: float = 0.3,
                               fixed: Sequence[Any] = (), key: Hashable | None = None
                               ) -> float:
  """Smallest noise multiplier ``z >= lower`` with ``epsilon(make_event(z) + fixed) <=
  epsilon`` at ``delta``, as the ledger composes it (to ``EPS_RTOL`` / ``RTOL``).

  Args:
    make_event: ``z -> event`` (one event or a list, which may mix dp_accounting events with
      the library's blocks), the mechanism's event at noise multiplier ``z``.
    epsilon: the target epsilon.
    delta: the target delta, in ``(0, 1)``.
    relation: the neighbouring relation (default ``"add_remove"``).
    accountant: ``"pld"``, ``"rdp"`` or ``"auto"`` (default).
    lower: the smallest multiplier searched (default 0.3).
    fixed: events composed with ``make_event(z)`` that do not depend on ``z``.
    key: a hashable description of ``make_event`` (public numbers only) to memoize on (a wrong
      key could only pick a wrong z: every run charges its actual events).

  Returns:
    The noise multiplier ``z`` (noise std over the add/remove sensitivity), a float.
  """
  if key is not None:   # python numbers for the memo: a 0-d jax array is unhashable
    epsilon, delta = check_epsilon(epsilon), check_delta(delta)
    lower = check_positive(lower, "lower")
    fixed = tuple(_as_list(fixed))
    family = ByKey((make_event, fixed), (key, tuple(event_key(e) for e in fixed)))
    return _keyed_calibration(family, epsilon, delta, relation, accountant, lower)
  return _calibrate(make_event, epsilon=epsilon, delta=delta, relation=relation,
                    accountant=accountant, lower=lower, fixed=fixed)


@bounded_cache()
def _keyed_calibration(family: ByKey, epsilon: float, delta: float, relation: str,
                       accountant: str, lower: float) -> float:
  make_event, fixed = family.value
  return _calibrate(make_event, epsilon=epsilon, delta=delta, relation=relation,
                    accountant=accountant, lower=lower, fixed=fixed)


def _calibrate(make_event: Callable[[float], Any], *, epsilon: float, delta: float,
               relation: str, accountant: str, lower: float, fixed: Sequence[Any]) -> float:
  check_epsilon(epsilon)
  check_delta(delta)
  check_relation(relation)
  check_choice(accountant, "accountant", ACCOUNTANTS)
  check_positive(lower, "lower")
  fixed = _as_list(fixed)
  # the gap to the target of the ledger's epsilon under the accountant ``kind``
  gap_at = lambda kind: _log_gap(
      lambda z: ledger_epsilon(_as_list(make_event(z)) + fixed, delta=delta, relation=relation,
                               accountant=kind), epsilon)
  probe = _as_list(make_event(1.0)) + fixed
  plain = all(not isinstance(e, OUTSIDE_ACCOUNTANT) for e in probe)
  rdp_ok = plain and all(supports("rdp", relation, e) for e in probe)
  pld_ok = plain and all(supports("pld", relation, e) for e in probe)
  # PLD (tight, slow) refines what RDP (cheap) brackets, when both can read the events
  if rdp_ok and (accountant == "pld" or (accountant == "auto" and pld_ok)):
    # RDP's answer (1%) only says where to look; a tiny target may have none
    try:
      z_rdp, slope = _solve(gap_at("rdp"), lower, None, rtol=1e-2)
    except ValueError:
      z_rdp, slope = None, None
    # "auto" refines as the ledger will account (RDP below PLD's truncated tails)
    fine = "pld" if accountant == "pld" else "auto"
    return _solve(gap_at(fine), lower, z_rdp, slope=slope)[0]
  return _solve(gap_at(accountant), lower, None)[0]


def calibrate_poisson_sgd(sampling_rate: float, steps: int, *, epsilon: float, delta: float,
                          relation: str = "add_remove", accountant: str = "auto") -> float:
  """:func:`calibrate_noise_multiplier` of DP-SGD's ``steps`` Poisson-sampled Gaussians.

  Args:
    sampling_rate: the Poisson sampling rate ``q`` in ``(0, 1]``.
    steps: the number of steps.
    epsilon: the target epsilon.
    delta: the target delta, in ``(0, 1)``.
    relation: the neighbouring relation (default ``"add_remove"``).
    accountant: ``"pld"``, ``"rdp"`` or ``"auto"`` (default).

  Returns:
    The noise multiplier ``z``, a float.
  """
  # python numbers before the memo: a 0-d jax array is unhashable, a numpy int64 count is
  # not an int to the event checks
  return _poisson_sgd(check_probability(sampling_rate, "sampling_rate"),
                      check_int(steps, "steps"), epsilon=check_epsilon(epsilon),
                      delta=check_delta(delta), relation=relation, accountant=accountant)


def _poisson_sgd(sampling_rate: float, steps: int, *, epsilon: float, delta: float,
                 relation: str, accountant: str) -> float:
  return calibrate_noise_multiplier(
      lambda z: dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(z)),
          steps),
      epsilon=epsilon, delta=delta, relation=relation, accountant=accountant)


# the memo keeps the public name it has in dpsco_jax.cache.stats()
_poisson_sgd.__name__ = _poisson_sgd.__qualname__ = "calibrate_poisson_sgd"
_poisson_sgd = bounded_cache()(_poisson_sgd)
calibrate_poisson_sgd.cache_clear = _poisson_sgd.cache_clear
calibrate_poisson_sgd.cache_info = _poisson_sgd.cache_info
