"""Issue 47.1: a plan has one named protocol. Every registered algorithm's family plan
(``Plan.detail``) is a :class:`~dpsco_jax.algorithms.registration.FamilyPlan`: its Gaussian
noise stages (each a ``GaussianStage`` carrying its sensitivity), its ``dp_accounting``
events, and ``charge()``, the guarantee of those events; the plan's guarantee is exactly
``detail.charge()``, so what a run spends (it reports the plan's) is what the plan's events
cost. Where the accountant composes the events directly (``accountant`` provenance, not lifted
by group privacy), a fresh ledger spending ``events`` gives the same epsilon. The broken twin:
a detail whose events are not the planned ones gives another guarantee, and both comparisons
catch it.
"""

from __future__ import annotations

import dataclasses

import dp_accounting
import pytest

from dpsco_jax import api
from dpsco_jax.algorithms.registration import FamilyPlan, registered
from dpsco_jax.privacy import GaussianStage, PrivacyLedger, PrivacyReport, Sensitivity
from dpsco_jax.privacy.sensitivity import gaussian_noise_std

import test_plan_is_what_runs as user_cases
import test_plan_is_what_runs_resque_bilevel as problem_cases


def _plan(case: str):
  if case in user_cases.CASES:
    return user_cases._plan_and_inputs(case)[0]
  kind, cfg = problem_cases.CASES[case]
  return api.plan_problem(case, cfg, problem_cases._problem(kind))


def _composed_epsilon(p, events) -> float:
  ledger = PrivacyLedger(delta=p.privacy.delta, relation=p.privacy.relation)
  for e in events:
    ledger.spend(e, label="event")
  return ledger.epsilon()


CASES = sorted(set(user_cases.CASES) | set(problem_cases.CASES))


def test_every_registered_algorithm_is_covered():
  names = {user_cases.CASES[c][0] for c in user_cases.CASES} | set(problem_cases.CASES)
  assert names == set(registered())


@pytest.mark.parametrize("case", CASES)
def test_the_plan_follows_the_protocol_and_its_guarantee_is_its_events(case):
  p = _plan(case)
  detail = p.detail
  assert isinstance(detail, FamilyPlan), type(detail).__name__
  stages = tuple(detail.stages)
  for s in stages:
    assert isinstance(s, GaussianStage) and isinstance(s.sensitivity, Sensitivity)
    assert s.std == gaussian_noise_std(s.noise_multiplier, s.sensitivity)
  private = p.privacy.provenance != "none"
  # a private plan adds noise through at least one stage and spends at least one event
  assert bool(stages) == private and bool(tuple(detail.events)) == private, case
  if p.noise_multiplier is not None and stages:
    assert p.noise_multiplier in {s.noise_multiplier for s in stages}
  assert tuple(p.stages) == stages
  report = detail.charge()
  assert isinstance(report, PrivacyReport)
  assert dataclasses.asdict(report) == dataclasses.asdict(p.privacy), case
  if p.privacy.provenance == "accountant" and p.algorithm != "dp_sgd_group":
    assert _composed_epsilon(p, detail.events) == pytest.approx(p.privacy.epsilon, rel=1e-9)


def test_a_plan_whose_events_are_not_the_planned_ones_is_caught():
  p = _plan("dp_sgd_user")
  twin = p.detail._replace(event=dp_accounting.SelfComposedDpEvent(p.detail.event, 2))
  assert twin.charge().epsilon > p.privacy.epsilon
  assert _composed_epsilon(p, twin.events) > p.privacy.epsilon * (1 + 1e-6)


def test_a_planner_whose_plan_object_lacks_the_protocol_is_refused_at_plan_time(monkeypatch):
  from dpsco_jax.algorithms import registration
  entry = registration.registered()["dp_sgd_user"]

  def no_protocol(facts, cfg):
    planned = entry.planner(facts, cfg)
    return planned._replace(detail=dict(planned.detail._asdict()))   # the same numbers
  monkeypatch.setitem(registration._REGISTRY, "dp_sgd_user",
                      dataclasses.replace(entry, planner=no_protocol))
  with pytest.raises(TypeError, match="without stages, events, charge"):
    _plan("dp_sgd_user")
