"""The DP-SGD baselines' typed configs: :class:`DpSgdConfig` (``dp_sgd_user`` /
``dp_sgd_item`` / ``dp_sgd_group``) and :class:`SgdSchedule` (its schedule keys, and all of
non-private SGD's: ``nonprivate_sgd``).

The fields follow :mod:`dpsco_jax.config.families`' conventions; their defaults are the ones
that run.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, Optional

from dpsco_jax.config.families import AlgorithmKeys, Averaging, Relation, config_key

__all__ = ["SgdSchedule", "DpSgdConfig"]


@dataclasses.dataclass(frozen=True)
class SgdSchedule(AlgorithmKeys):
  """The schedule keys shared by DP-SGD and non-private SGD (``nonprivate_sgd``)."""
  sampling: Optional[Literal["poisson", "fixed", "full"]] = config_key(
      "user sampling (DP-SGD's default: poisson)", "fixed")
  batch_size: Optional[int] = config_key("users (rows) per step (default round(sqrt n))")
  num_steps: Optional[int] = config_key("number of steps (default from epochs)")
  epochs: Optional[float] = config_key("passes over the data when num_steps is not given", 1.0)
  learning_rate: Optional[float] = config_key("step size (default R / (C sqrt(num_steps)))")
  averaging: Optional[Averaging] = config_key("released point: last iterate or uniform average",
                                              "uniform")


@dataclasses.dataclass(frozen=True)
class DpSgdConfig(SgdSchedule):
  """``dp_sgd_user`` / ``dp_sgd_item`` / ``dp_sgd_group`` (accountant)."""
  requires_one_of: ClassVar[tuple] = (("epsilon", "noise_multiplier"),)
  epsilon: Optional[float] = config_key("budget; null with noise_multiplier: report its epsilon")
  delta: float = config_key("target delta", required=True)
  noise_multiplier: Optional[float] = config_key(
      "explicit z (skips calibration; checked vs budget)")
  clip_norm: Optional[float] = config_key("clip norm C of each user's mean gradient (default L)")
  sampling_rate: Optional[float] = config_key("Poisson rate q (overrides batch_size / n_users)")
  relation: Optional[Relation] = config_key("neighbouring relation (default from sampling)")
  # issue #27: correlated (matrix-factorization) noise and the cyclic multi-epoch schedule
  sampling: Optional[Literal["poisson", "fixed", "full", "cyclic", "banded_poisson"]] = config_key(
      "user sampling (cyclic: fixed-order epochs, each user once per epoch; banded_poisson: "
      "b-min-sep Poisson within min_separation public groups, for banded noise)", "poisson")
  noise_mechanism: Optional[Literal["independent", "banded", "blt", "tree"]] = config_key(
      "noise: independent Gaussian, banded or BLT matrix factorization, or the binary tree",
      "independent")
  bands: Optional[int] = config_key("bands b of the banded strategy (default min(32, steps per "
                                    "epoch))")
  min_separation: Optional[int] = config_key("groups b of sampling banded_poisson (group t mod b "
                                             "is active at step t; default bands, else 32)")
  buffers: Optional[int] = config_key("buffers of the BLT strategy (at most)", 4)
  mf_strategy: Optional[Literal["auto", "sqrt", "optimized"]] = config_key(
      "MF strategy: jax_privacy's optimizer (optimized), the built-in sqrt one, or auto", "auto")
