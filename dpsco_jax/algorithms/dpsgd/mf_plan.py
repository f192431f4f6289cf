"""The correlated-noise part of the DP-SGD plan: the MF strategy a bounded-participation
schedule is priced for (banded, BLT, or paper 003's binary tree) and its participation
sensitivity, as :class:`MfNoise` (schedules, relations and accounting: :mod:`.plan`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dpsco_jax._checks import check_choice, check_int
from dpsco_jax.config.families import Schema
from dpsco_jax.privacy import cyclic_participation as cyclic
from dpsco_jax.privacy import matrix_factorization as mf

DEFAULT_BANDS = 32


class MfNoise(NamedTuple):
  """The correlated-noise part of a plan: ``kind`` (``banded`` | ``blt``), the strategy's
  Toeplitz ``coefs`` (length ``steps`` for a BLT), BLT parameters, where they come from, and
  the participation schema they are priced for."""
  kind: str
  coefs: tuple
  buf_decay: tuple
  output_scale: tuple
  source: str
  participations: int
  min_sep: int
  sensitivity: float

  def stage_spec(self) -> tuple:
    """Hashable static description of the noise stage (the chain's compile key)."""
    if self.kind == "banded":
      return ("banded", self.coefs)
    if self.kind == "tree":
      return ("tree",)
    return ("blt", self.buf_decay, self.output_scale)


def _tree_sensitivity(steps: int, participations: int, min_sep: int) -> float:
  """The binary tree's exact sensitivity when every user takes part at most
  ``participations`` times, at one fixed offset ``p, p + P, ...`` of the public order
  (``P = min_sep``; ``full``: ``P = 1``): :func:`~dpsco_jax.privacy.cyclic_participation.
  tree_cyclic_sensitivity` (one participation: ``sqrt(levels)``, paper 003's Lemma 5.6)."""
  period = min(min_sep, steps)
  return cyclic.tree_cyclic_sensitivity(steps, period, min(participations,
                                                           -(-steps // period)))


def _mf_noise(cfg: Schema, kind: str, steps: int, participations: int, min_sep: int
              ) -> MfNoise:
  """The MF strategy for the schedule. Default bands: ``min(32, steps)`` for one
  participation, else ``min(32, min_sep)`` (bands within the separation keep the columns
  disjoint: no overlap penalty; under ``full`` that is 1, i.e. independent noise)."""
  if kind == "tree":   # the paper-003 tree, no strategy to optimize
    return MfNoise("tree", (), (), (), "binary tree (paper 003, Lemma 5.6)", participations,
                   min_sep, _tree_sensitivity(steps, participations, min_sep))
  strategy = check_choice(cfg.mf_strategy, "mf_strategy", mf.STRATEGIES)
  if kind == "banded":
    default = min(DEFAULT_BANDS, steps if participations == 1 else min_sep)
    s = mf.banded_strategy(steps, check_int(cfg.get("bands", default), "bands"),
                           strategy=strategy)
    coefs, th, om, source = tuple(float(c) for c in s.coefs), (), (), s.source
  else:
    b = mf.blt_strategy(steps, check_int(cfg.buffers, "buffers"),
                        participations=participations, min_sep=min_sep, strategy=strategy)
    coefs = tuple(float(c) for c in mf.blt_coefs(b.buf_decay, b.output_scale, steps))
    th, om, source = tuple(map(float, b.buf_decay)), tuple(map(float, b.output_scale)), b.source
  sens = mf.participation_sensitivity(np.asarray(coefs), steps, participations=participations,
                                      min_sep=min_sep)
  return MfNoise(kind, coefs, th, om, source, participations, min_sep, sens)
