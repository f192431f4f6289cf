"""Paper 000's typed configs: :class:`FilterCommon` (every driver's keys),
:class:`PhasedSgdConfig`, :class:`AcceleratedErmConfig`, :class:`AcceleratedErmSmoothedConfig`."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Union

from dpsco_jax.config.families import AlgorithmKeys, Preset, Relation, config_key

__all__ = ["FilterCommon", "PhasedSgdConfig", "AcceleratedErmConfig",
           "AcceleratedErmSmoothedConfig"]


@dataclasses.dataclass(frozen=True)
class FilterCommon(AlgorithmKeys):
  """Keys of paper 000's drivers (replace-one; FILTER + private tests)."""
  epsilon: float = config_key("privacy budget", required=True)
  delta: float = config_key("target delta", required=True)
  preset: Optional[Preset] = config_key("paper constants (theory) or laptop scale", "practical")
  sensitivity: Optional[Literal["certified", "typical"]] = config_key(
      "coupled sensitivity bound (certified) or the heuristic typical one", "certified")
  privacy_noise: Optional[bool] = config_key("privacy noise switch (false: non-private ablation)",
                                      True)
  relation: Optional[Relation] = config_key("neighbouring relation (only replace_one)",
                                            "replace_one")
  noise_multiplier: Optional[float] = config_key("explicit z (practical only)")
  fallback: Optional[Literal["zero", "init"]] = config_key("point released on a halt", "zero")
  q_exp: Optional[float] = config_key("phase-size exponent q (default per preset)")
  p_exp: Optional[float] = config_key("step-size decay exponent p (default per preset)")
  num_phases: Optional[int] = config_key("number of phases (default floor(log2 n) / preset)")


@dataclasses.dataclass(frozen=True)
class PhasedSgdConfig(FilterCommon):
  """``user_level_phased_sgd`` (Algorithm 1)."""
  learning_rate: Optional[float] = config_key("base step size eta (default R/(L sqrt(d m n eps)))")
  num_groups: Optional[int] = config_key("groups C per phase (practical)")
  clip_norm: Optional[Union[bool, float]] = config_key(
      "clip norm C of each item's gradient in the groups' SGD (true: L; null/false: no "
      "clipping). FILTER, not the clip, bounds the sensitivity: the clip only keeps an item "
      "that breaks the declared L from moving its group's iterate")
  project_output: Optional[bool] = config_key("project the output (default: practical preset)")


@dataclasses.dataclass(frozen=True)
class AcceleratedErmConfig(FilterCommon):
  """``user_level_accelerated_erm`` (Algorithms 2-3)."""
  lam: Optional[float] = config_key("localization weight lambda (default Thm C.3)")
  lam_scale: Optional[float] = config_key("practical: multiplies Thm C.3's lambda")
  batch_size: Optional[int] = config_key("users K_i per phase batch (practical)")
  tau: Optional[float] = config_key("concentration radius tau (default per preset)")
  max_steps: Optional[int] = config_key("practical cap on AC-SA steps per phase")
  clip_norm: Optional[Union[bool, float]] = config_key(
      "clip norm (true: L; null/false: no clipping)")


@dataclasses.dataclass(frozen=True)
class AcceleratedErmSmoothedConfig(AcceleratedErmConfig):
  """``user_level_accelerated_erm_smoothed`` (§4, uniform-ball smoothing)."""
  smoothing_radius: Optional[float] = config_key("smoothing radius r (beta = L sqrt(d)/r)")
