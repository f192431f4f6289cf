"""Driver-level privacy audits (issue 12.1): each driver, run end to end through its audit hook
with a Dirac-like canary user, stays below the epsilon it reports; each broken twin (noise
halved, realized-count denominator, tree accounted as independent noise) is flagged: its
empirical lower bound exceeds the claim. Plus the ``dpsco audit`` CLI verb."""

import jax
import numpy as np
import pytest

from dpsco_jax.audit import drivers as DR
from dpsco_jax.audit.harness import AuditResult, run_audit

# thousands of audit trials per test: optimised code (conftest.py)
pytestmark = pytest.mark.usefixtures("optimized_codegen")

# (driver, relation, twin); trials: drivers.TRIALS (1e5 per side; compiling dominates the cost)
CASES = [
    ("dp_sgd_user_poisson", "add_remove", "noise_halved"),
    ("dp_sgd_user_full", "zero_out", "noise_halved"),
    ("dp_sgd_user_full", "add_remove", "realized_count"),
    ("dp_sgd_user_fixed", "replace_one", "noise_halved"),
    ("dp_trainer", "add_remove", "noise_halved"),
    ("naive_output_pert", "replace_one", "noise_halved"),
    ("dp_loc_gd", "replace_one", "noise_halved"),
    ("dp_bilevel", "replace_one", "noise_halved"),
]


def _check(honest: AuditResult, broken: AuditResult, relation: str):
  assert honest.relation == relation and honest.delta == DR.DELTA
  assert 1.0 <= honest.claimed_epsilon <= 4.0, honest  # claims in the intended range
  assert 0.5 <= honest.lower_bound <= honest.claimed_epsilon, honest  # power, and no violation
  assert not honest.violated
  assert broken.lower_bound > broken.claimed_epsilon, broken
  assert broken.violated


@pytest.mark.parametrize("name,relation,twin", CASES)
def test_driver_below_its_claim_and_broken_twin_flagged(name, relation, twin):
  trials = DR.TRIALS[name]
  honest_spec = DR.build_driver(name, relation)
  broken_spec = DR.build_driver(name, relation, twin)
  # the twin keeps the honest driver's claim: only the mechanism is broken
  assert broken_spec.claimed_epsilon == honest_spec.claimed_epsilon
  _check(run_audit(honest_spec, trials=trials, key=21),
         run_audit(broken_spec, trials=trials, key=22), relation)


def test_srgd_tree_below_its_claim_and_flagged_under_independent_accounting():
  # the twin is the same releases with the independent-noise claim: one run of scores serves
  honest_spec = DR.build_driver("accelerated_dp_srgd", "zero_out")
  twin_spec = DR.build_driver("accelerated_dp_srgd", "zero_out", "independent_accounting")
  assert twin_spec.claimed_epsilon < honest_spec.claimed_epsilon / 2  # sqrt(levels) = sqrt 5
  res = run_audit(honest_spec, trials=DR.TRIALS["accelerated_dp_srgd"], key=23)
  _check(res, res._replace(claimed_epsilon=twin_spec.claimed_epsilon), "zero_out")
  assert res.gdp_lower_bound > twin_spec.claimed_epsilon  # the Gaussian fit sees it too


def test_bilevel_canary_moves_only_the_outer_release_by_the_sensitivity():
  # Why no forced= replay is needed: with one key, D and D' give identical inner releases
  # (the canary's b is unchanged) and outer releases that differ by exactly the replace-one
  # sensitivity 2 C_out / n along e_0 at every step (v_i = a_i wherever x, y are).
  spec = DR.build_driver("dp_bilevel", "replace_one")
  rel = jax.jit(spec.release)
  key = jax.random.key(3)
  r_in, r_out = rel(key, spec.dataset_in), rel(key, spec.dataset_out)
  np.testing.assert_array_equal(np.asarray(r_in.y_star), np.asarray(r_out.y_star))
  np.testing.assert_array_equal(np.asarray(r_in.y_lam), np.asarray(r_out.y_lam))
  n = spec.dataset_in["a"].shape[0]
  diff = np.asarray(r_in.outer - r_out.outer)
  assert diff.shape == (4, 2)
  np.testing.assert_allclose(diff[:, 0], 2 * 1.0 / n, rtol=1e-4)
  np.testing.assert_allclose(diff[:, 1], 0.0, atol=1e-6)
  assert float(np.std(np.asarray(r_in.outer[:, 1]))) > 0  # the releases are noised


def test_claims_are_the_drivers_reports():
  from dpsco_jax.api import solve
  spec = DR.build_driver("dp_sgd_user_full", "zero_out")
  problem = DR.linear_problem(np.asarray(spec.dataset_in["x"]))
  res = solve("dp_sgd_user", {"sampling": "full", "relation": "zero_out", "num_steps": 2,
                              "delta": DR.DELTA, "noise_multiplier": 2.5}, problem,
              jax.random.key(5))
  assert spec.claimed_epsilon == pytest.approx(res.privacy.epsilon)
  assert res.privacy.relation == "zero_out" and res.privacy.provenance == "accountant"


def test_bad_inputs_name_the_parameter():
  with pytest.raises(ValueError, match="name"):
    DR.build_driver("dp_sgd_nope", "add_remove")
  with pytest.raises(ValueError, match="broken"):
    DR.build_driver("dp_sgd_user_poisson", "add_remove", "realized_count")
  with pytest.raises(ValueError, match="relation"):
    DR.build_driver("dp_sgd_user_fixed", "add_remove")
  with pytest.raises(ValueError, match="relation"):
    DR.build_driver("accelerated_dp_srgd", "add_remove")
  with pytest.raises(TypeError, match="relation"):
    DR.build_driver("dp_loc_gd", 1)
  with pytest.raises(ValueError, match="relation"):
    DR.build_driver("dp_bilevel", "zero_out")
  with pytest.raises(ValueError, match="broken"):
    DR.build_driver("dp_bilevel", "replace_one", "realized_count")


def test_cli_audit_verb_prints_claim_and_bound(dpsco):
  out = dpsco("audit", "--mechanism", "dp_sgd_user_poisson", "--trials", "3000")
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert "3000 trials per side" in lines[0] and "claim" in lines[1] and "lower" in lines[1]
  (row,) = [ln for ln in lines if ln.startswith("dp_sgd_user_poisson")]
  cells = row.split()
  assert cells[1] == "add_remove" and cells[4] == "noise_halved"
  claim, lower, twin_claim = float(cells[2]), float(cells[3]), float(cells[5])
  assert 0.0 <= lower <= claim and twin_claim == claim  # the twin keeps the honest claim


def test_cli_audit_verb_rejects_bad_arguments(capsys):
  from dpsco_jax.__main__ import main
  for argv in (["audit", "--trials", "1"], ["audit", "--mechanism", "nope"],
               ["audit", "--trials", "1e4"]):
    with pytest.raises(SystemExit) as err:
      main(argv)
    assert err.value.code == 2
    assert ("--trials" in capsys.readouterr().err) or argv[1] == "--mechanism"


def test_multi_epoch_srgd_below_its_claim_and_flagged_when_accounted_as_one_participation():
  """Issue 27: SRGD over 4 epochs of one fixed order (the canary at steps 0, P, 2P, 3P) stays
  below its exact k-participation claim, and the same releases claimed as one participation
  in the 4P steps are flagged."""
  honest_spec = DR.build_driver("accelerated_dp_srgd_epochs", "zero_out")
  twin_spec = DR.build_driver("accelerated_dp_srgd_epochs", "zero_out", "one_participation")
  assert twin_spec.claimed_epsilon < honest_spec.claimed_epsilon / 2
  res = run_audit(honest_spec, trials=DR.TRIALS["accelerated_dp_srgd_epochs"], key=25)
  _check(res, res._replace(claimed_epsilon=twin_spec.claimed_epsilon), "zero_out")
