"""Memory and time of ``dp.fit("dp_sgd_user", ...)`` by data placement (issue 46, "Memory at
the default").

Workload (the issue's): ``n`` users with 8 items of 20 float32 features each, the rows grouped
by user (``UserData.from_arrays`` views them, no copy), Poisson sampling with ``q n = 1000``
users per step, ``--steps`` steps. Each row is a fresh subprocess (peaks are per process):

* ``default``: ``data_placement="auto"`` (device, for an in-memory table) on the table as
  numpy allocates it (its buffer is usually 16 bytes off a 64-byte boundary: ``align``);
* ``default_aligned``: the same on a 64-byte aligned table (used in place on a CPU backend);
* ``device``: ``data_placement="device"`` (what ``auto`` resolves to here);
* ``host``: ``data_placement="host"`` (host-sampled users, only theirs sent to the device);
* ``default_before``: ``default`` with ``UserData.user_view`` as it was before the fix
  (``jnp.asarray`` of every leaf), for the side-by-side.

Measured in each: ``base_gb`` (the process after JAX started, before the table),
``built_gb`` (after ``from_arrays``), a cold fit (compiles) and a warm fit (same key), each
with its peak resident memory (VmHWM, reset before it starts through
``/proc/self/clear_refs``), its ``rise`` (that peak less the resident size when it started,
in raw units: the warm fit's is the data handling and the run, without the compiler) and wall
time. ``peak_above_base`` / ``peak_above_built`` are the
larger of the two peaks less ``base_gb`` / ``built_gb``, in units of the raw features
(``n * 8 * 20 * 4`` bytes; the table itself is 1.0 above base). ``same_params``: the warm
fit's params equal (bitwise) those of ``default`` (the host path draws other users, so not
for it).

Usage: ``python experiments/bench_fit_memory.py [--n 1e6] [--steps 100] [--quick]``; prints a
table and writes ``experiments/results/bench_fit_memory.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ITEMS, FEATURES, PER_STEP = 8, 20, 1000
MODES = ("default_before", "default", "default_aligned", "device", "host")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_scale import gb, reset_peak, status_kb  # noqa: E402  (the /proc RSS readers)


def _table(n: int, aligned: bool):
  """Grouped ``[n * 8, 20]`` float32 features; ``aligned``: at a 64-byte boundary."""
  import numpy as np
  shape, nbytes = (n * ITEMS, FEATURES), n * ITEMS * FEATURES * 4
  if aligned:
    buf = np.empty(nbytes + 64, np.uint8)
    start = -buf.ctypes.data % 64
    x = buf[start:start + nbytes].view(np.float32).reshape(shape)
  else:
    x = np.empty(shape, np.float32)
  np.random.default_rng(0).standard_normal(out=x, dtype=np.float32)
  return x


def _previous_user_view(self) -> dict:
  """``UserData.user_view`` before the fix: ``jnp.asarray`` of every leaf."""
  import jax
  import jax.numpy as jnp
  w = self.item_mask * (self.max_items_per_user / self.n_items[:, None])
  return {"example": jax.tree.map(jnp.asarray, self.examples),
          "weight": jnp.asarray(w, jnp.float32)}


def _loss(w, ex):
  import jax.numpy as jnp
  return 0.5 * jnp.square(jnp.dot(ex["x"], w) - 1.0)


def worker(mode: str, n: int, steps: int) -> dict:
  import gc
  import jax
  import jax.numpy as jnp
  import numpy as np
  import dpsco_jax
  from dpsco_jax.data import UserData
  if mode == "default_before":
    UserData.user_view = _previous_user_view
  jax.block_until_ready(jnp.zeros(1))          # backend up: part of the base
  out = {"mode": mode, "n": n, "steps": steps, "raw_gb": n * ITEMS * FEATURES * 4 / 2**30,
         "base_gb": gb(status_kb("VmRSS"))}
  x = _table(n, aligned=mode == "default_aligned")
  out["align"] = int(x.ctypes.data % 64)
  data = UserData.from_arrays({"x": x}, np.repeat(np.arange(n), ITEMS))
  assert np.shares_memory(data.examples["x"], x)   # grouped: viewed, not copied
  gc.collect()
  out["built_gb"] = gb(status_kb("VmRSS"))
  placement = {"device": "device", "host": "host"}.get(mode, "auto")
  cfg = {"epsilon": 2.0, "delta": 1e-7, "clip_norm": 1.0, "learning_rate": 0.1,
         "num_steps": steps, "sampling_rate": min(1.0, PER_STEP / n), "n_users": n}
  for phase in ("cold", "warm"):
    gc.collect()
    reset_peak()
    start_gb = gb(status_kb("VmRSS"))
    t0 = time.perf_counter()
    res = dpsco_jax.fit("dp_sgd_user", cfg, _loss, jnp.zeros(FEATURES), data,
                        jax.random.key(0), data_placement=placement)
    jax.block_until_ready(res.params)
    out[f"{phase}_s"] = time.perf_counter() - t0
    out[f"{phase}_peak_gb"] = gb(status_kb("VmHWM"))
    out[f"{phase}_rise"] = (out[f"{phase}_peak_gb"] - start_gb) / out["raw_gb"]
  peak = max(out["cold_peak_gb"], out["warm_peak_gb"])
  out["peak_above_base"] = (peak - out["base_gb"]) / out["raw_gb"]
  out["peak_above_built"] = (peak - out["built_gb"]) / out["raw_gb"]
  out["params"] = [float(v) for v in np.asarray(res.params)]
  return out


def _run(mode: str, n: int, steps: int) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  proc = subprocess.run([sys.executable, __file__, "--worker", mode, "--n", str(n),
                         "--steps", str(steps)], capture_output=True, text=True, env=env)
  if proc.returncode != 0:
    return {"mode": mode, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _table_text(rows: list[dict]) -> str:
  head = (f"{'mode':16s} {'align':>5s} {'cold_s':>7s} {'warm_s':>7s} {'peak_GB':>8s} "
          f"{'above_base':>10s} {'above_built':>11s} {'warm_rise':>9s} {'same_params':>11s}")
  lines = [head]
  for r in rows:
    if "error" in r:
      lines.append(f"{r['mode']:16s} error: {r['error']}")
      continue
    peak = max(r["cold_peak_gb"], r["warm_peak_gb"])
    lines.append(f"{r['mode']:16s} {r['align']:5d} {r['cold_s']:7.2f} {r['warm_s']:7.2f} "
                 f"{peak:8.3f} {r['peak_above_base']:9.2f}x {r['peak_above_built']:10.2f}x "
                 f"{r['warm_rise']:8.2f}x "
                 f"{str(r.get('same_params', '-')):>11s}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--n", type=float, default=1e6)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--quick", action="store_true", help="n = 2e4, 10 steps")
  parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_fit_memory.json"))
  parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  n, steps = (20_000, 10) if args.quick else (int(args.n), args.steps)
  if args.worker:
    print(json.dumps(worker(args.worker, n, steps)))
    return {}
  load_before = os.getloadavg()
  rows = [_run(mode, n, steps) for mode in MODES]
  ref = next((r["params"] for r in rows if r["mode"] == "default" and "params" in r), None)
  for r in rows:
    params = r.pop("params", None)
    if ref is not None and params is not None and r["mode"] != "host":
      r["same_params"] = params == ref
  summary = {"n": n, "steps": steps, "raw_gb": n * ITEMS * FEATURES * 4 / 2**30,
             "cpus": os.cpu_count(), "load_before": load_before,
             "load_after": os.getloadavg(), "rows": rows}
  print(_table_text(rows))
  print(f"raw features {summary['raw_gb']:.3f} GB; load average before "
        f"{load_before[0]:.2f}, after {summary['load_after'][0]:.2f} on {os.cpu_count()} CPUs")
  if not args.quick:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(summary, f, indent=1)
  print(json.dumps(summary))
  return summary


if __name__ == "__main__":
  main()
