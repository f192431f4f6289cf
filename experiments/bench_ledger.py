"""Issue 16.1: reporting epsilon must not dominate training.

(a) ``DPTrainer.train(T, report_every=r)`` on the digits MLP (scikit-learn ``load_digits``,
150 users x 10 images, nnx MLP 64-64-10, user-level Poisson q = 0.2, z = 3.44, delta = 1e-4,
declared denominator D = 30) for r in {1, 10, 100, T (one block)}, side by side: each run is a
fresh trainer (fresh ledger, cold accountant caches), compiled by a 1-step warm-up that is not
timed. Target: r = 1 at most 1.5x one block at T = 1e4.
(b) A ledger with 1e5 ``spend`` calls of that step's event: time of the spends, of
``epsilon()`` (the default: the cached grid upper bound, never below the exact value) and of
``epsilon(exact=True)`` (cold, then cached) with its ratio to the bound. Target: ``epsilon()``
under 50 ms.

    python experiments/bench_ledger.py            # T = 1e3 only
    python experiments/bench_ledger.py --full     # T = 1e3 and 1e4
    python experiments/bench_ledger.py --quick    # T = 50 (smoke)

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import dp_accounting
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flax_digits import MLP, load, loss_fn  # noqa: E402

from dpsco_jax.flax import DPTrainer  # noqa: E402
from dpsco_jax.privacy import PrivacyLedger  # noqa: E402

Q, Z, DELTA, USERS, ITEMS = 0.2, 3.44, 1e-4, 150, 10


def _trainer(train):
  return DPTrainer(MLP(nnx.Rngs(0)), loss_fn, optax.adam(5e-3),
                   data=(jnp.asarray(train[0]), jnp.asarray(train[1])), level="user",
                   clip_norm=1.0, sampling_rate=Q, expected_batch_size=Q * USERS, delta=DELTA,
                   noise_multiplier=Z, key=0, method="fast")


def time_train(train, steps: int, report_every: int) -> dict:
  tr = _trainer(train)
  tr.train(1, report_every=1)  # compile (not timed)
  t0 = time.perf_counter()
  tr.train(steps, report_every=report_every)
  dt = time.perf_counter() - t0
  return {"steps": steps, "report_every": report_every, "seconds": round(dt, 3),
          "ms_per_step": round(1e3 * dt / steps, 3), "reports": len(tr.history) - 1,
          "epsilon": round(tr.epsilon(), 4)}


def time_ledger(spends: int) -> dict:
  ev = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(Z))
  led = PrivacyLedger(delta=DELTA, accountant="pld")
  t0 = time.perf_counter()
  for _ in range(spends):
    led.spend(ev, label="step")
  t_spend = time.perf_counter() - t0
  out = {"spends": spends, "spend_total_s": round(t_spend, 3),
         "spend_us_each": round(1e6 * t_spend / spends, 1)}
  exact = lambda: led.epsilon(exact=True)  # noqa: E731
  for name, fn in (("epsilon_default_ms", led.epsilon), ("epsilon_exact_cold_ms", exact),
                   ("epsilon_exact_cached_ms", exact)):
    t0 = time.perf_counter()
    fn()
    out[name] = round(1e3 * (time.perf_counter() - t0), 3)
  out["epsilon_default"] = round(led.epsilon(), 3)
  out["epsilon_exact"] = round(exact(), 3)
  out["default_over_exact"] = round(led.epsilon() / exact(), 4)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--full", action="store_true", help="also T = 1e4")
  ap.add_argument("--quick", action="store_true", help="smoke: T = 50, 1e3 spends")
  args = ap.parse_args()
  horizons = [50] if args.quick else ([1000, 10000] if args.full else [1000])
  train, _ = load(0, USERS, ITEMS)

  rows = []
  print(f"(a) digits MLP, {USERS} users x {ITEMS}, q={Q}, z={Z}: train(T, report_every=r)")
  print(f"{'T':>6} {'r':>6} {'seconds':>9} {'ms/step':>8} {'vs 1 block':>10} {'epsilon':>8}")
  summary = {"mode": "quick" if args.quick else ("full" if args.full else "default")}
  for steps in horizons:
    block = time_train(train, steps, steps)
    runs = [time_train(train, steps, r) for r in (1, 10, 100) if r < steps] + [block]
    for r in runs:
      r["vs_one_block"] = round(r["seconds"] / block["seconds"], 3)
      rows.append(r)
      print(f"{steps:>6} {r['report_every']:>6} {r['seconds']:>9.2f} {r['ms_per_step']:>8.3f} "
            f"{r['vs_one_block']:>10.2f} {r['epsilon']:>8.3f}")
    summary[f"ratio_report1_vs_block_T{steps}"] = runs[0]["vs_one_block"]

  spends = 1000 if args.quick else 100_000
  led = time_ledger(spends)
  print(f"(b) ledger with {spends} spends: spends {led['spend_total_s']} s "
        f"({led['spend_us_each']} us each); epsilon() {led['epsilon_default_ms']} ms "
        f"(= {led['epsilon_default']}, {led['default_over_exact']}x exact); epsilon(exact=True) "
        f"cold {led['epsilon_exact_cold_ms']} ms, cached {led['epsilon_exact_cached_ms']} ms")
  summary.update(train=rows, ledger=led)
  big = max(horizons)
  summary["meets_targets"] = {
      f"report1_le_1.5x_block_T{big}": summary[f"ratio_report1_vs_block_T{big}"] <= 1.5,
      "epsilon_default_lt_50ms": led["epsilon_default_ms"] < 50,
      "epsilon_exact_cold_lt_50ms": led["epsilon_exact_cold_ms"] < 50}
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
