"""FILTER: private outlier removal of per-user vectors (paper 000, after [AL24] / FriendlyCore).

THE one kernel (:func:`filter_points`) used by Algorithm 1 (on SGD iterates, phase level) and by
the :func:`outlier_filter` chain stage of Algorithms 2-3 (on per-user gradients, every step).

Given ``K`` real points ``y_1..y_K`` (rows of a pytree with a leading user axis, padding slots
marked False in ``user_mask``):

  score    s   = (1/K) sum_{j,j'} 1(||y_j - y_j'|| <= r_s)          diagonal included: 1 <= s <= K
  degree   h_j = sum_{j'} 1(||y_j - y_j'|| <= r_h)                   includes j' = j
  p_j          = clip((h_j - K/2) / (K/6), 0, 1)                    0 below K/2, 1 from 2K/3
  keep_j       = U_j < p_j,  U_j ~ Unif[0, 1) i.i.d.                 randomized inclusion
  mean         = sum_{kept} y_j / max(|S|, 1)                         (0 when nothing is kept)

(paper 000 Alg. 1 lines 12-24, Alg. 2 lines 6-13; spec 000 §2.0). No square root is taken.

Numerics an input cannot defeat (issue #23). The Gram form ``|a|^2 + |b|^2 - 2<a, b>`` in
float32 errs by ~2^-24 |a|^2: with a common component of 1e5 (~600), a user 50 away rounded to
distance 0 and was kept. Now every pair's decision is defined by ONE canonical,
difference-first value (``sum_k (y_ik - y_jk)^2``, one fixed elementwise order: a function of
rows i and j alone, exactly symmetric, accurate to ``(D + 3) 2^-23`` relative whatever the
offset) against ``T(r) = r^2 (1 - 2 gamma) - slack``, so "close" implies ``||y_i - y_j|| <= r``
exactly (the direction the kept-set diameter argument needs; a truly close pair counted far
costs only utility). For speed, the Gram form on rows centred at a data-dependent point (any
centre: it changes no decision) comes with a rigorous error bound and decides only the pairs
it certifies to agree with the canonical value; the few near the radius are computed
canonically (all of them when the data defeat the bound, e.g. two clusters 1e4 apart: the
difference-first cost). Whatever the centre, tiling or matmul order, the decisions are the
canonical ones. (Assumed: the backend evaluates one elementwise float expression the same way
wherever it appears; IEEE float32 ops are deterministic, and an FMA contraction of
``acc + d * d`` is the same in every copy.) The score is exact on a dyadic grid
(:func:`_exact_score`): a float32 ``sum / K`` rounds by up to ``ulp(K) > 1/K`` (``K > 2896``)
and from ``K ~ 1e4`` exceeded its sensitivity 2 on neighbouring inputs. Counts are int32.

Why it is private (proofs of Lemmas B.2 / C.2, spec 000 §3). Replacing one point changes every
other degree by at most 1, the score by at most 2 (``2K-1`` indicators over ``K``), and every
``p_j`` by at most ``6/K``. Every kept point has ``h_j > K/2``, so two kept points share an
``r_h``-neighbour: the kept set has diameter ``<= 2 r_h``. With common ``U_j`` the kept sets of
neighbouring inputs differ in the replaced point plus ``Binomial``-like ``<= 6``-mean others, so
the filtered mean moves by ``O(r_h log(1/zeta)/K)`` w.p. ``1 - zeta`` once ``|S| = Omega(K)``
(guaranteed by a passed score test). The inclusion is randomized on purpose: a hard threshold
at ``K/2`` would let one point flip many memberships at once.

A user whose vector contains NaN/Inf is replaced by the zero vector before anything is computed:
a function of that user's data alone, so every sensitivity bound above still holds.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax._checks import (check_bool, check_int, check_key, check_positive,
                               check_probability, check_seed_or_key, check_user_mask)
from dpsco_jax.transforms.noise import noise_dtype, redacted_repr
from dpsco_jax.privacy.sparse_vector import (above_threshold_init, above_threshold_scales,
                                             above_threshold_step)

PyTree = Any

__all__ = [
    "FilterResult",
    "pairwise_sq_distances",
    "inclusion_probability",
    "filter_points",
    "OutlierFilterState",
    "FilterDebug",
    "outlier_filter",
    "find_filter_state",
    "filter_halted",
]

_HI = jax.lax.Precision.HIGHEST


def _rows(x: jax.Array) -> jax.Array:
  """Flattened rows in float32 or wider (distances decide membership: never in bf16)."""
  return jnp.reshape(x, (x.shape[0], -1)).astype(noise_dtype(x.dtype))


def _num_rows(stacked: PyTree) -> int:
  leaves = jax.tree.leaves(stacked)
  if not leaves:
    raise ValueError("stacked must have at least one leaf")
  u = leaves[0].shape[0] if leaves[0].ndim else None
  for leaf in leaves:
    if leaf.ndim == 0 or leaf.shape[0] != u:
      raise ValueError("every leaf of the stacked per-user pytree needs the same leading "
                       f"user axis; got shapes {[l.shape for l in leaves]}")
  if u == 0:
    raise ValueError("empty batch: the stacked per-user pytree has 0 user slots (pad with "
                     "a user_mask instead)")
  return u


def _sanitize(stacked: PyTree, user_mask: jax.Array | None) -> tuple[PyTree, jax.Array]:
  """Zero non-finite rows and padding rows; returns (clean rows, real-user mask). The mask
  is checked (bool, shape ``[U]``); without one every slot is a real user."""
  u = _num_rows(stacked)
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(_rows(x)), axis=1)
                              for x in jax.tree.leaves(stacked)]), axis=0)
  mask = check_user_mask(user_mask, u)
  mask = jnp.ones((u,), bool) if mask is None else mask
  keep = jnp.logical_and(finite, mask)

  def clean(x):
    k = keep.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(k, x, jnp.zeros_like(x))
  return jax.tree.map(clean, stacked), mask


# ---------------------------------------------------------------------------- distances
# (module docstring, "Numerics"). Error model: each float op errs by at most _UNIT relative.

_UNIT = 2.0 ** -23   # twice the float32 unit roundoff: headroom as in flax/fast_clip_norms.py
_ABS = 2.0 ** -120   # per-operation absolute slack (gradual underflow / flush to zero)
_CANON_ROWS = 128    # rows per canonical resolution step
_CANON_PAIRS = 128   # undecided pairs per row gathered in one step
_PAIRS_FROM_DIM = 256   # below this many coordinates undecided rows are recounted whole
_ROW_TERMS_PER_SLAB_PASS = 8   # whole-row recounts while they cost < 8 passes over the slab
_CENTRE_ROWS = 65    # rows sampled (evenly) for the centring median


def _gamma(k: int) -> float:
  """``k u / (1 - k u)``: relative error of ``k`` chained float ops (any order; Higham)."""
  ku = float(k) * _UNIT
  return ku / (1.0 - ku) if ku < 0.5 else float("inf")


def _canonical_sq(rows: list[jax.Array], cols_t: list[jax.Array],
                  cols: jax.Array | None = None) -> jax.Array:
  """Canonical squared distances: difference first, accumulated over the coordinates of every
  leaf in one fixed sequential order, elementwise (entry ``(i, j)`` depends on the two rows
  only, never on the chunk it is computed in). ``rows[l]`` is ``[M, d_l]``, ``cols_t[l]`` the
  transposed ``[d_l, U]``; result ``[M, U]``, or ``[M, P]`` for the pairs
  ``(i, cols[i, p])``. Relative error ``<= gamma(D + 3)``, plus ``3 D`` underflow slack."""
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


class _Geometry(NamedTuple):
  """Static error constants of one pytree layout."""
  dim: int          # all coordinates
  gamma_c: float    # canonical relative error
  abs_c: float      # canonical absolute slack
  gamma_g: float    # Gram error per unit of (|z_i|^2 + |z_j|^2)
  abs_g: float


def _geometry(rows: list[jax.Array]) -> _Geometry:
  dims = [x.shape[1] for x in rows]
  dim, dmax, leaves = sum(dims), max(dims), len(dims)
  # Gram bounds on centred rows z = fl(y - c) (:func:`_gram_bounds`), each op erring by at
  # most _UNIT relative: the norms and the dot err by gamma(d) (|z_i|^2 + |z_j|^2) together
  # (x2 for the dot's factor 2, /2 by Cauchy-Schwarz), the two roundings per leaf and the L
  # leaf accumulations by ~(2 L + 5) _UNIT of the same, the centring's rounding by ~4 _UNIT
  # (||y_i - y_j|| moves by _UNIT (|z_i| + |z_j|)): in all ~(2 d + 2 L + 9) _UNIT
  # (|z_i|^2 + |z_j|^2). gamma_g = 3 gamma(d + L + 8) exceeds it by a factor >= 1.5, which
  # also covers the rounding of the bound itself.
  return _Geometry(dim=dim, gamma_c=_gamma(dim + 3), abs_c=(3 * dim + 8) * _ABS,
                   gamma_g=3.0 * _gamma(dmax + leaves + 8),
                   abs_g=8.0 * (dmax + leaves + 8) * _ABS)


def _threshold(radius: jax.Array, geo: _Geometry) -> jax.Array:
  """``T(r)``: a canonical value ``<= T`` certifies ``||y_i - y_j|| <= r`` (``r * r`` and
  the product below round at most twice: the factor ``(1 - 2 gamma)`` covers them and the
  canonical computation's own ``gamma``)."""
  r = jnp.asarray(radius, jnp.float32)
  return (r * r) * (1.0 - 2.0 * geo.gamma_c - 4.0 * _UNIT) - 2.0 * geo.abs_c


def _centre(rows: list[jax.Array], mask: jax.Array) -> list[jax.Array]:
  """Coordinate-wise median of an evenly spaced sample of real rows (0 without any): only
  the speed of the Gram path depends on it (it removes a common component, and a few
  outliers cannot drag it), never a decision."""
  u = mask.shape[0]
  idx = np.unique(np.linspace(0, u - 1, min(u, _CENTRE_ROWS)).astype(np.int64))
  real = mask[idx][:, None]
  out = []
  for x in rows:
    c = jnp.nanmedian(jnp.where(real, x[idx], jnp.nan), axis=0)
    out.append(jnp.where(jnp.isfinite(c), c, 0.0))
  return out


class _Layout(NamedTuple):
  """Everything the per-block decisions read (rows padded to a multiple of the block).

  ``up`` / ``dn`` are the per-leaf squared norms of the centred rows ``z`` with the row's half
  of the Gram error bound added / subtracted on the first leaf, so that the slab
  ``sum_l (up_i + up_j - 2 <z_i, z_j>)`` is an upper bound on the true squared distance and the
  same with ``dn`` a lower bound, at the cost of the plain Gram form (no ``[U, U]`` error
  term)."""
  rows: list[jax.Array]     # raw rows [U', d_l]
  cols_t: list[jax.Array]   # raw rows transposed [d_l, U]  (canonical columns)
  z: list[jax.Array]        # centred rows [U', d_l]
  up: list[jax.Array]       # [U'] per leaf
  dn: list[jax.Array]       # [U'] per leaf
  mask: jax.Array           # real users [U'] (False on the padding)


def _layout(clean: PyTree, mask: jax.Array, pad: int, geo: _Geometry) -> _Layout:
  rows = [_rows(leaf) for leaf in jax.tree.leaves(clean)]
  centre = _centre(rows, mask)
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
  """Per leaf ``2 <z_i, z_j>`` for rows ``start..start+size`` against every row (one matmul
  per leaf, ``Precision.HIGHEST`` so accelerators do not drop to TF32)."""
  return [2.0 * jnp.matmul(jax.lax.dynamic_slice_in_dim(z, start, size), z[:n].T,
                           precision=_HI) for z in lay.z]


def _gram_bounds(lay: _Layout, dots: list[jax.Array], start, size: int, n: int
                 ) -> tuple[jax.Array, jax.Array]:
  """``[size, n]`` upper and lower bounds on the true squared distances (elementwise: fuses
  into whatever consumes them)."""
  hi = lo = jnp.zeros((size, n), lay.z[0].dtype)
  for dot2, up, dn in zip(dots, lay.up, lay.dn):
    upb = jax.lax.dynamic_slice_in_dim(up, start, size)
    dnb = jax.lax.dynamic_slice_in_dim(dn, start, size)
    hi = hi + (upb[:, None] + up[None, :n] - dot2)
    lo = lo + (dnb[:, None] + dn[None, :n] - dot2)
  return hi, lo


def _certain(hi, lo, diag, t, geo: _Geometry) -> tuple[jax.Array, jax.Array]:
  """``(close, maybe)``: certainly close, and not certainly far, for threshold ``t``. NaN or
  Inf bounds (overflow) fail both comparisons: not close, not certainly far. The diagonal
  (distance 0) is close at any radius (the score counts it, ``1 <= s``)."""
  slack = 2.0 * geo.gamma_c + 4.0 * _UNIT
  close = (hi <= t * (1.0 - slack) - geo.abs_c) | diag
  maybe = ~(lo > t * (1.0 + slack) + geo.abs_c) | diag
  return close, maybe


def _recount_rows(lay: _Layout, thresholds, start, size: int, n: int, left: jax.Array,
                  counts: list[jax.Array]) -> list[jax.Array]:
  """Replaces the counts of the rows in ``left`` by their canonical counts over every real
  column, ``_CANON_ROWS`` rows per iteration (they agree with every certified decision)."""
  m = min(_CANON_ROWS, size)
  cmask = lay.mask[:n]

  def body(state):
    *counts, left = state
    idx = jnp.nonzero(left, size=m, fill_value=size)[0]   # size: no row (dropped below)
    take = start + jnp.minimum(idx, size - 1)
    d = _canonical_sq([x[take] for x in lay.rows], lay.cols_t)
    ok = lay.mask[take][:, None] & cmask[None, :]
    diag = take[:, None] == jnp.arange(n)[None, :]
    counts = [c.at[idx].set(jnp.sum(ok & ((d <= t) | diag), axis=1, dtype=jnp.int32),
                            mode="drop") for c, t in zip(counts, thresholds)]
    return (*counts, left.at[idx].set(False, mode="drop"))

  *counts, _ = jax.lax.while_loop(lambda st: jnp.any(st[-1]), body, (*counts, left))
  return counts


def _resolve(lay: _Layout, thresholds, start, size: int, n: int, undecided: jax.Array,
             counts: list[jax.Array]) -> list[jax.Array]:
  """Adds to ``counts`` the undecided pairs that are canonically close: the first
  ``_CANON_PAIRS`` undecided pairs of every row per iteration (gathered) while they are few,
  else every pair of the block at once (the difference-first cost, on data the Gram bound
  cannot decide)."""
  p = min(_CANON_PAIRS, n)
  rows = start + jnp.arange(size)

  def body(state):
    *counts, rem = state

    def few(rem):
      cols = jax.vmap(lambda r: jnp.nonzero(r, size=p, fill_value=n)[0])(rem)
      d = _canonical_sq([x[rows] for x in lay.rows], lay.cols_t, jnp.minimum(cols, n - 1))
      adds = [jnp.sum((cols < n) & (d <= t), axis=1, dtype=jnp.int32) for t in thresholds]
      return adds, rem.at[jnp.arange(size)[:, None], cols].set(False, mode="drop")

    def every(rem):
      d = _canonical_sq([x[rows] for x in lay.rows], lay.cols_t)
      adds = [jnp.sum(rem & (d <= t), axis=1, dtype=jnp.int32) for t in thresholds]
      return adds, jnp.zeros_like(rem)

    adds, rem = jax.lax.cond(jnp.sum(rem) <= size * p // 4, few, every, rem)
    return (*[c + a for c, a in zip(counts, adds)], rem)

  *counts, _ = jax.lax.while_loop(lambda st: jnp.any(st[-1]), body, (*counts, undecided))
  return counts


def _block_counts(lay: _Layout, geo: _Geometry, thresholds: tuple[jax.Array, ...], start,
                  size: int) -> tuple[jax.Array, ...]:
  """Per row ``start .. start+size``: the number of real ``j`` canonically close to it, for
  each threshold (``int32 [size]``; 0 for padding rows).

  The Gram bounds decide the pairs they certify; per row two fused counts are taken, the
  pairs certainly close and the pairs not certainly far. Where they differ the row holds
  undecided pairs, decided by their canonical distances: the row is recounted whole
  (:func:`_recount_rows`), or, with many coordinates and many such rows, just those pairs are
  gathered (:func:`_resolve`). Nothing runs when every pair is certified."""
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
  # one variadic reduction: every count in a single pass over the slab (separate sums
  # re-evaluate the slab's elementwise bounds once each: ~2x the time)
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


def pairwise_sq_distances(stacked: PyTree) -> jax.Array:
  """``[U, U]`` squared Euclidean distances between rows, over all leaves jointly.

  Difference first (``sum_k (y_ik - y_jk)^2`` in one fixed order): within a relative
  ``(D + 3) 2^-23`` of the exact distance of the float32 rows whatever their common offset,
  exactly symmetric, exactly 0 on the diagonal. These are the canonical values the FILTER
  decisions are defined by (:func:`filter_points` computes only the ones near a radius and
  never holds this matrix).
  """
  _num_rows(stacked)
  rows = [_rows(leaf) for leaf in jax.tree.leaves(stacked)]
  return _canonical_sq(rows, [x.T for x in rows])


# Rows per block of the pair counts: above this many users the [U, U] matrix (4.4 GB at
# U = 33,333) is never formed; a [block, U] slab at a time keeps memory O(block * U).
_PAIR_BLOCK = 1024


def _close_pair_counts(clean: PyTree, mask: jax.Array, radii: tuple[jax.Array, ...],
                       block: int = _PAIR_BLOCK) -> tuple[jax.Array, ...]:
  """Per real user ``i`` and radius ``r``: ``#{j real: close_r(i, j)}`` (canonical decisions,
  see above), each ``int32 [nb, b]`` by row block (``U`` padded to ``nb * b``).

  Row blocks under ``lax.map`` (static shapes: ``U`` padded to a multiple of the block with
  zero rows that the mask excludes); one block when ``U <= block``.
  """
  u = _num_rows(clean)
  b = u if u <= block else block
  nb = -(-u // b)
  geo = _geometry([_rows(leaf) for leaf in jax.tree.leaves(clean)])
  lay = _layout(clean, mask, nb * b - u, geo)
  ts = tuple(_threshold(r, geo) for r in radii)
  return jax.lax.map(lambda start: _block_counts(lay, geo, ts, start, b), jnp.arange(nb) * b)


def _exact_score(close_s: jax.Array, k: jax.Array, u: int) -> jax.Array:
  """``s = (sum_i close_s_i) / K`` on a dyadic grid, with sensitivity exactly <= 2.

  The sum can exceed 2^24 (``K = 6666`` gives up to 4.4e7), so a float32 sum and division
  would round by up to ``ulp(K) > 1/K``: ``|s - s'|`` could exceed the 2 the AboveThreshold
  scales assume. Here ``S = A K + B`` in int32 (per block then across blocks: no overflow
  for ``U`` up to ~1.4e6) and ``s = A + floor(fl(B/K) 2^q) / 2^q`` with ``q`` chosen so the
  result is exact in float32. Any ``phi(B)`` non-decreasing in ``[0, 1]`` keeps
  ``|s(S) - s(S')| <= 2`` when ``|S - S'| <= 2K - 1``, and ``s`` is within ``2^-q`` below
  ``S/K``."""
  kk = jnp.maximum(k, 1)
  per_block = jnp.sum(close_s, axis=1, dtype=jnp.int32)       # <= block * U
  a = jnp.sum(per_block // kk) + jnp.sum(per_block % kk) // kk
  rem = jnp.sum(per_block % kk) % kk
  q = max(0, 22 - int(u).bit_length())
  frac = jnp.floor((rem.astype(jnp.float32) / kk.astype(jnp.float32)) * 2.0 ** q) / 2.0 ** q
  return a.astype(jnp.float32) + frac


def inclusion_probability(degrees: jax.Array, num_users: jax.Array | float,
                          lo: float = 0.5, hi: float = 2.0 / 3.0) -> jax.Array:
  """``p = clip((h - lo K) / ((hi - lo) K), 0, 1)``: 0 up to ``K/2``, 1 from ``2K/3``.

  Continuous and ``6/K``-Lipschitz in ``h`` for the paper's ``lo, hi`` (Alg. 1 line 17,
  Alg. 2 line 11); never a hard threshold.
  """
  k = jnp.asarray(num_users, jnp.float32)
  return jnp.clip((degrees - lo * k) / ((hi - lo) * k), 0.0, 1.0)


class FilterResult(NamedTuple):
  """Output of :func:`filter_points`. Only ``mean`` may be released (after noise); the rest is
  data-dependent and non-private."""
  mean: PyTree          # params-shaped masked mean of the kept rows (zeros if none kept)
  score: jax.Array      # s (scalar, in [1, K] for K >= 1)
  degrees: jax.Array    # h_j [U] (0 for padding)
  p_incl: jax.Array     # p_j [U] (0 for padding)
  keep: jax.Array       # bool [U]
  num_kept: jax.Array   # |S|
  num_users: jax.Array  # K (real users)


def filter_points(stacked: PyTree, key: jax.Array, *, score_radius: float | jax.Array,
                  degree_radius: float | jax.Array | None = None,
                  user_mask: jax.Array | None = None, lo: float = 0.5,
                  hi: float = 2.0 / 3.0) -> FilterResult:
  """The FILTER kernel (pure function; see module docstring for the math).

  Args:
    stacked: pytree whose leaves have a leading user axis ``U``.
    key: PRNG key of the inclusion coins ``U_j`` (common random numbers: the same key gives
      the same coins, which is how the coupling of Lemma B.2 is tested).
    score_radius: ``r_s`` (``tau_i`` in Alg. 1, ``2 tau`` in Alg. 2).
    degree_radius: ``r_h`` (``2 tau_i`` in Alg. 1, ``2 tau`` in Alg. 2); default ``r_s``.
    user_mask: bool ``[U]`` (checked), False for padding slots (excluded from ``s``, ``h``,
      ``K`` and the mean). Without it every slot counts as a real user.
    lo, hi: inclusion ramp bounds as fractions of ``K`` (paper: 1/2, 2/3).
  """
  check_key(key, "key")
  clean, mask = _sanitize(stacked, user_mask)
  u = mask.shape[0]
  r_s = jnp.asarray(score_radius, jnp.float32)
  r_h = r_s if degree_radius is None else jnp.asarray(degree_radius, jnp.float32)
  if degree_radius is None:   # one radius: one count (Algorithms 2-3)
    close_s, = _close_pair_counts(clean, mask, (r_s,))
    close_h = close_s
  else:
    close_s, close_h = _close_pair_counts(clean, mask, (r_s, r_h))
  k_int = jnp.sum(mask, dtype=jnp.int32)
  k = k_int.astype(jnp.float32)
  score = _exact_score(close_s, k_int, u)
  degrees = close_h.reshape(-1)[:u].astype(jnp.float32)   # counts <= U < 2^24: exact
  p = jnp.where(mask, inclusion_probability(degrees, jnp.maximum(k, 1.0), lo, hi), 0.0)
  coins = jax.random.uniform(key, mask.shape)
  keep = jnp.logical_and(mask, coins < p)
  num_kept = jnp.sum(keep)
  denom = jnp.maximum(num_kept, 1).astype(jnp.float32)

  def masked_mean(x):  # float32 or wider, not rounded before the noise stage
    x = x.astype(noise_dtype(x.dtype))
    w = keep.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype)
    return jnp.sum(x * w, axis=0) / denom.astype(x.dtype)
  mean = jax.tree.map(masked_mean, clean)
  return FilterResult(mean=mean, score=score, degrees=degrees, p_incl=p, keep=keep,
                      num_kept=num_kept, num_users=k)


class FilterDebug(NamedTuple):
  """Raw, NON-PRIVATE diagnostics, kept only with ``debug=True``."""
  last_score: jax.Array
  min_score: jax.Array
  last_num_kept: jax.Array
  steps_all_kept: jax.Array   # steps (before halting) where every real user was kept
  steps_run: jax.Array        # steps evaluated before halting


class OutlierFilterState(NamedTuple):
  """``key`` and ``noisy_threshold`` are SECRET (redacted in repr/str; still attributes)."""
  key: jax.Array              # secret: per-step keys are fold_in(key, count)
  noisy_threshold: jax.Array  # secret: Delta^ = thr_frac K + Lap(b_thr), drawn once at init
  halted: jax.Array           # bool, permanent once True
  count: jax.Array            # steps taken
  debug: FilterDebug | None

  def __repr__(self) -> str:
    return redacted_repr(self, ("key", "noisy_threshold"))

  __str__ = __repr__


def outlier_filter(num_users: int, radius: float, *, key: jax.Array | int,
                   epsilon: float | None = None, degree_radius: float | None = None,
                   threshold_fraction: float = 0.8, threshold_scale: float | None = None,
                   query_scale: float | None = None, lo: float = 0.5, hi: float = 2.0 / 3.0,
                   debug: bool = False) -> optax.GradientTransformationExtraArgs:
  """FILTER with AboveThreshold halting, as a chain stage (paper 000 Alg. 2 lines 4-13).

  Consumes stacked per-user gradients (leading axis ``U >= num_users``, padding marked by the
  ``user_mask`` extra argument) and outputs the filtered mean ``g_i^t`` (params-shaped).

  * ``init`` draws the noisy threshold ``Delta^ = threshold_fraction * K + Lap(b_thr)`` ONCE
    (spec 000 §7 item 1: printed inside the loop, indexed by the phase only). Re-``init`` per
    phase.
  * ``update``: score ``s`` (radius ``radius``), test ``s + Lap(b_q) >= Delta^``; the first
    failure sets ``halted`` permanently (``jnp.logical_or``; no Python branch). Halted steps
    output exact zeros; the driver freezes params (see :func:`filter_halted`).
  * Defaults ``b_thr = 8/eps, b_q = 16/eps``: AboveThreshold at budget ``eps/2`` on a
    sensitivity-2 score (Lemma A.9). Give either ``epsilon`` or both scales.
  * Raw scores / kept counts are stored (in ``state.debug``) only when ``debug=True`` (a real
    bool; ``"false"`` raises).
  * ``user_mask`` (bool ``[U]``, checked) marks padding; without it every slot is a user.

  Args:
    num_users: ``K_i``, the number of real users per step (the threshold is ``4 K_i/5``).
    radius: score radius (``2 tau`` in Alg. 2); ``degree_radius`` defaults to it.
    key: PRNG key (or int seed) for threshold, query noise and inclusion coins.
  """
  k_users = check_int(num_users, "num_users")
  check_positive(radius, "radius")
  if degree_radius is not None:
    check_positive(degree_radius, "degree_radius")
  frac = check_probability(threshold_fraction, "threshold_fraction")
  if not 0.0 <= lo < hi <= 1.0:
    raise ValueError(f"need 0 <= lo < hi <= 1 for the inclusion ramp, got lo={lo}, hi={hi}")
  if threshold_scale is None or query_scale is None:
    if epsilon is None:
      raise ValueError("outlier_filter needs epsilon or both threshold_scale and query_scale")
    b_thr, b_q = above_threshold_scales(0.5 * check_positive(epsilon, "epsilon"),
                                        sensitivity=2.0)
    threshold_scale = b_thr if threshold_scale is None else threshold_scale
    query_scale = b_q if query_scale is None else query_scale
  b_thr = check_positive(threshold_scale, "threshold_scale")
  b_q = check_positive(query_scale, "query_scale")
  key = check_seed_or_key(key, "key")
  debug = check_bool(debug, "debug")

  def init_fn(params):
    del params
    k_thr, k_run = jax.random.split(key)
    dbg = None
    if debug:
      z = jnp.zeros((), jnp.int32)
      dbg = FilterDebug(last_score=jnp.zeros(()), min_score=jnp.asarray(jnp.inf),
                        last_num_kept=z, steps_all_kept=z, steps_run=z)
    return OutlierFilterState(key=k_run,
                              noisy_threshold=above_threshold_init(k_thr, frac * k_users, b_thr),
                              halted=jnp.zeros((), bool), count=jnp.zeros((), jnp.int32),
                              debug=dbg)

  def update_fn(updates, state, params=None, *, user_mask=None, **extra):
    del params, extra
    k_q, k_coin = jax.random.split(jax.random.fold_in(state.key, state.count))
    res = filter_points(updates, k_coin, score_radius=radius, degree_radius=degree_radius,
                        user_mask=user_mask, lo=lo, hi=hi)
    halted = above_threshold_step(k_q, res.score, state.noisy_threshold, b_q, state.halted)
    out = jax.tree.map(lambda m: jnp.where(halted, jnp.zeros_like(m), m), res.mean)
    dbg = state.debug
    if debug:
      live = jnp.logical_not(halted).astype(jnp.int32)
      dbg = FilterDebug(
          last_score=res.score, min_score=jnp.minimum(dbg.min_score, res.score),
          last_num_kept=res.num_kept,
          steps_all_kept=dbg.steps_all_kept
          + live * (res.num_kept == res.num_users).astype(jnp.int32),
          steps_run=dbg.steps_run + live)
    return out, OutlierFilterState(key=state.key, noisy_threshold=state.noisy_threshold,
                                   halted=halted, count=state.count + 1, debug=dbg)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def find_filter_state(opt_state: Any) -> OutlierFilterState | None:
  """The first :class:`OutlierFilterState` inside a (chained) optimizer state, or None."""
  if isinstance(opt_state, OutlierFilterState):
    return opt_state
  if isinstance(opt_state, (tuple, list)):
    for child in opt_state:
      found = find_filter_state(child)
      if found is not None:
        return found
  return None


def filter_halted(opt_state: Any) -> jax.Array:
  """Whether the chain's outlier filter has halted (False when the chain has none)."""
  st = find_filter_state(opt_state)
  return jnp.zeros((), bool) if st is None else st.halted
