"""Issue 26: the vmap path of ``FastClippedGrad`` in chunks of users
(``dpsco_jax/flax/fast_clip_vmap.py``), timed where its ``"auto"`` rule chunks: bench_gpu's CNNs
at full size, executed on this CPU (bench_cost's medium sizes are below the rule's 8 MiB of
per-user gradients, so there it is the one-piece step).

Side by side, interleaved (``experiments/_timing.py``): the non-private step, the core vmap
step (per-user gradients + ``clip_and_aggregate``, all users at once) and
``FastClippedGrad(method="vmap")`` (``vmap_chunks="auto"``: 4 chunks here), with ``--peers``
also optax.contrib.dpsgd and jax_privacy, plus their compiled peak memory.

    python experiments/bench_cost_vmap_chunked.py                   # cnn_item, cnn_user
    python experiments/bench_cost_vmap_chunked.py --only cnn_item --reps 5 --peers

Same flags as bench_cost: single-threaded Eigen, matmuls at ``highest``. JSON last line.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
jax.config.update("jax_default_matmul_precision", "highest")
import bench_cost  # noqa: E402
from _timing import Candidate, compare, format_comparison  # noqa: E402

from dpsco_jax.flax.fast_clip import FastClippedGrad  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", nargs="*", default=["cnn_item", "cnn_user"])
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--peers", nargs="*", default=None,
                  help="also these peers (optax, jax_privacy; bare --peers: both, when installed)")
  ap.add_argument("--fast", action="store_true", help="also the fast path (taps, ghost norms)")
  ap.add_argument("--chunks", default="auto",
                  help="vmap_chunks of the chunked step ('auto' or an int)")
  ap.add_argument("--size", default="full", choices=("full", "medium"))
  args = ap.parse_args()
  out = {}
  rng = np.random.default_rng(0)
  chunk_rule = args.chunks if args.chunks == "auto" else int(args.chunks)
  peers = () if args.peers is None else (args.peers or ("optax", "jax_privacy"))
  for name, model, loss, batch, shape in bench_cost.workloads(args.size, rng, args.only):
    fns, params, _, level = bench_cost.steps(model, loss, shape)
    chunked = FastClippedGrad(model, loss, clip_norm=bench_cost.CLIP, level=level,
                              method="vmap", vmap_chunks=chunk_rule)
    steps = {"nonprivate": fns["nonprivate"], "vmap": fns["vmap"],
             "vmap_chunked": bench_cost._auto_step(chunked, shape[0], params)}
    steps.update({p: fns[p] for p in peers if p in fns})
    if args.fast:
      steps["fast"] = fns["fast"]
    cands, peak = [], {}
    for path, (fn, st) in steps.items():
      t0 = time.perf_counter()
      compiled = jax.jit(fn).lower(params, st, batch).compile()
      # a line per compile: a run stopped at its deadline still shows how far it got
      print(f"  {name}: {path} compiled in {time.perf_counter() - t0:.1f} s", flush=True)
      peak[path] = bench_cost.cost_of(compiled)["peak"]
      cands.append(Candidate(path, compiled, (params, st), (batch,)))
    comp = compare(cands, reps=args.reps, window_s=0.0, budget_s=600.0)
    print(format_comparison(f"\n{name} {tuple(shape)} [{args.size} size, executed]", comp))
    chunks = chunked.plan(params, batch).vmap_chunks
    print(f"  vmap_chunked: {chunks[1]}; peak / non-private: "
          + ", ".join(f"{p} {peak[p] / peak['nonprivate']:.3f}" for p in steps), flush=True)
    out[name] = {p: {"ms": round(1e3 * comp.median_s[p], 2),
                     "ratio": round(comp.ratio[p], 4),
                     "peak_ratio": round(peak[p] / peak["nonprivate"], 4)} for p in steps}
    out[name]["_chunks"] = chunks[0]
  print(json.dumps(out))


if __name__ == "__main__":
  main()
