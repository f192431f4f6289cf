"""FILTER's pair counts: which users lie within a radius of which (the ``O(U^2 D)`` part of
:func:`~dpsco_jax.transforms.filtering.filter_points`, which owns the privacy argument).

Every pair's decision is defined by ONE canonical, difference-first value ``sum_k (y_ik -
y_jk)^2`` (fixed elementwise order: a function of rows i and j alone, symmetric, within ``(D +
3) 2^-23`` relative whatever the offset) against ``T(r) = r^2 (1 - 2 gamma) - slack``, so
"close" implies ``||y_i - y_j|| <= r`` exactly; a float32 Gram form ``|a|^2 + |b|^2 - 2<a, b>``
would let a large common offset make a far user look close. For speed, the Gram form on
centred rows, with a rigorous error bound, decides only the pairs it certifies to agree; the
rest are computed canonically. Whatever the centre, tiling or device split, the decisions are
the canonical ones (assumed: one elementwise float expression evaluates the same everywhere).
:mod:`~dpsco_jax.transforms.filter_bands` certifies pairs with the same constants.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dpsco_jax.transforms.clipping import num_user_slots
from dpsco_jax.transforms.noise import noise_dtype

PyTree = Any

_HI = jax.lax.Precision.HIGHEST


def pair_rows(x: jax.Array) -> jax.Array:
  """Flattened rows in float32 or wider (distances decide membership: never in bf16)."""
  return jnp.reshape(x, (x.shape[0], -1)).astype(noise_dtype(x.dtype))


# Error model: each float op errs by at most _UNIT relative.
_UNIT = 2.0 ** -23   # twice the float32 unit roundoff: headroom as in flax/fast_clip_norms.py
_ABS = 2.0 ** -120   # per-operation absolute slack (gradual underflow / flush to zero)
_CANON_ROWS = 128    # rows per canonical resolution step
_CANON_PAIRS = 128   # undecided pairs per row gathered in one step
_PAIRS_FROM_DIM = 256   # below this many coordinates undecided rows are recounted whole
_ROW_TERMS_PER_SLAB_PASS = 8   # whole-row recounts while they cost < 8 passes over the slab
_CENTRE_ROWS = 65    # rows sampled (evenly) for the centring median


def rounding_gamma(k: int) -> float:
  """``k u / (1 - k u)``: relative error of ``k`` chained float ops (any order; Higham)."""
  ku = float(k) * _UNIT
  return ku / (1.0 - ku) if ku < 0.5 else float("inf")


def canonical_sq_distances(rows: list[jax.Array], cols_t: list[jax.Array],
                           cols: jax.Array | None = None) -> jax.Array:
  """Canonical squared distances (module docstring) of ``rows[l]`` ``[M, d_l]`` against
  ``cols_t[l]`` ``[d_l, U]``: ``[M, U]``, or ``[M, P]`` for the pairs ``(i, cols[i, p])``."""
  acc = jnp.zeros((rows[0].shape[0], cols_t[0].shape[1]) if cols is None else cols.shape,
                  cols_t[0].dtype)
  for r, ct in zip(rows, cols_t):
    rt = r.T

    def body(k, acc, rt=rt, ct=ct):
      b = ct[k][None, :] if cols is None else ct[k][cols]
      diff = rt[k][:, None] - b
      return acc + diff * diff
    acc = jax.lax.fori_loop(0, ct.shape[0], body, acc, unroll=min(8, ct.shape[0]))
  return acc


class PairGeometry(NamedTuple):
  """Static error constants of one pytree layout."""
  dim: int          # all coordinates
  gamma_c: float    # canonical relative error
  abs_c: float      # canonical absolute slack
  gamma_g: float    # Gram error per unit of (|z_i|^2 + |z_j|^2)
  abs_g: float


def pair_geometry(rows: list[jax.Array]) -> PairGeometry:
  """The error constants of the rows' layout (``rows[l]``: ``[U, d_l]`` per leaf)."""
  dims = [x.shape[1] for x in rows]
  dim, dmax, leaves = sum(dims), max(dims), len(dims)
  # Gram error on centred rows, per unit of |z_i|^2 + |z_j|^2: ~(2 d + 2 L + 9) _UNIT;
  # 3 gamma(d + L + 8) exceeds it by >= 1.5x (which covers the bound's own rounding).
  return PairGeometry(dim=dim, gamma_c=rounding_gamma(dim + 3), abs_c=(3 * dim + 8) * _ABS,
                      gamma_g=3.0 * rounding_gamma(dmax + leaves + 8),
                      abs_g=8.0 * (dmax + leaves + 8) * _ABS)


def close_threshold(radius: jax.Array, geo: PairGeometry) -> jax.Array:
  """``T(r)``: a canonical value ``<= T`` certifies ``||y_i - y_j|| <= r``."""
  r = jnp.asarray(radius, jnp.float32)
  return (r * r) * (1.0 - 2.0 * geo.gamma_c - 4.0 * _UNIT) - 2.0 * geo.abs_c


def median_centre(rows: list[jax.Array], mask: jax.Array) -> list[jax.Array]:
  """Coordinate-wise median of an even sample of real rows (0 without any): speed only."""
  u = mask.shape[0]
  idx = np.unique(np.linspace(0, u - 1, min(u, _CENTRE_ROWS)).astype(np.int64))
  real = mask[idx][:, None]
  out = []
  for x in rows:
    c = jnp.nanmedian(jnp.where(real, x[idx], jnp.nan), axis=0)
    out.append(jnp.where(jnp.isfinite(c), c, 0.0))
  return out


class _Layout(NamedTuple):
  """What the per-block decisions read (rows padded to a multiple of the block); ``sum_l (up_i
  + up_j - 2 <z_i, z_j>)`` bounds the true squared distance from above (``dn``: below)."""
  rows: list[jax.Array]     # raw rows [U', d_l]
  cols_t: list[jax.Array]   # raw rows transposed [d_l, U]  (canonical columns)
  z: list[jax.Array]        # centred rows [U', d_l]
  up: list[jax.Array]       # [U'] per leaf
  dn: list[jax.Array]       # [U'] per leaf
  mask: jax.Array           # real users [U'] (False on the padding)


def _layout(clean: PyTree, mask: jax.Array, pad: int, geo: PairGeometry) -> _Layout:
  rows = [pair_rows(leaf) for leaf in jax.tree.leaves(clean)]
  centre = median_centre(rows, mask)
  z = [x - c[None, :] for x, c in zip(rows, centre)]
  sq = [jnp.sum(v * v, axis=1) for v in z]
  half = geo.gamma_g * sum(sq[1:], sq[0]) + 0.5 * geo.abs_g   # e_ij = half_i + half_j
  up, dn = [sq[0] + half] + sq[1:], [sq[0] - half] + sq[1:]
  cols_t = [x.T for x in rows]
  if pad:
    padr = lambda x: jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
    rows, z, up, dn, mask = ([padr(x) for x in rows], [padr(x) for x in z],
                             [padr(v) for v in up], [padr(v) for v in dn], padr(mask))
  return _Layout(rows, cols_t, z, up, dn, mask)


def _gram_dots(lay: _Layout, start, size: int, n: int) -> list[jax.Array]:
  """Per leaf ``2 <z_i, z_j>``, rows ``start..start+size`` against every row (HIGHEST)."""
  return [2.0 * jnp.matmul(jax.lax.dynamic_slice_in_dim(z, start, size), z[:n].T,
                           precision=_HI) for z in lay.z]


def _gram_bounds(lay: _Layout, dots: list[jax.Array], start, size: int, n: int
                 ) -> tuple[jax.Array, jax.Array]:
  """``[size, n]`` upper and lower bounds on the true squared distances."""
  hi = lo = jnp.zeros((size, n), lay.z[0].dtype)
  for dot2, up, dn in zip(dots, lay.up, lay.dn):
    upb = jax.lax.dynamic_slice_in_dim(up, start, size)
    dnb = jax.lax.dynamic_slice_in_dim(dn, start, size)
    hi = hi + (upb[:, None] + up[None, :n] - dot2)
    lo = lo + (dnb[:, None] + dn[None, :n] - dot2)
  return hi, lo


def certified_sq_bounds(t: jax.Array, geo: PairGeometry) -> tuple[jax.Array, jax.Array]:
  """``(q_close, q_far)`` for threshold ``t``: a true squared distance ``<= q_close`` has a
  canonical value ``<= t``, one ``> q_far`` a canonical value ``> t``."""
  slack = 2.0 * geo.gamma_c + 4.0 * _UNIT
  return t * (1.0 - slack) - geo.abs_c, t * (1.0 + slack) + geo.abs_c


def _certain(hi, lo, diag, t, geo: PairGeometry) -> tuple[jax.Array, jax.Array]:
  """``(close, maybe)``: certainly close, not certainly far (the diagonal: both)."""
  q_close, q_far = certified_sq_bounds(t, geo)
  close = (hi <= q_close) | diag
  maybe = ~(lo > q_far) | diag
  return close, maybe


def _recount_rows(lay: _Layout, thresholds, start, size: int, n: int, left: jax.Array,
                  counts: list[jax.Array]) -> list[jax.Array]:
  """Replaces the counts of the rows in ``left`` by their canonical counts."""
  m = min(_CANON_ROWS, size)
  cmask = lay.mask[:n]

  def body(state):
    *counts, left = state
    idx = jnp.nonzero(left, size=m, fill_value=size)[0]   # size: no row (dropped below)
    take = start + jnp.minimum(idx, size - 1)
    d = canonical_sq_distances([x[take] for x in lay.rows], lay.cols_t)
    ok = lay.mask[take][:, None] & cmask[None, :]
    diag = take[:, None] == jnp.arange(n)[None, :]
    counts = [c.at[idx].set(jnp.sum(ok & ((d <= t) | diag), axis=1, dtype=jnp.int32),
                            mode="drop") for c, t in zip(counts, thresholds)]
    return (*counts, left.at[idx].set(False, mode="drop"))

  *counts, _ = jax.lax.while_loop(lambda st: jnp.any(st[-1]), body, (*counts, left))
  return counts


def _resolve(lay: _Layout, thresholds, start, size: int, n: int, undecided: jax.Array,
             counts: list[jax.Array]) -> list[jax.Array]:
  """Adds the undecided pairs that are canonically close (gathered while few)."""
  p = min(_CANON_PAIRS, n)
  rows = start + jnp.arange(size)

  def body(state):
    *counts, rem = state

    def few(rem):
      cols = jax.vmap(lambda r: jnp.nonzero(r, size=p, fill_value=n)[0])(rem)
      d = canonical_sq_distances([x[rows] for x in lay.rows], lay.cols_t,
                                 jnp.minimum(cols, n - 1))
      adds = [jnp.sum((cols < n) & (d <= t), axis=1, dtype=jnp.int32) for t in thresholds]
      return adds, rem.at[jnp.arange(size)[:, None], cols].set(False, mode="drop")

    def every(rem):
      d = canonical_sq_distances([x[rows] for x in lay.rows], lay.cols_t)
      adds = [jnp.sum(rem & (d <= t), axis=1, dtype=jnp.int32) for t in thresholds]
      return adds, jnp.zeros_like(rem)

    adds, rem = jax.lax.cond(jnp.sum(rem) <= size * p // 4, few, every, rem)
    return (*[c + a for c, a in zip(counts, adds)], rem)

  *counts, _ = jax.lax.while_loop(lambda st: jnp.any(st[-1]), body, (*counts, undecided))
  return counts


def _block_counts(lay: _Layout, geo: PairGeometry, thresholds: tuple[jax.Array, ...], start,
                  size: int) -> tuple[jax.Array, ...]:
  """Per row ``start .. start+size`` and threshold: the number of real ``j`` canonically
  close to it (``int32 [size]``); undecided rows are recounted whole or pair by pair."""
  n = lay.cols_t[0].shape[1]
  rmask = jax.lax.dynamic_slice_in_dim(lay.mask, start, size)
  cmask = lay.mask[:n]
  dots = _gram_dots(lay, start, size, n)
  hi, lo = _gram_bounds(lay, dots, start, size, n)
  diag = (start + jnp.arange(size))[:, None] == jnp.arange(n)[None, :]
  flags = []
  for t in thresholds:
    close, maybe = _certain(hi, lo, diag, t, geo)
    flags += [(cmask[None, :] & close).astype(jnp.int32),
              (cmask[None, :] & maybe).astype(jnp.int32)]
  # one variadic reduction: every count in a single pass over the slab
  sums = jax.lax.reduce(tuple(flags), (np.int32(0),) * len(flags),
                        lambda a, b: tuple(x + y for x, y in zip(a, b)), (1,))
  counts = [jnp.where(rmask, c, 0) for c in sums[0::2]]
  left = rmask & functools.reduce(jnp.logical_or,
                                  [mb > c for c, mb in zip(sums[0::2], sums[1::2])])

  def by_rows(counts):   # recount the undecided rows whole, canonically
    return _recount_rows(lay, thresholds, start, size, n, left, counts)

  if geo.dim < _PAIRS_FROM_DIM:   # static: a whole row is cheap (and the usual case)
    return tuple(by_rows(counts))

  def by_pairs(counts):  # gather just the undecided pairs (never stored above)
    hi, lo = _gram_bounds(lay, dots, start, size, n)
    und = jnp.zeros((size, n), bool)
    for t in thresholds:
      close, maybe = _certain(hi, lo, diag, t, geo)
      und = und | (maybe & ~close)
    und = und & rmask[:, None] & cmask[None, :]
    return _resolve(lay, thresholds, start, size, n, und, counts)

  # a whole row costs n D canonical terms, gathering pairs a few passes over the slab
  n_left = jnp.sum(left, dtype=jnp.int32)
  branch = jnp.where(n_left * geo.dim <= _ROW_TERMS_PER_SLAB_PASS * size, 0, 1)
  return tuple(jax.lax.cond(branch == 0, by_rows, by_pairs, counts))


def coordinate_leaves(stacked: PyTree) -> list[jax.Array]:
  """The leaves of ``stacked`` with coordinates (else one zero column: distances 0)."""
  u = num_user_slots(stacked)
  return [x for x in jax.tree.leaves(stacked) if x.size] or [jnp.zeros((u, 1), jnp.float32)]


def pairwise_sq_distances(stacked: PyTree) -> jax.Array:
  """``[U, U]`` canonical squared distances between rows, which FILTER's decisions read."""
  rows = [pair_rows(leaf) for leaf in coordinate_leaves(stacked)]
  return canonical_sq_distances(rows, [x.T for x in rows])


# Rows per block of the pair counts: a [block, U] slab at a time, never the [U, U] matrix.
_PAIR_BLOCK = 1024


def pair_layout(u: int, n_dev: int = 1, block: int = _PAIR_BLOCK) -> tuple[int, int]:
  """``(blocks per device, rows per block)`` of the counts' ``[blocks, block]`` layout."""
  per = -(-u // n_dev)                    # rows per device
  b = per if per <= block else block
  return -(-per // b), b


def gram_close_pair_counts(clean: PyTree, mask: jax.Array, radii: tuple[jax.Array, ...],
                           block: int = _PAIR_BLOCK, rows: NamedSharding | None = None
                           ) -> tuple[jax.Array, ...]:
  """Per real user ``i`` and radius ``r``: ``#{j real: close_r(i, j)}`` (canonical), each
  ``int32 [nb, b]`` by row block; ``rows`` (sharding ``P(axis)``) splits the blocks over
  ``axis`` and gathers the (identical) counts."""
  u = num_user_slots(clean)
  n_dev = 1 if rows is None else int(rows.mesh.shape[rows.spec[0]])
  nb_dev, b = pair_layout(u, n_dev, block)
  geo = pair_geometry([pair_rows(leaf) for leaf in jax.tree.leaves(clean)])
  lay = _layout(clean, mask, n_dev * nb_dev * b - u, geo)
  ts = tuple(close_threshold(r, geo) for r in radii)

  def counts(lay, ts, first):   # the blocks first .. first + nb_dev
    starts = (first + jnp.arange(nb_dev)) * b
    return jax.lax.map(lambda start: _block_counts(lay, geo, ts, start, b), starts)

  if rows is None:
    return counts(lay, ts, 0)
  axis = rows.spec[0]
  # check_vma off: carries turn device-varying; nothing is reduced across devices
  local = jax.shard_map(lambda lay, ts: counts(lay, ts, jax.lax.axis_index(axis) * nb_dev),
                        mesh=rows.mesh, in_specs=(PartitionSpec(), PartitionSpec()),
                        out_specs=PartitionSpec(axis), check_vma=False)
  # gathered: what follows runs replicated, so the mean is bitwise the one-device mean
  return jax.lax.with_sharding_constraint(local(lay, ts), NamedSharding(rows.mesh,
                                                                        PartitionSpec()))
