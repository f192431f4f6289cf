"""Host-side Poisson sampling of users and gathering of their padded batch.

For data kept off the device (in memory or a memory map, :meth:`dpsco_jax.data.UserData.open`):
each step samples users on the host in ``O(q n)`` expected work and gathers only their rows.
:class:`PoissonSampler` includes user ``i`` in step ``t``'s sample with probability ``q``,
independently of the other users and steps, the law the accountant assumes (exact up to numpy's
double-precision geometric sampler); its Geometric(``q``) gaps do not depend on ``n``, so
removing the last user leaves every other user's inclusion unchanged. Truncation is the device
sampler's: beyond ``capacity`` the lowest indices are kept; its probability is what the plan
adds to delta.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Iterator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax.data.user_data import UserData

__all__ = ["PoissonSampler", "poisson_indices", "gather_batch", "take_users", "iter_batches"]

_TAG = 0x5D5C0A11   # separates these generators' seeds from any other use of the same seed
VIEWS = ("user", "item", "item_rows")


def poisson_indices(rng: np.random.Generator, n: int, q: float) -> np.ndarray:
  """Sorted indices of a Bernoulli(``q``) subset of ``range(n)``, ``O(q n)`` expected work.

  I.i.d. Geometric(``q``) gaps, drawn in blocks: the sequence (hence the subset of the first
  ``n - 1`` indices) does not depend on ``n``.
  """
  if q >= 1.0:
    return np.arange(n, dtype=np.int64)
  if q <= 0.0 or n == 0:
    return np.empty(0, np.int64)
  mean = q * n
  block = int(mean + 4.0 * math.sqrt(mean) + 16)
  parts, last = [], -1
  while True:
    pos = last + np.cumsum(rng.geometric(q, block))
    if pos[-1] >= n:
      parts.append(pos[:np.searchsorted(pos, n)])
      return np.concatenate(parts) if len(parts) > 1 else parts[0]
    parts.append(pos)
    last = int(pos[-1])


def _seed_words(seed: int | jax.Array) -> tuple[int, ...]:
  """32-bit words of an int seed or a JAX key (the leading word tells the kinds apart)."""
  if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
    seed = int(seed)
    if not 0 <= seed < 2**64:
      raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return (0, seed & 0xFFFFFFFF, seed >> 32)
  if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
    seed = jax.random.key_data(seed)
  words = np.asarray(seed)
  if words.dtype != np.uint32 or words.ndim != 1:
    raise TypeError("seed must be a non-negative int or a single JAX PRNG key, got "
                    f"{type(seed).__name__} {getattr(seed, 'shape', '')}")
  return (1, words.size, *(int(w) for w in words))


class PoissonSampler:
  """Poisson sampling of ``n_users`` users at rate ``rate``, one independent draw per step.

  Args:
    n_users: users in the data (the sampled indices are ``< n_users``).
    rate: the sampling rate ``q`` in ``(0, 1]`` (the plan's public ``sampling_rate``).
    capacity: the static slot count of a batch (the plan's ``capacity``).
    seed: an int or a JAX PRNG key; step ``t`` uses a generator seeded by ``(seed, t)``, so
      every step's draw is fresh and the same seed replays the same samples.

  Raises:
    ValueError, TypeError: ``n_users`` or ``capacity`` not an int >= 1, ``rate`` not in
      ``(0, 1]``, ``seed`` neither an int in ``[0, 2**64)`` nor a single JAX PRNG key.
  """

  def __init__(self, n_users: int, rate: float, *, capacity: int,
               seed: int | jax.Array = 0):
    if isinstance(n_users, bool) or not isinstance(n_users, (int, np.integer)) or n_users < 1:
      raise ValueError(f"n_users must be an int >= 1, got {n_users!r}")
    if not (isinstance(rate, (int, float, np.floating)) and 0.0 < float(rate) <= 1.0):
      raise ValueError(f"rate must be a probability in (0, 1], got {rate!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) \
        or capacity < 1:
      raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    self.n_users, self.rate, self.capacity = int(n_users), float(rate), int(capacity)
    self._words = _seed_words(seed)

  def generator(self, step: int) -> np.random.Generator:
    """The generator of step ``step``.

    Args:
      step: the step index, an int in ``[0, 2**64)`` (else ValueError).

    Returns:
      A numpy ``Generator`` seeded by ``(seed, step)``.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) \
        or not 0 <= step < 2**64:
      raise ValueError(f"step must be an int in [0, 2**64), got {step!r}")
    step = int(step)
    entropy = [_TAG, *self._words, step & 0xFFFFFFFF, step >> 32]
    return np.random.default_rng(np.random.SeedSequence(entropy))

  def sample(self, step: int) -> np.ndarray:
    """Step ``step``'s sampled users, untruncated.

    Args:
      step: the step index (as :meth:`generator`).

    Returns:
      Sorted int64 indices, each user independently with probability ``rate``.
    """
    return poisson_indices(self.generator(step), self.n_users, self.rate)

  def __call__(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """``(idx, mask)`` of step ``step``, both ``[capacity]``: the sampled users (truncated to
    the ``capacity`` lowest indices), padded with index 0 and mask False."""
    chosen = self.sample(step)[:self.capacity]
    idx = np.zeros(self.capacity, np.int64)
    idx[:chosen.size] = chosen
    return idx, np.arange(self.capacity) < chosen.size


def take_users(tree: Any, idx: np.ndarray) -> Any:
  """``leaf[idx]`` for every leaf: reads only the rows of ``idx``."""
  return jax.tree.map(lambda x: np.asarray(np.take(x, idx, axis=0)), tree)


def _rows(data: UserData, view: str) -> int:
  """The rows a sampler draws from: users, or the ``U m`` item slots for ``"item_rows"``."""
  return data.n_users * (data.max_items_per_user if view == "item_rows" else 1)


def gather_batch(data: UserData, idx: np.ndarray, mask: np.ndarray, *,
                 view: str = "user") -> dict:
  """The host batch of users ``idx`` (a ``[capacity]`` sampler output with its ``mask``).

  Row ``i`` equals row ``idx[i]`` of ``data.user_view()`` (``view="user"``) or
  ``data.item_view()`` (``"item"``) where ``mask[i]``, with weight 0 elsewhere.
  ``view="item_rows"`` (item-level DP-SGD): ``idx`` indexes the ``U m`` item slots (slot ``r``
  is item ``r % m`` of user ``r // m``), giving leaves ``[capacity, 1, ...]``.

  Args:
    data: the users' data (in memory or memory-mapped).
    idx: ``[capacity]`` int indices (users, or item slots for ``"item_rows"``).
    mask: ``[capacity]`` bool, True where ``idx`` holds a sampled row.
    view: ``"user"`` (default), ``"item"`` or ``"item_rows"``.

  Returns:
    ``{"example": leaves [capacity, m, ...], "weight": float32 [capacity, m]}``.

  Raises:
    ValueError, IndexError: an unknown ``view``; ``idx`` and ``mask`` not both
      ``[capacity]``; an index outside the data's rows.
  """
  if view not in VIEWS:
    raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
  idx, mask = np.asarray(idx), np.asarray(mask, bool)
  if idx.shape != mask.shape or idx.ndim != 1:
    raise ValueError(f"idx and mask must both be [capacity], got {idx.shape}, {mask.shape}")
  rows = _rows(data, view)
  if idx.size and (idx.min() < 0 or idx.max() >= rows):
    raise IndexError(f"{'item slot' if view == 'item_rows' else 'user'} indices must be in "
                     f"[0, {rows})")
  if view == "item_rows":
    u, slot = np.divmod(idx, data.max_items_per_user)
    weight = data.item_mask[u, slot].astype(np.float32)[:, None]
    weight[~mask] = 0.0
    return {"example": jax.tree.map(lambda x: np.asarray(x[u, slot])[:, None], data.examples),
            "weight": weight}
  items = data.item_mask[idx]
  if view == "user":
    # The same float64 expression as user_view, so the weights agree bit for bit.
    weight = (items * (data.max_items_per_user / data.n_items[idx][:, None])).astype(np.float32)
  else:
    weight = items.astype(np.float32)
  weight[~mask] = 0.0
  return {"example": take_users(data.examples, idx), "weight": weight}


def iter_batches(data: UserData, sampler: PoissonSampler, steps: int, *, view: str = "user",
                 start: int = 0, put: Callable[[Any], Any] = jax.device_put
                 ) -> Iterator[tuple[int, Any, Any]]:
  """``(t, batch, mask)`` for ``t = start, ..., start + steps - 1``, moved to the device by
  ``put``; step ``t + 1`` is gathered in a background thread meanwhile.

  Args:
    data: the users' data.
    sampler: the Poisson sampler, for ``data``'s rows (users, or ``U m`` item slots for
      ``view="item_rows"``).
    steps: the number of steps to yield.
    view: ``"user"`` (default), ``"item"`` or ``"item_rows"`` (see :func:`gather_batch`).
    start: the first step index (default 0; e.g. when resuming).
    put: moves a host batch to the device (default ``jax.device_put``).

  Yields:
    ``(t, batch, mask)``: the step index, the batch of :func:`gather_batch` and the
    ``[capacity]`` mask, both passed through ``put``.

  Raises:
    ValueError: the sampler is not for ``data``'s row count; as :func:`gather_batch`.
  """
  rows = _rows(data, view)
  if sampler.n_users != rows:
    raise ValueError(f"the sampler is for {sampler.n_users} rows, the data has {rows} "
                     f"({view} rows)")

  def host(t):
    idx, mask = sampler(t)
    return gather_batch(data, idx, mask, view=view), mask

  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    pending = pool.submit(host, start) if steps > 0 else None
    for t in range(start, start + steps):
      batch, mask = pending.result()
      if t + 1 < start + steps:
        pending = pool.submit(host, t + 1)
      yield t, put(batch), put(mask)
