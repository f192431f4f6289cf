"""DPTrainer's contracts on the user's data and loss (checked before any step)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dpsco_jax.flax.fast_clip import FastClippedGrad, LossFn

PyTree = Any


def from_user_data(loss_fn: LossFn, data: Any, level: str) -> tuple[LossFn, PyTree]:
  """A :class:`~dpsco_jax.data.UserData` as the arrays a step reads: its weighted user view
  (a user's gradient is the mean over its real items; padding weighs 0) or its real items."""
  from dpsco_jax.data.user_data import UserData, require_numeric, weighted_loss
  require_numeric(data.examples if isinstance(data, UserData) else data)
  if not isinstance(data, UserData):
    return loss_fn, data
  if level == "user":
    return weighted_loss(loss_fn), data.user_view()
  data.require_all_items("DPTrainer(level='item')")
  return loss_fn, jax.tree.map(jnp.asarray, data.items())


def check_data(clipper: FastClippedGrad, data: PyTree, level: str) -> int:
  """``n`` after checking the layout and that ``loss_fn`` gives one float scalar per item."""
  leaves = jax.tree.leaves(data)
  if not leaves or any(not hasattr(x, "shape") for x in leaves):
    raise ValueError("data must be a pytree of arrays with a leading user/item axis")
  n = int(leaves[0].shape[0]) if leaves[0].ndim else 0
  shapes = [tuple(x.shape) for x in leaves]
  if n < 1 or any(x.ndim < 1 or int(x.shape[0]) != n for x in leaves):
    raise ValueError(f"data leaves must share a non-empty leading axis, got shapes {shapes}")
  if level == "user":
    if any(x.ndim < 2 for x in leaves) or len({int(x.shape[1]) for x in leaves}) != 1:
      raise ValueError(f"level='user' reads data leaves as [n_users, m, ...] with one m; got "
                       f"shapes {shapes} (item-shaped data [n, ...] needs level='item')")
  lead, layout = (2, "[n_users, m, ...]") if level == "user" else (1, "[n_items, ...]")
  example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[lead:], x.dtype), data)
  hint = (f"with level={level!r} (data {shapes} read as {layout}; if the data is laid out "
          f"otherwise use level={'user' if level == 'item' else 'item'!r})")
  try:
    out = jax.eval_shape(clipper.model_loss, clipper.params, example)
  except Exception as err:  # the user's code failed on the shape we would give it
    raise ValueError(f"loss_fn failed on one item {jax.tree.map(lambda s: s.shape, example)} "
                     f"{hint}: {err}") from err
  if not hasattr(out, "shape") or out.shape != () or not jnp.issubdtype(out.dtype,
                                                                        jnp.floating):
    raise ValueError(f"loss_fn must return one float scalar per item, got "
                     f"{getattr(out, 'shape', out)} {getattr(out, 'dtype', '')} {hint}")
  return n
