"""A narrow ``bench_cost.py --compile-only``: one workload at bench_gpu's full size, only the
named paths compiled (default the non-private and the fast step), absolute temp / peak / FLOPs
printed (seconds per row instead of minutes for the whole table; used for bench_cost.md's
"late per-user gradient buffers" rows).

    python experiments/bench_cost_rows.py cnn_item                  # nonprivate, fast
    python experiments/bench_cost_rows.py cnn_user nonprivate,fast,vmap

Same flags as bench_cost: single-threaded Eigen, matmuls at ``highest``. The fast step's
FLOPs here count each conv loop body once (bench_cost takes them from an unchunked compile).
"""

import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
jax.config.update("jax_default_matmul_precision", "highest")
import bench_cost  # noqa: E402


def main() -> None:
  name = sys.argv[1] if len(sys.argv) > 1 else "cnn_item"
  want = sys.argv[2].split(",") if len(sys.argv) > 2 else ["nonprivate", "fast"]
  for _, model, loss, batch, shape in bench_cost.workloads("full", None, [name]):
    fns, params, _, _ = bench_cost.steps(model, loss, shape)
    for path in want:
      t = time.time()
      fn, st = fns[path]
      r = bench_cost.cost_of(jax.jit(fn).lower(params, st, batch).compile())
      print(f"{name} {path}: temp {r['temp'] / 2**20:.1f} MiB peak {r['peak'] / 2**20:.1f} MiB "
            f"flops {r['flops']:.4g} ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
