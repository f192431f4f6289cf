"""Canary audit of a plan fact read off the private data: item-level DP-SGD's ``m`` (issue 23.1).

``dp_sgd_item`` under ``add_remove`` with Poisson sampling divides the clipped sum by the
declared expected batch ``D = q * n_users * m`` and adds noise ``z C / D``: ``m`` (items per
user) is part of the public denominator. Before issue 23 a ``UserData`` built without
``max_items_per_user`` *measured* ``m`` as the largest user's item count, so one added item
(a user's second one) doubled ``D`` and halved the noise; the outside audit measured
``eps >= 8.11`` against a claimed 2.0. :func:`dpsco_jax.plan` now refuses a measured ``m``
for every algorithm that reads it (``api.READS_M``).

The audit: ``n`` users of one item each, all with zero gradient (the linear loss ``<x, w>``
with ``x = 0``), plus a canary item ``x = 10 C e_0`` (clipped to ``C e_0``) that is user 0's
second item. ``D`` has it, ``D'`` (add/remove) does not.

* honest: ``m = 2`` is *declared*; ``D'`` keeps user 0's second slot as a zero row, which is
  what a removed item is to a sum (the padding of :class:`~dpsco_jax.data.UserData` has
  weight 0). The plan is the same on both sides: only the canary's ``C e_0`` moves.
* ``measured_m`` (broken twin): the plan's ``m`` is read off each dataset (2 with the
  canary, 1 without): the noise std differs by 2x between neighbours.

Score: ``-|release . e_0|`` (a small release is canary-like): the twin's noise on ``D`` is
half of ``D'``'s, which a magnitude test sees at once; for the honest mechanism the two sides
are Gaussians of one scale and the test has no more power than the claim allows. Claim: the
driver's own ``Result.privacy.epsilon``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax.audit.drivers import linear_problem
from dpsco_jax.audit.harness import AuditSpec
from dpsco_jax.audit.mechanisms import DELTA, check_broken

__all__ = ["item_count_driver", "TWINS"]

TWINS = ("measured_m",)
_CLIP = 1.0
_CANARY = 10.0


def _items(n: int, with_canary: bool, m: int, dim: int) -> np.ndarray:
  """``[n, m, dim]``: every user's first item is 0; user 0's second slot holds the canary."""
  x = np.zeros((n, m, dim), np.float32)
  if with_canary:
    x[0, 1, 0] = _CANARY * _CLIP
  return x


def _abs_e0(releases) -> jax.Array:
  (leaf,) = jax.tree.leaves(releases)
  return -jnp.abs(jnp.sum(leaf[..., 0]))


def item_count_driver(relation: str = "add_remove", broken: str | None = None, *,
                      users: int = 20, dim: int = 2, noise_multiplier: float = 1.5,
                      sampling_rate: float = 0.5) -> AuditSpec:
  """``dp_sgd_item`` (Poisson, ``add_remove``) through ``baselines.dp_sgd_releases``; see the
  module docstring. ``broken="measured_m"``: the plan's ``m`` is the dataset's own."""
  from dpsco_jax.algorithms.dpsgd import driver as baselines
  from dpsco_jax.api import solve
  if relation != "add_remove":
    raise ValueError("relation: the item-count audit is an add_remove one (the relation under "
                     "which the item count is private)")
  check_broken(broken, TWINS, "item_count_driver")
  cfg = {"sampling": "poisson", "relation": "add_remove", "num_steps": 1, "delta": DELTA,
         "noise_multiplier": noise_multiplier, "clip_norm": _CLIP, "learning_rate": 0.1,
         "sampling_rate": sampling_rate, "n_users": users}
  x_in = _items(users, True, 2, dim)
  declared = linear_problem(x_in, radius=1.0)      # m = 2, declared for both sides
  claim = solve("dp_sgd_item", cfg, declared, jax.random.key(0)).privacy.epsilon
  if broken == "measured_m":  # the bug: D' is stored without the empty slot, m measured = 1
    x_out = x_in[:, :1].copy()
  else:
    x_out = _items(users, False, 2, dim)

  # the twin's plan per measured m (built outside the trace; m is the data's static shape)
  by_m = {m: linear_problem(np.zeros((users, m, dim), np.float32), radius=1.0) for m in (1, 2)}

  def release(key, data):
    problem = declared
    if broken == "measured_m":
      problem = by_m[jax.tree.leaves(data)[0].shape[1]]
    return baselines.dp_sgd_releases(problem, cfg, key, level="item", data=data)

  return AuditSpec(f"dp_sgd_item/poisson[{broken or 'declared_m'}]", relation, release,
                   {"x": jnp.asarray(x_in)}, {"x": jnp.asarray(x_out)}, _abs_e0, float(claim),
                   DELTA, f"dp_sgd_item(...).privacy.epsilon (z={noise_multiplier:g}, "
                   f"q={sampling_rate:g}, m=2 declared)")
