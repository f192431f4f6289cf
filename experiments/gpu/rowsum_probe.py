"""Issue 26: where the vmap path's clip-and-sum spends its time on an accelerator, with no
model compile (seconds of device time).

On an H100 the transformer's DP step on our vmap path ran 1.38x the non-private step against
optax.contrib.dpsgd's 1.20x (``experiments/results/gpu/bench_tf_chunked_h100.log``), though
both instantiate the same per-example gradients. What differs is the clip-and-sum after
them. This times that part alone on stand-in per-user gradients shaped like bench_gpu's full
transformer (64 examples; every parameter leaf), interleaved:

* ``ours``     — :func:`dpsco_jax.transforms.clipping.clip_and_aggregate` as shipped (norms,
  then per leaf ``where`` and one HIGHEST dot over users; off CPU, since d8164c8, with no
  barrier between them, so XLA may fuse the ``where`` into the dot);
* ``barrier``  — the same sum with the zeroed rows held behind an optimization barrier
  (``_zeroed_row_sum(..., barrier=True)``: the form every backend ran before d8164c8, and
  CPU's still). The H100 log of 2026-11-27 (``rowsum_probe_h100_s6.log``) predates d8164c8:
  there ``ours`` was this barrier form and ``no_barrier`` what ``ours`` is now;
* ``scaled_sum`` — ``sum(w * g, axis=0)`` per leaf after ``where`` (optax's form: a fused
  multiply-reduce, float32, no dot);
* ``norms_only`` — the per-user norms alone (the floor every form pays).

    python experiments/gpu/rowsum_probe.py [--users 64] [--reps 9]

JSON last line (ms per call and ratio to ``norms_only``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from _timing import Candidate, compare, format_comparison  # noqa: E402

import bench_gpu  # noqa: E402
from dpsco_jax.transforms import clipping  # noqa: E402


def _scaled_sum(leaves, weights, keep):
  def f(g):
    k = keep.reshape((-1,) + (1,) * (g.ndim - 1))
    w = weights.reshape(k.shape)
    return jnp.sum(jnp.where(k, g * w, 0.0), axis=0)
  return [f(g) for g in leaves]


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--users", type=int, default=64)
  ap.add_argument("--reps", type=int, default=9)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  name, model, *_ = next(w for w in bench_gpu.workloads(False, rng) if w[0] == "transformer")
  from flax import nnx  # noqa: PLC0415
  params = nnx.state(model, nnx.Param)
  key = jax.random.key(0)
  stacked = jax.tree.map(
      lambda p: 1e-3 * jax.random.normal(jax.random.fold_in(key, p.size), (args.users,) + p.shape),
      params)
  n_el = sum(x.size for x in jax.tree.leaves(stacked))
  agg = clipping.clip_and_aggregate(1.0, "mean", args.users)
  st0 = agg.init(params)

  def with_rowsum(rowsum):
    def step(acc, g):
      norms = clipping.tree_global_norms(g)   # the weights as clip_and_aggregate forms them
      keep = jnp.isfinite(norms)
      w = jnp.where(keep, clipping._clip_factors(norms, 1.0) / args.users, 0.0)
      leaves, treedef = jax.tree.flatten(g)
      out = jax.tree.unflatten(treedef, rowsum(leaves, w, keep))
      return (jax.tree.map(jnp.add, acc, out),)
    return jax.jit(step)

  def ours(acc, g):
    out, _ = agg.update(g, st0, params)
    return (jax.tree.map(jnp.add, acc, out),)

  def norms_only(acc, g):
    n = clipping.tree_global_norms(g)
    return (jax.tree.map(lambda a: a + jnp.sum(n), acc),)

  acc0 = jax.tree.map(jnp.zeros_like, params)
  steps = {"norms_only": jax.jit(norms_only), "ours": jax.jit(ours),
           "barrier": with_rowsum(lambda l, w, k: clipping._zeroed_row_sum(l, w, k, barrier=True)),
           "scaled_sum": with_rowsum(_scaled_sum)}
  cands = [Candidate(k, f, (acc0,), (stacked,)) for k, f in steps.items()]
  comp = compare(cands, reps=args.reps, window_s=0.2, budget_s=30)
  dev = jax.devices()[0]
  print(f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}); {args.users} users x "
        f"{n_el // args.users} parameters ({4 * n_el / 2**20:.0f} MiB of per-user gradients)")
  print(format_comparison(f"clip-and-sum of {name}'s per-user gradients", comp))
  print(json.dumps({k: {"ms": round(1e3 * comp.median_s[k], 3), "ratio": round(comp.ratio[k], 3)}
                    for k in comp.names}))


if __name__ == "__main__":
  main()
