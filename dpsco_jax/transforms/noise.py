"""Independent Gaussian noise: the Gaussian mechanism as a chain stage.

``u <- u + N(0, stddev^2 I)`` on every coordinate. With ``stddev = z * Delta`` (formed by the
stage's :class:`~dpsco_jax.privacy.sensitivity.GaussianStage`, the one place ``z * Delta`` is
computed) one step is ``dp_accounting.GaussianDpEvent(z)``; composition and sampling are the
ledger's business.

Precision: noise is drawn and added in float32 or wider (a bfloat16 draw is not the Gaussian
the accountant assumes); only the noisy result is cast to the params' dtype (else the
update's), which is post-processing. Step ``t`` draws from ``fold_in(key, t)``: fresh noise
every step, reproducible from the key, which the state's repr redacts.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpsco_jax._checks import _traced, check_nonnegative, check_seed_or_key

PyTree = Any
_REDACTED = "<redacted>"
# draws reach ~6 sigma; keep them and a sum of a few of them finite in float32
_MAX_STDDEV = float(jnp.finfo(jnp.float32).max) / 1e3


def noise_dtype(dtype) -> jnp.dtype:
  """The dtype noise is drawn and added in: float32, or the input's if wider."""
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.promote_types(dtype, jnp.float32)
  return jnp.dtype(jnp.float32)


def tree_gaussian_like(key: jax.Array, tree: PyTree, stddev: float | jax.Array = 1.0) -> PyTree:
  """``N(0, stddev^2)`` noise shaped like ``tree`` (float32 or wider, whatever the leaves'
  dtype), one independent subkey per leaf.

  Args:
    key: a JAX PRNG key.
    tree: the pytree whose shapes the noise takes.
    stddev: the noise std (default 1.0).

  Returns:
    A pytree of noise shaped like ``tree``.
  """
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, max(len(leaves), 1))
  noise = []
  for k, x in zip(keys, leaves):
    dt = noise_dtype(jnp.result_type(x))
    noise.append(jnp.asarray(stddev, dt) * jax.random.normal(k, jnp.shape(x), dt))
  return jax.tree.unflatten(treedef, noise)


def output_like(updates: PyTree, params: PyTree | None) -> PyTree:
  """The tree whose dtypes a stage's output takes: ``params`` when it matches ``updates``'
  structure, else ``updates``."""
  same = params is not None and jax.tree.structure(params) == jax.tree.structure(updates)
  return params if same else updates


def add_noise_tree(updates: PyTree, noise: PyTree, like: PyTree | None = None) -> PyTree:
  """``updates + noise`` in the noise's (float32+) dtype, cast as :func:`output_like`."""
  return jax.tree.map(lambda u, n, r: (u.astype(n.dtype) + n).astype(jnp.result_type(r)),
                      updates, noise, output_like(updates, like))


def redacted_repr(state: tuple, secret: tuple[str, ...]) -> str:
  """``Name(field=..., secret=<redacted>)``: a state NamedTuple's repr, secrets hidden."""
  parts = [f"{f}={_REDACTED if f in secret else repr(v)}"
           for f, v in zip(state._fields, state)]
  return f"{type(state).__name__}({', '.join(parts)})"


class GaussianNoiseState(NamedTuple):
  """``key`` is SECRET (redacted in repr/str); ``count`` is the number of steps taken.

  Attributes:
    key: the noise key (secret).
    count: the number of steps taken (int32).
  """
  key: jax.Array
  count: jax.Array

  def __repr__(self) -> str:
    return redacted_repr(self, ("key",))

  __str__ = __repr__


def check_stddev(stddev: Any, name: str) -> Any:
  """A finite stddev >= 0 whose float32 draws stay finite (refused, not turned into Inf)."""
  v = check_nonnegative(stddev, name)
  if not _traced(v) and v > _MAX_STDDEV:
    raise ValueError(f"{name}={stddev!r} is too large for float32 noise (max {_MAX_STDDEV:.3g}):"
                     " the noisy update would be Inf/NaN; check the noise calibration")
  return v


def add_gaussian_noise(stddev: float, key: jax.Array | int
                       ) -> optax.GradientTransformationExtraArgs:
  """Adds i.i.d. ``N(0, stddev^2)`` to every coordinate, fresh noise each step.

  Args:
    stddev: the per-coordinate standard deviation, ``noise_multiplier * sensitivity``
      (finite, ``>= 0``; a stddev beyond float32 range is refused, not turned into Inf).
    key: a ``jax.random`` key, or an int seed in ``[0, 2**32 - 1]`` (the seeds that give
      distinct keys; a negative or larger one is refused), checked. The state is secret:
      its repr redacts the key.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is :class:`GaussianNoiseState`.
  """
  stddev = check_stddev(stddev, "stddev")
  key = check_seed_or_key(key, "key")

  def init_fn(params):
    del params
    return GaussianNoiseState(key=key, count=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra):
    del extra
    step_key = jax.random.fold_in(state.key, state.count)
    noise = tree_gaussian_like(step_key, updates, stddev)
    noisy = add_noise_tree(updates, noise, params)
    return noisy, GaussianNoiseState(key=state.key, count=state.count + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
