"""Smoke test of ``experiments/bench_scale.py --quick`` (issue 24): it runs end to end and its
last line is the JSON summary, with build times, per-step times and peak memory per run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "bench_scale.py"


@pytest.mark.slow
def test_bench_scale_quick_prints_json_summary():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True,
                        text=True, timeout=600, env=env, cwd=str(BENCH.parents[1]))
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["mode"] == "quick" and summary["largest_n"] == 10_000
  rows = summary["rows"]
  assert [(r["n"], r["mode"]) for r in rows] == [(1000, "memory"), (10_000, "memory"),
                                                 (10_000, "store")]
  for r in rows:
    assert "error" not in r, r
    for key in ("build_s", "step_ms", "sample_ms", "gather_ms", "put_ms", "peak_build_gb",
                "peak_run_gb", "raw_gb"):
      assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
    assert r["peak_build_gb"] >= r["base_gb"] > 0
    # q n = 1000 users per step (all of them at n = 1000)
    assert abs(r["mean_sampled"] - min(1000, r["n"])) < 50
  assert rows[0]["old_build_s"] > 0 and rows[1]["old_step_ms"] > 0
  assert "step ms" in proc.stdout              # the table precedes the JSON line
