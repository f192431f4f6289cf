"""Canary audit of numerics an input cannot defeat, with a broken twin.

``filter_offset``: Algorithm 1's filtered-mean release (score radius ``tau``, degree radius
``2 tau``, noise ``z Delta / 2`` with the certified sensitivity ``Delta``) on users sharing a
large common component ``(0, 1e5)``; the canary sits ``2000 tau`` from them (replace-one: one
more copy of the others), so an honest kernel never keeps it. Twin ``gram_float32``: float32
Gram distances, where the offset swamps the canary's distance, keep it. Claim:
``epsilon_of(SelfComposed(Gaussian(z), T))`` at ``delta - T zeta``. Importing this module
registers the audit in :data:`dpsco_jax.audit.mechanisms.MECHANISMS`.
"""

from __future__ import annotations

import dp_accounting
import jax
import jax.numpy as jnp

from dpsco_jax.algorithms.user_level_filter.schedules import certified_sensitivity
from dpsco_jax.audit import mechanisms
from dpsco_jax.audit.canary import DELTA, HI, UserBatch, check_broken, check_relation
from dpsco_jax.audit.harness import AUDITS, AuditSpec
from dpsco_jax.privacy.ledger import epsilon_of
from dpsco_jax.transforms.filtering import filter_points, inclusion_probability

__all__ = ["NUMERICS", "filter_offset", "gram_float32_filter_mean"]

_OFFSET = 1e5          # the common component (coordinate 1)
_TAU = 0.01            # score radius; degree radius 2 tau (Algorithm 1)
_CANARY = 2000 * _TAU  # the canary's distance from everyone else (along the offset)
_ZETA = 1e-9           # failure probability of the certified sensitivity, per release


def gram_float32_filter_mean(x: jax.Array, key: jax.Array, score_radius: float,
                             degree_radius: float) -> jax.Array:
  """The broken twin: FILTER's kept mean with plain float32 Gram distances."""
  sq = jnp.sum(x * x, axis=1)
  d2 = sq[:, None] + sq[None, :] - 2.0 * jnp.matmul(x, x.T, precision=HI)
  d2 = jnp.maximum(0.5 * (d2 + d2.T), 0.0)
  d2 = jnp.where(jnp.eye(x.shape[0], dtype=bool), 0.0, d2)
  del score_radius
  degrees = jnp.sum(d2 <= degree_radius * degree_radius, axis=1).astype(jnp.float32)
  p = inclusion_probability(degrees, float(x.shape[0]))
  keep = jax.random.uniform(key, (x.shape[0],)) < p   # the coins filter_points draws
  w = keep.astype(x.dtype)[:, None]
  return jnp.sum(x * w, axis=0) / jnp.maximum(jnp.sum(w), 1.0)


def _datasets(users: int) -> tuple[UserBatch, UserBatch]:
  others = jnp.tile(jnp.asarray([[0.0, _OFFSET]], jnp.float32), (users - 1, 1))
  canary = jnp.asarray([[0.0, _OFFSET + _CANARY]], jnp.float32)
  mask = jnp.ones((users,), bool)
  d_in = UserBatch(jnp.concatenate([canary, others]), mask)
  d_out = UserBatch(jnp.concatenate([others[:1], others]), mask)
  return d_in, d_out


def filter_offset(relation: str = "replace_one", broken: str | None = None, *,
                  users: int = 64, steps: int = 4, noise_multiplier: float = 8.0
                  ) -> AuditSpec:
  """The filtered-mean release at a large common offset."""
  check_relation(relation, ("replace_one",), "FILTER (paper 000) is audited under replace_one")
  check_broken(broken, ("gram_float32",), "filter_offset")
  r_s, r_h = _TAU, 2.0 * _TAU
  sens = certified_sensitivity(r_h, users, _ZETA, min_kept_fraction=2.0 / 3.0)
  sigma = noise_multiplier * sens / 2.0   # the ledger doubles C = Delta/2 under replace-one
  claim = epsilon_of(dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(noise_multiplier), steps),
      delta=DELTA - steps * _ZETA, relation="replace_one")
  d_in, d_out = _datasets(users)

  def release(key, data: UserBatch):
    def one(k):
      k_coin, k_noise = jax.random.split(k)
      if broken == "gram_float32":
        mean = gram_float32_filter_mean(data.grads, k_coin, r_s, r_h)
      else:
        mean = filter_points(data.grads, k_coin, score_radius=r_s, degree_radius=r_h,
                             user_mask=data.mask).mean
      return mean + sigma * jax.random.normal(k_noise, mean.shape, mean.dtype)
    return jax.vmap(one)(jax.random.split(key, steps))

  def score(releases):   # along the canary's direction, offset removed first (exact)
    return jnp.sum(releases[:, 1] - _OFFSET)

  return AuditSpec(f"filter_offset[{broken or 'honest'}]", relation, release, d_in, d_out,
                   score, claim, DELTA,
                   f"epsilon_of(SelfComposed(Gaussian(z={noise_multiplier:g}), {steps}), "
                   f"replace_one), Delta = certified_sensitivity(2 tau, K={users}, "
                   f"zeta={_ZETA:g})")


# name: (builder, relations, broken twins): the format of mechanisms.MECHANISMS
NUMERICS = {"filter_offset": (filter_offset, ("replace_one",), ("gram_float32",))}
mechanisms.MECHANISMS.update(NUMERICS)
AUDITS.update(NUMERICS)
