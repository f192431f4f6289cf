"""Exact stream sensitivity of cyclic (fixed public order, multi-epoch) participation.

Schedule. ``T`` steps; the examples (users) sit in public slots, and step ``t`` reads the
batch of slots ``[(t mod P) B, (t mod P + 1) B)``: the *same* data-independent order every
epoch, so the example in a slot of offset ``p in [0, P)`` contributes at steps
``p, p + P, ..., p + (k-1) P`` (those ``< T``), exactly ``P`` steps apart, ``k`` times. The
pattern of every slot is public (it depends on ``n``, ``B`` and ``T`` only).

Why a fixed order and not a fresh public permutation per epoch: with fresh permutations a
user's gaps vary (two participations can be 1 step apart across an epoch boundary), the
worst user must be found among ``n`` patterns, and it is no better than a fixed gap ``P``
(the largest gap every user can have); with a fixed order the patterns form one family,
offsets ``p in [0, P)``, whose worst case is computed exactly below.

Sensitivity. A prefix-noise strategy releases ``C x + Z`` (``Z`` i.i.d. Gaussian, std
``z s``; ``x`` the stream of increments, each of L2 sensitivity ``s`` per participation; for
the binary tree ``C`` is the 0/1 node-by-leaf encoder, for banded / BLT the Toeplitz
strategy, for independent noise ``I``). A user of offset ``p`` changes ``C x`` by
``sum_j C[:, p_j] g_j^T`` with ``||g_j|| <= s``, whose squared Frobenius norm is
``sum_{j,l} <C[:, p_j], C[:, p_l]> <g_j, g_l>``. When every such inner product is ``>= 0``
(nonnegative ``C``) the maximum over the ``g_j`` is at equal ``g_j``: ``s ||C 1_{P_p}||``,
and the stream's sensitivity is the exact ``max_p ||C 1_{P_p}||`` (per unit ``s``):

* tree: ``||C 1_{P_p}||^2 = sum over nodes of (participations inside the node)^2``; one
  leaf lies in at most one node per level, so this is ``O(P k log T)`` work
  (:func:`tree_cyclic_sensitivity`). ``k = 1`` gives ``T.bit_length()`` (Lemma 5.6's count).
* Toeplitz (banded, BLT): ``C 1_{P_p}`` is ``h = C 1_{P_0}`` shifted down by ``p`` and cut at
  ``T``, so its norm does not increase with ``p``: the maximum is at ``p = 0``, the pattern
  :func:`~dpsco_jax.privacy.matrix_factorization.participation_sensitivity` prices with
  ``min_sep = P`` — exact here (not only an upper bound), whether the columns are disjoint
  (``bands <= P``; then any coefficient signs) or overlap with nonnegative coefficients (it
  refuses the other cases).
* independent: ``sqrt(k)``.

Event: the whole run is one Gaussian mechanism with multiplier ``z / sens`` (adaptive
increments included: ``C`` is lower-triangular, each row a Gaussian release given the past;
Denisov et al. 2022, Thm 2.1), :func:`cyclic_event`. Relations as for one participation:
``zero_out`` (the slot stays, its increments become 0) and ``replace_one`` (the ledger's
conversion); removing an example would move every later slot, so ``add_remove`` is the
driver's to refuse.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np

from dpsco_jax._checks import check_choice, check_int, check_positive
from dpsco_jax.privacy import matrix_factorization as mf

__all__ = ["CYCLIC_MECHANISMS", "cyclic_pattern", "tree_cyclic_sensitivity",
           "toeplitz_cyclic_sensitivity", "cyclic_sensitivity", "cyclic_event"]

CYCLIC_MECHANISMS = ("tree", "independent", "banded", "blt")


def _checked(num_steps: int, period: int, participations: int) -> tuple[int, int, int]:
  T = check_int(num_steps, "num_steps")
  P = check_int(period, "period")
  k = check_int(participations, "participations")
  if P > T:
    raise ValueError(f"period={P} exceeds num_steps={T}")
  return T, P, k


def cyclic_pattern(num_steps: int, period: int, participations: int) -> np.ndarray:
  """``[P, k]`` steps of every offset's participations ``p + i P`` (``-1`` where ``>= T``)."""
  T, P, k = _checked(num_steps, period, participations)
  steps = np.arange(P)[:, None] + P * np.arange(k)[None, :]
  return np.where(steps < T, steps, -1)


def tree_cyclic_sensitivity(num_steps: int, period: int, participations: int) -> float:
  """Exact L2 sensitivity (per unit increment sensitivity) of the binary-tree encoder of
  :mod:`dpsco_jax.transforms.tree_noise` (leaf ``t+1`` = step ``t``; node ``(lvl, j)``, odd
  ``j`` with ``j 2^lvl <= T``, sums leaves ``((j-1) 2^lvl, j 2^lvl]``) under the cyclic
  schedule: ``max_p sqrt(sum_nodes count_p(node)^2)``. Vectorized over offsets and
  participations, one pass per level: ``O(P k log T)``."""
  T, P, k = _checked(num_steps, period, participations)
  steps = cyclic_pattern(T, P, k)
  leaf = steps + 1                                        # 0 where the step is past T
  idx = np.arange(k)[None, :]
  total = np.zeros(P, np.int64)
  for lvl in range(T.bit_length()):
    j = ((leaf - 1) >> lvl) + 1                           # the level's block holding the leaf
    in_node = (steps >= 0) & (j % 2 == 1) & ((j << lvl) <= T)
    # steps are increasing along a row, so equal j form runs; a run of length r adds r^2 =
    # sum over its members of (2 * position in run + 1). Equal j share in_node.
    new_run = np.ones_like(in_node)
    new_run[:, 1:] = j[:, 1:] != j[:, :-1]
    start = np.maximum.accumulate(np.where(new_run, idx, 0), axis=1)
    total += np.sum(np.where(in_node, 2 * (idx - start) + 1, 0), axis=1)
  return float(math.sqrt(int(total.max())))


def toeplitz_cyclic_sensitivity(coefs: np.ndarray, num_steps: int, period: int,
                                participations: int) -> float:
  """Exact sensitivity of a lower-triangular Toeplitz strategy (coefficients ``coefs``; a
  BLT's :func:`~dpsco_jax.privacy.matrix_factorization.blt_coefs`) under the cyclic
  schedule: the offset-0 pattern is the worst (module docstring), which
  ``participation_sensitivity(..., participations=k, min_sep=P)`` prices. Raises where it
  does (overlapping columns with coefficients that are not nonnegative and nonincreasing)."""
  T, P, k = _checked(num_steps, period, participations)
  return mf.participation_sensitivity(np.asarray(coefs, np.float64), T,
                                      participations=k, min_sep=P)


def cyclic_sensitivity(mechanism: str, num_steps: int, period: int, participations: int,
                       coefs: np.ndarray | None = None) -> float:
  """The stream's exact sensitivity for ``mechanism`` in :data:`CYCLIC_MECHANISMS`
  (``coefs``: the Toeplitz coefficients, needed for banded / BLT)."""
  check_choice(mechanism, "mechanism", CYCLIC_MECHANISMS)
  T, P, k = _checked(num_steps, period, participations)
  if mechanism == "tree":
    return tree_cyclic_sensitivity(T, P, k)
  if mechanism == "independent":
    return float(math.sqrt(int(np.max(np.sum(cyclic_pattern(T, P, k) >= 0, axis=1)))))
  if coefs is None:
    raise ValueError(f"mechanism={mechanism!r} needs its Toeplitz coefficients (coefs=)")
  return toeplitz_cyclic_sensitivity(coefs, T, P, k)


def cyclic_event(noise_multiplier: float, sensitivity: float) -> dp_accounting.DpEvent:
  """The whole run as one Gaussian event of multiplier ``z / sensitivity``."""
  z = float(noise_multiplier)
  if not z > 0:
    raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier!r}")
  return dp_accounting.GaussianDpEvent(z / check_positive(sensitivity, "sensitivity"))
