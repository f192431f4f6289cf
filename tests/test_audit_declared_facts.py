"""Issue 23.1 audit: item-level DP-SGD with a declared m stays below its claim; the broken twin
whose plan reads m off each dataset (the pre-issue-23 behaviour of a measured m) is caught."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dpsco_jax.audit.declared_facts import item_count_driver
from dpsco_jax.audit.harness import run_audit


def test_declared_m_below_claim_and_measured_m_twin_caught():
  honest = item_count_driver()
  twin = item_count_driver(broken="measured_m")
  assert twin.claimed_epsilon == honest.claimed_epsilon and 1.0 <= honest.claimed_epsilon <= 4
  h = run_audit(honest, trials=100_000, key=31)
  b = run_audit(twin, trials=100_000, key=32)
  assert not h.violated, h
  assert b.violated and b.lower_bound > honest.claimed_epsilon + 1.0, b
  # power on the honest side: the canary's mean shift, scored by e_0 itself, is seen but
  # stays below the claim
  shift = dataclasses.replace(honest, score=lambda r: jnp.sum(jax.tree.leaves(r)[0][..., 0]))
  s = run_audit(shift, trials=100_000, key=33)
  assert 0.5 <= s.lower_bound <= honest.claimed_epsilon, s


def test_item_count_audit_refuses_other_relations_and_twins():
  with pytest.raises(ValueError, match="add_remove"):
    item_count_driver("replace_one")
  with pytest.raises(ValueError, match="broken"):
    item_count_driver(broken="noise_halved")
