"""1 vs 2 processes (issue 24, part 3): user-level DP-SGD host-streamed in one process against
the same run under ``jax.distributed`` in two processes on 127.0.0.1 (gloo CPU collectives).

Workload: bench_scale's (``n`` users x 8 items x 20 float32 features, logistic loss, Poisson
sampling with ``q n = 1000`` users per step, ``--steps`` steps, delta 1e-7, declared
``n_users``). Each process builds the table, keeps its shard (``UserData.shard``), runs the fit
once to compile, then times a second fit (``run_s``, per step ``step_ms``). Reported: both
times, the 2-process / 1-process ratio, and the largest parameter difference between the two
runs (same key: the released params agree to float tolerance).

Usage: ``python experiments/bench_distributed.py [--n 1e5] [--steps 200] [--quick]``; the last
line is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ITEMS, FEATURES, PER_STEP = 8, 20, 1000


def worker(pid: int, procs: int, port: int, n: int, steps: int) -> dict:
  import jax
  if procs > 1:
    from dpsco_jax import distributed
    distributed.initialize(f"127.0.0.1:{port}", procs, pid, timeout_s=120)
  import jax.numpy as jnp
  import numpy as np
  import dpsco_jax
  from dpsco_jax.data import UserData
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n * ITEMS, FEATURES), dtype=np.float32)
  y = np.sign(x @ rng.standard_normal(FEATURES).astype(np.float32))
  ids = np.repeat(np.arange(n, dtype=np.int64), ITEMS)
  data = UserData.from_arrays({"x": x, "y": y}, ids, max_items_per_user=ITEMS)
  if procs > 1:
    data = data.shard(pid, procs)

  def loss(w, ex):
    return jnp.logaddexp(0.0, -ex["y"] * (ex["x"] @ w))
  cfg = {"epsilon": 1.0, "delta": 1e-7, "clip_norm": 1.0, "learning_rate": 0.5,
         "num_steps": steps, "batch_size": PER_STEP, "n_users": n}
  params = jnp.zeros(FEATURES)
  p = dpsco_jax.plan("dp_sgd_user", cfg, data.spec, num_params=FEATURES)
  kw = {"data_placement": "host"} if procs == 1 else {}
  t = time.perf_counter()
  dpsco_jax.run(p, loss, params, data, jax.random.key(0), **kw)
  first = time.perf_counter() - t
  t = time.perf_counter()
  res = dpsco_jax.run(p, loss, params, data, jax.random.key(0), **kw)
  run_s = time.perf_counter() - t
  return {"pid": pid, "first_run_s": first, "run_s": run_s, "step_ms": 1e3 * run_s / steps,
          "params": [float(v) for v in np.asarray(res.params)]}


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(procs: int, n: int, steps: int) -> list[dict]:
  port = _port()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, __file__, "--n", str(n), "--steps", str(steps), "--procs", str(procs),
         "--port", str(port), "--worker"]
  ps = [subprocess.Popen(cmd + [str(i)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(procs)]
  outs = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in ps]
  return outs


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--n", type=float, default=1e5)
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--quick", action="store_true", help="n = 1e4, 20 steps")
  ap.add_argument("--procs", type=int, default=1, help=argparse.SUPPRESS)
  ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
  ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
  args = ap.parse_args()
  n, steps = (10_000, 20) if args.quick else (int(args.n), args.steps)
  if args.worker is not None:
    print(json.dumps(worker(args.worker, args.procs, args.port, n, steps)), flush=True)
    return
  one = _launch(1, n, steps)[0]
  two = _launch(2, n, steps)
  diff = max(abs(a - b) for r in two for a, b in zip(r["params"], one["params"]))
  run2 = max(r["run_s"] for r in two)
  summary = {"n": n, "steps": steps, "users_per_step": PER_STEP,
             "one_process": {k: round(one[k], 4) for k in ("first_run_s", "run_s", "step_ms")},
             "two_processes": {"first_run_s": round(max(r["first_run_s"] for r in two), 4),
                               "run_s": round(run2, 4), "step_ms": round(1e3 * run2 / steps, 4)},
             "ratio_two_over_one": round(run2 / one["run_s"], 3),
             "max_param_diff": diff}
  print(f"n={n}, {steps} steps, q n = {PER_STEP}: 1 process {one['step_ms']:.2f} ms/step, "
        f"2 processes {1e3 * run2 / steps:.2f} ms/step (x{run2 / one['run_s']:.2f}); "
        f"max |params difference| {diff:.2g}")
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
