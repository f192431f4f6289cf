"""FILTER's pair counts in ``O(U log U + band)`` on concentrated data: a radial pre-decision
in front of :mod:`~dpsco_jax.transforms.filter_pairs`.

The triangle inequality on ``a_i = ||y_i - c||`` (any centre ``c``) decides most pairs
uncomputed: ``a_i + a_j <= r`` implies close, ``|a_i - a_j| > r`` far. Users sorted by ``a_i``,
binary searches give each row's columns certified close and far, and only the band between
is evaluated canonically; with too wide bands or a non-finite ``a_i`` the Gram path runs.
The counts are exactly the canonical ones: with the true ``a_i`` in ``[lb_i, ub_i]``, ``ub_i +
ub_j <= rho_close`` implies a canonical value ``<= T(r)`` and ``lb_i - ub_j > rho_far`` one
``> T(r)`` (``filter_pairs.certified_sq_bounds``); the centre only moves work."""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from dpsco_jax.transforms.clipping import num_user_slots
from dpsco_jax.transforms.filter_pairs import (PairGeometry, canonical_sq_distances,
                                               certified_sq_bounds, close_threshold,
                                               gram_close_pair_counts, median_centre,
                                               pair_geometry, pair_layout, pair_rows,
                                               rounding_gamma)

PyTree = Any

#: Sorted rows per block (the band is taken per block: a block's rows have nearly equal
#: ``a``, so their bands nearly coincide).
BAND_ROWS = 256
#: Columns per chunk of a block's band.
BAND_COLS = 512
#: The banded path is taken when its pair evaluations (blocks x chunks x rows x columns) are
#: at most this fraction of ``U^2``; above it the Gram path is cheaper (one matmul a block).
BAND_FRACTION = 0.25
#: Relative widening of every search bound (far above every rounding error here).
_REL = 1e-5


def _down(x: jax.Array) -> jax.Array:
  return x - (_REL * jnp.abs(x) + 1e-30)


def _up(x: jax.Array) -> jax.Array:
  return x + (_REL * jnp.abs(x) + 1e-30)


def _radial(rows: list[jax.Array], mask: jax.Array, geo: PairGeometry
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(a, ub, lb)``: computed distances to the centre and bounds on the true ones (4x the
  norm's ``gamma(D + 4)`` error; monotone in ``a``), ``+inf`` for padding (sorts last)."""
  centre = median_centre(rows, mask)
  sq = sum(jnp.sum(jnp.square(x - c[None, :]), axis=1) for x, c in zip(rows, centre))
  a = jnp.where(mask, jnp.sqrt(sq), jnp.inf)
  rel = 4.0 * rounding_gamma(geo.dim + 4)
  absl = 4.0 * math.sqrt(geo.dim) * 2.0 ** -60
  return a, a * (1.0 + rel) + absl, a * (1.0 - rel) - absl


def _radii(t: jax.Array, geo: PairGeometry) -> tuple[jax.Array, jax.Array]:
  """``(rho_close, rho_far)``: the square roots of the Gram path's certified bounds for ``t``."""
  q_close, q_far = certified_sq_bounds(t, geo)
  return _down(jnp.sqrt(jnp.maximum(q_close, 0.0))), _up(jnp.sqrt(jnp.maximum(q_far, 0.0)))


def _bands(ub_s: jax.Array, lb_s: jax.Array, thresholds, geo: PairGeometry
           ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
  """``(c1, lo, hi)`` per sorted row: per threshold ``c1`` (columns ``< c1`` certified close),
  and the band ``[lo, hi)`` outside which every column is certified."""
  c1, lo, hi = [], None, None
  for t in thresholds:
    rho_c, rho_f = _radii(t, geo)
    close = jnp.searchsorted(ub_s, _down(rho_c - ub_s), side="right")   # ub_i + ub_j <= rho_c
    far_lo = jnp.searchsorted(ub_s, _down(lb_s - rho_f), side="left")   # lb_i - ub_j > rho_f
    far_hi = jnp.searchsorted(lb_s, _up(ub_s + rho_f), side="right")    # lb_j - ub_i > rho_f
    lo_k = jnp.maximum(close, far_lo)
    c1.append(close.astype(jnp.int32))
    lo = lo_k if lo is None else jnp.minimum(lo, lo_k)
    hi = far_hi if hi is None else jnp.maximum(hi, far_hi)
  return c1, lo.astype(jnp.int32), jnp.maximum(hi, lo).astype(jnp.int32)


def _block_bands(lo: jax.Array, hi: jax.Array, real_s: jax.Array, rows: int
                 ) -> tuple[jax.Array, jax.Array]:
  """Per block of ``rows`` sorted rows: the union ``[lo, hi)`` of its real rows' bands."""
  nb = real_s.shape[0] // rows
  big = jnp.iinfo(jnp.int32).max
  blo = jnp.where(real_s, lo, big).reshape(nb, rows).min(axis=1)
  bhi = jnp.where(real_s, hi, 0).reshape(nb, rows).max(axis=1)
  return jnp.minimum(blo, bhi), bhi


#: Below this many user slots the Gram path alone runs.
BAND_MIN_USERS = 4096


def close_pair_counts(clean: PyTree, mask: jax.Array, radii: tuple[jax.Array, ...],
                      rows: NamedSharding | None = None) -> tuple[jax.Array, ...]:
  """The counts of :func:`filter_pairs.gram_close_pair_counts` (same decisions and layout), by
  radial bands (:func:`banded_close_counts`) on one device with ``BAND_MIN_USERS`` slots or
  more, else by the Gram path."""
  gram = lambda: gram_close_pair_counts(clean, mask, radii, rows=rows)
  u = num_user_slots(clean)
  if rows is not None or u < BAND_MIN_USERS:
    return gram()
  rs = [pair_rows(leaf) for leaf in jax.tree.leaves(clean)]
  geo = pair_geometry(rs)
  return banded_close_counts(rs, mask, tuple(close_threshold(r, geo) for r in radii), geo, gram,
                             pair_layout(u))


def banded_close_counts(rows: list[jax.Array], mask: jax.Array, thresholds: tuple,
                        geo: PairGeometry, fallback: Callable[[], tuple[jax.Array, ...]],
                        shape: tuple[int, int]) -> tuple[jax.Array, ...]:
  """The canonical close counts (per real row and threshold ``t``: ``#{j real: canonical
  d_ij <= t or j = i}``, ``int32`` of the padded ``shape``), by sorted radial bands when they
  are narrow and finite, else ``fallback()`` (one ``cond``: a cost, never a decision)."""
  u = mask.shape[0]
  r = min(BAND_ROWS, u)
  padded = -(-u // r) * r
  a, ub, lb = _radial(rows, mask, geo)
  order = jnp.argsort(a)
  ub_s, lb_s, real_s = ub[order], lb[order], mask[order]
  c1, lo, hi = _bands(ub_s, lb_s, thresholds, geo)
  pad = padded - u
  padi = lambda x, v: jnp.pad(x, (0, pad), constant_values=v)
  real_p = padi(real_s, False)
  c1 = [padi(c, 0) for c in c1]
  blo, bhi = _block_bands(padi(lo, 0), padi(hi, 0), real_p, r)
  c = min(BAND_COLS, u)
  chunks = (bhi - blo + c - 1) // c
  work = jnp.sum(chunks.astype(jnp.float32)) * float(r * c)
  finite = jnp.all(jnp.where(mask, jnp.isfinite(ub) & jnp.isfinite(lb), True))
  take = finite & (work <= BAND_FRACTION * float(u) * float(u))

  def banded():
    ys = [jnp.pad(x[order], ((0, pad), (0, 0))) for x in rows]       # sorted rows, padded
    ys_t = [x.T for x in ys]

    def block(args):
      b, lo, hi, n_chunks = args
      start = b * r
      brows = [jax.lax.dynamic_slice_in_dim(y, start, r) for y in ys]
      pos = start + jnp.arange(r)
      bc1 = [jax.lax.dynamic_slice_in_dim(x, start, r) for x in c1]

      def body(state):
        i, acc = state
        c0 = jnp.minimum(lo + i * c, padded - c)            # static width, clamped in range
        cols = c0 + jnp.arange(c)
        new = (cols >= lo + i * c) & (cols < hi)           # each band column counted once
        ok = new[None, :] & real_p[cols][None, :]
        d = canonical_sq_distances(brows, [jax.lax.dynamic_slice_in_dim(x, c0, c, axis=1)
                                           for x in ys_t])
        diag = cols[None, :] == pos[:, None]
        acc = tuple(s + jnp.sum(ok & (cols[None, :] >= k1[:, None]) & ((d <= t) | diag),
                                axis=1, dtype=jnp.int32)
                    for s, k1, t in zip(acc, bc1, thresholds))
        return i + 1, acc

      zero = tuple(jnp.zeros((r,), jnp.int32) for _ in thresholds)
      _, acc = jax.lax.while_loop(lambda st: st[0] < n_chunks, body, (0, zero))
      return acc

    per = jax.lax.map(block, (jnp.arange(padded // r), blo, bhi, chunks))
    out = []
    for k, counts in enumerate(per):
      counts = counts.reshape(-1) + c1[k]
      counts = jnp.where(real_p, counts, 0)[:u]
      unsorted = jnp.zeros((u,), jnp.int32).at[order].set(counts)
      out.append(jnp.pad(unsorted, (0, shape[0] * shape[1] - u)).reshape(shape))
    return tuple(out)

  return jax.lax.cond(take, banded, fallback)
