"""Canary audit of amplified banded MF noise (b-min-sep Poisson), with broken-sampler twins.

The driver's step: ``banded_poisson.sample_group`` (group ``t mod b`` active at step ``t``, its
rows kept with probability ``p``), then ``clip_and_aggregate(C, "mean", p G) ->
banded_noise``. The canary is slot 0, the other users have zero gradients; the partition comes
from a fixed public key (a guarantee for every partition covers a fixed one). Claim:
``amplified_banded_event`` under zero_out (as add_remove) or replace_one; score:
``C^T C Delta`` over the canary's admissible steps. Twins, same claim: ``ignores_groups``
(every row sampled at every step) and ``two_groups`` (the canary also in group ``g0 + 1``:
~1.5x the claim, the test uses 200 000 trials a side).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax.algorithms.dpsgd.banded_poisson import group_slots, sample_group
from dpsco_jax.audit.canary import (CANARY_NORM, CLIP, DELTA, HI, UserBatch, check_broken,
                                    check_relation, dirac_canary, neighbouring_pair)
from dpsco_jax.audit.harness import AuditSpec
from dpsco_jax.privacy import matrix_factorization as mf
from dpsco_jax.privacy.ledger import epsilon_of
from dpsco_jax.transforms.clipping import clip_and_aggregate
from dpsco_jax.transforms.matrix_factorization import banded_noise

__all__ = ["TWINS", "amplified_banded_audit"]

TWINS = ("ignores_groups", "two_groups")
_ORDER_SEED = 20230  # the public partition's key (fixed: the attacker knows the partition)


def _partition(users: int, groups: int, broken: str | None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(slots, real, the canary's active groups)`` of the sampler under test."""
  slots, real = map(np.array, group_slots(jax.random.key(_ORDER_SEED), users, groups))
  if broken == "ignores_groups":   # one group of every row, active at every step
    return np.arange(users)[None], np.ones((1, users), bool), np.ones(1, bool)
  g0 = int(np.argwhere((slots == 0) & real)[0, 0])
  active = np.zeros(groups, bool)
  active[g0] = True
  if broken == "two_groups":
    g1 = (g0 + 1) % groups
    slots[g1, 0], active[g1] = 0, True
  return slots, real, active


def amplified_banded_audit(relation: str = "zero_out", broken: str | None = None, *,
                           steps: int = 8, groups: int = 4, bands: int = 4,
                           rows_per_group: int = 2, sampling_rate: float = 0.9,
                           noise_multiplier: float = 3.0, dim: int = 2) -> AuditSpec:
  """The audit of b-min-sep Poisson + banded noise; ``broken``: ``None`` or one of ``TWINS``."""
  check_relation(relation, ("zero_out", "replace_one"),
                 "b-min-sep sampling is analysed under zero_out / replace_one (its partition "
                 "is by slot)")
  check_broken(broken, TWINS)
  users = groups * rows_per_group
  coefs = mf.banded_strategy(steps, bands, strategy="sqrt").coefs
  claim = epsilon_of(mf.amplified_banded_event(noise_multiplier, coefs, steps,
                                               sampling_rate=sampling_rate, min_sep=groups),
                     delta=DELTA, relation=relation)
  slots_np, real_np, active = _partition(users, groups, broken)
  slots, real = jnp.asarray(slots_np), jnp.asarray(real_np)
  capacity = slots_np.shape[1]             # a whole group: no truncation in the audit
  denom = sampling_rate * rows_per_group   # D = p G, the plan's fixed denominator
  std = noise_multiplier * CLIP / denom
  d_in, d_out = neighbouring_pair(jnp.zeros((users - 1, dim)), dirac_canary(dim, CANARY_NORM),
                                  relation)
  pattern = active[np.arange(steps) % len(active)].astype(np.float64)
  cmat = mf.toeplitz_matrix(coefs, steps)
  weights = jnp.asarray(cmat.T @ cmat @ pattern, jnp.float32)

  def release(key, data: UserBatch):
    noise_key, sample_key = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    tx = optax.chain(clip_and_aggregate(CLIP, "mean", denom),
                     banded_noise(std, steps, noise_key, coefs=coefs, output="increment"))
    params = jnp.zeros((dim,), jnp.float32)

    def body(state, t):
      idx, mask = sample_group(jax.random.fold_in(sample_key, t), slots, real, t,
                               rate=sampling_rate, capacity=capacity)
      out, state = tx.update(data.grads[idx], state, params, user_mask=mask & data.mask[idx])
      return state, out
    return jax.lax.scan(body, tx.init(params), jnp.arange(steps))[1]

  source = (f"epsilon_of(amplified_banded_event(z={noise_multiplier}, {bands} sqrt bands, "
            f"p={sampling_rate}, b={groups}, T={steps})) = {claim:.4g}"
            + ("" if broken is None else f"; sampler broken: {broken}"))
  return AuditSpec(f"amplified_banded[{broken or 'honest'}]", relation, release, d_in, d_out,
                   lambda r: jnp.dot(weights, r[:, 0], precision=HI), float(claim), DELTA,
                   source)
