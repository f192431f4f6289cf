"""Times the fast path's backend-aware conv chunking (``conv_budget="auto"``, the default)
against all users at once (``conv_budget=None``) and today's CPU budget
(``conv_budget=CONV_CHUNK_BUDGET``, the old default everywhere), on bench_gpu's item- and
user-level CNN steps, beside the non-private step, interleaved in one run (issue 26).

    python experiments/gpu/conv_budget_default.py            # full sizes, ~75 s on an H100
    python experiments/gpu/conv_budget_default.py --only cnn_user   # one workload, ~40 s
    python experiments/gpu/conv_budget_default.py --quick    # bench_gpu's tiny sizes (CPU smoke)
    python experiments/gpu/conv_budget_default.py --extra 4.0   # more budgets (~9 s each)

One line per variant (workload, variant, each conv's chunk of users, ms/step, ratio to the
non-private step [IQR], compile s) and a JSON last line
``{workload: {variant: {"ms", "ratio", "iqr", "chunks"}}, "_meta": {...}}``. A variant whose
chunks are those of one already compiled (the default resolves to one of the others) is not
compiled twice: it is reported with that variant's timings and ``"same_as"``.
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_gpu as bg  # noqa: E402
from _timing import Candidate, compare, smoke_xla_flags  # noqa: E402

from dpsco_jax.flax import fast_clip_conv as fcv  # noqa: E402
from dpsco_jax.flax.fast_clip import FastClippedGrad  # noqa: E402
from dpsco_jax.transforms.noise import add_gaussian_noise  # noqa: E402


def cnn_workloads(quick: bool, only=None):
  """bench_gpu's two CNN workloads, same models and shapes, built alone
  (``bench_gpu.workloads`` draws every workload's data first: 4 GiB for its GLM)."""
  rng = np.random.default_rng(0)
  img, ch = (8, 4) if quick else (32, 32)
  for name, shape in (("cnn_item", (8,) if quick else (1024,)),
                      ("cnn_user", (4, 2) if quick else (256, 8))):
    if only and name not in only:
      continue
    batch = (jnp.asarray(rng.standard_normal(shape + (img, img, 3)), jnp.float32),
             jnp.asarray(rng.integers(0, 10, shape), jnp.int32))
    yield name, bg.CNN(ch, 10, nnx.Rngs(0)), bg.ce_loss, batch, shape


def fast_step(model, loss, level: str, rows: int, budget):
  fast = FastClippedGrad(model, loss, clip_norm=bg.CLIP, level=level, conv_budget=budget)
  noisy = optax.chain(add_gaussian_noise(bg.Z * bg.CLIP / rows, jax.random.key(0)),
                      optax.sgd(bg.LR))

  def step(p, st, b):
    u, st = noisy.update(fast.aggregate(p, b, mode="mean", denominator=rows), st, p)
    return optax.apply_updates(p, u), st
  return fast, step, noisy.init(fast.params)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="bench_gpu's tiny sizes (smoke)")
  ap.add_argument("--extra", type=float, action="append", default=[],
                  help="another conv_budget to time (a fraction of each conv's activations)")
  ap.add_argument("--only", action="append", choices=("cnn_item", "cnn_user"),
                  help="time only this workload (repeatable; default both)")
  args = ap.parse_args()
  t_start = time.perf_counter()
  if args.quick:
    smoke_xla_flags()
  jax.config.update("jax_default_matmul_precision", "highest")
  variants = [("default", "auto"), ("unchunked", None), ("cpu_budget", fcv.CONV_CHUNK_BUDGET)]
  variants += [(f"budget_{b:g}", b) for b in args.extra]
  out, rules = {}, {}
  for name, model, loss, batch, shape in cnn_workloads(args.quick, args.only):
    steps, params, _, level = bg.step_functions(model, loss, shape)
    rows = shape[0]
    fn, st = steps["nonprivate"]
    cands = [Candidate("nonprivate", jax.jit(fn), (params, st), (batch,))]
    chunks, same_as = {}, {}
    for label, budget in variants:
      fast, step, st0 = fast_step(model, loss, level, rows, budget)
      plan = fast.plan(params, batch)
      chunks[label] = [r.chunk for r in plan.layers if r.kind == "conv"]
      if label == "default":
        rules[name] = plan.conv_chunks.reason
      twin = next((k for k, v in chunks.items() if k != label and v == chunks[label]
                   and k not in same_as), None)
      if twin is not None:  # the same chunks: the same compiled program
        same_as[label] = twin
        continue
      cands.append(Candidate(label, jax.jit(step), (params, st0), (batch,)))
    comp = compare(cands, reps=3 if args.quick else 5, window_s=0.02 if args.quick else 0.2,
                   budget_s=2 if args.quick else 6)
    rows_out = {}
    print(f"{name} {tuple(shape)}: non-private {1e3 * comp.median_s['nonprivate']:.2f} ms; "
          f"default rule: {rules[name]}")
    for label, _ in variants:
      src = same_as.get(label, label)
      lo, hi = comp.ratio_iqr[src]
      rows_out[label] = {"ms": round(1e3 * comp.median_s[src], 4),
                         "ratio": round(comp.ratio[src], 4), "iqr": [round(lo, 4), round(hi, 4)],
                         "chunks": chunks[label]}
      if label in same_as:
        rows_out[label]["same_as"] = src
      note = f" (= {src})" if label in same_as else ""
      print(f"  {name:<9} {label + note:<26} chunks {str(chunks[label]):<22} "
            f"{1e3 * comp.median_s[src]:8.2f} ms  {comp.ratio[src]:5.2f}x "
            f"[{lo:.2f}, {hi:.2f}]  compile {comp.compile_s[src]:5.1f} s", flush=True)
    out[name] = rows_out
  dev = jax.devices()[0]
  out["_meta"] = {"device": getattr(dev, "device_kind", str(dev)),
                  "backend": jax.default_backend(), "jax": jax.__version__,
                  "quick": args.quick, "default_rule": rules,
                  "wall_s": round(time.perf_counter() - t_start, 1)}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
