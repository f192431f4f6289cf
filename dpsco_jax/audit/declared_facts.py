"""Canary audit of a plan fact read off the private data: item-level DP-SGD's ``m``.

``dp_sgd_item`` (Poisson, ``add_remove``) divides by the declared ``D = q n_users m`` and adds
noise ``z C / D``, so ``m`` must be public (:func:`dpsco_jax.plan` refuses a measured one). The
canary is user 0's second item ``10 C e_0``, in ``D`` only. Honest: ``m = 2`` declared, ``D'``
keeps the slot as a zero row; twin ``measured_m``: ``m`` read off each dataset, so the noise
std differs by 2x between neighbours. Score: ``-|release . e_0|``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax.audit.canary import CANARY_NORM, CLIP, DELTA, check_broken
from dpsco_jax.audit.drivers import linear_problem
from dpsco_jax.audit.harness import AuditSpec
from dpsco_jax.audit.mechanisms import e0_sum

__all__ = ["item_count_driver", "TWINS"]

TWINS = ("measured_m",)


def _items(n: int, with_canary: bool, m: int, dim: int) -> np.ndarray:
  x = np.zeros((n, m, dim), np.float32)
  if with_canary:
    x[0, 1, 0] = CANARY_NORM * CLIP
  return x


def item_count_driver(relation: str = "add_remove", broken: str | None = None, *,
                      users: int = 20, dim: int = 2, noise_multiplier: float = 1.5,
                      sampling_rate: float = 0.5) -> AuditSpec:
  """``dp_sgd_item`` (Poisson, ``add_remove``) through ``dp_sgd_releases``; the twin
  ``measured_m`` reads the plan's ``m`` off each dataset."""
  from dpsco_jax.algorithms.dpsgd import driver as baselines
  from dpsco_jax.api import solve
  if relation != "add_remove":
    raise ValueError("relation: the item-count audit is an add_remove one (the relation under "
                     "which the item count is private)")
  check_broken(broken, TWINS, "item_count_driver")
  cfg = {"sampling": "poisson", "relation": "add_remove", "num_steps": 1, "delta": DELTA,
         "noise_multiplier": noise_multiplier, "clip_norm": CLIP, "learning_rate": 0.1,
         "sampling_rate": sampling_rate, "n_users": users}
  x_in = _items(users, True, 2, dim)
  declared = linear_problem(x_in, radius=1.0)      # m = 2, declared for both sides
  claim = solve("dp_sgd_item", cfg, declared, jax.random.key(0)).privacy.epsilon
  if broken == "measured_m":  # the bug: D' is stored without the empty slot, m measured = 1
    x_out = x_in[:, :1].copy()
  else:
    x_out = _items(users, False, 2, dim)

  # the twin's problem per measured m (m is the data's static shape)
  by_m = {m: linear_problem(np.zeros((users, m, dim), np.float32), radius=1.0) for m in (1, 2)}

  def release(key, data):
    problem = declared
    if broken == "measured_m":
      problem = by_m[jax.tree.leaves(data)[0].shape[1]]
    return baselines.dp_sgd_releases(problem, cfg, key, level="item", data=data)

  return AuditSpec(f"dp_sgd_item/poisson[{broken or 'declared_m'}]", relation, release,
                   {"x": jnp.asarray(x_in)}, {"x": jnp.asarray(x_out)},
                   lambda r: -jnp.abs(e0_sum(r)), float(claim), DELTA,
                   f"dp_sgd_item(...).privacy.epsilon (z={noise_multiplier:g}, "
                   f"q={sampling_rate:g}, m=2 declared)")
