"""The DP-SGD baselines' typed configs: :class:`DpSgdConfig` (``dp_sgd_user`` /
``dp_sgd_item`` / ``dp_sgd_group``) and :class:`SgdSchedule` (``nonprivate_sgd``'s keys)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, Optional, Union

from dpsco_jax.config.families import AlgorithmKeys, Averaging, Relation, config_key

__all__ = ["SgdSchedule", "DpSgdConfig"]

#: The value of ``clip_norm`` that asks for adaptive clipping.
ADAPTIVE = "adaptive"
#: The keys only adaptive clipping reads.
ADAPTIVE_KEYS = ("target_quantile", "clip_learning_rate", "initial_clip_norm", "count_stddev")
#: The paper's defaults (§4): the median, a step of 0.2.
DEFAULT_TARGET_QUANTILE = 0.5
DEFAULT_CLIP_LEARNING_RATE = 0.2


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
  #: an adaptive key without ``clip_norm: adaptive`` would be ignored: refused
  read_only_with: ClassVar[dict] = dict.fromkeys(ADAPTIVE_KEYS, ("clip_norm", ADAPTIVE))
  epsilon: Optional[float] = config_key("budget; null with noise_multiplier: report its epsilon")
  delta: float = config_key("target delta", required=True)
  noise_multiplier: Optional[float] = config_key(
      "explicit z (skips calibration; checked vs budget)")
  clip_norm: Optional[Union[float, Literal["adaptive"]]] = config_key(
      "clip norm C of each user's mean gradient (default L), or adaptive: C follows "
      "target_quantile of the users' norms (Andrew et al. 2021)")
  sampling_rate: Optional[float] = config_key("Poisson rate q (overrides batch_size / n_users)")
  relation: Optional[Relation] = config_key("neighbouring relation (default from sampling)")
  # correlated (matrix-factorization) noise and the cyclic multi-epoch schedule
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
  # adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021)
  target_quantile: Optional[float] = config_key(
      "clip_norm: adaptive: fraction gamma in (0, 1) of users left unclipped (0.5: median)")
  clip_learning_rate: Optional[float] = config_key(
      "clip_norm: adaptive: step eta_C of the geometric update C <- C exp(-eta_C (b - gamma)) "
      "(default 0.2)")
  initial_clip_norm: Optional[float] = config_key(
      "clip_norm: adaptive: the first clip norm C_0 (default L)")
  count_stddev: Optional[float] = config_key(
      "clip_norm: adaptive: std sigma_b of the unclipped count's noise, in users (default "
      "max(D / 20, z)); 2 sigma_b must exceed z")
