"""What one DP-SGD step costs against its non-private step, as XLA counts it: a cost table any
machine can produce (issue 26, part 1).

XLA reports, for any compiled step on any backend, its FLOPs and bytes accessed
(``compiled.cost_analysis()``) and its memory (``compiled.memory_analysis()``); these need a
compilation only, so the full sizes of ``experiments/bench_gpu.py`` are costed here on a CPU
without running them. At a medium size that runs on a CPU the steps are also timed.

Workloads and steps are those of ``bench_gpu.py`` (same models, losses, C, z, learning rate,
same step functions): the five workloads at bench_gpu's full sizes (compiled only, the batch
is abstract so even the 4 GiB GLM batch is never allocated) and at a medium size (compiled
and run). Paths, each as a ratio to the non-private step
(``jax.grad`` of the batch-mean loss + SGD):

  * ``fast``        — :class:`dpsco_jax.flax.fast_clip.FastClippedGrad` (taps / ghost norms);
  * ``vmap``        — the core's vmapped per-user gradients + fused ``clip_and_aggregate``;
  * ``auto``        — the path ``FastClippedGrad(method="auto")`` picks at that size: the one
                      with the lower predicted cost (per-layer cost model of
                      ``dpsco_jax/flax/fast_clip_cost.py``, shapes only, no timing); where
                      it picks fast the row is the fast row, where it picks vmap its own
                      step is compiled and timed (FastClippedGrad's vmap path forms its sum
                      in chunks of users on CPU: ``dpsco_jax/flax/fast_clip_vmap.py``);
  * ``optax``       — ``optax.contrib.dpsgd`` on vmapped per-example (per-user) gradients;
  * ``jax_privacy`` — jax-privacy's ``clipped_grad`` + ``gaussian_privatizer`` (skipped with a
                      note when the package is not installed).

Columns: ``flops_ratio`` and ``bytes_ratio`` (``cost_analysis``' "flops" / "bytes accessed"),
``temp_ratio`` (``temp_size_in_bytes``), ``peak_ratio`` (arguments + outputs + temporaries:
a GLM whose data dwarfs its temporaries is judged on its whole footprint) — all at full size
— and ``cpu_time_ratio`` (median of paired, interleaved timings, experiments/_timing.py) at
the medium size. Matmuls at ``jax_default_matmul_precision=highest`` as in bench_gpu.

    python experiments/bench_cost.py                  # full-size costs + medium-size costs, times
    python experiments/bench_cost.py --compile-only   # full-size costs only (no execution)
    python experiments/bench_cost.py --quick          # bench_gpu's tiny sizes (CI smoke)

``--quick`` compiles and runs bench_gpu's tiny sizes with an unoptimising XLA:CPU
(``--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false``, ~10x faster to
compile): a check of the plumbing and of the JSON's shape, not a measurement.

The last printed line is one JSON object
``{workload: {path: {"flops_ratio", "bytes_ratio", "temp_ratio", "peak_ratio",
"cpu_time_ratio"}}}`` plus one ``"_meta"`` key (not a workload): mode, device, sizes, the auto
picks, the non-private reference in absolute numbers, every path's absolute numbers, the
medium-size cost ratios, the fast path's per-layer plan on the transformers, and notes.
"""

from __future__ import annotations

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import Candidate, compare, format_comparison, smoke_xla_flags  # noqa: E402
import bench_gpu  # noqa: E402
from bench_gpu import CLIP, CNN, LM, Z, ce_loss, lm_loss, logistic_loss  # noqa: E402

from dpsco_jax.flax.fast_clip import FastClippedGrad  # noqa: E402
from dpsco_jax.transforms.noise import add_gaussian_noise  # noqa: E402

WORKLOADS = ("cnn_item", "transformer", "transformer_mha", "logistic_user", "cnn_user")
PATHS = ("fast", "auto", "vmap", "optax", "jax_privacy")
KEYS = ("flops_ratio", "bytes_ratio", "temp_ratio", "peak_ratio", "cpu_time_ratio")

# Sizes: "full" and "quick" are bench_gpu.workloads' full / quick sizes (tests/test_bench_cost.py
# checks that they build the same shapes); "medium" runs on a 2-core CPU.
SIZES = {
    "full": dict(img=32, ch=32, b_item=1024, vocab=8192, d=256, layers=4, t=128, b_lm=64,
                 users=4096, m_glm=64, dim=4096, u_cnn=256, m_cnn=8),
    "medium": dict(img=32, ch=16, b_item=64, vocab=2048, d=128, layers=2, t=64, b_lm=8,
                   users=1024, m_glm=16, dim=1024, u_cnn=32, m_cnn=4),
    "quick": dict(img=8, ch=4, b_item=8, vocab=64, d=16, layers=1, t=8, b_lm=4,
                  users=16, m_glm=4, dim=16, u_cnn=4, m_cnn=2),
}


def workloads(size: str, rng: np.random.Generator | None, only=None):
  """(name, model, loss, batch, batch_shape) exactly as ``bench_gpu.workloads`` builds them, at
  ``SIZES[size]``; ``rng=None`` gives abstract batches (``jax.ShapeDtypeStruct``) to compile.
  ``only``: the names to build (default all)."""
  s = SIZES[size]
  want = lambda name: not only or name in only

  def arr(make, shape, dtype):
    if rng is None:
      return jax.ShapeDtypeStruct(shape, dtype)
    return jnp.asarray(make(shape), dtype)

  normal = lambda scale: (lambda shape: rng.standard_normal(shape) / scale)
  ints = lambda hi: (lambda shape: rng.integers(0, hi, shape))

  def images(shape):
    return (arr(normal(1.0), shape + (s["img"], s["img"], 3), jnp.float32),
            arr(ints(10), shape, jnp.int32))

  tokens = (arr(ints(s["vocab"]), (s["b_lm"], s["t"] + 1), jnp.int32),)
  glm = (arr(normal(np.sqrt(s["dim"])), (s["users"], s["m_glm"], s["dim"]), jnp.float32),
         arr(ints(2), (s["users"], s["m_glm"]), jnp.float32))
  ch = s["ch"]
  if want("cnn_item"):
    yield ("cnn_item", CNN(ch, 10, nnx.Rngs(0)), ce_loss, images((s["b_item"],)),
           (s["b_item"],))
  for name, mha in (("transformer", False), ("transformer_mha", True)):
    if want(name):
      yield (name, LM(s["vocab"], s["d"], s["layers"], mha, nnx.Rngs(0)), lm_loss, tokens,
             (s["b_lm"],))
  if want("logistic_user"):
    yield ("logistic_user", nnx.Linear(s["dim"], 1, rngs=nnx.Rngs(0)), logistic_loss, glm,
           (s["users"], s["m_glm"]))
  if want("cnn_user"):
    yield ("cnn_user", CNN(ch, 10, nnx.Rngs(0)), ce_loss, images((s["u_cnn"], s["m_cnn"])),
           (s["u_cnn"], s["m_cnn"]))


def steps(model, loss, batch_shape):
  """bench_gpu's step functions (one copy of the step code), keyed by this bench's path
  names, with their initial optimizer states; plus the params, the fast path's
  ``FastClippedGrad`` and the level."""
  fns, params, fast, level = bench_gpu.step_functions(model, loss, batch_shape)
  return {bench_gpu.PATHS[k]: v for k, v in fns.items()}, params, fast, level


def cost_of(compiled) -> dict:
  """Absolute XLA numbers of one compiled step (None where the backend reports nothing)."""
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):  # older jax: one dict per computation
    ca = ca[0] if ca else None
  ma = compiled.memory_analysis()
  out = {"flops": None, "bytes": None, "temp": None, "peak": None}
  if ca:
    out["flops"] = float(ca.get("flops", float("nan")))
    out["bytes"] = float(ca.get("bytes accessed", float("nan")))
  if ma is not None:
    out["temp"] = float(ma.temp_size_in_bytes)
    out["peak"] = float(ma.temp_size_in_bytes + ma.argument_size_in_bytes
                        + ma.output_size_in_bytes)
  return out


def _ratio(x, ref):
  if x is None or ref is None or not ref > 0:
    return None
  return round(x / ref, 4)


def _auto_step(auto: FastClippedGrad, rows: int, params) -> tuple:
  """``auto``'s private step (its aggregate, then bench_gpu's noise and SGD step)."""
  sgd = optax.sgd(bench_gpu.LR)
  noisy = optax.chain(add_gaussian_noise(Z * CLIP / rows, jax.random.key(0)), sgd)

  def step(p, st, b):
    u, st = noisy.update(auto.aggregate(p, b, mode="mean", denominator=rows), st, p)
    return optax.apply_updates(p, u), st
  return step, noisy.init(params)


def ratios(costs: dict) -> dict:
  ref = costs["nonprivate"]
  return {path: {"flops_ratio": _ratio(c["flops"], ref["flops"]),
                 "bytes_ratio": _ratio(c["bytes"], ref["bytes"]),
                 "temp_ratio": _ratio(c["temp"], ref["temp"]),
                 "peak_ratio": _ratio(c["peak"], ref["peak"])}
          for path, c in costs.items() if path != "nonprivate"}


def _node(model, path):
  for k in path:
    model = getattr(model, k) if isinstance(k, str) and hasattr(model, k) else model[k]
  return model


def _prod(xs) -> int:
  out = 1
  for x in xs:
    out *= int(x)
  return out


def layer_plan(fast: FastClippedGrad, params, batch) -> dict:
  """``FastClippedGrad.plan`` at the batch's shapes: per tapped layer the kernel form the
  cost model takes (ghost norm / instantiation / layer VJP) with its predicted cost, the
  parameters on the exact vmap fallback, and the predicted cost of each path."""
  got = []  # traced abstractly: a full-size batch is never allocated
  jax.eval_shape(lambda b: (got.append(fast.plan(params, b)), 0)[1], batch)
  plan, rows = got[0], []
  for r in plan.layers:
    if r.kind == "fallback":
      continue
    row = {"layer": r.layer, "kind": r.kind, "form": r.method, "predicted_cost": r.cost,
           "vmap_cost": r.vmap_cost}
    if r.n:
      row.update(n=r.n, p=r.p, q=r.q)
    if r.kind == "conv":
      row.update(chunk=r.chunk, release=r.release)
    rows.append(row)
  return {"tapped": rows, "fallback": ["/".join(map(str, lp)) for lp in plan.fallback],
          "predicted": plan.predicted}


def _fmt(v, spec=".3f"):
  return "-" if v is None else format(v, spec)


def print_table(title: str, table: dict, reference: dict) -> None:
  print(f"\n{title}")
  print(f"  {'workload':<16} {'path':<12} {'FLOPs':>7} {'bytes':>7} {'temp':>7} {'peak':>7} "
        f"{'CPU time':>9}")
  for w, rows in table.items():
    ref = reference[w]
    print(f"  {w:<16} {'nonprivate':<12} " + " ".join(
        f"{x:>7}" for x in (f"{ref['flops'] / 1e9:.3g}G" if ref['flops'] else "-",
                            f"{ref['bytes'] / 2**20:.4g}M" if ref['bytes'] else "-",
                            f"{ref['temp'] / 2**20:.4g}M" if ref['temp'] is not None else "-",
                            f"{ref['peak'] / 2**20:.4g}M" if ref['peak'] else "-"))
          + (f" {ref['cpu_ms']:>7.2f}ms" if ref.get("cpu_ms") is not None else ""))
    for path, r in rows.items():
      if r is None:
        print(f"  {'':<16} {path:<12}   (not resolved: see notes)")
        continue
      print(f"  {'':<16} {path:<12} {_fmt(r['flops_ratio']):>7} {_fmt(r['bytes_ratio']):>7} "
            f"{_fmt(r['temp_ratio']):>7} {_fmt(r['peak_ratio']):>7} "
            f"{_fmt(r.get('cpu_time_ratio')):>9}")


def measure(size: str, execute: bool, only, reps: int, budget_s: float, window_s: float,
            plans: bool):
  """Compiles every path of every workload at ``size``; with ``execute`` also times them.
  Returns (ratios, absolute, auto picks, plans)."""
  rng = np.random.default_rng(0) if execute else None
  table, absolute, picks, layer_plans = {}, {}, {}, {}
  for name, model, loss, batch, shape in workloads(size, rng, only):
    t0 = time.perf_counter()
    fns, params, fast, level = steps(model, loss, shape)
    compiled, costs = {}, {}
    for path, (fn, st) in fns.items():
      compiled[path] = jax.jit(fn).lower(params, st, batch).compile()
      costs[path] = cost_of(compiled[path])
    if any(isinstance(node, nnx.Conv) for _, node in nnx.iter_graph(model)):
      # The fast path's convs run in a fori_loop over chunks of users, and XLA's
      # cost_analysis counts a while body once, not once per trip: FLOPs and bytes are those
      # of the same step compiled unchunked (the same arithmetic in one piece); memory stays
      # the chunked step's.
      ufns, _, ufast, _ = steps(model, loss, shape)
      ufast.conv_budget = None
      whole = cost_of(jax.jit(ufns["fast"][0]).lower(params, ufns["fast"][1], batch).compile())
      costs["fast"]["flops_loop_once"] = costs["fast"]["flops"]
      costs["fast"]["flops"], costs["fast"]["bytes"] = whole["flops"], whole["bytes"]
    rows = ratios(costs)
    if plans:
      layer_plans[name] = layer_plan(fast, params, batch)
    auto = FastClippedGrad(model, loss, clip_norm=CLIP, level=level, method="auto")
    # shapes only: traced abstractly, so the full-size batches are never allocated
    jax.eval_shape(lambda b, _a=auto: (_a.autotune(params, b), 0)[1], batch)
    picks[name] = auto.method
    print(f"  auto picks: {picks[name]} (predicted cost: "
          + ", ".join(f"{k} {v:.4g}" for k, v in auto.autotune_report["predicted"].items())
          + ")")
    if picks[name] == "vmap":
      # FastClippedGrad's vmap path forms its sum in chunks of users (vmap_chunks, CPU), so
      # auto is not the core vmap step: compiled (and timed) as itself
      fns["auto"] = _auto_step(auto, shape[0], params)
      compiled["auto"] = jax.jit(fns["auto"][0]).lower(params, fns["auto"][1], batch).compile()
      costs["auto"] = cost_of(compiled["auto"])
      rows.update(ratios({"nonprivate": costs["nonprivate"], "auto": costs["auto"]}))
    if execute:
      cands = [Candidate(path, compiled[path], (params, fns[path][1]), (batch,))
               for path in fns]
      comp = compare(cands, reps=reps, window_s=window_s, budget_s=budget_s)
      print(format_comparison(f"\n{name} {tuple(shape)} [{size}]", comp))
      for path in rows:
        rows[path]["cpu_time_ratio"] = round(comp.ratio[path], 4)
      for path in costs:
        costs[path]["cpu_ms"] = round(1e3 * comp.median_s[path], 4)
    if picks[name] != "vmap":
      rows["auto"] = dict(rows[picks[name]])   # the fast step is FastClippedGrad's own
    table[name] = {p: rows.get(p) for p in PATHS if p in rows or p == "auto"}
    absolute[name] = costs
    print(f"  [{name} @ {size}: {time.perf_counter() - t0:.1f} s]", flush=True)
  return table, absolute, picks, layer_plans


def main() -> None:
  ap = argparse.ArgumentParser()
  mode = ap.add_mutually_exclusive_group()
  mode.add_argument("--quick", action="store_true",
                    help="bench_gpu's tiny sizes, compiled and run (CPU smoke run)")
  mode.add_argument("--compile-only", action="store_true",
                    help="full-size FLOPs / bytes / memory only (no execution)")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--only", nargs="*", help="workload names to run")
  args = ap.parse_args()
  if args.quick:
    smoke_xla_flags()
  jax.config.update("jax_default_matmul_precision", "highest")
  dev = jax.devices()[0]
  print(f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}); C={CLIP}, z={Z}; "
        "matmul precision highest")
  notes = []
  try:
    import jax_privacy  # noqa: PLC0415
    notes.append(f"jax_privacy {jax_privacy.__version__}: clipped_grad + gaussian_privatizer")
  except ImportError:
    notes.append("jax_privacy not installed: its column is skipped (pip install "
                 "'dpsco_jax[bench]')")
  mode_name = "quick" if args.quick else ("compile_only" if args.compile_only else "full")
  t_start = time.perf_counter()
  if args.quick:
    costs_size, time_size = "quick", "quick"
  else:
    costs_size, time_size = "full", None if args.compile_only else "medium"
  meta = {"mode": mode_name, "device": dev.device_kind, "platform": dev.platform,
          "jax": jax.__version__, "cost_size": costs_size, "time_size": time_size,
          "sizes": {k: SIZES[k] for k in {costs_size, time_size} - {None}}}
  if args.quick:  # one size: its compiled costs and its times come from the same executables
    notes.append("quick: tiny sizes compiled with " + os.environ["XLA_FLAGS"] + "; a smoke run "
                 "(shapes and plumbing), not a measurement")
    table, absolute, picks, plans = measure("quick", True, args.only, 3, 5.0, 0.05, True)
    meta["absolute"] = {"quick": absolute}
  else:
    table, absolute, picks, plans = measure("full", False, args.only, 0, 0, 0, True)
    meta["absolute"] = {"full": absolute}
    if args.compile_only:
      notes.append("compile-only: nothing is executed, so cpu_time_ratio is null")
      for rows in table.values():
        for r in rows.values():
          if r is not None:
            r["cpu_time_ratio"] = None
    else:
      med, med_abs, med_picks, _ = measure("medium", True, args.only, args.reps, 60.0, 0.5,
                                           False)
      meta["auto_choice_medium"] = med_picks
      meta["absolute"]["medium"] = med_abs
      meta["medium_ratios"] = med
      for w, rows in table.items():
        for path, r in rows.items():
          if path != "auto":
            r["cpu_time_ratio"] = med[w][path]["cpu_time_ratio"]
        rows["auto"]["cpu_time_ratio"] = med[w]["auto"]["cpu_time_ratio"]
      notes.append("full-size rows: FLOPs / bytes / temp / peak of the full-size compiled "
                   "step; cpu_time_ratio at the medium size (auto: its own step, the path it "
                   "picks at the medium size)")
  meta["auto_choice"] = picks
  meta["reference"] = {size: {w: dict(costs["nonprivate"]) for w, costs in absolute.items()}
                       for size, absolute in meta["absolute"].items()}
  meta["transformer_plans"] = {w: p for w, p in plans.items() if w.startswith("transformer")}
  meta["plans"] = plans
  meta["notes"] = notes
  ref_full = {w: c["nonprivate"] for w, c in meta["absolute"][costs_size].items()}
  if time_size and time_size != costs_size:
    print_table(f"medium size (compiled and run on {dev.platform}); ratios to the non-private "
                "step", meta["medium_ratios"], {w: c["nonprivate"] for w, c in
                                                 meta["absolute"]["medium"].items()})
    for w, rc in meta["reference"]["full"].items():
      rc["cpu_ms_at_medium"] = meta["absolute"]["medium"][w]["nonprivate"]["cpu_ms"]
  print_table(f"{costs_size} size, XLA:{dev.platform} cost analysis; ratios to the non-private "
              "step" + (f" (CPU time at the {time_size} size)" if time_size else ""),
              table, ref_full)
  for w, plan in plans.items():
    print(f"\nper-layer plan of FastClippedGrad on {w} ({costs_size} size; predicted cost "
          f"fast {plan['predicted']['fast']:.4g} vs vmap {plan['predicted']['vmap']:.4g}):")
    for row in plan["tapped"]:
      extra = (f"  n={row['n']} p={row['p']} q={row['q']}" if "n" in row else "")
      if "chunk" in row:
        extra += f"  chunk={row['chunk']} release={row['release']}"
      print(f"  {row['layer']:<22} {row['kind']:<15} {row['form']:<12} "
            f"cost {row['predicted_cost']:.4g} (vmap {row['vmap_cost']:.4g}){extra}")
    print(f"  fallback (exact per-user grads): {plan['fallback'] or 'none'}")
  for n in notes:
    print("note: " + n)
  meta["wall_s"] = round(time.perf_counter() - t_start, 1)
  print(f"total {meta['wall_s']} s")
  out = dict(table)
  out["_meta"] = meta
  print(json.dumps(out, default=str))


if __name__ == "__main__":
  main()
