"""Paper 003's typed config: :class:`SrgdConfig` (``accelerated_dp_srgd`` and its ablations)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, Optional

from dpsco_jax.config.families import AlgorithmKeys, Averaging, Preset, Relation, config_key

__all__ = ["SrgdConfig"]


@dataclasses.dataclass(frozen=True)
class SrgdConfig(AlgorithmKeys):
  """Paper 003's drivers (accelerated_dp_srgd and its ablations)."""
  private_requires: ClassVar[tuple] = ("delta",)
  # as DP-SGD: no run is non-private by leaving epsilon out; noise_multiplier: 0 says so
  requires_one_of: ClassVar[tuple] = (("epsilon", "noise_multiplier"),)
  epsilon: Optional[float] = config_key("budget; null with noise_multiplier: report its epsilon "
                                        "(noise_multiplier: 0 is the non-private reference)")
  delta: Optional[float] = config_key("target delta (required for a private run: epsilon or "
                                      "noise_multiplier given)")
  relation: Optional[Relation] = config_key("zero_out or replace_one (add_remove refused)",
                                            "zero_out")
  preset: Preset = config_key("theory (accelerated_dp_srgd only) or practical", "practical")
  variant: Literal["interior", "constrained"] = config_key("theory preset's theorem", "constrained")
  noise_mechanism: Literal["tree", "independent", "banded", "blt"] = config_key(
      "default per algorithm; banded / blt: matrix-factorization prefix noise (issue #27)")
  bands: Optional[int] = config_key("bands of the banded strategy (default min(32, T))")
  buffers: Optional[int] = config_key("buffers of the BLT strategy (at most)", 4)
  mf_strategy: Optional[Literal["auto", "sqrt", "optimized"]] = config_key(
      "MF strategy: jax_privacy's optimizer (optimized), the built-in sqrt one, or auto", "auto")
  batch_size: Optional[int] = config_key("B (default floor(sqrt n))")
  num_steps: Optional[int] = config_key("steps of one epoch P (default floor(n / B)); T = epochs P")
  epochs: int = config_key("passes in one fixed public order (practical preset, SRG variants; "
                           "theory: 1)", 1)
  beta: Optional[float] = config_key("smoothness parameter of the step (default M max(1, scale T))")
  beta_scale: float = config_key("practical: beta = M max(1, beta_scale T)", 1.0)
  clip_norm: float = config_key("clip norm C (default L)")
  noise_multiplier: Optional[float] = config_key("explicit z (refused above the budget)")
  z_scale: float = config_key("post-processing scale of the accelerated step", 1.0)
  learning_rate: Optional[float] = config_key("projected-SGD variants' step (default 1/beta)")
  averaging: Averaging = config_key("projected-SGD variants' released point", "none")
