"""Smoke test of ``experiments/bench_core.py --quick``: it runs end to end and its last line is
the JSON summary with the expected ratio keys (positive, finite numbers).

The benchmarks (and the digits example) run in a subprocess with :data:`FAST_COMPILE`
(``XLA_FLAGS=--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false``): the
timings of a smoke run are meaningless anyway, and the flags cut XLA:CPU compile time several
fold (bench_gpu --quick: 63 s with the first flag alone, 36 s with both; they must be set
before the backend starts, hence the subprocess). bench_core, bench_ledger and the digits
example share one such process (:func:`smokes`: one import of jax, dpsco_jax and flax instead
of three)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from multidevice_users import FAST_COMPILE as MULTIDEVICE_FAST_COMPILE

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "bench_core.py"
# The 4-device tests' compile flags less one thread per device (whichever this jaxlib knows).
FAST_COMPILE = MULTIDEVICE_FAST_COMPILE.replace("--xla_cpu_multi_thread_eigen=false", "").strip()
RATIO_KEYS = ("logistic_user_vs_nonprivate", "mlp_user_vs_nonprivate",
              "item_ours_vs_optax_dpsgd")


def _smoke_env() -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


# Runs each script as ``python SCRIPT ARGS`` would (``__main__``, its argv, its folder first
# on the path), one after another, and prints [{"code", "stdout", "stderr"}], one per run.
_SMOKES = """
import contextlib, io, json, pathlib, runpy, sys, traceback
out = []
for script, *args in json.loads(sys.argv[1]):
  stdout, stderr, path = io.StringIO(), io.StringIO(), list(sys.path)
  sys.argv, sys.path[0] = [script, *args], str(pathlib.Path(script).resolve().parent)
  code = 0
  with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
    try:
      runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
      code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    except BaseException:
      code = 1
      traceback.print_exc()
  sys.path[:] = path
  out.append({"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()})
print(json.dumps(out))
"""
_MAX_BATCH_GIB = 1e-4   # bench_gpu --max-batch's smoke: a limit a few users' step exceeds
_MAX_BATCH = ["experiments/bench_gpu.py", "--quick", "--only", "logistic_user", "--max-batch"]
# bench_gpu's runs last: it sets jax_default_matmul_precision for the rest of the process
_SMOKE_RUNS = {"bench_core": ["experiments/bench_core.py", "--quick"],
               "bench_ledger": ["experiments/bench_ledger.py", "--quick"],
               "digits": ["experiments/digits_user_level.py", "--quick"],
               "max_batch": [*_MAX_BATCH, "--memory-limit-gib", str(_MAX_BATCH_GIB)],
               "max_batch_no_limit": _MAX_BATCH}


def _run_smokes(runs: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
  """``runs`` (name -> script and its arguments) one after another in one process with
  :data:`FAST_COMPILE`: each one's exit code and output."""
  proc = subprocess.run([sys.executable, "-c", _SMOKES, json.dumps(list(runs.values()))],
                        capture_output=True, text=True, timeout=1200, env=_smoke_env(),
                        cwd=str(BENCH.parents[1]))
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  return {name: subprocess.CompletedProcess(run, r["code"], r["stdout"], r["stderr"])
          for (name, run), r in zip(runs.items(), got)}


@pytest.fixture(scope="module")
def smokes() -> dict:
  """The smokes' exit codes and output, from one process with :data:`FAST_COMPILE`."""
  return _run_smokes(_SMOKE_RUNS)


@pytest.mark.slow
def test_bench_core_quick_prints_json_summary(smokes):
  proc = smokes["bench_core"]
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


@pytest.mark.slow
@pytest.mark.xdist_group("bench_steps")
def test_bench_gpu_quick_prints_json_summary():
  """``experiments/bench_gpu.py --quick``: the five workloads of issue 14 at tiny sizes; every
  row has a finite positive ratio to its own non-private step. Its steps are bench_cost
  --quick's: the two run on one worker, one after the other, so the second loads the first's
  executables from the run's compilation cache (conftest)."""
  bench = BENCH.parent / "bench_gpu.py"
  env = _smoke_env()
  proc = subprocess.run([sys.executable, str(bench), "--quick", "--reps", "2"],
                        capture_output=True, text=True, timeout=600, env=env,
                        cwd=str(BENCH.parents[1]))
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["mode"] == "quick"
  assert set(summary["workloads"]) == {"cnn_item", "transformer", "transformer_mha",
                                       "logistic_user", "cnn_user"}
  for rows in summary["workloads"].values():
    assert set(rows) >= {"nonprivate", "dpsco_fast", "dpsco_vmap", "optax_dpsgd"}
    assert rows["nonprivate"]["ratio"] == 1.0
    assert rows.pop("auto_choice") in ("fast", "vmap")
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in rows.values())


@pytest.mark.slow
def test_bench_gpu_max_batch_brackets_the_memory_limit(smokes):
  """``bench_gpu.py --max-batch`` (issue 50) on the smallest workload under a 0.1 MiB limit:
  per path, the largest user batch B whose compiled step fits and B + 1, which does not; and
  on CPU (no ``bytes_limit``) the limit must be given, the error naming the flag."""
  proc, missing = smokes["max_batch"], smokes["max_batch_no_limit"]
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  limit = summary["max_batch"]["limit_bytes"]
  assert limit == int(_MAX_BATCH_GIB * 2 ** 30)
  rows = summary["max_batch"]["workloads"]["logistic_user"]
  assert set(rows) >= {"nonprivate", "dpsco_fast", "dpsco_vmap", "optax_dpsgd"}
  for path, r in rows.items():
    assert isinstance(r["B"], int) and r["B"] >= 1, (path, r)
    assert r["exact"] and r["next_B"] == r["B"] + 1, (path, r)
    assert r["bytes"] <= limit < r["next_bytes"], (path, r)
    assert f"max batch {path}: B={r['B']} fits" in proc.stdout
  assert missing.returncode != 0 and "--memory-limit-gib" in missing.stderr, missing.stderr


def test_bench_gpu_runtime_peaks_reads_the_counter_around_each_first_run():
  """``bench_gpu.runtime_peaks`` (issue 50) against a fake device whose process-wide peak
  rises by the bytes each run allocates beyond it: the reading after each run, its rise (0
  under an earlier peak) and the floor; None where the backend has no memory_stats (CPU)."""
  sys.path.insert(0, str(BENCH.parent))
  import bench_gpu  # noqa: PLC0415
  mib, peak = 2 ** 20, [5 * 2 ** 20]
  stats = lambda: {"peak_bytes_in_use": peak[0], "bytes_limit": 100 * mib}

  def run(needs: int):
    peak[0] = max(peak[0], needs * mib)
    return ()
  floor, rows = bench_gpu.runtime_peaks(
      [("a", lambda: run(8)), ("b", lambda: run(6)), ("c", lambda: run(11))], stats)
  assert floor == 5.0
  assert rows == {"a": {"peak_mib_runtime": 8.0, "peak_rise_mib": 3.0},
                  "b": {"peak_mib_runtime": 8.0, "peak_rise_mib": 0.0},
                  "c": {"peak_mib_runtime": 11.0, "peak_rise_mib": 3.0}}
  assert bench_gpu.runtime_peaks([("a", lambda: run(1))], lambda: None) is None


@pytest.mark.slow
def test_bench_ledger_quick_prints_json_summary(smokes):
  """``experiments/bench_ledger.py --quick`` (issue 16.1) runs end to end; JSON last line."""
  proc = smokes["bench_ledger"]
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  led = summary["ledger"]
  assert 1.0 <= led["default_over_exact"] <= 1.1  # the default answer is a valid, close bound
  assert summary["meets_targets"]["epsilon_default_lt_50ms"]
  assert all(r["epsilon"] > 0 for r in summary["train"])


@pytest.mark.slow
def test_digits_example_quick_runs_every_algorithm_through_fit_model(smokes):
  out = smokes["digits"]
  assert out.returncode == 0, out.stderr[-2000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  names = [r["algorithm"] for r in summary["rows"]]
  assert names == ["nonprivate_sgd", "dp_sgd_user", "user_level_accelerated_erm",
                   "accelerated_dp_srgd"]
  for r in summary["rows"][1:]:
    assert r["epsilon"] <= 4.0 + 1e-6 and r["provenance"] in ("accountant", "heuristic")
