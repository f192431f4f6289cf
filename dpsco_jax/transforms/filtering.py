"""FILTER: private outlier removal of per-user vectors (paper 000, after [AL24] / FriendlyCore).

One kernel (:func:`filter_points`), used by Algorithm 1 (on SGD iterates, per phase) and by the
:func:`outlier_filter` chain stage of Algorithms 2-3 (on per-user gradients, every step).

Given ``K`` real points ``y_1..y_K`` (rows with a leading user axis, padding False in
``user_mask``):

  score    s   = (1/K) sum_{j,j'} 1(||y_j - y_j'|| <= r_s)          diagonal included: 1 <= s <= K
  degree   h_j = sum_{j'} 1(||y_j - y_j'|| <= r_h)                   includes j' = j
  p_j          = clip((h_j - K/2) / (K/6), 0, 1)                    0 below K/2, 1 from 2K/3
  keep_j       = U_j < p_j,  U_j ~ Unif[0, 1) i.i.d.                 randomized inclusion
  mean         = sum_{kept} y_j / max(|S|, 1)                         (0 when nothing is kept)

(paper 000 Alg. 1 lines 12-24, Alg. 2 lines 6-13; spec 000 §2.0), with canonical pair
decisions (:mod:`~dpsco_jax.transforms.filter_pairs`) and the score exact on a dyadic grid.

Privacy (Lemmas B.2 / C.2, spec 000 §3): replacing one point moves every other degree by at
most 1, the score by at most 2 and every ``p_j`` by at most ``6/K``; kept points have ``h_j >
K/2``, so the kept set has diameter ``<= 2 r_h``, and with common coins ``U_j`` the filtered
mean moves by ``O(r_h log(1/zeta)/K)`` w.p. ``1 - zeta`` once ``|S| = Omega(K)``. A hard
threshold would let one point flip many memberships. Non-finite rows are zeroed first.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from dpsco_jax._checks import (_traced, check_bool, check_int, check_key, check_positive,
                               check_probability, check_seed_or_key)
from dpsco_jax.transforms.clipping import num_user_slots, real_users
from dpsco_jax.transforms.noise import noise_dtype, redacted_repr
from dpsco_jax.transforms.filter_pairs import coordinate_leaves, pair_rows, pairwise_sq_distances
from dpsco_jax.transforms.filter_bands import close_pair_counts
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


def _sanitize(stacked: PyTree, user_mask: jax.Array | None) -> tuple[PyTree, jax.Array]:
  """(rows with non-finite and padding rows zeroed, the checked real-user mask)."""
  u = num_user_slots(stacked)
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(pair_rows(x)), axis=1)
                              for x in jax.tree.leaves(stacked)]), axis=0)
  mask = real_users(user_mask, u)
  keep = jnp.logical_and(finite, mask)
  return jax.tree.map(lambda x: jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x,
                                          jnp.zeros_like(x)), stacked), mask


def _exact_score(close_s: jax.Array, k: jax.Array, u: int) -> jax.Array:
  """``s = (sum_i close_s_i) / K`` on a dyadic grid, sensitivity exactly <= 2: ``S = A K + B``
  in int32, ``s = A + floor(fl(B/K) 2^q) / 2^q`` (a float32 division could err by ``> 1/K``)."""
  kk = jnp.maximum(k, 1)
  per_block = jnp.sum(close_s, axis=1, dtype=jnp.int32)       # <= block * U
  a = jnp.sum(per_block // kk) + jnp.sum(per_block % kk) // kk
  rem = jnp.sum(per_block % kk) % kk
  q = max(0, 22 - int(u).bit_length())
  frac = jnp.floor((rem.astype(jnp.float32) / kk.astype(jnp.float32)) * 2.0 ** q) / 2.0 ** q
  return a.astype(jnp.float32) + frac


def inclusion_probability(degrees: jax.Array, num_users: jax.Array | float,
                          lo: float = 0.5, hi: float = 2.0 / 3.0) -> jax.Array:
  """``p = clip((h - lo K) / ((hi - lo) K), 0, 1)`` (Alg. 1 line 17, Alg. 2 line 11)."""
  k = jnp.asarray(num_users, jnp.float32)
  return jnp.clip((degrees - lo * k) / ((hi - lo) * k), 0.0, 1.0)


class FilterResult(NamedTuple):
  """Output of :func:`filter_points`; only ``mean`` may be released (after noise)."""
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
                  hi: float = 2.0 / 3.0, rows: NamedSharding | None = None) -> FilterResult:
  """The FILTER kernel (pure function; the math is in the module docstring).

  Args:
    stacked: pytree whose leaves have a leading user axis ``U``.
    key: PRNG key of the inclusion coins ``U_j`` (same key, same coins: Lemma B.2's coupling).
    score_radius: ``r_s`` (``tau_i`` in Alg. 1, ``2 tau`` in Alg. 2).
    degree_radius: ``r_h`` (``2 tau_i`` in Alg. 1, ``2 tau`` in Alg. 2); default ``r_s``.
    user_mask: bool ``[U]``, False for padding slots (default: every slot a real user).
    lo: the inclusion ramp's lower bound, a fraction of ``K`` (paper: 1/2).
    hi: the inclusion ramp's upper bound, a fraction of ``K`` (paper: 2/3).
    rows: optional ``NamedSharding(mesh, P(axis))`` splitting the pair counts over ``axis``.

  Returns:
    A ``FilterResult``: the masked mean of the kept rows (the only field that may be released,
    after noise) and the data-dependent diagnostics.
  """
  check_key(key, "key")
  clean, mask = _sanitize(stacked, user_mask)
  u = mask.shape[0]
  r_s = jnp.asarray(score_radius, jnp.float32)
  r_h = r_s if degree_radius is None else jnp.asarray(degree_radius, jnp.float32)
  coords = coordinate_leaves(clean)   # zero-width leaves: no coordinate, no distance
  if degree_radius is None:   # one radius: one count (Algorithms 2-3)
    close_s = close_h = close_pair_counts(coords, mask, (r_s,), rows=rows)[0]
  else:
    close_s, close_h = close_pair_counts(coords, mask, (r_s, r_h), rows=rows)
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


def _filter_scales(epsilon: float | None, threshold_scale: float | None,
                   query_scale: float | None) -> tuple[float, float]:
  """``(b_thr, b_q)`` of the AboveThreshold test: the given scales, the missing ones from
  budget ``epsilon / 2`` on a sensitivity-2 score (Lemma A.9: ``8/eps, 16/eps``)."""
  if threshold_scale is None or query_scale is None:
    if epsilon is None:
      raise ValueError("outlier_filter needs epsilon or both threshold_scale and query_scale")
    b_thr, b_q = above_threshold_scales(0.5 * check_positive(epsilon, "epsilon"),
                                        sensitivity=2.0)
    threshold_scale = b_thr if threshold_scale is None else threshold_scale
    query_scale = b_q if query_scale is None else query_scale
  return (check_positive(threshold_scale, "threshold_scale"),
          check_positive(query_scale, "query_scale"))


def outlier_filter(num_users: int, radius: float, *, key: jax.Array | int,
                   epsilon: float | None = None, degree_radius: float | None = None,
                   threshold_fraction: float = 0.8, threshold_scale: float | None = None,
                   query_scale: float | None = None, lo: float = 0.5, hi: float = 2.0 / 3.0,
                   debug: bool = False, rows: NamedSharding | None = None
                   ) -> optax.GradientTransformationExtraArgs:
  """FILTER with AboveThreshold halting, as a chain stage (paper 000 Alg. 2 lines 4-13):
  stacked per-user gradients in, the filtered mean out.

  ``init`` draws ``Delta^ = threshold_fraction K + Lap(b_thr)`` ONCE (spec 000 §7 item 1; the
  paper prints it inside the loop; re-``init`` per phase). ``update`` tests ``s + Lap(b_q) >=
  Delta^``; the first failure halts for good, and halted steps output zeros. Defaults ``b_thr =
  8/eps, b_q = 16/eps``: AboveThreshold at budget ``eps/2`` on a sensitivity-2 score (Lemma A.9).

  Args:
    num_users: ``K_i``, the number of real users per step.
    radius: score radius (``2 tau`` in Alg. 2).
    key: PRNG key (or int seed) of threshold, query noise and inclusion coins.
    epsilon: the stage's AboveThreshold budget (sets both scales).
    degree_radius: the degree radius ``r_h`` (default ``radius``).
    threshold_fraction: the threshold over ``num_users``, in ``(0, 1]`` (default 0.8).
    threshold_scale: the threshold's Laplace scale ``b_thr`` (instead of ``epsilon``).
    query_scale: the queries' Laplace scale ``b_q`` (instead of ``epsilon``).
    lo: the inclusion ramp's lower bound (default 1/2), as in :func:`filter_points`.
    hi: the inclusion ramp's upper bound (default 2/3).
    debug: keep raw scores and kept counts in ``state.debug`` (non-private; default False).
    rows: as in :func:`filter_points`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: ``update(stacked, state, params, *,
    user_mask=None)`` gives the filtered mean (params-shaped; zeros once halted).
  """
  k_users = check_int(num_users, "num_users")
  check_positive(radius, "radius")
  if degree_radius is not None:
    check_positive(degree_radius, "degree_radius")
  frac = check_probability(threshold_fraction, "threshold_fraction")
  # traced under optax.inject_hyperparams + jit: checked by the caller while concrete
  if not (_traced(lo) or _traced(hi)) and not 0.0 <= lo < hi <= 1.0:
    raise ValueError(f"need 0 <= lo < hi <= 1 for the inclusion ramp, got lo={lo}, hi={hi}")
  b_thr, b_q = _filter_scales(epsilon, threshold_scale, query_scale)
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
                        user_mask=user_mask, lo=lo, hi=hi, rows=rows)
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
