"""Adaptive clipping as a chain stage: the clip norm follows a quantile of the users' norms.

Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive
Clipping", NeurIPS 2021 (Algorithm 1, DP-FedAvg with adaptive clipping). Each step, with the
current clip norm ``C_t`` carried in the state:

1. every real user ``i`` (row of the stacked per-user updates) is clipped at ``C_t`` and
   reports ``b_i = 1[||g_i|| <= C_t]`` (a non-finite row is dropped from the sum and counts
   as clipped);
2. the stage releases the clipped mean ``(sum_i clip(g_i) + N(0, (z_Delta C_t)^2 I)) / D`` and
   the noisy unclipped fraction ``b~ = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / D + 1/2``
   (§3: the centred count has add/remove sensitivity 1/2; ``D`` is the declared, expected
   batch size, never the realized count);
3. the norm takes the geometric step ``C_{t+1} = C_t exp(-eta_C (b~ - gamma))`` (§3), towards
   the norm that leaves a fraction ``gamma`` of the users unclipped.

Privacy. ``z_Delta`` and ``sigma_b`` come from
:func:`dpsco_jax.privacy.sensitivity.adaptive_clip_split` (Theorem 1): the pair is one Gaussian
mechanism of multiplier ``z``, so a step is priced as DP-SGD's step at ``z``. The sum's
sensitivity is ``C_t / D`` (:meth:`~dpsco_jax.privacy.sensitivity.AdaptiveClipSplit.sum_stage`,
the std formed in ``privacy/``), and ``C_t`` is a function of the past releases ``b~`` and
public constants only: post-processing, so the analysis holds step by step.

Why one stage (clip, mean, both noises) rather than ``clip -> noise``: the sum's std is
``z_Delta C_t / D`` with ``C_t`` in this stage's state, which an ``optax.chain`` cannot hand to
a later stage. The pieces are the library's own: :func:`~dpsco_jax.transforms.clipping.
clip_and_aggregate` at ``C_t`` and the noise of :mod:`dpsco_jax.transforms.noise`.

Keys: step ``t`` uses ``fold_in(key, t)``, split by ``fold_in`` into the sum's (0) and the
count's (1): no key is used twice. The state's repr redacts the key; ``clip_norm`` and
``fraction`` (the last released ``b~``) are public.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpsco_jax._checks import (check_nonnegative, check_positive, check_seed_or_key,
                               check_user_mask)
from dpsco_jax.privacy.sensitivity import AdaptiveClipSplit, GaussianStage
from dpsco_jax.transforms.clipping import clip_and_aggregate, tree_global_norms
from dpsco_jax.transforms.noise import add_noise_tree, redacted_repr, tree_gaussian_like

__all__ = ["AdaptiveClipState", "adaptive_clip_and_noise", "adaptive_noise",
           "adaptive_sum_stage", "check_target_quantile", "unclipped_centred_count"]

PyTree = Any


class AdaptiveClipState(NamedTuple):
  """``clip_norm`` is ``C_t`` (public: a function of past releases); ``fraction`` the last
  released noisy unclipped fraction ``b~``; ``key`` is SECRET (redacted in repr/str);
  ``count`` the number of steps taken.

  Attributes:
    clip_norm: ``C_t``.
    fraction: the last released noisy unclipped fraction.
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
  """A target quantile ``gamma`` in the open interval (0, 1): at 0 or 1 the geometric step
  drives the norm to 0 or to infinity."""
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
  """``sum_i real_i (b_i - 1/2)`` with ``b_i = 1[norms_i <= C_t]`` (a non-finite norm: 0), the
  count the pair releases (sensitivity 1/2). SECRET until the count's noise is added.

  Args:
    norms: ``[U]`` per-user norms (or certified upper bounds of them, as fast clipping gives).
    clip_norm: ``C_t``.
    real: ``[U]`` bool, False for padded slots.

  Returns:
    The centred count, a float32 scalar.
  """
  b = (jnp.isfinite(norms) & (norms <= clip_norm)).astype(jnp.float32)
  return jnp.sum(jnp.where(real, b - 0.5, 0.0))


def _unclipped_centred(updates: PyTree, clip_norm: jax.Array, real: jax.Array) -> jax.Array:
  return unclipped_centred_count(tree_global_norms(updates), clip_norm, real)


def _checked(initial_clip_norm, target_quantile, clip_learning_rate, denominator, split, key):
  c0 = check_positive(initial_clip_norm, "initial_clip_norm")
  gamma = target_quantile if isinstance(target_quantile, jax.core.Tracer) else (
      check_target_quantile(target_quantile))
  eta = check_positive(clip_learning_rate, "clip_learning_rate")
  denom = check_positive(denominator, "denominator")
  if not isinstance(split, AdaptiveClipSplit):
    raise TypeError("split must be an AdaptiveClipSplit (privacy.sensitivity."
                    f"adaptive_clip_split), got {type(split).__name__}")
  check_nonnegative(split.count_stddev, "count_stddev")
  return c0, gamma, eta, denom, check_seed_or_key(key, "key")


def adaptive_noise(initial_clip_norm: float, *, target_quantile: float,
                   clip_learning_rate: float, denominator: float, split: AdaptiveClipSplit,
                   key: jax.Array | int) -> optax.GradientTransformationExtraArgs:
  """The noise half of :func:`adaptive_clip_and_noise`, for a caller that clips at ``C_t``
  itself (``flax.DPTrainer``: its fast clipper sums micro-batches of users clipped at the
  state's ``clip_norm`` before the one noise draw of the step).

  Input: the clipped mean at ``state.clip_norm`` (``sum_i clip(g_i) / D``) and the extra
  argument ``centred_count`` (:func:`unclipped_centred_count` at the same ``C_t``). Output:
  the noisy mean; the state takes the geometric step. Same keys, noises and update as
  :func:`adaptive_clip_and_noise` (which is this stage after its own clipping).

  Args:
    initial_clip_norm: ``C_0 > 0``.
    target_quantile: ``gamma`` in (0, 1).
    clip_learning_rate: ``eta_C > 0``.
    denominator: the declared expected batch ``D``.
    split: the pair's multipliers (:func:`dpsco_jax.privacy.sensitivity.adaptive_clip_split`).
    key: a ``jax.random`` key or an int seed.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is :class:`AdaptiveClipState`.

  Raises:
    ValueError: a bad argument (named in the message).
    TypeError: ``split`` is not an :class:`~dpsco_jax.privacy.AdaptiveClipSplit`.
  """
  c0, gamma, eta, denom, key = _checked(initial_clip_norm, target_quantile,
                                        clip_learning_rate, denominator, split, key)

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

  Input: stacked per-user updates (leading user axis) and the extra argument ``user_mask``
  (bool ``[U]``; without it every slot is a real user). Output: the noisy mean, params-shaped.
  Concrete arguments are checked here; traced ones were checked by the caller.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is :class:`AdaptiveClipState`.

  Raises:
    ValueError: a bad ``initial_clip_norm``, ``target_quantile``, ``clip_learning_rate``,
      ``denominator`` or count std (named in the message).
    TypeError: ``split`` is not an :class:`~dpsco_jax.privacy.AdaptiveClipSplit`.
  """
  noise = adaptive_noise(initial_clip_norm, target_quantile=target_quantile,
                         clip_learning_rate=clip_learning_rate, denominator=denominator,
                         split=split, key=key)
  denom = check_positive(denominator, "denominator")

  def update_fn(updates, state, params=None, *, user_mask=None, **extra):
    del extra
    n = jax.tree.leaves(updates)[0].shape[0]
    mask = check_user_mask(user_mask, n)
    real = jnp.ones((n,), bool) if mask is None else mask
    clip = clip_and_aggregate(state.clip_norm, "mean", denom)
    mean, _ = clip.update(updates, clip.init(None), user_mask=real)
    return noise.update(mean, state, params,
                        centred_count=_unclipped_centred(updates, state.clip_norm, real))

  return optax.GradientTransformationExtraArgs(noise.init, update_fn)
