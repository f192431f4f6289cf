"""Issue 26, part 3 (investigation, not a library path): the vmap path's clipped sum taken over
chunks of users, on bench_cost's item-level CNN, where ``method="auto"`` picks vmap on CPU and
its peak memory is 1.41x the non-private step's (target 1.2x).

A user's clip weight needs only its own gradient's norm, so the clipped sum can be formed
chunk by chunk (per-user gradients of one chunk at a time, and only that chunk's
activations), with the same FLOPs. Two forms, compiled beside bench_cost's non-private, vmap
and fast steps (same step code: noise, SGD):

* ``loop``: a ``fori_loop`` over chunks (``dynamic_slice`` of the batch);
* ``unrolled``: one static slice per chunk, unrolled in the program.

    python experiments/bench_cost_vmap_chunks.py medium 8,16,32 loop,unrolled   # + CPU times
    python experiments/bench_cost_vmap_chunks.py full 128,256 loop,unrolled     # compile only

Prints peak (arguments + outputs + temporaries) and temporaries per variant, as ratios to
the non-private step, and at ``medium`` the paired CPU-time ratios. Same flags as bench_cost.
"""
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
import bench_gpu  # noqa: E402
from _timing import Candidate, compare, format_comparison  # noqa: E402

from dpsco_jax.grads import per_user_grads  # noqa: E402
from dpsco_jax.transforms.clipping import clip_and_aggregate  # noqa: E402
from dpsco_jax.transforms.noise import add_gaussian_noise  # noqa: E402


def clipped_sum(model_loss, params, users, chunk: int, form: str):
  """``sum_u min(1, C/||g_u||) g_u`` over ``chunk`` users at a time."""
  n = jax.tree.leaves(users)[0].shape[0]
  agg = clip_and_aggregate(bench_gpu.CLIP, "sum")
  total = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

  def part_sum(part, mask=None):
    s, _ = agg.update(per_user_grads(model_loss, params, part), agg.init(params), params,
                      user_mask=mask)
    return s

  if form == "unrolled":
    for i in range(0, n, chunk):
      s = part_sum(jax.tree.map(lambda x, i=i: x[i:i + chunk], users))
      total = jax.tree.map(jnp.add, total, s)
    return total

  def body(c, tot):  # the last chunk ends at the last user; users seen before are masked
    i = jnp.minimum(c * chunk, n - chunk)
    fresh = (i + jnp.arange(chunk)) >= c * chunk
    part = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, chunk, 0), users)
    return jax.tree.map(jnp.add, tot, part_sum(part, fresh))
  return jax.lax.fori_loop(0, -(-n // chunk), body, total)


def main() -> None:
  size = sys.argv[1] if len(sys.argv) > 1 else "medium"
  chunks = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "8,16").split(",")]
  forms = (sys.argv[3] if len(sys.argv) > 3 else "loop,unrolled").split(",")
  execute = size != "full"
  rng = np.random.default_rng(0) if execute else None
  (_, model, loss, batch, shape), = bench_cost.workloads(size, rng, ["cnn_item"])
  fns, params, fast, _ = bench_cost.steps(model, loss, shape)
  rows = shape[0]
  noisy = optax.chain(add_gaussian_noise(bench_gpu.Z * bench_gpu.CLIP / rows, jax.random.key(0)),
                      optax.sgd(bench_gpu.LR))

  def chunked_step(chunk, form):
    def step(p, st, b):
      users = jax.tree.map(lambda x: x[:, None], b)
      s = clipped_sum(fast.model_loss, p, users, chunk, form)
      u, st = noisy.update(jax.tree.map(lambda x: x / rows, s), st, p)
      return optax.apply_updates(p, u), st
    return step, noisy.init(params)

  variants = [(k, fns[k]) for k in ("nonprivate", "vmap", "fast")]
  variants += [(f"{form}_{c}", chunked_step(c, form)) for form in forms for c in chunks]
  cands, costs = [], {}
  for label, (fn, st) in variants:
    compiled = jax.jit(fn).lower(params, st, batch).compile()
    costs[label] = bench_cost.cost_of(compiled)
    cands.append(Candidate(label, compiled, (params, st), (batch,)))
  ref = costs["nonprivate"]
  print(f"cnn_item {tuple(shape)} [{size}]: peak / temp as ratios to the non-private step's "
        f"({ref['peak'] / 2**20:.1f} / {ref['temp'] / 2**20:.1f} MiB)")
  for label, r in costs.items():
    print(f"  {label:<14} peak {r['peak'] / ref['peak']:.3f}  temp {r['temp'] / ref['temp']:.3f}")
  if execute:
    print(format_comparison(f"\ncnn_item {tuple(shape)} [{size}] CPU time",
                            compare(cands, reps=5, window_s=0.3)))


if __name__ == "__main__":
  main()
