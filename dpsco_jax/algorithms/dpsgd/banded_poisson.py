"""The fixed-order samplers: cyclic batches (:func:`cyclic_slots`) and b-min-sep Poisson
sampling, the sampler of amplified banded MF noise.

Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization", Thm 4. The row slots
``0..n-1`` are split into ``b`` groups by a public partition drawn from the run's order key
alone (position ``i`` of a permutation in group ``i mod b``; the largest group has ``G =
ceil(n / b)`` rows). At step ``t`` group ``t mod b`` is active and each of its rows joins
independently with probability ``p`` (one Bernoulli draw of shape ``[G]`` from
``fold_in(sample_key, t)``): a row participates at most ``k = ceil(T / b)`` times, ``>= b``
steps apart. The included rows fill ``capacity`` static slots (the Poisson slot capacity at
``(G, p)``); the plan charges the truncation probability to delta, as plain Poisson does.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from dpsco_jax.algorithms.common import scan_slot_batches
from dpsco_jax.cache import bounded_cache

__all__ = ["cyclic_slots", "group_slots", "sample_group", "group_size", "banded_poisson_loop"]


def group_size(n: int, groups: int) -> int:
  """The largest group's size ``G = ceil(n / groups)`` (public: ``n`` and ``groups`` are)."""
  return -(-int(n) // int(groups))


def cyclic_slots(order_key: jax.Array, n: int, batch: int) -> tuple[jax.Array, jax.Array]:
  """The cyclic schedule: ``(slots [P B], real [P B])`` with ``P = ceil(n / B)``; step ``t``
  uses ``slots[(t mod P) B : (t mod P + 1) B]`` (masked where not ``real``). The order is a
  permutation drawn from ``order_key`` alone: public and data-independent."""
  periods = -(-n // batch)
  order = jax.random.permutation(order_key, n)
  slots = jnp.concatenate([order, jnp.zeros((periods * batch - n,), order.dtype)])
  return slots, jnp.arange(periods * batch) < n


def group_slots(order_key: jax.Array, n: int, groups: int) -> tuple[jax.Array, jax.Array]:
  """The public partition: ``(slots [groups, G], real [groups, G])``; row ``g`` lists the
  slots of group ``g`` (``real`` False on the padding of a group one row short). Drawn from
  ``order_key`` alone (the cyclic order of :func:`cyclic_slots`), so it does not depend on the
  data."""
  size = group_size(n, groups)
  slots, real = cyclic_slots(order_key, n, groups)
  # position i -> group i mod groups: the padding (the last positions) spreads over the
  # last groups, one each, so group sizes differ by at most one
  return slots.reshape(size, groups).T, real.reshape(size, groups).T


def sample_group(key: jax.Array, slots: jax.Array, real: jax.Array, t: jax.Array, *,
                 rate: float, capacity: int) -> tuple[jax.Array, jax.Array]:
  """Step ``t``'s rows: ``(idx [capacity], mask [capacity])``. Group ``t mod b`` is active;
  each of its real slots is included with probability ``rate`` (``key``: this step's key);
  included slots beyond ``capacity`` are dropped (the plan's truncation term)."""
  groups = slots.shape[0]
  g = t % groups
  row, live = slots[g], real[g]
  coins = jax.random.bernoulli(key, rate, row.shape) & live
  (pos,) = jnp.nonzero(coins, size=capacity, fill_value=0)
  return row[pos], jnp.arange(capacity) < jnp.sum(coins)


@bounded_cache(32)
def banded_poisson_loop(loss_fn: Callable, tx_factory: Callable, static: tuple, steps: int,
                        groups: int, rate: float, capacity: int,
                        record: Callable | None, report: int | None = None) -> Callable:
  """One jitted scan of ``steps`` b-min-sep Poisson steps (the body of
  :func:`~dpsco_jax.algorithms.common.run_chain`'s loop with this sampler). ``key`` is split
  into the order key (``fold_in(key, 0)``: the partition) and the sample key
  (``fold_in(key, 1)``; step ``t`` uses ``fold_in(sample_key, t)``): no key is used twice.
  ``report`` / ``tick``: a progress session's (:func:`~dpsco_jax.algorithms.common.
  progress_session`)."""

  @jax.jit
  def loop(params: Any, key: jax.Array, hparams: dict, data: Any, tick=None):
    n = jax.tree.leaves(data)[0].shape[0]
    slots, real = group_slots(jax.random.fold_in(key, 0), n, groups)
    sample_key = jax.random.fold_in(key, 1)
    tx = tx_factory(hparams, *static)
    return scan_slot_batches(
        loss_fn, tx, params, data,
        lambda t: sample_group(jax.random.fold_in(sample_key, t), slots, real, t, rate=rate,
                               capacity=capacity),
        steps, record, report, tick)

  return loop
