"""Your loss, your parameters, your users: the problem object every algorithm driver reads.

:class:`UserDataProblem` gives the drivers ``loss_fn(w, example)``, ``data``,
``init_params()``, ``n_users``, ``m``, ``d`` and the constants ``lipschitz``, ``smoothness``,
``radius`` and ``meta["strong_convexity"]`` for any ``loss_fn(params, example) -> scalar``, any
params pytree and a :class:`UserData`:

* the params pytree is raveled to one vector ``w`` so the papers' vector algorithms apply
  unchanged; :meth:`UserDataProblem.unflatten` turns a released vector back into your pytree;
* the data is the user view (per-user gradients are means over each user's real items) or,
  for item-level algorithms, the item view;
* constants are what you declare in :class:`ProblemConstants`: public facts about the *loss
  class*, never estimated from the data. One an algorithm needs but you did not declare raises
  :class:`MissingConstant` when first read. The radius defaults to ``inf`` (no projection).

There is no known optimum: runs report privacy and your own metrics, not excess risk.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from dpsco_jax.cache import bounded_cache
from dpsco_jax.config.types import ConfigError
from dpsco_jax.data.user_data import DataSpec, UserData, require_numeric, weighted_loss

__all__ = ["ProblemConstants", "MissingConstant", "PublicFacts", "UserDataProblem",
           "as_constants"]

LEVELS = ("user", "item")


class MissingConstant(ConfigError):
  """An algorithm needs a constant of the loss class that was not declared (the message says
  which and how to declare it)."""


@dataclasses.dataclass(frozen=True)
class ProblemConstants:
  """Public constants of the loss class (declared, never estimated from the data).

  Attributes:
    lipschitz: L, a bound on every item's gradient norm over the domain (clipping at
      ``clip_norm`` makes the clipped per-user gradient ``clip_norm``-bounded whatever L is).
    smoothness: beta, the gradient's Lipschitz constant.
    radius: R, the radius of the constraint ball around 0 (``inf``: unconstrained).
    strong_convexity: mu (strongly convex methods: paper 001, dp_loc_gd).

  Raises:
    TypeError, ValueError: a constant is not a number > 0.
  """
  lipschitz: float | None = None
  smoothness: float | None = None
  radius: float = math.inf
  strong_convexity: float | None = None

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if v is None:
        continue
      if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"constants.{f.name} must be a number, got {v!r}")
      if not v > 0:
        raise ValueError(f"constants.{f.name} must be > 0, got {v!r}")


_DOC = {"lipschitz": "L (Lipschitz constant of the loss)",
        "smoothness": "beta (smoothness of the loss)",
        "strong_convexity": "mu (strong convexity of the loss)"}


@bounded_cache(64)
def _flat_loss(loss_fn: Callable, treedef: Any, shapes: tuple) -> Callable:
  """``loss_fn`` on the raveled vector, cached so compiled loops are reused."""
  zeros = jax.tree.unflatten(treedef, [jnp.zeros(s, d) for s, d in shapes])
  _, unravel = ravel_pytree(zeros)
  return weighted_loss(lambda w, ex: loss_fn(unravel(w), ex))


class PublicFacts:
  """What a data-free plan may read: sizes and the declared constants, never the data.

  ``lipschitz`` / ``smoothness`` raise :class:`MissingConstant` when read undeclared.
  ``constants_declared`` is True: the constants are the user's unverifiable declaration, so an
  algorithm whose sensitivity rests on one it does not enforce reports provenance
  ``declared``.

  Args:
    spec: the data's public facts (users ``n_users``, items per user ``m``).
    constants: the declared constants (:class:`ProblemConstants` or a dict of its fields;
      ``None``: none).
    d: the number of parameters.
    level: ``"user"`` (default) or ``"item"``.

  Raises:
    ValueError, TypeError: an unknown ``level``; ``constants`` of another type.
  """

  constants_declared = True

  def __init__(self, spec: DataSpec, constants: ProblemConstants | dict | None, d: int,
               level: str = "user"):
    if level not in LEVELS:
      raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    self.constants = as_constants(constants)
    self.n_users, self.m, self.d, self.level = (int(spec.n_users),
                                                int(spec.max_items_per_user), int(d), level)
    self.meta = ({} if self.constants.strong_convexity is None
                 else {"strong_convexity": self.constants.strong_convexity})

  # read lazily: an algorithm that does not need a constant does not require it
  def _const(self, name: str) -> float:
    value = getattr(self.constants, name)
    if value is None:
      raise MissingConstant(f"this algorithm needs {_DOC[name]}: declare it with "
                            f"constants={{'{name}': ...}} (or give the config key that "
                            "replaces it, e.g. clip_norm for L)")
    return float(value)

  @property
  def lipschitz(self) -> float:
    return self._const("lipschitz")

  @property
  def smoothness(self) -> float:
    return self._const("smoothness")

  @property
  def radius(self) -> float:
    return float(self.constants.radius)


def as_constants(constants: ProblemConstants | dict | None) -> ProblemConstants:
  if constants is None:
    return ProblemConstants()
  if isinstance(constants, dict):
    return ProblemConstants(**constants)
  if not isinstance(constants, ProblemConstants):
    raise TypeError("constants must be a ProblemConstants or a dict of its fields, got "
                    f"{type(constants).__name__}")
  return constants


class UserDataProblem(PublicFacts):
  """A problem built from your ``loss_fn``, ``params`` and :class:`UserData`.

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for one item (``example`` has your
      item's structure).
    params: the initial parameters (any pytree of float arrays).
    data: the users' data.
    level: ``"user"`` (each user's mean over its real items) or ``"item"`` (every item).
    constants: :class:`ProblemConstants` (or a dict of its fields).

  Raises:
    TypeError: ``loss_fn`` is not callable, ``data`` is not a ``UserData`` or ``params`` is not
      a non-empty pytree of floating-point arrays.
    ValueError: ``loss_fn`` does not return a scalar for one item.
  """

  name = "user_data"

  def __init__(self, loss_fn: Callable, params: Any, data: UserData, *, level: str = "user",
               constants: ProblemConstants | dict | None = None):
    if not callable(loss_fn):
      raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(data, UserData):
      raise TypeError("data must be a dpsco_jax.UserData (UserData.from_arrays / from_table), "
                      f"got {type(data).__name__}")
    leaves, treedef = jax.tree.flatten(params)
    if not leaves or not all(jnp.issubdtype(jnp.result_type(x), jnp.floating) for x in leaves):
      raise TypeError("params must be a non-empty pytree of floating-point arrays")
    shapes = tuple((tuple(jnp.shape(x)), jnp.result_type(x)) for x in leaves)
    require_numeric(data.examples)
    self._w0, self._unravel = ravel_pytree(params)
    super().__init__(data.spec, constants, int(self._w0.size), level)
    self.loss_fn = _flat_loss(loss_fn, treedef, shapes)
    self.user_data = data
    self._data = None   # the device copy, built on first read: a streamed run never reads it
    # the loss must give one scalar per item (checked before the first step)
    first = jax.tree.map(lambda x: jnp.asarray(x[0, 0]), self.user_data.examples)
    out = jax.eval_shape(loss_fn, params, first)
    if getattr(out, "shape", None) != ():
      raise ValueError(f"loss_fn must return a scalar per item, got shape {out.shape}: "
                       "reduce it (e.g. jnp.sum or jnp.mean over its outputs)")

  @property
  def data(self) -> dict:
    """The whole table on the device (the user or item view), built on first read."""
    if self._data is None:
      self._data = (self.user_data.user_view() if self.level == "user"
                    else self.user_data.item_view())
    return self._data

  @data.setter
  def data(self, value: dict) -> None:
    self._data = value

  def init_params(self) -> jax.Array:
    """The initial parameters, raveled.

    Returns:
      ``params`` as one float vector of length ``d``.
    """
    return self._w0

  def unflatten(self, w: jax.Array) -> Any:
    """A released vector as your params pytree.

    Args:
      w: a vector of length ``d`` (e.g. ``Result.params`` of a driver).

    Returns:
      ``w`` with the structure, shapes and dtypes of the initial params.
    """
    return self._unravel(w)

  def describe(self) -> dict:
    """The problem's public sizes, for records.

    Returns:
      ``{"problem", "n_users", "m", "d", "level"}``.
    """
    return {"problem": self.name, "n_users": self.n_users, "m": self.m, "d": self.d,
            "level": self.level}
