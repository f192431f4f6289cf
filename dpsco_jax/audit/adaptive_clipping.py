"""Canary audit of one adaptive-clipping step, with two broken twins.

The stage releases the noisy clipped mean and the noisy unclipped fraction ``b~`` (the next
clip norm is post-processing of ``b~``). ``D``: a ``10 C`` Dirac canary plus zero-gradient
users; ``D'`` masks the canary out (add/remove). Score: the pair's likelihood ratio. Honest:
:func:`~dpsco_jax.privacy.sensitivity.adaptive_clip_split`'s ``z_Delta``, ``sigma_b``, claimed
as the Gaussian at ``z`` (Andrew et al. 2021, Theorem 1). Twins, same claim:
``count_without_noise`` (``sigma_b = 0``) and ``sum_multiplier_unadjusted`` (the sum's noise
at ``z``: with the count's, a Gaussian of multiplier ``(z^-2 + (2 sigma_b)^-2)^(-1/2) < z``).
``delta = 0.1`` keeps the claim small enough that the twins show at ~5e4 trials.
"""

from __future__ import annotations

import dp_accounting
import jax.numpy as jnp

from dpsco_jax.audit.canary import check_broken, dirac_canary, neighbouring_pair
from dpsco_jax.audit.harness import AuditSpec
from dpsco_jax.privacy.ledger import epsilon_of
from dpsco_jax.privacy.sensitivity import AdaptiveClipSplit, adaptive_clip_split
from dpsco_jax.transforms.adaptive_clipping import adaptive_clip_and_noise

__all__ = ["BROKEN", "adaptive_clipping_audit"]

BROKEN = ("count_without_noise", "sum_multiplier_unadjusted")
_CLIP, _GAMMA, _ETA, _DIM = 1.0, 0.5, 0.2, 2


def _split(broken: str | None, z: float, sigma_b: float) -> AdaptiveClipSplit:
  honest = adaptive_clip_split(z, sigma_b)
  if broken == "count_without_noise":
    return AdaptiveClipSplit(z, honest.sum_multiplier, 0.0)
  if broken == "sum_multiplier_unadjusted":
    return AdaptiveClipSplit(z, z, sigma_b)
  return honest


def _release(split: AdaptiveClipSplit, denominator: float):
  def release(key, data):
    tx = adaptive_clip_and_noise(_CLIP, target_quantile=_GAMMA, clip_learning_rate=_ETA,
                           denominator=denominator, split=split, key=key)
    mean, state = tx.update(data.grads, tx.init(None), user_mask=data.mask)
    return jnp.stack([mean[0] * denominator, (state.fraction - 0.5) * denominator])
  return release


def _score(split: AdaptiveClipSplit):
  s_x = split.sum_multiplier * _CLIP
  s_y = split.count_stddev
  if s_y == 0:   # a noiseless count decides alone
    return lambda r: -r[1]
  return lambda r: r[0] * _CLIP / (s_x * s_x) - r[1] / (2.0 * s_y * s_y)


def adaptive_clipping_audit(broken: str | None = None, *, noise_multiplier: float = 1.5,
                            count_stddev: float = 0.9, background: int = 7,
                            delta: float = 0.1) -> AuditSpec:
  """One adaptive-clipping step's audit; ``broken``: ``None`` or one of :data:`BROKEN`."""
  check_broken(broken, BROKEN)
  split = _split(broken, noise_multiplier, count_stddev)
  d_in, d_out = neighbouring_pair(jnp.zeros((background, _DIM), jnp.float32),
                                  dirac_canary(_DIM, 10.0 * _CLIP), "add_remove")
  denominator = float(background + 1)
  claim = epsilon_of(dp_accounting.GaussianDpEvent(noise_multiplier), delta=delta)
  return AuditSpec(f"adaptive_clipping[{broken or 'honest'}]", "add_remove",
                   _release(split, denominator), d_in, d_out, _score(split), float(claim),
                   delta, f"epsilon_of Gaussian(z={noise_multiplier:g}) (Andrew et al. 2021, "
                   f"Thm 1: z_Delta={split.sum_multiplier:.4g}, sigma_b={split.count_stddev:g})")
