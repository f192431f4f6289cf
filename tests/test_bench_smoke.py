"""Smoke test of ``experiments/bench_core.py --quick``: it runs end to end and its last line is
the JSON summary with the expected ratio keys (positive, finite numbers).

The benchmark runs in a subprocess with ``XLA_FLAGS=--xla_backend_optimization_level=0``:
the timings of a smoke run are meaningless anyway, and the flag cuts XLA:CPU compile time
about 4x (it must be set before the backend starts, hence the subprocess)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "bench_core.py"
RATIO_KEYS = ("logistic_user_vs_nonprivate", "mlp_user_vs_nonprivate",
              "item_ours_vs_optax_dpsgd")


@pytest.mark.slow
def test_bench_core_quick_prints_json_summary():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
  env.setdefault("JAX_PLATFORMS", "cpu")
  proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True,
                        text=True, timeout=600, env=env, cwd=str(BENCH.parents[1]))
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
  summary = json.loads(lines[-1])
  for key in RATIO_KEYS:
    assert key in summary, (key, summary)
    assert isinstance(summary[key], float) and math.isfinite(summary[key]) and summary[key] > 0
  assert summary["mode"] == "quick"
  assert set(summary["meets_targets"]) == {"logistic_user_vs_nonprivate",
                                           "item_ours_vs_optax_dpsgd"}
  assert all(isinstance(v, bool) for v in summary["meets_targets"].values())
  # The human-readable table precedes the JSON line: one header per section.
  for header in ("(a)(i) logistic", "(a)(ii) MLP", "(b) item-level DP-SGD"):
    assert header in proc.stdout


def _load_bench():
  import importlib.util
  sys.path.insert(0, str(BENCH.parent))
  try:
    spec = importlib.util.spec_from_file_location("bench_core", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
  finally:
    sys.path.remove(str(BENCH.parent))
  return mod


def test_proposed_clip_aggregate_matches_core_chain():
  """The fused clip+mean timed as the proposed core fix equals clip_per_user -> aggregate,
  including a NaN row, an Inf row, rows below/above the clip norm and masked slots."""
  import chex
  import jax
  import jax.numpy as jnp
  import optax

  from dpsco_jax.transforms.clipping import aggregate, clip_per_user

  bench = _load_bench()
  k1, k2 = jax.random.split(jax.random.key(0))
  g = {"w": jax.random.normal(k1, (6, 3, 4)), "b": 0.1 * jax.random.normal(k2, (6, 4))}
  g["w"] = g["w"].at[1, 0, 0].set(jnp.nan).at[2, 1, 1].set(jnp.inf).at[3].multiply(0.01)
  g["b"] = g["b"].at[3].multiply(0.01)              # row 3 is below the clip norm
  g["b"] = g["b"].at[5].set(jnp.nan)                # masked slot holding NaN
  mask = jnp.array([True, True, True, True, False, False])
  params = jax.tree.map(lambda x: jnp.zeros(x.shape[1:]), g)
  core = optax.chain(clip_per_user(1.5), aggregate("mean", denominator=4.0))
  fused = bench.proposed_clip_aggregate(1.5, 4.0)
  wrong = bench.proposed_clip_aggregate(0.75, 4.0)

  @jax.jit
  def run_all(g, m):
    return tuple(tx.update(g, tx.init(params), params, user_mask=m)[0]
                 for tx in (core, fused, wrong))

  want, got, bad = run_all(g, mask)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  chex.assert_tree_all_finite(got)
  # A wrong clip norm must be detected (the comparison can fail).
  assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b)), bad, want)))
