"""Canary audits of the MF noise stages (banded, BLT), each with a broken-accounting twin.

``clip_and_aggregate -> banded_noise | blt_noise`` over ``steps`` batches, the canary at steps
``0, sep, ..., (k-1) sep``; score: ``C^T C Delta`` (noise covariance ``C^{-1} C^{-T}``). Claim:
``mf_event`` with ``participation_sensitivity(c, T, k, sep)`` (zero_out as add_remove). Twin
``single_participation_accounting``: claimed with the one-participation sensitivity.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax.audit.canary import CLIP, DELTA, HI, UserBatch, check_broken, check_relation
from dpsco_jax.audit.harness import AUDITS, AuditSpec, build
from dpsco_jax.audit.mechanisms import canary_stream, chain_releases
from dpsco_jax.privacy import matrix_factorization as mf
from dpsco_jax.privacy.ledger import epsilon_of
from dpsco_jax.transforms.clipping import clip_and_aggregate
from dpsco_jax.transforms.matrix_factorization import banded_noise, blt_noise

__all__ = ["MECHANISMS", "build", "banded_noise_audit", "blt_noise_audit"]

TWINS = ("single_participation_accounting",)


def _spec(name: str, relation: str, broken: str | None, stage, coefs: np.ndarray,
          steps: int, participations: int, sep: int, users: int, dim: int,
          noise_multiplier: float) -> AuditSpec:
  check_relation(relation, ("add_remove", "zero_out"), "the MF audits use add_remove or zero_out")
  check_broken(broken, TWINS, name)
  pattern = np.arange(participations) * sep
  if pattern[-1] >= steps:
    raise ValueError(f"{participations} participations {sep} apart do not fit {steps} steps")
  sens = mf.participation_sensitivity(coefs, steps, participations=participations,
                                      min_sep=sep)
  claimed = (mf.participation_sensitivity(coefs, steps) if broken else sens)
  claim = epsilon_of(mf.mf_event(noise_multiplier, claimed), delta=DELTA,
                     relation="add_remove")
  denom = float(users)
  std = noise_multiplier * CLIP / denom
  d_in, d_out = canary_stream(relation, steps, pattern, users, dim)
  shift = np.zeros(steps)
  shift[pattern] = 1.0
  cmat = mf.toeplitz_matrix(coefs, steps)
  weights = jnp.asarray(cmat.T @ cmat @ shift, jnp.float32)

  def release(key, data: UserBatch):
    tx = optax.chain(clip_and_aggregate(CLIP, "mean", denom), stage(std, steps, key))
    return chain_releases(tx, data, dim)

  source = (f"epsilon_of(mf_event(z={noise_multiplier}, sens={claimed:.4g})); canary "
            f"participates {participations}x, {sep} apart"
            + (" (claimed as one participation)" if broken else ""))
  return AuditSpec(f"{name}[{broken or 'honest'}]", relation, release, d_in, d_out,
                   lambda r: jnp.dot(weights, r[:, 0], precision=HI), claim, DELTA, source)


def banded_noise_audit(relation: str = "zero_out", broken: str | None = None, *,
                       steps: int = 8, bands: int = 4, participations: int = 3, sep: int = 1,
                       users: int = 4, dim: int = 2, noise_multiplier: float = 3.0
                       ) -> AuditSpec:
  """``banded_noise`` with the sqrt strategy of ``bands`` bands (module docstring)."""
  coefs = mf.banded_strategy(steps, bands, strategy="sqrt").coefs
  stage = lambda std, t, key: banded_noise(std, t, key, coefs=coefs, output="increment")
  return _spec("banded_noise", relation, broken, stage, coefs, steps, participations, sep,
               users, dim, noise_multiplier)


def blt_noise_audit(relation: str = "zero_out", broken: str | None = None, *,
                    steps: int = 8, buffers: int = 2, participations: int = 3, sep: int = 1,
                    users: int = 4, dim: int = 2, noise_multiplier: float = 4.0
                    ) -> AuditSpec:
  """``blt_noise`` with the built-in BLT fit (its coefficients make the sensitivity exact)."""
  s = mf.blt_strategy(steps, buffers, strategy="sqrt")
  coefs = mf.blt_coefs(s.buf_decay, s.output_scale, steps)
  stage = lambda std, t, key: blt_noise(std, t, key, buf_decay=s.buf_decay,
                                        output_scale=s.output_scale, output="increment")
  return _spec("blt_noise", relation, broken, stage, coefs, steps, participations, sep,
               users, dim, noise_multiplier)


MECHANISMS = {
    "banded_noise": (banded_noise_audit, ("zero_out", "add_remove"), TWINS),
    "blt_noise": (blt_noise_audit, ("zero_out", "add_remove"), TWINS),
}
AUDITS.update(MECHANISMS)
