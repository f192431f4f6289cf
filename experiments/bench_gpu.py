"""One DP-SGD step (gradient + clip C=1 + Gaussian noise + SGD) against the same library's
non-private step, on the five workloads of issue 14, side by side in one run.

Rows per workload (each ratio is to its own library's non-private step):
  * ``dpsco_fast``  — :class:`dpsco_jax.flax.fast_clip.FastClippedGrad` (taps, no per-example
    gradients where a layer is supported; exact fallback elsewhere);
  * ``dpsco_vmap``  — the core's vmapped per-user gradients + fused ``clip_and_aggregate``;
  * ``optax_dpsgd`` — ``optax.contrib.dpsgd`` on vmapped per-example (per-user) gradients;
  * ``jax_privacy`` — jax-privacy's ``clipped_grad`` + ``gaussian_privatizer``, when the
    package is installed (skipped with a note otherwise);
  * Opacus rows are not implemented in this script yet (noted in the output).
  * ``dpsco_fast_gram`` / ``dpsco_fast_direct`` (``--ghost-variants gram direct``) — the fast
    path with ``ghost="gram"`` (every Linear kernel's Gram norm, where certified) or
    ``ghost="direct"`` (every kernel's per-user gradient instantiated): what the cost model's
    per-layer choice (``fast_clip_cost.kernel_form``) is checked against.
Per workload, ``auto`` is the path ``FastClippedGrad(method="auto")`` picks (by the per-layer
cost model of ``dpsco_jax/flax/fast_clip_cost.py``, from shapes only); its ratio is the one of
the row it picks.
Times: medians of interleaved repetitions (experiments/_timing.py), matmuls at full f32
precision (``jax_default_matmul_precision=highest``: the DP norms need it, and it keeps the
non-private reference comparable). Peak memory: XLA's compiled memory analysis
(``peak_mib``) and, where the device reports ``memory_stats()`` (GPU, TPU; not CPU), the
device's peak bytes in use after each path's first step, run alone before the timing
(``peak_mib_runtime``; the counter is process-wide and cannot be reset, so ``peak_rise_mib``
says how much that path raised it: see ``runtime_peaks``).

``--max-batch`` (issue 50; instead of timing, meant with ``--only transformer``): per path, the
largest user batch B whose step, compiled at B users and never run, holds at most the device's
``bytes_limit`` (or ``--memory-limit-gib``, required on CPU): doubling from the workload's B
(then jumping to the bytes' linear extrapolation), then bisecting, compiles only
(``largest_fitting``), at most ``--max-batch-cap`` users and ``--max-batch-budget`` seconds a
path.

    python experiments/bench_gpu.py            # the issue's sizes (meant for a GPU)
    python experiments/bench_gpu.py --quick    # tiny sizes, CPU, under a minute
    python experiments/bench_gpu.py --only transformer --max-batch    # on a GPU

The last printed line is one JSON object: per workload, each row's ratio, ms and MiB (compiled
and runtime peaks); with ``--max-batch``, ``max_batch``: per workload and path, B, its bytes,
the first B found not to fit (``next_B``) and its bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import Candidate, compare, format_comparison  # noqa: E402

from dpsco_jax.flax.fast_clip import FastClippedGrad  # noqa: E402
from dpsco_jax.grads import per_user_grads  # noqa: E402
from dpsco_jax.transforms.clipping import clip_and_aggregate  # noqa: E402
from dpsco_jax.transforms.noise import add_gaussian_noise  # noqa: E402

CLIP, Z, LR = 1.0, 1.0, 0.05
MIB = 2 ** 20


class CNN(nnx.Module):
  def __init__(self, ch: int, classes: int, rngs: nnx.Rngs):
    self.convs = nnx.List([nnx.Conv(c_in, c_out, (3, 3), strides=s, rngs=rngs) for c_in, c_out, s
                           in ((3, ch, 1), (ch, ch, 2), (ch, 2 * ch, 1), (2 * ch, 2 * ch, 2))])
    self.head = nnx.Linear(2 * ch, classes, rngs=rngs)

  def __call__(self, x):
    for conv in self.convs:
      x = jax.nn.relu(conv(x))
    return self.head(jnp.mean(x, axis=(-3, -2)))


class Block(nnx.Module):
  def __init__(self, d: int, heads: int, mha: bool, rngs: nnx.Rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
    self.mha, self.heads = mha, heads
    if mha:
      self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
    else:
      self.qkv, self.out = nnx.Linear(d, 3 * d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
    self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x):  # x: [T, d] (one example; vmapped by the engines)
    t, d = x.shape[-2:]
    h = self.ln1(x)
    mask = jnp.tril(jnp.ones((t, t), bool))
    if self.mha:
      a = self.attn(h, mask=mask[None])
    else:
      q, k, v = jnp.split(self.qkv(h), 3, axis=-1)
      split = lambda u: u.reshape(u.shape[:-1] + (self.heads, d // self.heads))
      a = nnx.dot_product_attention(split(q), split(k), split(v), mask=mask[None])
      a = self.out(a.reshape(a.shape[:-2] + (d,)))
    x = x + a
    return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class LM(nnx.Module):
  def __init__(self, vocab: int, d: int, layers: int, mha: bool, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.blocks = nnx.List([Block(d, 4, mha, rngs) for _ in range(layers)])
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for b in self.blocks:
      x = b(x)
    return self.head(self.ln(x))


def ce_loss(model, ex):
  x, y = ex
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def lm_loss(model, ex):
  tokens = ex[0]
  logits = model(tokens[..., :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[..., 1:]).mean()


def logistic_loss(model, ex):
  x, y = ex
  return optax.sigmoid_binary_cross_entropy(model(x)[..., 0], y)


def workloads(quick: bool, rng: np.random.Generator):
  """(name, model, loss, batch, batch_shape) — batch_shape (B,) item level, (U, m) user level."""
  s = (lambda full, small: small if quick else full)
  img = s(32, 8)
  def images(shape):
    return (jnp.asarray(rng.standard_normal(shape + (img, img, 3)), jnp.float32),
            jnp.asarray(rng.integers(0, 10, shape), jnp.int32))
  vocab, d, layers, t = s(8192, 64), s(256, 16), s(4, 1), s(128, 8)
  tokens = (jnp.asarray(rng.integers(0, vocab, (s(64, 4), t + 1)), jnp.int32),)
  dl = s(4096, 16)
  logit = (jnp.asarray(rng.standard_normal((s(4096, 16), s(64, 4), dl)) / np.sqrt(dl),
                       jnp.float32),
           jnp.asarray(rng.integers(0, 2, (s(4096, 16), s(64, 4))), jnp.float32))
  ch = s(32, 4)
  yield ("cnn_item", CNN(ch, 10, nnx.Rngs(0)), ce_loss, images((s(1024, 8),)), (s(1024, 8),))
  yield ("transformer", LM(vocab, d, layers, False, nnx.Rngs(0)), lm_loss, tokens,
         tokens[0].shape[:1])
  yield ("transformer_mha", LM(vocab, d, layers, True, nnx.Rngs(0)), lm_loss, tokens,
         tokens[0].shape[:1])
  yield ("logistic_user", nnx.Linear(dl, 1, rngs=nnx.Rngs(0)), logistic_loss, logit,
         logit[1].shape)
  yield ("cnn_user", CNN(ch, 10, nnx.Rngs(0)), ce_loss, images((s(256, 4), s(8, 2))),
         (s(256, 4), s(8, 2)))


def _jax_privacy_step(model_loss, level: str, rows: int, sgd):
  """jax-privacy's DP-SGD step: ``clipped_grad`` (its per-example / per-user clipping, sum)
  + ``gaussian_privatizer`` (stddev z C) + mean over the rows + the same SGD; None when the
  package is missing."""
  try:
    import jax_privacy  # noqa: PLC0415
    from jax_privacy.noise_addition import gaussian_privatizer  # noqa: PLC0415
  except ImportError:
    return None
  # A user's loss is the mean over its items (keep_batch_dim=False hands fun one user's
  # [m, ...] slice); at item level each example arrives as a batch of one.
  def fun(p, b):
    return jnp.mean(jax.vmap(model_loss, (None, 0))(p, b))
  grad_fn = jax_privacy.clipped_grad(fun, l2_clip_norm=CLIP, batch_argnums=1,
                                     keep_batch_dim=(level == "item"))
  tx = optax.chain(gaussian_privatizer(stddev=Z * CLIP, prng_key=0),
                   optax.scale(1.0 / rows), sgd)

  def step(p, st, b):
    u, st = tx.update(grad_fn(p, b), st, p)
    return optax.apply_updates(p, u), st

  return step, tx


#: bench_gpu's row names -> bench_cost's path names
PATHS = {"nonprivate": "nonprivate", "dpsco_fast": "fast", "dpsco_vmap": "vmap",
         "optax_dpsgd": "optax", "jax_privacy": "jax_privacy"}


def step_functions(model, loss, batch_shape, ghost_variants: tuple = ()
                   ) -> tuple[dict, Any, FastClippedGrad, str]:
  """One step of every path (``name -> (step(p, st, b), initial state)``, names of ``PATHS``),
  the params, the fast path's ``FastClippedGrad`` and the level: what this bench times and
  ``bench_cost.py`` compiles (one copy of the step code). ``ghost_variants`` (``"gram"``,
  ``"direct"``) add the fast path with that ``ghost`` (``dpsco_fast_<ghost>``)."""
  level = "item" if len(batch_shape) == 1 else "user"
  rows = batch_shape[0]
  fast = FastClippedGrad(model, loss, clip_norm=CLIP, level=level)
  params, model_loss = fast.params, fast.model_loss
  sgd = optax.sgd(LR)
  noisy = optax.chain(add_gaussian_noise(Z * CLIP / rows, jax.random.key(0)), sgd)
  as_users = (lambda b: jax.tree.map(lambda x: x[:, None], b)) if level == "item" else (
      lambda b: b)
  flat = lambda b: jax.tree.map(lambda x: x.reshape((-1,) + x.shape[len(batch_shape):]), b)

  def nonprivate(p, st, b):
    g = jax.grad(lambda q: jnp.mean(jax.vmap(model_loss, (None, 0))(q, flat(b))))(p)
    u, st = sgd.update(g, st, p)
    return optax.apply_updates(p, u), st

  def dp_fast(p, st, b):
    u, st = noisy.update(fast.aggregate(p, b, mode="mean", denominator=rows), st, p)
    return optax.apply_updates(p, u), st

  clip_agg = clip_and_aggregate(CLIP, "mean", rows)

  def dp_vmap(p, st, b):
    agg, _ = clip_agg.update(per_user_grads(model_loss, p, as_users(b)), clip_agg.init(p), p)
    u, st = noisy.update(agg, st, p)
    return optax.apply_updates(p, u), st

  dpsgd = optax.contrib.dpsgd(LR, CLIP, Z, seed=0)

  def dp_optax(p, st, b):
    u, st = dpsgd.update(per_user_grads(model_loss, p, as_users(b)), st, p)
    return optax.apply_updates(p, u), st

  steps = {"nonprivate": (nonprivate, sgd.init(params)),
           "dpsco_fast": (dp_fast, noisy.init(params)),
           "dpsco_vmap": (dp_vmap, noisy.init(params)),
           "optax_dpsgd": (dp_optax, dpsgd.init(params))}
  for ghost in ghost_variants:
    variant = FastClippedGrad(model, loss, clip_norm=CLIP, level=level, ghost=ghost)

    def dp_variant(p, st, b, variant=variant):
      u, st = noisy.update(variant.aggregate(p, b, mode="mean", denominator=rows), st, p)
      return optax.apply_updates(p, u), st
    steps[f"dpsco_fast_{ghost}"] = (dp_variant, noisy.init(params))
  jp = _jax_privacy_step(model_loss, level, rows, sgd)
  if jp is not None:
    steps["jax_privacy"] = (jp[0], jp[1].init(params))
  return steps, params, fast, level


def candidates(model, loss, batch, batch_shape, quick: bool = False, ghost_variants: tuple = (),
               paths: tuple | None = None) -> tuple[list[Candidate], dict, str, dict]:
  """The timed candidates, each path's compiled peak (MiB), ``auto``'s choice and each path's
  compiled executable."""
  steps, params, _, level = step_functions(model, loss, batch_shape, ghost_variants)
  cands, mem, executables = [], {}, {}
  for name, (fn, st) in steps.items():
    if paths and name != "nonprivate" and name not in paths:
      continue
    jitted = jax.jit(fn)
    compiled = executables[name] = jitted.lower(params, st, batch).compile()
    ma = compiled.memory_analysis()
    mem[name] = ((ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes)
                 / MIB) if ma is not None else float("nan")
    # --quick (a smoke run) times the executable it just compiled for the memory analysis
    # rather than compiling the step a second time through the jit cache
    step = compiled if quick else jitted
    cands.append(Candidate(name, lambda p, st, b, _f=step: _f(p, st, b), (params, st),
                           (batch,)))
  auto = FastClippedGrad(model, loss, clip_norm=CLIP, level=level, method="auto")
  choice = auto.autotune(params, jax.tree.map(jnp.zeros_like, batch))
  if choice == "fast":  # the cost model's per-layer forms, so a log says what ran
    print("  fast path per layer: " + ", ".join(
        f"{r['layer']} {r['method']}" for r in auto.autotune_report["layers"]), flush=True)
  return cands, mem, choice, executables


def runtime_peaks(first_runs: list[tuple[str, Callable[[], Any]]],
                  memory_stats: Callable[[], dict | None]) -> tuple[float, dict] | None:
  """Each path's first run, one path at a time: the device's ``peak_bytes_in_use`` after it
  (``peak_mib_runtime``) and how much that peak rose during it (``peak_rise_mib``), plus the
  peak before the first one (the floor: resident buffers and what compiling allocated). The
  counter is process-wide and cannot be reset, so a path that peaks below an earlier one rises
  by 0; callers order ``first_runs`` by compiled peak, smallest first, so that each reading is
  that path's own peak where the compiled analysis ranks the paths as the device does. None
  when the backend reports no memory statistics (CPU)."""
  stats = memory_stats()
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  floor = stats["peak_bytes_in_use"]
  rows = {}
  for name, run in first_runs:
    before = memory_stats()["peak_bytes_in_use"]
    jax.block_until_ready(run())
    after = memory_stats()["peak_bytes_in_use"]
    rows[name] = {"peak_mib_runtime": after / MIB, "peak_rise_mib": (after - before) / MIB}
  return floor / MIB, rows


def step_bytes(compiled) -> int:
  """What a compiled step holds at its peak: arguments + outputs + temporaries, less the
  outputs that alias (reuse) an argument's buffer."""
  ma = compiled.memory_analysis()
  if ma is None:
    raise RuntimeError("this backend gives no compiled memory analysis: --max-batch needs one")
  return (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
          - ma.alias_size_in_bytes)


def batch_of(batch, users: int):
  """``batch`` with ``users`` rows (its leading axis), as shapes only: nothing is allocated."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((users,) + x.shape[1:], x.dtype), batch)


def path_bytes(model, loss, batch, batch_shape, path: str, users: int,
               ghost_variants: tuple = ()) -> int:
  """``step_bytes`` of ``path``'s step at ``users`` users, compiled and never run. The steps are
  rebuilt at that batch shape: the timed step's code, whose noise and mean divide by the user
  count."""
  shape = (users,) + tuple(batch_shape[1:])
  steps, params, _, _ = step_functions(model, loss, shape, ghost_variants)
  fn, st = steps[path]
  return step_bytes(jax.jit(fn).lower(params, st, batch_of(batch, users)).compile())


def largest_fitting(bytes_at: Callable[[int], int], limit: int, start: int, cap: int,
                    budget_s: float) -> dict:
  """The largest B in [1, cap] with ``bytes_at(B) <= limit``, assuming bytes grow with B:
  from ``start``, doubling (or halving) until a B fits and another does not, then bisecting.
  A step's bytes grow about linearly in B and each probe is a compile (tens of seconds for the
  transformer on a GPU), so once two sizes fit, a step up goes to the linear extrapolation of
  their bytes to ``limit`` (at most 16 times up), and every other bisection probe is at the
  bracket's linear interpolation: a few probes where bytes are linear, bisection's count at
  worst. A probe that raises (a compile that fails, e.g. out of memory) counts as not fitting.
  Stops when ``budget_s`` is spent: the answer is then the bracket so far (``exact`` false)."""
  t0, probes, errors = time.perf_counter(), {}, []

  def fits(b: int) -> bool:
    if b not in probes:
      try:
        probes[b] = bytes_at(b)
      except Exception as e:  # noqa: BLE001 — any failure to compile is "does not fit"
        probes[b], _ = None, errors.append(f"B={b}: {type(e).__name__}: {str(e)[:200]}")
    return probes[b] is not None and probes[b] <= limit

  def toward_limit(a: int, b: int) -> int:
    """Where the line through a's and b's bytes reaches ``limit``, from b (which fits);
    twice b where the bytes do not rise."""
    (x0, x1), rise = sorted((a, b)), abs(probes[b] - probes[a])
    return b + (limit - probes[b]) * (x1 - x0) // rise if rise else 2 * b

  in_time = lambda: time.perf_counter() - t0 < budget_s
  lo, hi = 0, None  # lo fits (0: nothing known to fit), hi does not (None: nothing known)
  if fits(min(start, cap)):
    first = lo = min(start, cap)
    while hi is None and lo < cap and in_time():
      up = 2 * lo if lo == first else min(16 * lo, max(lo + 1, toward_limit(first, lo)))
      b = min(up, cap)
      lo, hi = (b, hi) if fits(b) else (lo, b)
  else:
    hi = min(start, cap)
    while lo == 0 and hi > 1 and in_time():
      b = hi // 2
      lo, hi = (b, hi) if fits(b) else (lo, b)
  interpolate = True
  while hi is not None and hi - lo > 1 and in_time():
    b = lo + (hi - lo) // 2
    if interpolate and lo and probes[hi] is not None:
      b = min(max(toward_limit(hi, lo), lo + 1), hi - 1)
    interpolate = not interpolate
    lo, hi = (b, hi) if fits(b) else (lo, b)
  return {"B": lo, "bytes": probes.get(lo), "next_B": hi, "next_bytes": probes.get(hi),
          "exact": hi == lo + 1 or (hi is None and lo == cap), "capped": hi is None,
          "compiles": len(probes), "seconds": round(time.perf_counter() - t0, 1),
          "errors": errors}


def memory_limit(dev, limit_gib: float | None) -> int | None:
  """The bytes a step may hold: ``--memory-limit-gib`` when given, else the device allocator's
  ``bytes_limit`` (on a GPU, the pool JAX takes: 75% of the card by default); None when
  neither is known (CPU without the flag)."""
  if limit_gib is not None:
    return int(limit_gib * 2 ** 30)
  stats = dev.memory_stats() or {}
  return stats.get("bytes_limit")


def max_batch_rows(model, loss, batch, batch_shape, paths: list[str], limit: int,
                   cap: int, budget_s: float, ghost_variants: tuple = ()) -> dict:
  """``largest_fitting`` for every path, from the workload's own user count; one line each."""
  rows = {}
  for path in paths:
    bytes_at = lambda b, path=path: path_bytes(model, loss, batch, batch_shape, path, b,
                                               ghost_variants)
    r = rows[path] = largest_fitting(bytes_at, limit, batch_shape[0], cap, budget_s)
    mib = lambda x: "?" if x is None else f"{x / MIB:.3f} MiB"
    above = ("cap reached" if r["capped"] else
             f"B={r['next_B']} does not ({mib(r['next_bytes'])})")
    print(f"  max batch {path}: B={r['B']} fits ({mib(r['bytes'])} <= {mib(limit)}), "
          f"{above}; {'exact' if r['exact'] else 'budget spent: a bracket'}, "
          f"{r['compiles']} compiles, {r['seconds']} s" + (
              f"; {len(r['errors'])} failed compiles, first: {r['errors'][0]}"
              if r["errors"] else ""), flush=True)
  return rows


def time_workload(name: str, model, loss, batch, shape, args, dev) -> tuple[dict, float | None]:
  """Times one workload's paths (the table, the peaks and ``auto``'s pick printed): its JSON
  rows and the runtime peak before its first runs (None without memory_stats)."""
  t0 = time.perf_counter()
  cands, mem, choice, executables = candidates(model, loss, batch, shape, quick=args.quick,
                                               ghost_variants=tuple(args.ghost_variants),
                                               paths=args.paths)
  # Before the timing, whose interleaved runs would mix the paths' peaks: each path's first
  # run alone, smallest compiled peak first (what runtime_peaks' readings assume)
  by_peak = sorted(cands, key=lambda c: mem[c.name])
  runtime = runtime_peaks([(c.name, lambda c=c: executables[c.name](*c.carry, *c.args))
                           for c in by_peak], dev.memory_stats)
  comp = compare(cands, reps=3 if args.quick else args.reps,
                 window_s=0.05 if args.quick else 0.5, budget_s=5 if args.quick else args.budget)
  print(format_comparison(f"\n{name} {tuple(shape)}", comp))
  print("  peak MiB: " + ", ".join(f"{k} {v:.1f}" for k, v in mem.items())
        + f"   ({time.perf_counter() - t0:.1f} s)")
  if runtime is not None:
    print(f"  runtime peak MiB (process-wide, from {runtime[0]:.1f} before these runs): "
          + ", ".join(f"{k} {v['peak_mib_runtime']:.1f} (+{v['peak_rise_mib']:.1f})"
                      for k, v in runtime[1].items()))
  picked = comp.ratio.get("dpsco_" + choice)
  print(f"  auto picks: {choice}" + (f" (ratio {picked:.3f})" if picked else ""))
  rows = {k: {"ratio": round(comp.ratio[k], 3), "ms": round(1e3 * comp.median_s[k], 3),
              "peak_mib": round(mem[k], 1),
              **({m: round(v, 1) for m, v in runtime[1][k].items()} if runtime else
                 {"peak_mib_runtime": None, "peak_rise_mib": None})} for k in comp.names}
  rows["auto_choice"] = choice
  return rows, None if runtime is None else round(runtime[0], 1)


RUNTIME_NOTE = (
    "peak_mib: XLA's compiled memory analysis (arguments + outputs + temporaries). "
    "peak_mib_runtime: the device's peak_bytes_in_use (memory_stats) right after the path's "
    "first step, run alone before the timing, the paths one at a time in ascending peak_mib; "
    "the counter is process-wide and cannot be reset, so it also holds every earlier peak "
    "(runtime_floor_mib, per workload: earlier workloads, compiles, resident buffers) and "
    "peak_rise_mib is how much this path's step raised it (0: under an earlier peak). None: "
    "the backend has no memory_stats (CPU).")

MAX_BATCH_NOTE = (
    "max_batch: per path, the largest user batch B whose step, compiled at B users and never "
    "run, holds at most limit_bytes (the device's bytes_limit, or --memory-limit-gib): bytes = "
    "arguments + outputs + temporaries - aliased, XLA's compiled memory analysis; next_B is the "
    "smallest B found not to fit (exact: next_B = B + 1). What else the process holds and the "
    "allocator's fragmentation are not counted: the batch that runs may be somewhat smaller.")


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--only", nargs="*", help="workload names to run")
  ap.add_argument("--budget", type=float, default=60.0,
                  help="seconds of timing per workload at full sizes (device time is scarce)")
  ap.add_argument("--ghost-variants", nargs="*", default=(), choices=("gram", "direct"),
                  help="also the fast path with these ghost settings (rows dpsco_fast_<ghost>)")
  ap.add_argument("--paths", nargs="*", default=None,
                  help="time only these rows (and nonprivate): device time is scarce")
  ap.add_argument("--precision", default="highest", choices=("highest", "default"),
                  help="matmul precision of every step; 'default' leaves the backend's (TF32 on "
                       "a GPU) to the non-private step and the peers, while dpsco's clipped "
                       "sums pin HIGHEST inside (dpsco_jax/precision.py)")
  ap.add_argument("--max-batch", action="store_true",
                  help="instead of timing: each path's largest user batch whose compiled step "
                       "fits the memory limit (compiles only; meant with --only transformer)")
  ap.add_argument("--memory-limit-gib", type=float, default=None,
                  help="--max-batch's limit (GiB); default: the device's bytes_limit "
                       "(required where memory_stats has none, e.g. CPU)")
  ap.add_argument("--max-batch-cap", type=int, default=2 ** 16,
                  help="--max-batch searches B in [1, cap]")
  ap.add_argument("--max-batch-budget", type=float, default=40.0,
                  help="--max-batch's seconds per path; when spent, the bracket so far")
  args = ap.parse_args()
  dev = jax.devices()[0]
  limit = memory_limit(dev, args.memory_limit_gib) if args.max_batch else None
  if args.max_batch and limit is None:
    ap.error(f"--max-batch on {dev.platform}: the device reports no bytes_limit, so give the "
             "limit with --memory-limit-gib")
  if args.precision == "highest":
    jax.config.update("jax_default_matmul_precision", "highest")
  rng = np.random.default_rng(0)
  print(f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}); C={CLIP}, z={Z}; "
        f"matmul precision {args.precision}")
  try:
    import jax_privacy  # noqa: F401
    note = f"jax_privacy {jax_privacy.__version__}: clipped_grad + gaussian_privatizer"
  except ImportError:
    note = "jax_privacy not installed: its rows are skipped"
  note += "; Opacus rows: not implemented in this script (pending)"
  note += ". " + (MAX_BATCH_NOTE if args.max_batch else RUNTIME_NOTE)
  print(note)
  out = {"mode": "quick" if args.quick else "full", "device": dev.device_kind,
         "precision": args.precision, "jax": jax.__version__, "notes": note, "workloads": {},
         "runtime_floor_mib": {}}
  if args.max_batch:
    out["max_batch"] = {"limit_bytes": limit, "cap": args.max_batch_cap, "workloads": {}}
  for name, model, loss, batch, shape in workloads(args.quick, rng):
    if args.only and name not in args.only:
      continue
    if args.max_batch:
      steps = step_functions(model, loss, shape, tuple(args.ghost_variants))[0]
      paths = [k for k in steps if not args.paths or k == "nonprivate" or k in args.paths]
      print(f"\n{name} {tuple(shape)}: largest user batch within {limit / MIB:.3f} MiB")
      out["max_batch"]["workloads"][name] = max_batch_rows(
          model, loss, batch, shape, paths, limit, args.max_batch_cap, args.max_batch_budget,
          tuple(args.ghost_variants))
    else:
      out["workloads"][name], out["runtime_floor_mib"][name] = time_workload(
          name, model, loss, batch, shape, args, dev)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
