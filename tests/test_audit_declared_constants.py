"""Issue 23.3 audit: ``naive_output_pert`` on a user's loss with a declared L. Data that meets
the declaration stays below the claim; the broken twin (a canary whose gradient is 4x the
declared L) is caught above the claim, and the run's report says the claim was conditional on
that declaration (provenance ``declared``, L named), not an ``accountant`` guarantee."""

import pytest

from dpsco_jax.audit.declared_constants import (TRIALS, declared_lipschitz_driver,
                                                run_report)
from dpsco_jax.audit.harness import run_audit


def test_declared_L_met_below_claim_and_violated_L_caught_and_labelled_conditional():
  honest = declared_lipschitz_driver()
  twin = declared_lipschitz_driver(broken="lipschitz_violated")
  assert twin.claimed_epsilon == honest.claimed_epsilon
  assert 1.0 <= honest.claimed_epsilon <= 4.0
  h = run_audit(honest, trials=TRIALS, key=41)
  b = run_audit(twin, trials=TRIALS, key=42)
  assert 0.5 <= h.lower_bound <= h.claimed_epsilon and not h.violated, h   # power, no breach
  assert b.violated and b.lower_bound > honest.claimed_epsilon + 1.0, b
  assert b.gdp_lower_bound > 2 * honest.claimed_epsilon, b
  # what the user is told for the violating run: a guarantee conditional on the declared L
  for broken in (None, "lipschitz_violated"):
    rep = run_report(broken)
    assert rep.provenance == "declared", rep
    assert "DECLARED: conditional on the declared lipschitz=1" in rep.notes, rep.notes
    assert rep.epsilon == pytest.approx(honest.claimed_epsilon, rel=1e-12)


def test_declared_constants_audit_refuses_other_relations_and_twins():
  with pytest.raises(ValueError, match="replace_one"):
    declared_lipschitz_driver("add_remove")
  with pytest.raises(ValueError, match="broken"):
    declared_lipschitz_driver(broken="noise_halved")
