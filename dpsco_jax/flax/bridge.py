"""Any registered algorithm on a Flax nnx model (:func:`fit_model`), updating it in place.

The model's ``nnx.Param`` variables are trained; other state (batch statistics, RNG counters)
is held fixed and the forward pass's updates to it are discarded, so no user's data leaks
through a running statistic (train batch-norm models in eval mode). Step-by-step DP-SGD:
:class:`dpsco_jax.flax.DPTrainer`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import jax
from flax import nnx

from dpsco_jax.api import fit
from dpsco_jax.cache import bounded_cache
from dpsco_jax.data.problem import ProblemConstants
from dpsco_jax.data.user_data import UserData
from dpsco_jax.result import Result

__all__ = ["fit_model", "params_loss"]


@bounded_cache(64)
def _cached_params_loss(loss_fn: Callable, graphdef: Any, *rest: Any) -> Callable:
  def loss(params, example):
    return loss_fn(nnx.merge(graphdef, params, *rest), example)
  return loss


def params_loss(model: nnx.Module, loss_fn: Callable) -> tuple[Callable, Any]:
  """``(loss(params, example), params)``: ``loss_fn(model, example)`` as a pure function of the
  model's ``nnx.Param`` state (cached per loss and structure when there is no other state).

  Args:
    model: the ``nnx.Module``.
    loss_fn: ``loss_fn(model, example) -> scalar``.

  Returns:
    ``(loss, params)``: the pure loss and the model's ``nnx.Param`` state.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if not jax.tree.leaves(rest):
    return _cached_params_loss(loss_fn, graphdef), params
  return _cached_params_loss.__wrapped__(loss_fn, graphdef, rest), params  # rest: unhashable


def fit_model(algorithm: str, config: Mapping | Any, model: nnx.Module, loss_fn: Callable,
              data: UserData, key: jax.Array, *,
              constants: ProblemConstants | dict | None = None,
              mesh: jax.sharding.Mesh | None = None,
              callback: Callable | None = None) -> Result:
  """Runs ``algorithm`` (:func:`dpsco_jax.fit`) on the model's ``nnx.Param`` state and writes
  the released parameters into ``model``; the Result's ``params`` is the released ``nnx.State``.

  Args:
    algorithm: a registered algorithm name.
    config: the algorithm's keys (a mapping or its config dataclass).
    model: the ``nnx.Module`` (updated in place with the released params).
    loss_fn: ``loss_fn(model, example) -> scalar`` for one item.
    data: the user-keyed data.
    key: the run's JAX PRNG key.
    constants: the declared constants of the loss class (see :func:`dpsco_jax.plan`).
    mesh: a device mesh with a ``"users"`` axis (see :func:`dpsco_jax.run`).
    callback: called with a :class:`~dpsco_jax.api.Progress` during the run.

  Returns:
    The :class:`~dpsco_jax.Result`.

  Raises:
    TypeError: ``model`` is not an ``nnx.Module``; as :func:`dpsco_jax.fit`.
    ConfigError: an unknown algorithm or a bad config key (named in the message).
    ValueError: as :func:`dpsco_jax.fit`.
    NonFiniteRelease: the released params hold NaN or infinity.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}")
  loss, params = params_loss(model, loss_fn)
  result = fit(algorithm, config, loss, params, data, key, constants=constants, mesh=mesh,
               callback=callback)
  nnx.update(model, result.params)
  return result
