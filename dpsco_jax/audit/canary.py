"""Canary users and the neighbouring datasets an audit compares.

A stage-level dataset is ``UserBatch(grads, mask)``: per-user gradients ``[U, d]`` and the
bool user mask ``[U]``, the canary in slot 0. The neighbour of ``D`` under each relation:

* ``add_remove``: the canary's slot masked out (static shapes; what is public is the padded
  size ``U``, never the realized count);
* ``replace_one``: the canary replaced by ``-g`` (the worst case for a linear score);
* ``zero_out``: the canary stays counted with a zero gradient (Kairouz et al. 2021).

The canary is a Dirac vector ``B e_j`` with ``B >> C``, so clipping decides how far it moves
the release.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["RELATIONS", "UserBatch", "dirac_canary", "neighbouring_pair", "check_relation",
           "check_broken"]

RELATIONS = ("add_remove", "replace_one", "zero_out")
DELTA = 1e-5     # the delta of every claim but those that say otherwise
CLIP = 1.0
CANARY_NORM = 10.0  # >> C: clipping, not the data, decides how far the canary moves things
HI = jax.lax.Precision.HIGHEST  # scores are sums of many terms: no TF32/bf16 passes


def check_relation(relation, allowed: tuple[str, ...] = RELATIONS, why: str = "") -> str:
  """``relation`` if it is one of ``allowed`` (TypeError: not a string; ValueError: unknown,
  or not allowed, the message ``relation: why``)."""
  if not isinstance(relation, str):
    raise TypeError(f"relation must be a string, got {type(relation).__name__}")
  if relation not in RELATIONS:
    raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
  if relation not in allowed:
    raise ValueError(f"relation: {why}")
  return relation


def check_broken(broken: str | None, allowed: tuple[str, ...], name: str = "") -> None:
  """ValueError unless ``broken`` is ``None`` (honest) or one of the audit's twins."""
  if broken is not None and broken not in allowed:
    where = f" for {name}" if name else ""
    raise ValueError(f"broken must be None or one of {allowed}{where}, got {broken!r}")


class UserBatch(NamedTuple):
  """Per-user gradients ``grads [U, ...]`` and the real-user mask ``mask`` (bool ``[U]``).

  Attributes:
    grads: per-user gradients ``[U, ...]``.
    mask: bool ``[U]``, True for real users.
  """
  grads: jax.Array
  mask: jax.Array


def dirac_canary(dim: int, norm: float, index: int = 0) -> jax.Array:
  """``norm * e_index`` in ``R^dim`` (float32).

  Args:
    dim: the dimension, an int >= 1.
    norm: the canary's norm.
    index: the nonzero coordinate (default 0).

  Returns:
    The ``[dim]`` canary.

  Raises:
    ValueError: ``dim`` is not an int >= 1 or ``index`` not in ``[0, dim)``.
  """
  if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
    raise ValueError(f"dim must be an int >= 1, got {dim!r}")
  if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < dim:
    raise ValueError(f"index must be an int in [0, {dim}), got {index!r}")
  return jnp.zeros((dim,), jnp.float32).at[index].set(float(norm))


def neighbouring_pair(background: jax.Array, canary: jax.Array, relation: str
                      ) -> tuple[UserBatch, UserBatch]:
  """``(D, D')``: the canary in slot 0 then the ``background`` users, and its neighbour.

  Args:
    background: the other users' gradients ``[n, ...]``.
    canary: the canary's gradient.
    relation: ``add_remove``, ``replace_one`` or ``zero_out``.

  Returns:
    ``(D, D')``, two :class:`UserBatch` of ``n + 1`` slots.

  Raises:
    ValueError: an unknown relation, or a canary whose shape is not a background user's.
  """
  check_relation(relation)
  background = jnp.asarray(background, jnp.float32)
  canary = jnp.asarray(canary, jnp.float32)
  if background.shape[1:] != canary.shape:
    raise ValueError(f"canary shape {canary.shape} does not match the background users' "
                     f"{background.shape[1:]}")
  n = background.shape[0] + 1
  grads_in = jnp.concatenate([canary[None], background], axis=0)
  mask_in = jnp.ones((n,), bool)
  if relation == "add_remove":
    out = UserBatch(grads_in, mask_in.at[0].set(False))
  elif relation == "replace_one":
    out = UserBatch(grads_in.at[0].set(-canary), mask_in)
  else:
    out = UserBatch(grads_in.at[0].set(jnp.zeros_like(canary)), mask_in)
  return UserBatch(grads_in, mask_in), out
