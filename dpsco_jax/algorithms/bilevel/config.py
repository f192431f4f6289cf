"""Paper 004's typed configs: ``dp_bilevel`` (and its minibatch / population variants),
``nonprivate_penalty``, ``dp_loc_gd`` and ``dp_loc_sgd``."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Union

from dpsco_jax.config.families import AlgorithmKeys, Preset, Relation, config_key

__all__ = ["BilevelConfig", "NonPrivatePenaltyConfig", "LocGdConfig", "LocSgdConfig"]


@dataclasses.dataclass(frozen=True)
class BilevelConfig(AlgorithmKeys):
  """``dp_bilevel`` / ``dp_bilevel_minibatch`` / ``dp_bilevel_population`` (replace-one)."""
  epsilon: float = config_key("privacy budget", required=True)
  delta: float = config_key("target delta", required=True)
  relation: Optional[Relation] = config_key("only replace_one", "replace_one")
  preset: Preset = config_key("Thm 4.1/5.1/6.1 constants or practical", "practical")
  inner_batch_size: Optional[int] = config_key("inner Poisson batch (Alg 3)")
  outer_batch_size: Optional[int] = config_key("outer Poisson batch (Alg 3)")
  outer_noise: Union[Literal["auto"], bool] = config_key("noise the outer estimator", "auto")
  lam: float = config_key("penalty lambda", 30.0)
  learning_rate: float = config_key("outer step size eta", 0.5)
  num_steps: int = config_key("outer steps T", 30)
  outer_clip_norm: float = config_key("outer clip norm (default 5 ell kappa)")
  inner_num_steps: int = config_key("steps per inner solve", 300)
  inner_rounds: int = config_key("localization rounds per inner solve", 2)
  inner_step_rule: Literal["smooth", "paper"] = config_key("inner step-size rule", "smooth")
  inner_clip_norm: Optional[float] = config_key(
      "inner clip norm of both solves (default per solve)")
  inner_clip_norm_lam: float = config_key(
      "inner clip norm of the penalized solve (default inner_clip_norm)")
  radius_const: float = config_key("localization radius constant", 4.0)
  inner_radius0: float = config_key("initial inner radius (default per solve)")
  shares: tuple[float, float, float] = config_key(
      "budget shares (y, y^lam, outer); write [[a,b,c]]")
  warm_start: bool = config_key("warm-start the inner solves", True)
  noise_multiplier: Optional[float] = config_key("explicit base z (default: calibrated)")
  population: bool = config_key("theory preset: Thm 6.1's population alpha", False)
  max_theory_work: float = config_key("theory preset: refuse above this many gradients", 1e10)


@dataclasses.dataclass(frozen=True)
class NonPrivatePenaltyConfig(AlgorithmKeys):
  """``nonprivate_penalty``: exact inner solves, non-private reference."""
  lam: float = config_key("penalty lambda", 1e3)
  learning_rate: float = config_key("outer step size eta", 0.5)
  num_steps: int = config_key("outer steps T", 300)
  newton_steps: int = config_key("Newton steps per exact solve", 30)


@dataclasses.dataclass(frozen=True)
class LocGdConfig(AlgorithmKeys):
  """``dp_loc_gd`` (Alg 2), item level, replace-one."""
  epsilon: float = config_key("privacy budget", required=True)
  delta: float = config_key("target delta", required=True)
  mu: Optional[float] = config_key("public strong-convexity constant (default: the declared "
                                   "strong_convexity)")
  relation: Optional[Relation] = config_key("only replace_one", "replace_one")
  preset: Preset = config_key("Thm 8.2 constants or practical", "practical")
  batch_size: Optional[int] = config_key("Poisson batch (dp_loc_sgd); null: full batch")
  noise_multiplier: Optional[float] = config_key("explicit z (refused above the budget)")
  clip_norm: float = config_key("clip norm (default the problem's L)")
  radius0: float = config_key("initial radius (default 2R)")
  l2: float = config_key("data-independent ridge term l2/2 ||y||^2", 0.0)
  smoothness: Optional[float] = config_key("smooth step rule's beta (null: paper rule)")
  num_steps: Optional[int] = config_key("steps per round (default from rho n^2/d)")
  rounds: Optional[int] = config_key("localization rounds (default Thm 8.2)")
  radius_const: float = config_key("localization radius constant", 4.0)


@dataclasses.dataclass(frozen=True)
class LocSgdConfig(LocGdConfig):
  """``dp_loc_sgd`` (Alg 4): Poisson mini-batches."""
  batch_size: int = config_key("Poisson batch size", required=True)
