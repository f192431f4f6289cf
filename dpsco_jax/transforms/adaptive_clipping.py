"""Adaptive clipping as a chain stage: the clip norm follows a quantile of the users' norms.

Andrew et al., "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021,
Algorithm 1. Each step, at the state's clip norm ``C_t``:

1. every real user is clipped at ``C_t`` and reports ``b_i = 1[||g_i|| <= C_t]`` (a non-finite
   row is dropped from the sum and counts as clipped);
2. the stage releases the clipped mean ``(sum_i clip(g_i) + N(0, (z_Delta C_t)^2 I)) / D`` and
   the noisy unclipped fraction ``b~ = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / D + 1/2``
   (``D`` the declared expected batch size);
3. ``C_{t+1} = C_t exp(-eta_C (b~ - gamma))`` (§3).

Privacy: the pair is one Gaussian mechanism of multiplier ``z``
(:class:`~dpsco_jax.privacy.sensitivity.AdaptiveClipSplit`, Theorem 1), priced as DP-SGD's step;
``C_t`` is post-processing of past releases. Step ``t``'s key is ``fold_in(key, t)``, then
``fold_in`` 0 (sum) and 1 (count); the state redacts the key.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpsco_jax._checks import check_nonnegative, check_positive, check_seed_or_key
from dpsco_jax.privacy.sensitivity import AdaptiveClipSplit, GaussianStage
from dpsco_jax.transforms.clipping import (clip_and_aggregate, num_user_slots, real_users,
                                           tree_global_norms)
from dpsco_jax.transforms.noise import add_noise_tree, redacted_repr, tree_gaussian_like

__all__ = ["AdaptiveClipState", "adaptive_clip_and_noise", "adaptive_noise",
           "adaptive_sum_stage", "check_target_quantile", "unclipped_centred_count"]

PyTree = Any


class AdaptiveClipState(NamedTuple):
  """The state of the adaptive clipping stages (repr redacts the key).

  Attributes:
    clip_norm: ``C_t`` (public: a function of past releases).
    fraction: the last released noisy unclipped fraction ``b~``.
    key: the noise key (secret).
    count: the steps taken.
  """
  clip_norm: jax.Array
  fraction: jax.Array
  key: jax.Array
  count: jax.Array

  def __repr__(self) -> str:
    return redacted_repr(self, ("key",))

  __str__ = __repr__


def check_target_quantile(x: Any, name: str = "target_quantile") -> float:
  """``gamma`` in the open interval (0, 1): at 0 or 1 the norm goes to 0 or infinity."""
  v = check_positive(x, name)
  if not v < 1.0:
    raise ValueError(f"{name} must lie in the open interval (0, 1) (the fraction of users "
                     f"left unclipped), got {x!r}")
  return v


def adaptive_sum_stage(state: AdaptiveClipState, split: AdaptiveClipSplit,
                       denominator: float) -> GaussianStage:
  """The sum's Gaussian stage at the state's ``C_t``: multiplier ``z_Delta`` on ``C_t / D``."""
  return split.sum_stage(state.clip_norm, denominator)


def unclipped_centred_count(norms: jax.Array, clip_norm: jax.Array, real: jax.Array
                            ) -> jax.Array:
  """``sum_i real_i (b_i - 1/2)``, ``b_i = 1[norms_i <= C_t]``: the count (SECRET until noised).

  Args:
    norms: ``[U]`` per-user norms (or certified upper bounds of them).
    clip_norm: ``C_t``.
    real: ``[U]`` bool, False for padded slots.

  Returns:
    The centred count, a float32 scalar.
  """
  b = (jnp.isfinite(norms) & (norms <= clip_norm)).astype(jnp.float32)
  return jnp.sum(jnp.where(real, b - 0.5, 0.0))


def adaptive_noise(initial_clip_norm: float, *, target_quantile: float,
                   clip_learning_rate: float, denominator: float, split: AdaptiveClipSplit,
                   key: jax.Array | int) -> optax.GradientTransformationExtraArgs:
  """The noise half of :func:`adaptive_clip_and_noise` (same arguments, keys and state), for a
  caller that clips at ``C_t`` itself: the clipped mean and the extra argument
  ``centred_count`` (:func:`unclipped_centred_count`) in, the noisy mean out."""
  c0 = check_positive(initial_clip_norm, "initial_clip_norm")
  gamma = target_quantile if isinstance(target_quantile, jax.core.Tracer) else (
      check_target_quantile(target_quantile))
  eta = check_positive(clip_learning_rate, "clip_learning_rate")
  denom = check_positive(denominator, "denominator")
  if not isinstance(split, AdaptiveClipSplit):
    raise TypeError("split must be an AdaptiveClipSplit (privacy.sensitivity."
                    f"adaptive_clip_split), got {type(split).__name__}")
  check_nonnegative(split.count_stddev, "count_stddev")
  key = check_seed_or_key(key, "key")

  def init_fn(params):
    del params
    return AdaptiveClipState(clip_norm=jnp.asarray(c0, jnp.float32),
                             fraction=jnp.asarray(gamma, jnp.float32), key=key,
                             count=jnp.zeros((), jnp.int32))

  def update_fn(mean, state, params=None, *, centred_count, **extra):
    del extra
    c_t = state.clip_norm
    step_key = jax.random.fold_in(state.key, state.count)
    noise = tree_gaussian_like(jax.random.fold_in(step_key, 0), mean,
                               adaptive_sum_stage(state, split, denom).std)
    noisy = add_noise_tree(mean, noise, params)
    count_noise = split.count_stage().std * jax.random.normal(
        jax.random.fold_in(step_key, 1), (), jnp.float32)
    fraction = (centred_count + count_noise) / denom + 0.5
    new_c = c_t * jnp.exp(-eta * (fraction - gamma))
    return noisy, AdaptiveClipState(clip_norm=new_c.astype(jnp.float32),
                                    fraction=fraction.astype(jnp.float32), key=state.key,
                                    count=state.count + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adaptive_clip_and_noise(initial_clip_norm: float, *, target_quantile: float,
                      clip_learning_rate: float, denominator: float,
                      split: AdaptiveClipSplit, key: jax.Array | int
                      ) -> optax.GradientTransformationExtraArgs:
  """Clip at ``C_t``, noisy mean, noisy unclipped count, geometric update of ``C_t``.

  Args:
    initial_clip_norm: ``C_0 > 0``.
    target_quantile: ``gamma`` in (0, 1), the fraction of users to leave unclipped (0.5: the
      median norm, the paper's default).
    clip_learning_rate: ``eta_C > 0`` of the geometric step (the paper's 0.2).
    denominator: the declared expected batch ``D`` of the mean and of the fraction.
    split: the pair's multipliers (:func:`dpsco_jax.privacy.sensitivity.adaptive_clip_split`).
    key: a ``jax.random`` key or an int seed (checked); the state redacts it.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: stacked per-user updates (and ``user_mask``)
    in, the noisy mean out; its state is :class:`AdaptiveClipState`.
  """
  noise = adaptive_noise(initial_clip_norm, target_quantile=target_quantile,
                         clip_learning_rate=clip_learning_rate, denominator=denominator,
                         split=split, key=key)
  denom = check_positive(denominator, "denominator")

  def update_fn(updates, state, params=None, *, user_mask=None, **extra):
    del extra
    real = real_users(user_mask, num_user_slots(updates))
    clip = clip_and_aggregate(state.clip_norm, "mean", denom)
    mean, _ = clip.update(updates, clip.init(None), user_mask=real)
    return noise.update(mean, state, params,
                        centred_count=unclipped_centred_count(
                            tree_global_norms(updates), state.clip_norm, real))

  return optax.GradientTransformationExtraArgs(noise.init, update_fn)
