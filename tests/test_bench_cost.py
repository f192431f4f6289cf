"""``experiments/bench_cost.py`` (issue 26.1): the XLA cost table of one DP step against its
non-private step.

* ``--quick`` runs end to end; its last line is the JSON table
  ``{workload: {path: {flops_ratio, bytes_ratio, temp_ratio, peak_ratio, cpu_time_ratio}}}``
  (plus ``_meta``), every ratio a finite positive number, and ``auto`` is the fast row where
  it picks fast, its own step (FastClippedGrad's vmap path) with vmap's FLOPs where vmap;
* ``--compile-only`` at the full GLM size (4096 users x 64 items x 4096 features, a 4 GiB batch
  that stays abstract): the vmap path's per-user gradients cost about the non-private
  gradient's FLOPs, and every path's footprint is the data's;
* the bench's full and quick sizes build exactly the workloads of ``bench_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
BENCH = EXPERIMENTS / "bench_cost.py"
WORKLOADS = {"cnn_item", "transformer", "transformer_mha", "logistic_user", "cnn_user"}
KEYS = {"flops_ratio", "bytes_ratio", "temp_ratio", "peak_ratio", "cpu_time_ratio"}


def _run(*args: str, env: dict | None = None) -> dict:
  # Always XLA:CPU, whatever backend the test session has: the table is defined as the
  # CPU-compiled cost (an accelerator's cost_analysis may not count its library calls, and a
  # GPU run of the suite must not race the suite's own jobs for the device).
  env = dict(os.environ, **(env or {}))
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                        timeout=900, env=env, cwd=str(EXPERIMENTS.parent))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.xdist_group("bench_steps")
def test_bench_cost_quick_prints_json_table():
  table = _run("--quick")
  meta = table.pop("_meta")
  assert meta["mode"] == "quick"
  assert set(table) == WORKLOADS
  paths = {"fast", "auto", "vmap", "optax"}
  if importlib.util.find_spec("jax_privacy") is not None:
    paths.add("jax_privacy")
  else:
    assert any("jax_privacy not installed" in n for n in meta["notes"])
  for w, rows in table.items():
    assert set(rows) == paths, (w, rows)
    for path, row in rows.items():
      assert set(row) == KEYS, (w, path, row)
      for k, v in row.items():
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (w, path, k, v)
    pick = meta["auto_choice"][w]
    assert pick in ("fast", "vmap")
    if pick == "fast":   # FastClippedGrad's own fast step
      assert rows["auto"] == rows["fast"], w
    else:                # its vmap path compiled as itself (chunks of users): the same FLOPs
      assert rows["auto"]["flops_ratio"] == pytest.approx(rows["vmap"]["flops_ratio"],
                                                          rel=0.02), w
    ref = meta["reference"]["quick"][w]
    assert ref["flops"] > 0 and ref["peak"] >= ref["temp"] > 0 and ref["cpu_ms"] > 0
  for w in ("transformer", "transformer_mha"):  # the fast path's per-layer plan is reported
    plan = meta["transformer_plans"][w]
    assert {r["kind"] for r in plan["tapped"]} >= {"embed", "local"}
    assert all(r["form"] in ("ghost", "instantiate", "layer_vjp") and r["predicted_cost"] > 0
               for r in plan["tapped"])
    assert set(plan["predicted"]) == {"fast", "vmap"}


@pytest.mark.slow
def test_bench_cost_glm_full_size_compile_only():
  """Compile only, at bench_gpu's full GLM size: one user's gradient of a GLM is ``X_u^T r_u``,
  so vmapping it over users costs the non-private gradient's FLOPs plus the clip (issue 26:
  1.02 measured); and the batch (4 GiB) dwarfs every path's temporaries, so each path's
  whole footprint stays within a few percent of the non-private step's."""
  table = _run("--compile-only", "--only", "logistic_user")
  meta = table.pop("_meta")
  assert meta["mode"] == "compile_only" and set(table) == {"logistic_user"}
  rows = table["logistic_user"]
  # the cost model takes the vmap-equivalent path for a GLM (resolved from shapes alone)
  assert meta["auto_choice"]["logistic_user"] == "vmap"
  for k in ("flops_ratio", "peak_ratio"):   # one chunk here: the core vmap step's costs
    assert rows["auto"][k] == pytest.approx(rows["vmap"][k], rel=0.01), (k, rows)
  assert 1.0 <= rows["vmap"]["flops_ratio"] <= 1.1, rows["vmap"]
  assert 1.0 <= rows["optax"]["flops_ratio"] <= 1.1, rows["optax"]
  ref = meta["reference"]["full"]["logistic_user"]
  assert ref["peak"] >= 4096 * 64 * 4096 * 4  # the abstract batch is counted, never allocated
  for path, row in rows.items():
    if row is not None:
      assert row["cpu_time_ratio"] is None
      assert 0.99 <= row["peak_ratio"] <= 1.1, (path, row)


class _Shape:
  """What ``rng.standard_normal(shape) / s`` would be, without the data."""

  def __init__(self, shape):
    self.shape = tuple(shape)

  def __truediv__(self, other):
    return self


class _ShapeRng:
  def standard_normal(self, shape):
    return _Shape(shape)

  def integers(self, lo, hi, shape):
    return _Shape(shape)


class _ShapeJnp:
  """``jnp`` whose ``asarray`` gives a ``ShapeDtypeStruct`` (bench_gpu's full GLM batch would
  be 4 GiB)."""

  def __getattr__(self, name):
    return getattr(jnp, name)

  @staticmethod
  def asarray(x, dtype=None):
    return jax.ShapeDtypeStruct(x.shape, dtype)


class _Nnx:
  """``nnx`` whose ``Rngs`` and ``Linear`` record their arguments (no parameters are built)."""

  @staticmethod
  def Rngs(seed):  # noqa: N802
    return ("Rngs", seed)

  @staticmethod
  def Linear(*args, **kwargs):  # noqa: N802
    return ("Linear", args, tuple(sorted(kwargs.items())))


def _record(cls):
  return lambda *args, **kwargs: (cls, args, tuple(sorted(kwargs.items())))


def _signature(items):
  return [(name, model, loss.__name__, tuple(shape),
           [(tuple(x.shape), jnp.dtype(x.dtype)) for x in jax.tree.leaves(batch)])
          for name, model, loss, batch, shape in items]


def test_bench_cost_sizes_are_bench_gpu_workloads(monkeypatch):
  """Both benches measure the same steps: bench_cost's ``full`` and ``quick`` sizes build
  bench_gpu's workloads (same model constructors and arguments, losses, batch shapes and
  dtypes). Shapes only: nothing is allocated, no model is built."""
  monkeypatch.syspath_prepend(str(EXPERIMENTS))
  import bench_cost
  import bench_gpu
  for mod in (bench_gpu, bench_cost):
    monkeypatch.setattr(mod, "CNN", _record("CNN"))
    monkeypatch.setattr(mod, "LM", _record("LM"))
    monkeypatch.setattr(mod, "nnx", _Nnx)
  monkeypatch.setattr(bench_gpu, "jnp", _ShapeJnp())
  for quick, size in ((True, "quick"), (False, "full")):
    theirs = _signature(bench_gpu.workloads(quick, _ShapeRng()))
    assert {w[0] for w in theirs} == WORKLOADS
    assert _signature(bench_cost.workloads(size, None)) == theirs, size
