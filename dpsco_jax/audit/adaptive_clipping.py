"""Canary audit of adaptive clipping (one step of the stage), with two broken twins.

The stage (:func:`dpsco_jax.transforms.adaptive_clipping.adaptive_clipping`) releases per step
the noisy clipped mean and the noisy unclipped fraction ``b~`` (the next clip norm is
``C exp(-eta (b~ - gamma))``: post-processing of ``b~``, so auditing ``b~`` audits the norm).
Datasets (:func:`~dpsco_jax.audit.canary.neighbouring_pair`, add/remove): ``D`` holds a Dirac
canary of norm ``10 C`` (clipped: ``b = 0``) in slot 0 and background users with zero
gradients (``b = 1``); ``D'`` masks the canary out. ``D = U`` (the padded size) is the public
denominator. The score is the likelihood ratio of the pair, ``x_0 / (s_x^2 / C) -
y / (2 s_y^2)`` with ``x_0 = D mean_0`` and ``y = D (b~ - 1/2)``, ``s_x`` and ``s_y`` the
stds the release really draws (the auditor knows the mechanism).

* honest: the stage with :func:`~dpsco_jax.privacy.sensitivity.adaptive_clip_split`'s
  ``z_Delta`` and ``sigma_b``; the claim is DP-SGD's Gaussian at ``z`` (Theorem 1).
* ``count_without_noise``: the count released without noise (``sigma_b = 0``), same claim: the
  fraction (and so the next clip norm) says whether the canary was above ``C``.
* ``sum_multiplier_unadjusted``: the sum's noise at ``z`` instead of ``z_Delta``, same claim:
  with the count's noise on top the pair is a Gaussian of multiplier ``(z^-2 +
  (2 sigma_b)^-2)^(-1/2) < z``.

Defaults (``z = 1.5``, ``sigma_b = 0.9`` so ``2 sigma_b = 1.2 z``, ``delta = 0.1``): a large
delta keeps the claim small enough that the unadjusted twin shows at ~5e4 trials per side.
"""

from __future__ import annotations

import dp_accounting
import jax
import jax.numpy as jnp

from dpsco_jax.audit.canary import dirac_canary, neighbouring_pair
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
  """The audit spec of one adaptive-clipping step (module docstring); ``broken``: ``None``
  or one of :data:`BROKEN`. The claim is always the Gaussian's at ``noise_multiplier``."""
  if broken is not None and broken not in BROKEN:
    raise ValueError(f"broken must be None or one of {BROKEN}, got {broken!r}")
  split = _split(broken, noise_multiplier, count_stddev)
  d_in, d_out = neighbouring_pair(jnp.zeros((background, _DIM), jnp.float32),
                                  dirac_canary(_DIM, 10.0 * _CLIP), "add_remove")
  denominator = float(background + 1)
  claim = epsilon_of(dp_accounting.GaussianDpEvent(noise_multiplier), delta=delta)
  return AuditSpec(f"adaptive_clipping[{broken or 'honest'}]", "add_remove",
                   _release(split, denominator), d_in, d_out, _score(split), float(claim),
                   delta, f"epsilon_of Gaussian(z={noise_multiplier:g}) (Andrew et al. 2021, "
                   f"Thm 1: z_Delta={split.sum_multiplier:.4g}, sigma_b={split.count_stddev:g})")
