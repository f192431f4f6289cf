"""Amplified banded MF noise (issue #27 leftover): noise at equal (epsilon, delta).

Every row is a DP-SGD plan of ``dp_sgd_user`` (:func:`~dpsco_jax.algorithms.dpsgd.plan.
plan_dp_sgd`, the planner a run uses: calibrated through the one calibrator) for
``n = 2000`` users and the same (expected) batch ``B = 50``, so every mechanism divides by the
same ``D = 50`` and its noise is comparable in units of ``(C / D)^2``:

* ``poisson independent`` — Poisson rate ``q = B / n``, independent Gaussian noise
  (amplified by sampling; the usual practice);
* ``cyclic independent`` / ``cyclic banded`` — fixed-order epochs of ``P = n / B = 40`` steps,
  banded sqrt strategy with ``min(32, P)`` bands (no amplification);
* ``banded_poisson b=...`` — b-min-sep Poisson (Choquette-Choo et al. 2023, Thm 4): ``b``
  groups of ``n / b`` rows, rate ``p = B b / n`` within the active group (so the expected
  batch is ``B``), ``bands = min(32, b)`` sqrt bands; ``b = 40`` is ``p = 1``: the cyclic
  schedule accounted through the amplified event (a sanity row: it must match cyclic banded
  at bands = 32).

Columns: ``z`` (the noise multiplier: std of the released ``C x + Z`` per coordinate in units
of ``C / D``), ``step std`` (std of the noise on one step's increment ``(C^{-1} Z)_t`` at the
last step, same units; independent: ``z``), and the prefix-sum noise variance ``Var(N_t)``
divided by ``T`` (units ``(C / D)^2``), max and mean over ``t < T``. Lower is better; the
prefix sum is what SGD's iterate carries (``theta_T = theta_0 - lr * prefix``).

Usage: ``python experiments/bench_banded_amplification.py [--quick]`` (quick: T = 64 only,
epsilon = 1); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dpsco_jax.algorithms.dpsgd.plan import plan_dp_sgd
from dpsco_jax.privacy import matrix_factorization as mf

N, BATCH, DELTA = 2000, 50, 1e-7


def _plan(eps: float, T: int, **cfg):
  base = dict(epsilon=eps, delta=DELTA, num_steps=T, learning_rate=1.0, clip_norm=1.0,
              mf_strategy="sqrt", relation="zero_out")
  return plan_dp_sgd(dict(base, **cfg), level="user", realized_rows=N, rows_per_user=1,
                     default_clip=1.0, radius=2.0)


def _row(name: str, plan, T: int, seconds: float) -> dict:
  z = plan.noise_multiplier * plan.denominator / BATCH   # noise std in units of C / B
  if plan.mf is None:
    unit, step = np.arange(1, T + 1, dtype=np.float64), 1.0
  else:
    inv = mf.toeplitz_inverse_coefs(np.asarray(plan.mf.coefs), T)
    unit, step = mf.prefix_errors(inv), float(np.sqrt(np.sum(inv ** 2)))
  var = z * z * unit
  return {"mechanism": name, "T": T, "epsilon": plan.epsilon, "z": z,
          "step_std": z * step, "prefix_max": float(var.max() / T),
          "prefix_mean": float(var.mean() / T),
          "bands": None if plan.mf is None else len(plan.mf.coefs),
          "participations": plan.participations, "rate": plan.sampling_rate,
          "denominator": plan.denominator, "calibration_s": seconds}


def rows(eps: float, T: int, groups: list[int]) -> list[dict]:
  out = []
  specs = [("poisson independent", dict(sampling="poisson", batch_size=BATCH)),
           ("cyclic independent", dict(sampling="cyclic", batch_size=BATCH)),
           ("cyclic banded", dict(sampling="cyclic", batch_size=BATCH,
                                  noise_mechanism="banded"))]
  specs += [(f"banded_poisson b={b}", dict(sampling="banded_poisson", min_separation=b,
                                           noise_mechanism="banded", batch_size=BATCH))
            for b in groups]
  for name, cfg in specs:
    t = time.perf_counter()
    plan = _plan(eps, T, **cfg)
    out.append(_row(name, plan, T, time.perf_counter() - t))
    r = out[-1]
    print(f"  eps={eps:<4} T={T:<5} {name:<24} z={r['z']:8.3f} step std={r['step_std']:8.3f} "
          f"prefix var/T max={r['prefix_max']:10.3f} mean={r['prefix_mean']:10.3f} "
          f"(k={r['participations']}, p={r['rate']:.3g}, bands={r['bands']})", flush=True)
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="T=64, epsilon=1 only")
  args = ap.parse_args(argv)
  Ts, epss = ([64], [1.0]) if args.quick else ([64, 1024], [1.0, 4.0])
  print(f"n={N}, B=D={BATCH}, delta={DELTA}; noise in units of C/D (lower is better)")
  out = {"n": N, "batch": BATCH, "delta": DELTA, "rows": []}
  for T in Ts:
    for eps in epss:
      out["rows"] += rows(eps, T, [4, 10, 20, 40])
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
