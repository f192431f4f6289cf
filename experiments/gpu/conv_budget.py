"""Times bench_gpu's item- and user-level CNN steps with the fast path's convs chunked (the
default ``conv_budget``) against unchunked (``conv_budget=None``), beside the non-private step,
in one interleaved run: what the chunking (issue 26's memory target) costs on a GPU."""
import os
import sys

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_gpu as bg  # noqa: E402
from _timing import Candidate, compare, format_comparison  # noqa: E402

from dpsco_jax.flax.fast_clip import FastClippedGrad  # noqa: E402
from dpsco_jax.transforms.noise import add_gaussian_noise  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
quick = "--quick" in sys.argv
for name, model, loss, batch, shape in bg.workloads(quick, np.random.default_rng(0)):
  if not name.startswith("cnn"):
    continue
  steps, params, _, level = bg.step_functions(model, loss, shape)
  rows = shape[0]
  cands = []
  for label, budget in (("fast_chunked", "default"), ("fast_unchunked", None)):
    kw = {} if budget == "default" else {"conv_budget": None}
    fast = FastClippedGrad(model, loss, clip_norm=bg.CLIP, level=level, **kw)
    noisy = optax.chain(add_gaussian_noise(bg.Z * bg.CLIP / rows, jax.random.key(0)),
                        optax.sgd(bg.LR))

    def step(p, st, b, _f=fast, _n=noisy):
      u, st = _n.update(_f.aggregate(p, b, mode="mean", denominator=rows), st, p)
      return optax.apply_updates(p, u), st
    cands.append(Candidate(label, jax.jit(step), (params, noisy.init(params)), (batch,)))
  fn, st = steps["nonprivate"]
  cands.insert(0, Candidate("nonprivate", jax.jit(fn), (params, st), (batch,)))
  comp = compare(cands, reps=3 if quick else 5, window_s=0.05 if quick else 0.5,
                 budget_s=5 if quick else 25)
  print(format_comparison(f"\n{name} {tuple(shape)}", comp))
