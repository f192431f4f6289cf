"""Private hyper-parameter selection (Papernot & Steinke, ICLR 2022): :func:`private_select`
and its cost before anything runs, :func:`private_select_cost` (the law, bound and report are
:mod:`dpsco_jax.privacy.selection`'s).

The candidates are plans, one per grid point, each a private run on the same users. ``K`` is
drawn from a public law with a key of its own, ``K`` candidates drawn uniformly are trained
(each with a fresh key) and only the best by a score declared public (``metric_data="public"``:
computed without the training users) is released. The guarantee covers training *and*
selection (provenance ``theorem``), the same number as the YAML runner's ``select.private``
(both use :func:`plans_cost` and :func:`best_of_k`). ``K``, the candidates drawn and their
scores are secret: nothing here prints, records or returns them (no wall time either).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable, TypeVar

import jax
import numpy as np

from dpsco_jax._checks import check_choice, check_key
from dpsco_jax.api import Plan, run
from dpsco_jax.config.types import ConfigError
from dpsco_jax.privacy.ledger import PrivacyReport
from dpsco_jax.privacy.selection import (DISTRIBUTIONS, SelectionCost, SelectionLaw,
                                         law_for_grid, selection_cost)
from dpsco_jax.result import NonFiniteRelease
from dpsco_jax.smoothing import num_params

__all__ = ["private_select", "private_select_cost", "SelectionResult", "selection_law",
           "plans_cost", "best_of_k", "METRIC_DATA", "RULES", "LAW_KEYS"]

#: what a private selection's score may read: data that is not the training users'
METRIC_DATA = ("public",)
RULES = ("min", "max")
LAW_KEYS = ("distribution", "eta", "gamma")
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class SelectionResult:
  """What a private selection releases: the best candidate's model and grid point and the
  guarantee of training and selection; nothing else (no ``K``, no other candidate, no time).

  Attributes:
    params: the released parameters of the best run.
    config: the winner's algorithm config (its public grid point).
    plan: the winner's plan (public: one of the candidates the caller passed).
    score: the winner's score on the caller's public data (a function of the release).
    privacy: the guarantee of training and selection (provenance ``theorem``; the law and
      ``E[K]`` in its notes).
    cost: what the selection was announced to cost before it ran.
  """
  params: Any
  config: Any
  plan: Any
  score: float
  privacy: PrivacyReport
  cost: SelectionCost


def selection_law(law: SelectionLaw | Mapping, candidates: int) -> SelectionLaw:
  """The law of ``K``: ``law`` itself, or built from ``{distribution, eta, gamma}`` (without
  ``gamma``: ``E[K]`` = ``candidates``); a ``ValueError`` names an unknown key or bad value."""
  if isinstance(law, SelectionLaw):
    return law
  if not isinstance(law, Mapping):
    raise TypeError(f"law must be a SelectionLaw or a mapping {{distribution, eta, gamma}}, "
                    f"got {type(law).__name__}")
  unknown = set(law) - set(LAW_KEYS)
  if unknown:
    raise ValueError(f"law: unknown key(s) {', '.join(sorted(map(str, unknown)))}; it reads "
                     f"{', '.join(LAW_KEYS)}")
  return law_for_grid(candidates, law.get("distribution", DISTRIBUTIONS[0]),
                      eta=law.get("eta"), gamma=law.get("gamma"))


def _event_of(plan: Any) -> Any:
  """A candidate's plan's event, when that is its whole guarantee."""
  detail = getattr(plan, "detail", None)
  if getattr(detail, "event", None) is None or getattr(detail, "group_size", 1) != 1:
    raise ConfigError(f"{plan.algorithm}'s plan does not expose one privacy event that is its "
                      "whole guarantee (needed for the candidates' RDP curves): private "
                      "selection runs the DP-SGD family (no group privacy)")
  return detail.event


def _same(plans: Sequence[Any], what: str, get: Callable[[Any], Any]) -> Any:
  values = {repr(get(p)) for p in plans}
  if len(values) > 1:
    raise ConfigError(f"the candidates differ in {what} ({', '.join(sorted(values))}): a "
                      "selection's guarantee is one guarantee over one set of users")
  return get(plans[0])


def best_of_k(law: SelectionLaw, n: int, key: jax.Array, train_key: jax.Array,
              train: Callable[[int, jax.Array], tuple[float | None, T]],
              rule: str) -> T | None:
  """The selection's loop: ``K ~ law`` (``fold_in(key, 0)``), ``K`` candidates drawn uniformly
  from ``n`` (``fold_in(key, 1)``), the ``j``-th trained by ``train(index, fold_in(train_key,
  j)) -> (score or None if not eligible, output)``. Returns the best output by ``rule``
  (``min`` / ``max``), ``None`` when none was eligible; ``K``, draws and scores stay here."""
  k = int(law.sample(jax.random.fold_in(key, 0)))
  picks = np.asarray(jax.random.randint(jax.random.fold_in(key, 1), (k,), 0, n))
  sign = 1.0 if rule == "min" else -1.0
  best, best_score = None, math.inf
  for j, i in enumerate(picks):
    score, out = train(int(i), jax.random.fold_in(train_key, j))
    if score is not None and sign * score < best_score:
      best, best_score = out, sign * score
  return best


def private_select_cost(plans: Sequence[Any], law: SelectionLaw | Mapping) -> SelectionCost:
  """What :func:`private_select` over ``plans`` costs, before anything runs: the expected
  number of runs, one candidate's epsilon, and the epsilon of training and selection.

  Args:
    plans: the candidates' plans, one per grid point (:func:`dpsco_jax.plan`), of one
      relation, level and delta.
    law: the law of ``K``: a :class:`~dpsco_jax.privacy.selection.SelectionLaw` or a mapping
      ``{distribution, eta, gamma}`` (without ``gamma``: ``E[K]`` = the number of plans).

  Returns:
    The :class:`~dpsco_jax.privacy.selection.SelectionCost` (``line()`` says it in words).

  Raises:
    ConfigError: a plan without one privacy event (not the DP-SGD family, group privacy), or
      plans of different relations, levels or deltas.
    ValueError: a bad law parameter.
  """
  plans = list(plans)
  if not plans:
    raise ConfigError("plans: a selection needs at least one candidate")
  law = selection_law(law, len(plans))
  events = [_event_of(p) for p in plans]
  relation = _same(plans, "relation", lambda p: p.privacy.relation)
  level = _same(plans, "level", lambda p: p.privacy.level)
  delta = _same(plans, "delta", lambda p: p.detail.delta)
  tv = max(getattr(p.detail, "truncation_probability", 0.0) for p in plans)
  return selection_cost(law, events, delta=delta, relation=relation, level=level,
                        tv_distance=tv,
                        candidate_epsilon=max(p.privacy.epsilon for p in plans))


#: the YAML runner's name for it
plans_cost = private_select_cost


def _check_candidates(plans: list, data: Any, params: Any) -> None:
  """Every plan fits ``data`` and ``params``, checked before any run (a misfit at the j-th run
  would tell how far the selection got)."""
  n_params = num_params(params)
  for i, p in enumerate(plans):
    if not isinstance(p, Plan):
      raise TypeError(f"plans[{i}] must be a Plan (dpsco_jax.plan(...)), got "
                      f"{type(p).__name__}")
    p.check_unchanged()
    facts = (p.spec.n_users, p.spec.max_items_per_user, p.num_params)
    if facts != (data.spec.n_users, data.spec.max_items_per_user, n_params):
      raise ValueError(f"plans[{i}] was made for {facts[0]} users x {facts[1]} items and "
                       f"{facts[2]} parameters, the data and params have {data.spec.n_users} "
                       f"x {data.spec.max_items_per_user} and {n_params}: every candidate is "
                       "a run on the same users")


def private_select(plans: Sequence[Any], law: SelectionLaw | Mapping, loss_fn: Callable,
                   params: Any, data: Any, key: jax.Array, *,
                   score: Callable[[Any], float], metric_data: str | None = None,
                   rule: str = "min") -> SelectionResult:
  """Private selection among ``plans``: ``K ~ law`` runs of a uniformly drawn candidate on
  ``data`` (each :func:`dpsco_jax.run` with its own key; ``K`` with a key of its own), the best
  by ``score`` released with the guarantee of training and selection. A candidate whose
  release or score is not finite is not eligible.

  Args:
    plans: the candidates' plans, one per grid point, all made for ``data.spec`` and
      ``params`` (:func:`dpsco_jax.plan`; the DP-SGD family).
    law: the law of ``K`` (see :func:`private_select_cost`).
    loss_fn: ``loss_fn(params, item) -> scalar``, as :func:`dpsco_jax.run` takes it.
    params: the initial parameters.
    data: the training users (:class:`~dpsco_jax.data.UserData`).
    key: the selection's JAX PRNG key.
    score: ``score(params) -> float`` of a released model, computed without the training
      users (e.g. a loss on held-out public data the function closes over).
    metric_data: what ``score`` reads; must be ``"public"`` (a declaration: a score read from
      the training users without noise is outside the theorem).
    rule: ``"min"`` (default: lower is better) or ``"max"``.

  Returns:
    A :class:`SelectionResult`: the winner's params, config, plan and score, the privacy
    report of training and selection, and the announced cost.

  Raises:
    ConfigError: ``metric_data`` is not ``"public"``; a plan without one privacy event;
      plans of different relations, levels or deltas (all before any run).
    ValueError: a bad law or ``rule``; a plan that does not fit ``data`` / ``params``.
    RuntimeError: no candidate run was eligible.
  """
  if metric_data not in METRIC_DATA:
    raise ConfigError(f"metric_data: a private selection reads a score declared public "
                      f"(metric_data='public': computed without the training users, e.g. on "
                      f"held-out public data), got {metric_data!r}; a score read from the "
                      "training users without noise is not covered by the guarantee")
  if not callable(score):
    raise TypeError(f"score must be callable: score(params) -> float, got "
                    f"{type(score).__name__}")
  check_choice(rule, "rule", RULES)
  key = check_key(key)
  plans = list(plans)
  cost = plans_cost(plans, law)
  _check_candidates(plans, data, params)

  def train(i: int, run_key: jax.Array) -> tuple[float | None, tuple]:
    try:
      result = run(plans[i], loss_fn, params, data, run_key)
    except NonFiniteRelease:   # a diverging grid point is not eligible
      return None, None
    out = score(result.params)
    try:
      value = float(out)
    except (TypeError, ValueError):   # its type and shape only: the value is the release's
      raise TypeError(f"score must return one number: score(params) -> float, got "
                      f"{type(out).__name__} of shape {getattr(out, 'shape', None)}") from None
    return (value if math.isfinite(value) else None), (i, result.params, value)

  best = best_of_k(cost.law, len(plans), jax.random.fold_in(key, 0),
                   jax.random.fold_in(key, 1), train, rule)
  if best is None:
    raise RuntimeError("private selection: no candidate run was eligible (every release or "
                       "score was not finite)")
  i, released, value = best
  return SelectionResult(released, plans[i].config, plans[i], value, cost.report, cost)
