"""Benchmark of the core DP engine against non-private training and ``optax.contrib.dpsgd``.

Measures, in one run, the wall time of ONE jitted training step (gradients + transformation
chain + apply) and prints a table and, on the last line, one JSON object with the ratios:

(a) user-level DP step ``per_user_grads -> clip_and_aggregate("mean") (fused) ->
    add_gaussian_noise -> projected_sgd -> apply`` versus the non-private step (``jax.grad`` of
    the batch-mean loss + the same ``projected_sgd``) on the same data, for
      (i)  logistic regression, d = 1000, 256 users x 64 items   (target: ratio <= 1.5);
      (ii) a Flax nnx MLP 784-512-10 (cross-entropy, random inputs), 64 users x 8 items;
(b) item-level DP-SGD on the same MLP, batch 256: our engine with m = 1 rows and the same chain
    versus ``optax.contrib.dpsgd`` fed ``vmap(grad)`` per-example gradients
    (target: ratio < 1).

Every step receives the all-true ``user_mask`` as ``run_chain`` does (it is a runtime
argument, so XLA cannot fold it away). Timing: compile first (reported apart), then paired
interleaved repetitions, medians (see ``_timing.py``). Absolute times on a small shared CPU
are only indicative; the ratios are the result.

JSON keys: ``logistic_user_vs_nonprivate``, ``mlp_user_vs_nonprivate`` (DP step / non-private
step), ``item_ours_vs_optax_dpsgd`` (ours / optax); ``diag_*`` keys (not in ``--quick``) time
variants that explain the numbers: the non-private gradient in the per-user layout, and the
unfused ``clip_per_user -> aggregate`` pair (a clipped copy of the gradients, then the sum).
The fused stage exists because XLA:CPU turned ``sum(axis=0)`` over a large ``[U, ...]`` array
into a YNNPACK fusion ~50x slower than the equivalent ``tensordot`` (compare with
``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=``, which disables it).

Usage: ``python experiments/bench_core.py [--quick] [--only SECTION..] [--reps N] [--window S]
[--hlo] [--no-diagnostics]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from _timing import Candidate, compare, format_comparison  # noqa: E402
from dpsco_jax.grads import per_user_grads  # noqa: E402
from dpsco_jax.problems import logistic_loss  # noqa: E402
from dpsco_jax.transforms.clipping import (aggregate, clip_and_aggregate,  # noqa: E402
                                           clip_per_user)
from dpsco_jax.transforms.noise import add_gaussian_noise  # noqa: E402
from dpsco_jax.transforms.steps import projected_sgd  # noqa: E402

PyTree = Any
CLIP = 1.0
NOISE_MULTIPLIER = 1.1
LR = 0.1

SIZES = {
    "full": dict(log_users=256, log_m=64, log_d=1000, mlp_users=64, mlp_m=8, mlp_in=784,
                 mlp_hidden=512, mlp_out=10, item_batch=256, reps=7, window=0.25, budget=15.0),
    "quick": dict(log_users=32, log_m=8, log_d=100, mlp_users=8, mlp_m=4, mlp_in=64,
                  mlp_hidden=32, mlp_out=10, item_batch=32, reps=3, window=0.02, budget=1.0),
}


# ----------------------------------------------------------------------------- problems
def logistic_data(key: jax.Array, users: int, m: int, d: int) -> dict:
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (users, m, d), jnp.float32) / jnp.sqrt(d)
  y = jax.random.bernoulli(ky, 0.5, (users, m)).astype(jnp.float32)
  return {"x": x, "y": y}


def mlp_problem(key: jax.Array, d_in: int, hidden: int, d_out: int
                ) -> tuple[Callable, PyTree]:
  """A Flax nnx MLP ``d_in - hidden - d_out``; returns ``(loss_fn(params, example), params)``.

  The loss is written against the ``nnx.State`` of parameters (``nnx.split``/``nnx.merge``), so
  the core engine sees an ordinary pytree.
  """
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.l1 = nnx.Linear(d_in, hidden, rngs=rngs)
      self.l2 = nnx.Linear(hidden, d_out, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.l1(x)))

  model = MLP(nnx.Rngs(int(jax.random.randint(key, (), 0, 2**30))))
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(p, ex):
    logits = nnx.merge(graphdef, p)(ex["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ex["y"])

  return loss_fn, params


def mlp_data(key: jax.Array, shape: tuple[int, ...], d_in: int, d_out: int) -> dict:
  kx, ky = jax.random.split(key)
  return {"x": jax.random.normal(kx, shape + (d_in,), jnp.float32),
          "y": jax.random.randint(ky, shape, 0, d_out)}


# ----------------------------------------------------------------------------- steps
def dp_chain(denominator: int, key: jax.Array, radius: float | None
             ) -> optax.GradientTransformationExtraArgs:
  """The core DP-SGD chain as ``algorithms.dpsgd.driver`` builds it (last iterate, no averaging,
  like the non-private step it is compared with; ``radius=None`` for the MLP)."""
  return optax.chain(
      clip_and_aggregate(CLIP, "mean", float(denominator)),
      add_gaussian_noise(NOISE_MULTIPLIER * CLIP / denominator, key),
      projected_sgd(LR, radius=radius))


def private_step_fn(loss_fn: Callable, tx: optax.GradientTransformationExtraArgs) -> Callable:
  """``(params, state, batch, mask) -> (params, state)``: engine gradients + chain + apply."""
  @jax.jit
  def step(params, state, batch, mask):
    g = per_user_grads(loss_fn, params, batch, user_mask=mask)
    updates, state = tx.update(g, state, params, user_mask=mask)
    return optax.apply_updates(params, updates), state
  return step


def nonprivate_step_fn(loss_fn: Callable, tx: optax.GradientTransformation) -> Callable:
  """``(params, state, batch) -> (params, state)``: grad of the batch-mean loss + same step."""
  @jax.jit
  def step(params, state, batch):
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)
    mean_loss = lambda p: jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0))(p, flat))
    g = jax.grad(mean_loss)(params)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state
  return step


def optax_dpsgd_step_fn(loss_fn: Callable) -> tuple[Callable, Any]:
  """``optax.contrib.dpsgd`` fed ``vmap(grad)`` per-example gradients (its documented use)."""
  with warnings.catch_warnings():
    # optax 0.2.8 still requires ``seed`` and warns that it is deprecated in favour of key.
    warnings.simplefilter("ignore")
    tx = optax.contrib.dpsgd(learning_rate=LR, l2_norm_clip=CLIP,
                             noise_multiplier=NOISE_MULTIPLIER, seed=0)

  @jax.jit
  def step(params, state, batch):
    g = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, batch)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state
  return step, tx


# ----------------------------------------------------------------------------- diagnostics
def unfused_chain(denominator: int, key: jax.Array, radius: float | None,
                  ) -> optax.GradientTransformationExtraArgs:
  """DIAGNOSTIC: ``dp_chain`` with the unfused pair ``clip_per_user -> aggregate`` (writes a
  clipped copy of the ``[U, ...]`` gradients before summing)."""
  return optax.chain(
      clip_per_user(CLIP),
      aggregate("mean", denominator=float(denominator)),
      add_gaussian_noise(NOISE_MULTIPLIER * CLIP / denominator, key),
      projected_sgd(LR, radius=radius))


def hlo_summary(jitted: Callable, *args) -> dict:
  """Counts of the heavy ops in the optimized HLO of ``jitted(*args)``."""
  text = jitted.lower(*args).compile().as_text()
  return {"fusions": len(re.findall(r"^\s*\S+ = \S+ fusion\(", text, re.M)),
          "dots": len(re.findall(r" dot\(", text)),
          "reduces": len(re.findall(r" reduce\(", text)),
          "while": len(re.findall(r" while\(", text))}


# ----------------------------------------------------------------------------- benchmark
# A section returns (ratios for the JSON line, printed tables).
Section = tuple[dict, list[str]]


def nonprivate_per_user_layout_fn(loss_fn: Callable, tx: optax.GradientTransformation
                                  ) -> Callable:
  """DIAGNOSTIC: the non-private gradient computed the way the DP step computes it (mean of
  ``per_user_grads``), isolating the cost of clipping + noise from the gradient layout."""
  @jax.jit
  def step(params, state, batch):
    g = per_user_grads(loss_fn, params, batch)
    n = jax.tree.leaves(g)[0].shape[0]
    mean = jax.tree.map(lambda x: jnp.tensordot(jnp.full((n,), 1.0 / n, x.dtype), x, axes=1), g)
    updates, state = tx.update(mean, state, params)
    return optax.apply_updates(params, updates), state
  return step


def bench_logistic(sizes: dict, key: jax.Array, reps: int, window: float, budget: float,
                   diagnostics: bool, show_hlo: bool) -> Section:
  """(a)(i): user-level DP step vs non-private step, logistic regression."""
  U, m, d = sizes["log_users"], sizes["log_m"], sizes["log_d"]
  k_data, k_noise = jax.random.split(key)
  data = logistic_data(k_data, U, m, d)
  w0 = jnp.zeros((d,), jnp.float32)
  mask = jnp.ones((U,), bool)
  tx_p = dp_chain(U, k_noise, radius=10.0)
  tx_np = projected_sgd(LR, radius=10.0)
  ours = private_step_fn(logistic_loss, tx_p)
  base = nonprivate_step_fn(logistic_loss, tx_np)
  cands = [Candidate("non-private (grad of mean + projected_sgd)", base,
                     (w0, tx_np.init(w0)), (data,)),
           Candidate("user-level DP (per_user_grads + chain)", ours,
                     (w0, tx_p.init(w0)), (data, mask))]
  if diagnostics:
    cands.append(Candidate("diag: non-private via per_user_grads mean",
                           nonprivate_per_user_layout_fn(logistic_loss, tx_np),
                           (w0, tx_np.init(w0)), (data,)))
  comp = compare(cands, reps=reps, window_s=window, budget_s=budget)
  out = [format_comparison(f"(a)(i) logistic d={d}, {U} users x {m} items", comp)]
  if show_hlo:
    out.append("  HLO ours: " + json.dumps(hlo_summary(ours, w0, tx_p.init(w0), data, mask))
               + "\n  HLO base: " + json.dumps(hlo_summary(base, w0, tx_np.init(w0), data)))
  ratios = {"logistic_user_vs_nonprivate": comp.ratio[comp.names[1]]}
  if diagnostics:
    ratios["diag_logistic_user_vs_nonprivate_per_user_layout"] = comp.paired_ratio(
        comp.names[1], comp.names[2])
  return ratios, out


def bench_mlp_user(sizes: dict, key: jax.Array, reps: int, window: float, budget: float,
                   diagnostics: bool) -> Section:
  """(a)(ii): user-level DP step vs non-private step, Flax nnx MLP."""
  U, m = sizes["mlp_users"], sizes["mlp_m"]
  k_model, k_data, k_noise = jax.random.split(key, 3)
  loss_fn, p0 = mlp_problem(k_model, sizes["mlp_in"], sizes["mlp_hidden"], sizes["mlp_out"])
  data = mlp_data(k_data, (U, m), sizes["mlp_in"], sizes["mlp_out"])
  mask = jnp.ones((U,), bool)
  tx_p = dp_chain(U, k_noise, radius=None)
  tx_np = projected_sgd(LR, radius=None)
  cands = [Candidate("non-private (grad of mean + projected_sgd)",
                     nonprivate_step_fn(loss_fn, tx_np), (p0, tx_np.init(p0)), (data,)),
           Candidate("user-level DP (per_user_grads + chain)",
                     private_step_fn(loss_fn, tx_p), (p0, tx_p.init(p0)), (data, mask))]
  if diagnostics:
    tx_v = unfused_chain(U, k_noise, radius=None)
    cands.append(Candidate("diag: unfused clip_per_user -> aggregate",
                           private_step_fn(loss_fn, tx_v), (p0, tx_v.init(p0)), (data, mask)))
  comp = compare(cands, reps=reps, window_s=window, budget_s=budget)
  title = (f"(a)(ii) MLP {sizes['mlp_in']}-{sizes['mlp_hidden']}-{sizes['mlp_out']}, "
           f"{U} users x {m} items")
  ratios = {"mlp_user_vs_nonprivate": comp.ratio[comp.names[1]]}
  if diagnostics:
    ratios["diag_mlp_user_unfused_vs_nonprivate"] = comp.ratio[comp.names[2]]
  return ratios, [format_comparison(title, comp)]


def bench_item(sizes: dict, key: jax.Array, reps: int, window: float, budget: float,
               diagnostics: bool) -> Section:
  """(b): item-level DP-SGD, our engine (m = 1 rows) vs ``optax.contrib.dpsgd``."""
  B = sizes["item_batch"]
  k_model, k_data, k_noise = jax.random.split(key, 3)
  loss_fn, p0 = mlp_problem(k_model, sizes["mlp_in"], sizes["mlp_hidden"], sizes["mlp_out"])
  flat = mlp_data(k_data, (B,), sizes["mlp_in"], sizes["mlp_out"])
  rows = jax.tree.map(lambda x: x[:, None], flat)          # [B, 1, ...]: one item per row
  mask = jnp.ones((B,), bool)
  tx_p = dp_chain(B, k_noise, radius=None)
  opt_step, opt_tx = optax_dpsgd_step_fn(loss_fn)
  cands = [Candidate("optax.contrib.dpsgd (vmap(grad))", opt_step,
                     (p0, opt_tx.init(p0)), (flat,)),
           Candidate("ours: per_user_grads (m=1 rows) + chain",
                     private_step_fn(loss_fn, tx_p), (p0, tx_p.init(p0)), (rows, mask))]
  if diagnostics:
    tx_v = unfused_chain(B, k_noise, radius=None)
    cands.append(Candidate("diag: unfused clip_per_user -> aggregate",
                           private_step_fn(loss_fn, tx_v), (p0, tx_v.init(p0)), (rows, mask)))
  comp = compare(cands, reps=reps, window_s=window, budget_s=budget)
  title = (f"(b) item-level DP-SGD, MLP {sizes['mlp_in']}-{sizes['mlp_hidden']}-"
           f"{sizes['mlp_out']}, batch {B}")
  ratios = {"item_ours_vs_optax_dpsgd": comp.ratio[comp.names[1]]}
  if diagnostics:
    ratios["diag_item_unfused_vs_optax_dpsgd"] = comp.ratio[comp.names[2]]
  return ratios, [format_comparison(title, comp)]


SECTIONS = ("logistic", "mlp", "item")


def main(argv: list[str] | None = None) -> dict:
  """Runs the benchmark, prints the tables and, last, one JSON line; returns that dict."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="small sizes and few repetitions (CI smoke test, < 20 s)")
  parser.add_argument("--reps", type=int, default=None, help="paired repetitions")
  parser.add_argument("--window", type=float, default=None,
                      help="target seconds per timed window")
  parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                      help="run only these sections")
  parser.add_argument("--hlo", action="store_true", help="print HLO op counts of (a)(i)")
  parser.add_argument("--no-diagnostics", dest="diagnostics", action="store_false",
                      default=None, help="skip the diagnostic variants (default in --quick)")
  args = parser.parse_args(argv)
  mode = "quick" if args.quick else "full"
  sizes = SIZES[mode]
  reps = args.reps or sizes["reps"]
  window = args.window or sizes["window"]
  diagnostics = (not args.quick) if args.diagnostics is None else args.diagnostics

  t0 = time.perf_counter()
  print(f"# bench_core: jax {jax.__version__}, optax {optax.__version__}, "
        f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
        f"{os.cpu_count()} CPUs, {platform.machine()}, mode {mode}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print("# CAVEAT: absolute times on a small shared CPU are indicative only; compare ratios.")
  if args.quick:
    print("# QUICK: smoke-test sizes; fixed per-step costs (PRNG, dispatch) dominate, so these "
          "ratios say nothing about the full sizes.")
  keys = dict(zip(SECTIONS, jax.random.split(jax.random.key(0), len(SECTIONS))))
  ratios: dict[str, float] = {}
  for section in SECTIONS:
    if section not in args.only:
      continue
    common = dict(reps=reps, window=window, budget=sizes["budget"], diagnostics=diagnostics)
    if section == "logistic":
      r, tables = bench_logistic(sizes, keys[section], show_hlo=args.hlo, **common)
    elif section == "mlp":
      r, tables = bench_mlp_user(sizes, keys[section], **common)
    else:
      r, tables = bench_item(sizes, keys[section], **common)
    ratios.update(r)
    for t in tables:
      print()
      print(t, flush=True)
  targets = {"logistic_user_vs_nonprivate": (1.5, "<="), "item_ours_vs_optax_dpsgd": (1.0, "<")}
  summary = {
      **{k: round(v, 3) for k, v in ratios.items()},
      "targets": {k: f"{op} {v}" for k, (v, op) in targets.items()},
      "meets_targets": {k: bool(ratios[k] <= v if op == "<=" else ratios[k] < v)
                        for k, (v, op) in targets.items() if k in ratios},
      "mode": mode,
      "backend": jax.default_backend(),
      "wall_s": round(time.perf_counter() - t0, 1),
  }
  print()
  print(json.dumps(summary), flush=True)
  return summary


if __name__ == "__main__":
  main()
