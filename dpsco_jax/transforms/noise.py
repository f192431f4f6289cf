"""Independent Gaussian noise: the Gaussian mechanism as a chain stage.

``u <- u + N(0, stddev^2 I)`` on every coordinate of every leaf. With an aggregate of L2
sensitivity ``Delta`` and ``stddev = z * Delta`` one step is the Gaussian mechanism with noise
multiplier ``z`` (``dp_accounting.GaussianDpEvent(z)``); composition over steps and subsampling
are the ledger's business (``dpsco_jax.privacy.ledger``).

The key lives in the state; step ``t`` uses ``fold_in(key, t)``, so every step draws fresh
noise, a given key reproduces the same stream, and no key is ever used twice.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpsco_jax._checks import check_nonnegative

PyTree = Any


def tree_gaussian_like(key: jax.Array, tree: PyTree, stddev: float | jax.Array = 1.0) -> PyTree:
  """``N(0, stddev^2)`` noise shaped like ``tree``, one independent subkey per leaf."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, max(len(leaves), 1))
  noise = [stddev * jax.random.normal(k, jnp.shape(x), jnp.result_type(x, jnp.float32))
           for k, x in zip(keys, leaves)]
  return jax.tree.unflatten(treedef, noise)


class GaussianNoiseState(NamedTuple):
  key: jax.Array
  count: jax.Array


def add_gaussian_noise(stddev: float, key: jax.Array | int
                       ) -> optax.GradientTransformationExtraArgs:
  """Adds i.i.d. ``N(0, stddev^2)`` to every coordinate, fresh noise each step.

  Args:
    stddev: the per-coordinate standard deviation, ``noise_multiplier * sensitivity``.
    key: a ``jax.random`` key (or an int seed). The state is secret: never log it.
  """
  check_nonnegative(stddev, "stddev")
  if isinstance(key, int):
    key = jax.random.key(key)

  def init_fn(params):
    del params
    return GaussianNoiseState(key=key, count=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra):
    del params, extra
    step_key = jax.random.fold_in(state.key, state.count)
    noise = tree_gaussian_like(step_key, updates, stddev)
    noisy = jax.tree.map(lambda u, n: u + n.astype(u.dtype), updates, noise)
    return noisy, GaussianNoiseState(key=state.key, count=state.count + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
