"""Post-processing stages: after the noise stage, touching no private data
(:func:`add_public_gradient`, :func:`track_min_step`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpsco_jax.transforms.steps import tree_l2_norm

__all__ = ["PublicGradientState", "add_public_gradient", "MinStepState", "track_min_step"]

PyTree = Any


class PublicGradientState(NamedTuple):
  pass


def add_public_gradient(grad_fn: Callable[[PyTree], PyTree] | None
                        ) -> optax.GradientTransformationExtraArgs:
  """Adds ``grad_fn(params)``, the gradient of a data-independent term (e.g. paper 004's ``l2/2
  ||y||^2``), AFTER the noise stage.

  Args:
    grad_fn: ``params -> gradient`` of the data-independent term, or ``None``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; with a ``grad_fn``, ``update`` needs
    ``params``.
  """
  def update_fn(updates, state, params=None, **extra):
    del extra
    if grad_fn is None:
      return updates, state
    if params is None:
      raise ValueError("add_public_gradient needs params")
    g = grad_fn(params)
    return jax.tree.map(lambda u, gi: u + gi.astype(u.dtype), updates, g), state

  return optax.GradientTransformationExtraArgs(lambda params: PublicGradientState(), update_fn)


class MinStepState(NamedTuple):
  count: jax.Array
  best_norm: jax.Array
  best_t: jax.Array
  released: PyTree   # x_{t_out}: the PRE-step iterate of the smallest step


def track_min_step() -> optax.GradientTransformationExtraArgs:
  """Output rule ``t_out = argmin_t ||x_{t+1} - x_t||``, releasing ``x_{t_out}`` (paper 004
  Alg 1 line 8); after the step stage, passing the update through.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` keeping the best ``x_t`` in ``released``
    (read it with :func:`released_params`); ``update`` needs ``params``.
  """
  def init_fn(params):
    return MinStepState(count=jnp.zeros((), jnp.int32),
                        best_norm=jnp.asarray(jnp.inf, jnp.result_type(float)),
                        best_t=-jnp.ones((), jnp.int32), released=params)

  def update_fn(updates, state, params=None, **extra):
    del extra
    if params is None:
      raise ValueError("track_min_step needs params")
    norm = tree_l2_norm(updates).astype(state.best_norm.dtype)
    better = norm < state.best_norm
    released = jax.tree.map(lambda p, r: jnp.where(better, p, r), params, state.released)
    return updates, MinStepState(count=state.count + 1,
                                 best_norm=jnp.where(better, norm, state.best_norm),
                                 best_t=jnp.where(better, state.count, state.best_t),
                                 released=released)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
