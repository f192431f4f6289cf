"""Correlated noise side by side (issue #27): prefix-sum error at equal (epsilon, delta), step
time and state memory of each noise stage.

Error. Every mechanism here is one Gaussian event ``GaussianDpEvent(z_eff)`` for the whole run
(tree: ``z / sqrt(levels)``, MF: ``z / sens``), so equal ``(epsilon, delta)`` means equal
``z_eff``, and the variance of the prefix-sum noise ``N_t`` per coordinate is ``(z_eff s)^2``
times the *normalized error* ``e_t``:

* independent: ``e_t = t + 1`` (sensitivity 1 per participation);
* tree (paper 003): node std ``z s = z_eff sqrt(levels) s``, ``e_t = levels * popcount(t+1)``;
* banded / BLT: ``e_t = sens^2 * ||row t of A C^{-1}||^2`` (``prefix_errors``).

Reported: ``max_t e_t / T`` and ``mean_t e_t / T`` (so independent noise's max is 1), plus
the factor ``z_eff^2`` at (epsilon=1, delta=1e-5) that turns them into variances per ``s^2 T``.
Where jax_privacy is installed the banded/BLT numbers are cross-checked against its own
``toeplitz.per_query_error`` / ``buffered_toeplitz.max_error`` on the same strategy
(``jp_check_max_rel_diff``). Single epoch; a second table prices k = 4 cyclic epochs
(separation T/4) for independent / banded (b <= T/4) / BLT (overlapping, priced exactly).

Step time and memory: one jitted update of each stage on 1e6 float32 params (``max_steps`` =
8192), paired interleaved timing (``_timing.py``); state memory = bytes of the state's arrays.
CPU numbers on a small shared machine are indicative only.

Usage: ``python experiments/bench_mf.py [--quick]``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _timing import Candidate, compare, format_comparison  # noqa: E402
from dpsco_jax.privacy import calibrate_noise_multiplier  # noqa: E402
from dpsco_jax.privacy import matrix_factorization as mf  # noqa: E402
from dpsco_jax.transforms.matrix_factorization import banded_noise, blt_noise  # noqa: E402
from dpsco_jax.transforms.noise import add_gaussian_noise  # noqa: E402
from dpsco_jax.transforms.tree_noise import tree_levels, tree_prefix_sum_noise  # noqa: E402


def _row(name: str, e: np.ndarray, T: int, source: str = "", **extra) -> dict:
  return {"mechanism": name, "T": T, "max": float(e.max() / T), "mean": float(e.mean() / T),
          "source": source, **extra}


def _jp_check(kind: str, T: int, coefs=None, blt=None) -> float | None:
  """Relative difference of our unit prefix error to jax_privacy's on the same strategy."""
  if mf.jax_privacy_version() is None:
    return None
  from jax_privacy.matrix_factorization import buffered_toeplitz as bt
  from jax_privacy.matrix_factorization import toeplitz
  with jax.enable_x64():
    if kind == "banded":
      jp = np.asarray(toeplitz.per_query_error(strategy_coef=jnp.asarray(coefs), n=T))
      ours = mf.prefix_errors(mf.toeplitz_inverse_coefs(coefs, T))
      return float(np.max(np.abs(ours - jp) / jp))
    b = bt.BufferedToeplitz.build(blt.buf_decay, blt.output_scale)
    jp = float(bt.max_error(b.inverse(), T))
  ours = mf.prefix_errors(mf.blt_inverse_coefs(blt.buf_decay, blt.output_scale, T))[-1]
  return float(abs(ours - jp) / jp)


def error_rows(T: int, bands: list[int], *, optimized: bool, epochs: int = 1) -> list[dict]:
  """Normalized errors of every mechanism at horizon T (``epochs`` cyclic epochs)."""
  rows = []
  sep = T // epochs
  k = epochs
  t = np.arange(T)
  rows.append(_row("independent", k * (t + 1.0), T, "sens^2 = k"))
  if epochs == 1:
    lv = tree_levels(T)
    pop = np.array([bin(i + 1).count("1") for i in t], np.float64)
    rows.append(_row("tree (paper 003)", lv * pop, T, f"levels={lv}"))
  strategies = ["sqrt"] + (["optimized"] if optimized else [])
  for b in bands:
    if b > sep:
      continue
    for strat in strategies:
      s = mf.banded_strategy(T, b, strategy=strat)
      sens = mf.participation_sensitivity(s.coefs, T, participations=k, min_sep=sep)
      e = sens ** 2 * mf.prefix_errors(mf.toeplitz_inverse_coefs(s.coefs, T))
      rows.append(_row(f"banded b={b} ({strat})", e, T, s.source,
                       jp_check_max_rel_diff=_jp_check("banded", T, coefs=s.coefs)))
  if epochs == 1:   # full-width sqrt (Fichtenberger et al.): b = T, the unbanded optimum
    c = mf.sqrt_coefs(T)
    c = c / np.linalg.norm(c)
    rows.append(_row("toeplitz sqrt b=T (dense)", mf.prefix_errors(
        mf.toeplitz_inverse_coefs(c, T)), T, "sqrt, no banding"))
  for strat in strategies:
    blt = mf.blt_strategy(T, 4, participations=k, min_sep=sep, strategy=strat,
                          error="max")
    coefs = mf.blt_coefs(blt.buf_decay, blt.output_scale, T)
    try:
      sens = mf.participation_sensitivity(coefs, T, participations=k, min_sep=sep)
    except ValueError as err:   # optimized multi-epoch BLT with increasing coefficients
      rows.append({"mechanism": f"BLT d<=4 ({strat})", "T": T, "skipped": str(err)})
      continue
    e = sens ** 2 * mf.prefix_errors(mf.blt_inverse_coefs(blt.buf_decay, blt.output_scale, T))
    rows.append(_row(f"BLT d={len(blt.buf_decay)} ({strat})", e, T, blt.source,
                     jp_check_max_rel_diff=_jp_check("blt", T, blt=blt) if k == 1 else None))
  return rows


def stage_costs(params: int, *, reps: int, window: float) -> list[dict]:
  """Step time and state bytes of each stage at ``params`` float32 parameters."""
  T = 8192
  p = jnp.zeros((params,), jnp.float32)
  x = jnp.ones((params,), jnp.float32) * 1e-3
  c8 = mf.banded_strategy(T, 8, strategy="sqrt").coefs
  c32 = mf.banded_strategy(T, 32, strategy="sqrt").coefs
  blt = mf.blt_strategy(T, 4, strategy="sqrt")
  stages = {
      "independent": add_gaussian_noise(1.0, 0),
      "tree (paper 003)": tree_prefix_sum_noise(1.0, T, 0),
      "banded b=8": banded_noise(1.0, T, 0, coefs=c8, output="increment"),
      "banded b=32": banded_noise(1.0, T, 0, coefs=c32, output="increment"),
      f"BLT d={len(blt.buf_decay)}": blt_noise(1.0, T, 0, buf_decay=blt.buf_decay,
                                               output_scale=blt.output_scale,
                                               output="increment"),
  }
  cands, mem = [], {}
  for name, tx in stages.items():
    st = tx.init(p)
    mem[name] = int(sum(np.asarray(a).nbytes for a in jax.tree.leaves(st)
                        if not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)))

    def step(state, u, tx=tx):
      out, state = tx.update(u, state, p)
      return state, out
    cands.append(Candidate(name, jax.jit(step), (st, x)))
  comp = compare(cands, reps=reps, window_s=window)
  print(format_comparison(f"noise stage update, {params:.0e} float32 params", comp))
  return [{"stage": n, "ms_per_step": 1e3 * comp.median_s[n], "ratio_vs_independent":
           comp.ratio[n], "state_bytes": mem[n], "state_over_params": mem[n] / (4 * params)}
          for n in comp.names]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="smoke run: T=64, 1e4 params")
  args = ap.parse_args(argv)
  t0 = time.time()
  optimized = mf.jax_privacy_version() is not None
  horizons = [64] if args.quick else [64, 1024, 8192]
  z_eff = calibrate_noise_multiplier(lambda z: mf.mf_event(z, 1.0), epsilon=1.0, delta=1e-5)
  errors, multi = [], []
  for T in horizons:
    bands = [b for b in (4, 16, 64) if b <= T]
    errors += error_rows(T, bands, optimized=optimized and not args.quick)
    if not args.quick and T >= 256:
      multi += error_rows(T, [b for b in (16, 64, T // 4) if b <= T // 4], optimized=optimized,
                          epochs=4)
  for title, rows in (("single epoch", errors), ("4 cyclic epochs, separation T/4", multi)):
    if not rows:
      continue
    print(f"\nprefix-sum noise variance / (z_eff^2 s^2 T) at equal (eps, delta), {title}")
    print(f"  {'mechanism':<34} {'T':>6} {'max':>9} {'mean':>9}  source")
    for r in rows:
      if "skipped" in r:
        print(f"  {r['mechanism']:<34} {r['T']:>6}  skipped: {r['skipped'][:60]}")
        continue
      print(f"  {r['mechanism']:<34} {r['T']:>6} {r['max']:>9.4f} {r['mean']:>9.4f}  "
            f"{r['source'][:70]}")
  costs = stage_costs(10_000 if args.quick else 1_000_000, reps=3 if args.quick else 7,
                      window=0.05 if args.quick else 0.5)
  for c in costs:
    print(f"  {c['stage']:<20} state {c['state_bytes'] / 2**20:8.1f} MiB "
          f"({c['state_over_params']:.1f} x params)")
  out = {"jax_privacy": mf.jax_privacy_version(), "z_eff_eps1_delta1e-5": z_eff,
         "errors_single_epoch": errors, "errors_4_epochs": multi, "stage_costs": costs,
         "backend": jax.default_backend(), "quick": args.quick,
         "wall_s": round(time.time() - t0, 1)}
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
