"""Paper 002's typed configs: ``resque_parallel_sco``, ``resque_private_sco``, ``minibatch_sgd``."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from dpsco_jax.config.families import AlgorithmKeys, Preset, Relation, config_key

__all__ = ["TargetKeys", "ResqueParallelConfig", "ResquePrivateConfig", "MinibatchSgdConfig"]


@dataclasses.dataclass(frozen=True)
class TargetKeys(AlgorithmKeys):
  target: Optional[float] = config_key("excess-risk target (default target_frac x initial excess)")
  target_frac: Optional[float] = config_key("target as a fraction of the initial excess risk", 0.1)


@dataclasses.dataclass(frozen=True)
class ResqueParallelConfig(TargetKeys):
  """``resque_parallel_sco`` (Theorem 1, non-private)."""
  eps_opt: Optional[float] = config_key("accuracy eps_opt (default target)")
  c_ba: Optional[float] = config_key("ball-acceleration constant", 1.0)
  oracle: Optional[Literal["epoch_sgd", "acsa"]] = config_key("ball oracle", "epoch_sgd")
  ls_runs: Optional[int] = config_key("EpochSGD repetitions", 1)
  lam_min_scale: Optional[float] = config_key("multiplies lambda_star for lambda_min", 1.0)
  c_phi: Optional[float] = config_key("ball-oracle phi constant", 1.0)
  max_iter: Optional[int] = config_key("cap on accelerated iterations (default none)")


@dataclasses.dataclass(frozen=True)
class ResquePrivateConfig(AlgorithmKeys):
  """``resque_private_sco`` (Theorems 3-4, item level, replace-one)."""
  epsilon: float = config_key("privacy budget", required=True)
  delta: float = config_key("target delta", required=True)
  relation: Optional[Relation] = config_key("neighbouring relation (only replace_one)",
                                            "replace_one")
  preset: Optional[Preset] = config_key("theory checks Theorem 3's preconditions", "practical")
  constants: Optional[Literal["explicit", "c_priv"]] = config_key(
      "explicit proof constants or the C_priv form", "explicit")
  c_priv: Optional[float] = config_key("universal constant C_priv (default 60 theory / 1)")
  C: Optional[float] = config_key("theory preset: Theorem 3's C", 1.0)
  c_ba: Optional[float] = config_key("theory preset: ball-acceleration constant", 1.0)
  phases: Optional[int] = config_key("localization phases", 2)
  phase_budget: Optional[Literal["paper", "parallel"]] = config_key(
      "eps/2^i per phase (paper) or parallel composition", "paper")
  rho_over_r: Optional[float] = config_key("rho / r", 4.0)
  eps_opt_scale: Optional[float] = config_key("multiplies the eps_opt formula", 1.0)
  rho: Optional[float] = config_key("practical override of eq. (30)'s rho (x L sqrt d)")
  T_frac: Optional[float] = config_key("Alg. 4 T as a fraction of n_i (power of 2 floor)", 0.25)
  runs_ls: Optional[int] = config_key("line-search solver runs", 1)
  mlmc_copies: Optional[int] = config_key("MLMC estimator copies", 1)
  max_iter: Optional[int] = config_key("accelerated iterations per phase", 20)
  max_bisection: Optional[int] = config_key("bisection steps per iteration", 2)


@dataclasses.dataclass(frozen=True)
class MinibatchSgdConfig(TargetKeys):
  """``minibatch_sgd`` (paper 002's non-private query-depth baseline)."""
  num_steps: Optional[int] = config_key("steps (= query depth)", 20000)
  batch_size: Optional[int] = config_key("examples per step (with replacement)", 64)
  eval_every: Optional[int] = config_key("steps between risk evaluations", 100)
  learning_rate: Optional[float] = config_key("step size (default R/(L sqrt(num_steps)))")
