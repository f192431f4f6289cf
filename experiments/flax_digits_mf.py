"""DPTrainer's noise choice on the digits example (issue #27): Poisson DP-SGD with independent
noise vs the cyclic schedule with independent, banded or BLT noise, at equal (eps, delta),
equal steps T and equal batch (B users a step; Poisson: q = B / n, D = B).

Setup of ``experiments/flax_digits.py`` (150 users x 10 items, MLP 64-64-10, Adam, user level,
clip 1, delta 1e-4); every mechanism runs on the same evaluation seeds (data split, init and
key from the seed), accuracy on the held-out digits. Poisson runs under add_remove (``n``
declared), cyclic under zero_out (its only relations are zero_out / replace_one).

    python -m experiments.flax_digits_mf [--seeds 10] [--epsilon 4] [--epochs 5] [--batch 15]
                                         [--optimizer adam|sgd] [--lr 1e-2]
"""

from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from scipy import stats

from dpsco_jax.flax import DPTrainer
from experiments.flax_digits import MLP, accuracy, load, loss_fn

_Z: dict[str, float] = {}
MECHANISMS = ("poisson", "cyclic-independent", "cyclic-banded", "cyclic-blt")


def run(mech: str, seed: int, args) -> tuple[float, float, float]:
  train, test = load(seed, args.users, args.items)
  period = -(-args.users // args.batch)
  steps = args.epochs * period
  common = dict(data=(jnp.asarray(train[0]), jnp.asarray(train[1])), clip_norm=args.clip,
                delta=args.delta, target_epsilon=args.epsilon, num_steps=steps, key=seed)
  if mech == "poisson":
    extra = dict(sampling_rate=args.batch / args.users, expected_batch_size=float(args.batch))
  else:
    extra = dict(sampling="cyclic", batch_size=args.batch,
                 noise_mechanism=mech.split("-")[1], mf_strategy="sqrt")
  if mech in _Z:  # the plan is data-free: the same z for every seed (skip re-calibrating)
    common.update(noise_multiplier=_Z[mech], target_epsilon=None, epsilon_budget=args.epsilon)
  t0 = time.time()
  tr = DPTrainer(MLP(nnx.Rngs(seed)), loss_fn, getattr(optax, args.optimizer)(args.lr), **common, **extra)
  _Z[mech] = tr.noise_multiplier
  tr.train(steps, report_every=steps)
  acc = accuracy(tr.model, jnp.asarray(test[0]), jnp.asarray(test[1]))
  return acc, tr.privacy_report().epsilon, time.time() - t0


def interval(x: np.ndarray) -> list[float]:
  h = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
  return [float(x.mean() - h), float(x.mean() + h)]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seeds", type=int, default=10)
  ap.add_argument("--first-seed", type=int, default=100)
  ap.add_argument("--epsilon", type=float, default=4.0)
  ap.add_argument("--delta", type=float, default=1e-4)
  ap.add_argument("--epochs", type=int, default=5)
  ap.add_argument("--batch", type=int, default=15)
  ap.add_argument("--users", type=int, default=150)
  ap.add_argument("--items", type=int, default=10)
  ap.add_argument("--clip", type=float, default=1.0)
  ap.add_argument("--lr", type=float, default=1e-2)
  ap.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
  ap.add_argument("--mechanisms", default=",".join(MECHANISMS))
  args = ap.parse_args()
  mechs = args.mechanisms.split(",")
  seeds = range(args.first_seed, args.first_seed + args.seeds)
  acc = {m: [] for m in mechs}
  for s in seeds:
    for m in mechs:
      a, eps, sec = run(m, s, args)
      acc[m].append(a)
      print(f"seed {s} {m:20s} acc {a:.3f} eps {eps:.4f} ({sec:.1f}s)", flush=True)
  out = {}
  for m in mechs:
    x = np.asarray(acc[m])
    d = x - np.asarray(acc[mechs[0]])
    out[m] = {"mean": float(x.mean()), "ci95": interval(x),
              f"minus_{mechs[0]}": float(d.mean()),
              f"minus_{mechs[0]}_ci95": interval(d) if m != mechs[0] else [0.0, 0.0]}
    print(f"{m:20s} {x.mean():.3f} [{out[m]['ci95'][0]:.3f}, {out[m]['ci95'][1]:.3f}]  "
          f"paired diff vs {mechs[0]}: {d.mean():+.3f}")
  print(json.dumps({"args": vars(args), "results": out}))


if __name__ == "__main__":
  main()
