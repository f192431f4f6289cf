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


@pytest.mark.slow
def test_bench_scale_devices_section_compares_one_and_four_devices():
  """``--quick --no-rows --devices 4`` (~20 s): the per-n rows' fit on 1 device and on a
  4-device users mesh, each in its own process; the releases agree."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--no-rows", "--devices", "4"],
                        capture_output=True, text=True, timeout=600, env=env,
                        cwd=str(BENCH.parents[1]))
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["rows"] == [] and "processes" not in summary and "sweep" not in summary
  d = summary["devices"]
  assert (d["n"], d["devices"], d["one"]["devices"], d["many"]["devices"]) == (10_000, 4, 1, 4)
  for r in (d["one"], d["many"]):
    assert "error" not in r, r
    for key in ("plan_s", "first_run_s", "run_s", "step_ms", "peak_run_gb"):
      assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
  assert d["same_privacy"] and d["same_record"]
  assert d["max_param_diff"] <= 1e-5 * max(1.0, d["param_scale"]), d
  assert "4 forced host devices" in proc.stdout


def test_bench_scale_folds_the_process_and_sweep_summaries_in(monkeypatch):
  """``--processes`` / ``--sweep`` run bench_distributed.py / bench_sweep.py and keep their
  JSON summaries (here canned, in their keys: the scripts themselves take 30-40 s quick)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("bench_scale", BENCH)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  procs = {"n": 10_000, "steps": 20, "users_per_step": 1000,
           "one_process": {"first_run_s": 1.5, "run_s": 0.1, "step_ms": 4.9},
           "two_processes": {"first_run_s": 3.0, "run_s": 0.17, "step_ms": 8.5},
           "ratio_two_over_one": 1.74, "max_param_diff": 6e-8}
  sweep = {"bench": "sweep", "rows": [
      {"config": "quickstart", "seeds": 2, "runs": 8, "cold_batched_s": 12.6,
       "cold_one_by_one_s": 13.0, "cold_speedup": 1.03, "max_abs_risk_diff": 0.0,
       "records_identical_but_risk": True}]}
  calls = []

  def fake(cmd, env=None):
    calls.append(cmd)
    return procs if cmd[1].endswith("bench_distributed.py") else sweep
  monkeypatch.setattr(bench, "_subprocess_json", fake)
  summary = {"processes": bench.processes_section(100_000, 200, quick=False),
             "sweep": bench.sweep_section(10, "quickstart", quick=True)}
  assert summary == {"processes": procs, "sweep": sweep}
  assert calls[0][2:] == ["--n", "100000", "--steps", "200"]
  assert calls[1][2:] == ["--seeds", "10", "--only", "quickstart", "--no-warm"]
  lines = "\n".join(bench._section_lines(summary))
  assert "4.90 vs 8.50 ms/step (x1.74)" in lines and "(x1.03)" in lines
