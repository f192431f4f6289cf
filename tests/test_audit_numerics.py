"""The numerics canary audit (issue #23): a large common offset cannot smuggle a far user into
a FILTER release. The honest kernel stays below its claim; the former float32 Gram distances
(the broken twin) are caught."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax.audit import mechanisms as M
from dpsco_jax.audit import numerics as N
from dpsco_jax.audit import run_audit
from dpsco_jax.transforms.filtering import filter_points

# on the code generation users get (conftest.py; as tests/test_numerics_adversarial.py)
pytestmark = pytest.mark.usefixtures("optimized_codegen")


def test_the_twin_keeps_the_far_canary_and_the_kernel_does_not():
  d_in, _ = N._datasets(64)
  twin = N.gram_float32_filter_mean(d_in.grads, jax.random.key(0), N._TAU, 2 * N._TAU)
  ulp = float(np.spacing(np.float32(N._OFFSET)))
  assert abs(float(twin[1]) - N._OFFSET - 2000 * N._TAU / 64) <= 2 * ulp   # canary averaged in
  res = filter_points(d_in.grads, jax.random.key(0), score_radius=N._TAU,
                      degree_radius=2 * N._TAU)
  assert not bool(res.keep[0]) and float(res.degrees[0]) == 1.0
  assert abs(float(res.mean[1]) - N._OFFSET) <= 2 * ulp


def test_filter_offset_honest_below_claim_and_twin_flagged():
  honest = run_audit(M.build("filter_offset", "replace_one"), trials=20_000, key=11)
  broken = run_audit(M.build("filter_offset", "replace_one", "gram_float32"), trials=20_000,
                     key=12)
  assert 1.5 <= honest.claimed_epsilon <= 2.5
  assert honest.lower_bound <= honest.claimed_epsilon and not honest.violated, honest
  assert broken.lower_bound > broken.claimed_epsilon and broken.violated, broken
  assert broken.lower_bound > 2 * broken.claimed_epsilon


def test_filter_offset_is_in_the_audit_table(capsys):
  from dpsco_jax.audit.__main__ import main
  assert "filter_offset" in M.MECHANISMS
  rows = main(["--trials", "20000", "--mechanism", "filter_offset"])
  out = capsys.readouterr().out
  assert "filter_offset" in out and "gram_float32" in out
  assert rows[0]["twins"]["gram_float32"]["flagged"]
  assert rows[0]["lower_bound"] <= rows[0]["claimed_epsilon"]
  assert np.isfinite(rows[0]["lower_bound"])
