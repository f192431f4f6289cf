"""The vmap path's clip-and-aggregate on the GLM, before / after its weighted sum over users
stopped copying the per-user gradients on CPU (issue 26; ``_weighted_row_sum`` in
``dpsco_jax/transforms/clipping.py``).

``before`` is the same step traced with the zeroed form on every backend (``where`` over the
``[U, ...]`` rows, then the HIGHEST dot: what ``_weighted_row_sum`` did everywhere, and still
does off CPU and when a dropped row is not finite); ``after`` is the code as it is. Timed
interleaved (``experiments/_timing.py``), in two groups:

* ``update``: ``clip_and_aggregate(C, "mean", U).update`` alone on stacked per-user gradients
  ``{kernel [U, D, 1], bias [U, 1]}`` against ``optax.contrib.dpsgd``'s whole update on the
  same gradients (its clipping, sum and noise);
* ``step``: bench_cost's medium GLM row (1024 users x 16 items, d 1024): non-private, vmap
  before / after, optax.contrib.dpsgd (per-user gradients, clipping, noise, SGD).

    python experiments/bench_cost_rowsum.py            # U = D = 1024 and the medium GLM step
    python experiments/bench_cost_rowsum.py --quick    # tiny sizes (smoke)

Same flags as bench_cost: single-threaded Eigen, matmuls at ``highest``. JSON last line.
"""

import argparse
import contextlib
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
jax.config.update("jax_default_matmul_precision", "highest")
import bench_cost  # noqa: E402
from _timing import Candidate, compare, format_comparison  # noqa: E402

from dpsco_jax.transforms import clipping as cl  # noqa: E402


@contextlib.contextmanager
def zeroed_form():
  """Traces ``_weighted_row_sum`` as before: the zeroed form (behind its barrier, as it then
  was) on every backend."""
  orig = cl._weighted_row_sum

  def before(stacked, weights, keep):
    leaves, treedef = jax.tree.flatten(stacked)
    return jax.tree.unflatten(treedef, cl._zeroed_row_sum(leaves, weights, keep,
                                                           barrier=True))
  cl._weighted_row_sum = before
  try:
    yield
  finally:
    cl._weighted_row_sum = orig


def traced_with(fn, form):
  """``fn`` jitted, traced (at its first call) under ``form``. A fresh wrapper per call: jit
  caches traces by function, so ``jax.jit(fn)`` twice would run the first trace twice."""
  jitted = jax.jit(lambda *a: fn(*a))

  def call(*args):
    with form():
      return jitted(*args)
  return call


def update_group(u: int, d: int, reps: int, window_s: float):
  rng = np.random.default_rng(0)
  grads = {"kernel": jnp.asarray(rng.standard_normal((u, d, 1)), jnp.float32),
           "bias": jnp.asarray(rng.standard_normal((u, 1)), jnp.float32)}
  p0 = jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads)
  chain = cl.clip_and_aggregate(bench_cost.CLIP, "mean", float(u))

  def ours(p, g):  # the aggregate folded into the carry, so every call depends on the last
    out, _ = chain.update(g, chain.init(p), p)
    return (jax.tree.map(lambda a, b: a + 1e-6 * b, p, out),)

  dpsgd = optax.contrib.dpsgd(bench_cost.bench_gpu.LR, bench_cost.CLIP, bench_cost.Z, seed=0)

  def theirs(p, st, g):
    upd, st = dpsgd.update(g, st, p)
    return optax.apply_updates(p, upd), st

  cands = [Candidate("optax_dpsgd_update", jax.jit(theirs), (p0, dpsgd.init(p0)), (grads,)),
           Candidate("before", traced_with(ours, zeroed_form), (p0,), (grads,)),
           Candidate("after", traced_with(ours, contextlib.nullcontext), (p0,), (grads,))]
  return compare(cands, reps=reps, window_s=window_s)


def step_group(size: str, reps: int, window_s: float):
  rng = np.random.default_rng(0)
  (_, model, loss, batch, shape), = bench_cost.workloads(size, rng, ["logistic_user"])
  fns, params, _, _ = bench_cost.steps(model, loss, shape)
  cands = []
  for label, path, form in (("nonprivate", "nonprivate", contextlib.nullcontext),
                            ("vmap_before", "vmap", zeroed_form),
                            ("vmap_after", "vmap", contextlib.nullcontext),
                            ("optax", "optax", contextlib.nullcontext)):
    fn, st = fns[path]
    cands.append(Candidate(label, traced_with(fn, form), (params, st), (batch,)))
  return compare(cands, reps=reps, window_s=window_s), shape


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--users", type=int, default=1024)
  ap.add_argument("--dim", type=int, default=1024)
  ap.add_argument("--reps", type=int, default=9)
  args = ap.parse_args()
  u, d = (16, 16) if args.quick else (args.users, args.dim)
  reps, window = (3, 0.02) if args.quick else (args.reps, 0.25)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
  out = {}
  comp = update_group(u, d, reps, window)
  print(format_comparison(f"clip_and_aggregate update, U={u} D={d}", comp))
  out["update"] = {k: {"ms": round(1e3 * comp.median_s[k], 4), "ratio": round(comp.ratio[k], 4),
                       "after_over_before": round(comp.paired_ratio(k, "before"), 4)}
                   for k in comp.names}
  comp, shape = step_group("quick" if args.quick else "medium", reps, window)
  print(format_comparison(f"\nGLM step {tuple(shape)}", comp))
  out["step"] = {k: {"ms": round(1e3 * comp.median_s[k], 4), "ratio": round(comp.ratio[k], 4)}
                 for k in comp.names}
  out["step"]["vmap_after"]["after_over_before"] = round(
      comp.paired_ratio("vmap_after", "vmap_before"), 4)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
