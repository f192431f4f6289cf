"""Exact stream sensitivity of cyclic (fixed public order, multi-epoch) participation.

Step ``t`` reads the public slots ``[(t mod P) B, (t mod P + 1) B)``, the same order every
epoch, so offset ``p`` contributes at steps ``p, p + P, ...`` (``< T``), ``k`` times: every gap
is ``P``. A prefix-noise strategy releases ``C x + Z`` (tree: the 0/1 node-by-leaf encoder;
banded / BLT: Toeplitz; independent: ``I``); with nonnegative ``C`` the sensitivity is exactly
``max_p ||C 1_{P_p}||`` per unit ``s``: for the tree ``sqrt(sum over nodes of
participations^2)`` (:func:`tree_cyclic_sensitivity`), for Toeplitz the offset-0 pattern
(``participation_sensitivity`` with ``min_sep = P``), independent ``sqrt(k)``. The run is one
Gaussian mechanism of multiplier ``z / sens`` (:func:`cyclic_event`). Relations: ``zero_out``
and ``replace_one``; removing an example would move every later slot (``add_remove``: refused).
"""

from __future__ import annotations

import math

import numpy as np

from dpsco_jax._checks import check_choice, check_int
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
  """Exact sensitivity of :mod:`dpsco_jax.transforms.tree_noise`'s encoder under the cyclic
  schedule: ``max_p sqrt(sum_nodes count_p(node)^2)``."""
  T, P, k = _checked(num_steps, period, participations)
  steps = cyclic_pattern(T, P, k)
  leaf = steps + 1                                        # 0 where the step is past T
  idx = np.arange(k)[None, :]
  total = np.zeros(P, np.int64)
  for lvl in range(T.bit_length()):
    j = ((leaf - 1) >> lvl) + 1                           # the level's block holding the leaf
    in_node = (steps >= 0) & (j % 2 == 1) & ((j << lvl) <= T)
    # equal j form runs along a row; a run of length r adds r^2 = sum (2 * position + 1)
    new_run = np.ones_like(in_node)
    new_run[:, 1:] = j[:, 1:] != j[:, :-1]
    start = np.maximum.accumulate(np.where(new_run, idx, 0), axis=1)
    total += np.sum(np.where(in_node, 2 * (idx - start) + 1, 0), axis=1)
  return float(math.sqrt(int(total.max())))


def toeplitz_cyclic_sensitivity(coefs: np.ndarray, num_steps: int, period: int,
                                participations: int) -> float:
  """Exact sensitivity of a Toeplitz strategy under the cyclic schedule (offset 0)."""
  T, P, k = _checked(num_steps, period, participations)
  return mf.participation_sensitivity(np.asarray(coefs, np.float64), T,
                                      participations=k, min_sep=P)


def cyclic_sensitivity(mechanism: str, num_steps: int, period: int, participations: int,
                       coefs: np.ndarray | None = None) -> float:
  """The stream's exact sensitivity (``coefs``: needed for banded / BLT)."""
  check_choice(mechanism, "mechanism", CYCLIC_MECHANISMS)
  T, P, k = _checked(num_steps, period, participations)
  if mechanism == "tree":
    return tree_cyclic_sensitivity(T, P, k)
  if mechanism == "independent":
    return float(math.sqrt(int(np.max(np.sum(cyclic_pattern(T, P, k) >= 0, axis=1)))))
  if coefs is None:
    raise ValueError(f"mechanism={mechanism!r} needs its Toeplitz coefficients (coefs=)")
  return toeplitz_cyclic_sensitivity(coefs, T, P, k)


#: The whole run as one Gaussian event of multiplier ``z / sensitivity``.
cyclic_event = mf.mf_event
