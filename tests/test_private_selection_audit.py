"""The canary audit of private selection: best of K noisy counts on neighbouring datasets.

The honest claim (training and selection, Theorem 2) stands above the empirical lower bound;
the broken twin, whose report claims one candidate's epsilon only, is caught."""

import pytest

from dpsco_jax.audit.harness import run_audit
from dpsco_jax.audit.selection import selection_audit

TRIALS = 50_000


@pytest.fixture(scope="module")
def results():
  return {b: run_audit(selection_audit(b), trials=TRIALS, key=1)
          for b in (None, "cost_left_out")}


def test_honest_selection_claim_holds(results):
  r = results[None]
  assert r.lower_bound > 1.5          # the audit has power: it sees more than one run's loss
  assert not r.violated and r.lower_bound < r.claimed_epsilon


def test_twin_without_the_selection_cost_is_caught(results):
  honest, twin = results[None], results["cost_left_out"]
  assert twin.claimed_epsilon < honest.claimed_epsilon
  assert twin.violated, (twin.lower_bound, twin.claimed_epsilon)


def test_unknown_twin_refused():
  with pytest.raises(ValueError, match="broken"):
    selection_audit("k_fixed")
