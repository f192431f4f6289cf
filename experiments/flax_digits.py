"""User-level DP training of a small nnx MLP on scikit-learn's digits, with a non-private reference.

The 1797 8x8 digit images are split into train/test; the training examples are grouped into
``n_users`` users of ``m`` items each (a user's gradient is the mean over its items; the whole
user is protected). Training: :class:`dpsco_jax.flax.DPTrainer` (Poisson-sampled users, fast
per-user clipping, Gaussian noise calibrated by the PLD accountant to ``--epsilon``, Adam on the
privatized gradient). Reference: the same model, optimizer and number of steps without privacy
(full-batch gradients). Prints test accuracy and (epsilon, delta); runs in well under 3 minutes.

Relation ``add_remove`` (one user added or removed): the sampling rate ``q`` and the
denominator ``D = q * 150`` are declared public constants (150 is the public design size of the
example, not a count read from the data); ``--epsilon`` is both the calibration target and the
ledger's budget.

    python experiments/flax_digits.py [--epsilon 4] [--steps 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

from dpsco_jax.flax import DPTrainer


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(64, 64, rngs=rngs)
    self.l2 = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


def loss_fn(model, ex):
  x, y = ex
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y)


def accuracy(model, x, y) -> float:
  return float(jnp.mean(jnp.argmax(model(x), -1) == y))


def load(seed: int, n_users: int, m: int):
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  perm = np.random.default_rng(seed).permutation(len(y))
  x, y = x[perm], y[perm]
  n_train = n_users * m
  train = (x[:n_train].reshape(n_users, m, 64), y[:n_train].reshape(n_users, m))
  test = (x[n_train:], y[n_train:])
  return train, test


def nonprivate(train, test, steps: int, lr: float, seed: int) -> float:
  model = MLP(nnx.Rngs(seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = optax.adam(lr)
  x = jnp.asarray(train[0].reshape(-1, 64))
  y = jnp.asarray(train[1].reshape(-1))

  @jax.jit
  def run(params):
    def full_loss(p):
      mdl = nnx.merge(graphdef, p, rest)
      return jnp.mean(jax.vmap(lambda a, b: loss_fn(mdl, (a, b)))(x, y))

    def step(carry, _):
      p, st = carry
      u, st = opt.update(jax.grad(full_loss)(p), st, p)
      return (optax.apply_updates(p, u), st), None

    (p, _), _ = jax.lax.scan(step, (params, opt.init(params)), None, length=steps)
    return p

  trained = nnx.merge(graphdef, run(params), rest)
  return accuracy(trained, jnp.asarray(test[0]), jnp.asarray(test[1]))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--epsilon", type=float, default=4.0)
  ap.add_argument("--delta", type=float, default=1e-4)
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--users", type=int, default=150)
  ap.add_argument("--items", type=int, default=10)
  ap.add_argument("--sampling-rate", type=float, default=0.2)
  ap.add_argument("--clip", type=float, default=1.0)
  ap.add_argument("--lr", type=float, default=5e-3)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()

  train, test = load(args.seed, args.users, args.items)
  print(f"digits: {args.users} users x {args.items} items (train), {len(test[1])} test; "
        f"target (eps, delta) = ({args.epsilon}, {args.delta:g}) at user level")

  t0 = time.time()
  ref_acc = nonprivate(train, test, args.steps, args.lr, args.seed)
  t_ref = time.time() - t0
  print(f"non-private: test accuracy {ref_acc:.3f} ({t_ref:.1f}s)")

  t0 = time.time()
  trainer = DPTrainer(
      MLP(nnx.Rngs(args.seed)), loss_fn, optax.adam(args.lr),
      data=(jnp.asarray(train[0]), jnp.asarray(train[1])), level="user",
      clip_norm=args.clip, sampling_rate=args.sampling_rate, delta=args.delta,
      # add/remove: the number of users is private, so the denominator is declared public
      expected_batch_size=args.sampling_rate * args.users,
      target_epsilon=args.epsilon, num_steps=args.steps, key=args.seed, method="fast")
  print(f"calibrated noise multiplier z = {trainer.noise_multiplier:.3f} "
        f"(noise stddev {trainer.noise_stddev:.4g} on the clipped sum / declared D = "
        f"{trainer.denominator:g})")
  trainer.train(args.steps, report_every=max(1, args.steps // 5),
                log_fn=lambda r: print(f"  step {r['step']:4d}  epsilon {r['epsilon']:.3f}  "
                                       f"delta {r['delta']:g}"))
  dp_acc = accuracy(trainer.model, jnp.asarray(test[0]), jnp.asarray(test[1]))
  t_dp = time.time() - t0
  rep = trainer.privacy_report()
  print(f"user-level DP: test accuracy {dp_acc:.3f} at (eps, delta) = "
        f"({rep.epsilon:.3f}, {rep.delta:g}), provenance {rep.provenance} ({t_dp:.1f}s)")
  print(json.dumps({"nonprivate_accuracy": round(ref_acc, 4), "dp_accuracy": round(dp_acc, 4),
                    "epsilon": round(rep.epsilon, 4), "delta": rep.delta,
                    "noise_multiplier": round(trainer.noise_multiplier, 4),
                    "users": args.users, "items": args.items, "steps": args.steps,
                    "provenance": rep.provenance, "seconds": round(t_ref + t_dp, 1)}))


if __name__ == "__main__":
  main()
