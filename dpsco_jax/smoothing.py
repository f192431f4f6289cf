"""Uniform-ball convolution smoothing for non-smooth losses (paper 000 §4, Lemma D.1).

``f_r(x, z) = E_{y ~ Unif(B_r)} f(x + y, z)``, ``B_r`` the l2 ball of radius ``r`` over all
leaves jointly. Lemma D.1 ([YNS12, DBW12]): for ``f`` convex and L-Lipschitz on ``X + r B``,
``f_r`` is convex, L-Lipschitz, ``L sqrt(d)/r``-smooth, ``f_r <= f <= f_r + L r`` and ``grad
f_r(x) = E grad f(x + y)``. Algorithm 3's unbiased oracle on ``f_r`` (spec 000 §2.6 [AMBIG])
evaluates ``grad f(x + y, z)`` with a fresh ``y`` per (step, user, item), passed as
``per_user_grads(..., offsets=...)``; ``y`` is data-independent, so smoothing costs no privacy.
Sampler: ``y = r U^{1/d} g / ||g||``, ``g ~ N(0, I_d)``, ``U ~ Unif[0, 1]``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from dpsco_jax._checks import check_int, check_positive

PyTree = Any

__all__ = ["sample_uniform_ball", "smoothing_offsets", "smoothed_smoothness",
           "smoothing_radius_theory", "num_params"]


def num_params(params: PyTree) -> int:
  """``d``: total number of coordinates over all leaves."""
  return int(sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(params)))


def sample_uniform_ball(key: jax.Array, like: PyTree, radius: float | jax.Array,
                        batch_shape: Sequence[int] = ()) -> PyTree:
  """``prod(batch_shape)`` i.i.d. uniform points of the radius-``r`` ball in params space (the
  global norm over all leaves, not leaf by leaf).

  Args:
    key: a JAX PRNG key.
    like: a params pytree (its structure, shapes and dtypes).
    radius: the ball's radius.
    batch_shape: the leading shape of the draws (default: one point).

  Returns:
    A pytree like ``like`` with leaves ``[*batch_shape, *leaf.shape]``.
  """
  leaves, treedef = jax.tree.flatten(like)
  batch_shape = tuple(batch_shape)
  d = num_params(like)
  k_dir, k_rad = jax.random.split(key)
  keys = jax.random.split(k_dir, max(len(leaves), 1))
  gs = [jax.random.normal(k, batch_shape + jnp.shape(x), jnp.float32)
        for k, x in zip(keys, leaves)]
  nb = len(batch_shape)
  sq = sum(jnp.sum(jnp.square(g), axis=tuple(range(nb, g.ndim))) for g in gs)
  u = jax.random.uniform(k_rad, batch_shape)
  scale = radius * u ** (1.0 / d) / jnp.sqrt(jnp.maximum(sq, 1e-30))

  def shape(g, x):
    s = scale.reshape(batch_shape + (1,) * (g.ndim - nb))
    return (g * s).astype(jnp.result_type(x, jnp.float32))
  return jax.tree.unflatten(treedef, [shape(g, x) for g, x in zip(gs, leaves)])


def smoothing_offsets(key: jax.Array, params: PyTree, radius: float | jax.Array,
                      num_users: int, m: int) -> PyTree:
  """Fresh offsets for one step, one per user and item.

  Args:
    key: a JAX PRNG key, ``fold_in(key, step)`` (an independent ``y`` per step, user, item).
    params: a params pytree (its structure and shapes).
    radius: the smoothing radius.
    num_users: users per step.
    m: items per user.

  Returns:
    The offsets, leaves ``[num_users, m, *p.shape]``.
  """
  return sample_uniform_ball(key, params, radius, (num_users, m))


def smoothed_smoothness(lipschitz: float, d: int, radius: float) -> float:
  """``beta = L sqrt(d) / r`` (Lemma D.1)."""
  return (check_positive(lipschitz, "lipschitz") * math.sqrt(check_int(d, "d"))
          / check_positive(radius, "radius"))


def smoothing_radius_theory(d: int, R: float, epsilon: float, n: int, m: int) -> float:
  """Theorem D.3: ``r = sqrt(d) R / (eps n sqrt(m))``."""
  return (math.sqrt(check_int(d, "d")) * check_positive(R, "R")
          / (check_positive(epsilon, "epsilon") * check_int(n, "n") * math.sqrt(check_int(m, "m"))))
