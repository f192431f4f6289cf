"""Paper 001's typed configs: :class:`OutputPertConfig` (the output perturbation drivers) and
:class:`NaiveOutputPertConfig` (``naive_output_pert``)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from dpsco_jax.config.families import (AlgorithmKeys, Preset, Relation, config_key,
                                       refused_key)

__all__ = ["OutputPertConfig", "NaiveOutputPertConfig"]


@dataclasses.dataclass(frozen=True)
class OutputPertConfig(AlgorithmKeys):
  """Paper 001's output perturbation drivers (replace-one, n public)."""
  epsilon: float = config_key("privacy budget (theory preset: in (0, 1])", required=True)
  delta: float = config_key("target delta", required=True)
  preset: Optional[Preset] = config_key(
      "paper calibration (theory) or analytic Gaussian", "practical")
  stability_test: Optional[Literal["certificate", "exact"]] = config_key(
      "App. C certificate or the exact 2^n test", "certificate")
  on_certificate_failure: Optional[Literal["exact", "raise"]] = config_key(
      "exact fallback or abort (heuristic provenance)", "exact")
  max_exact_users: Optional[int] = config_key("largest n for the exact test (<= 22)", 16)
  solver_tol: Optional[float] = config_key("solver error as a fraction of Delta (<= 1)", 0.05)
  beta: Optional[float] = config_key("failure probability (default per algorithm)")
  Delta: Optional[float] = config_key("explicit data-independent Delta (practical, exact mode)")
  epsilon_budget: Optional[float] = config_key("ledger budget if different from epsilon")
  relation: Optional[Relation] = config_key("neighbouring relation (only replace_one)",
                                            "replace_one")
  clip_norm: Optional[float] = refused_key(
      "paper 001's algorithms release a noisy minimizer of a strongly convex ERM, and their "
      "sensitivity (naive: 2G/(mu n); DelOutputPert: the stability test's Delta) rests on the "
      "loss's Lipschitz constant G, which no clip can enforce (clipped gradients are not the "
      "gradient of any loss, so there is no minimizer to perturb). Declare G as the problem's "
      "lipschitz (constants={'lipschitz': G}); for a clipped mechanism use dp_sgd_user")


@dataclasses.dataclass(frozen=True)
class NaiveOutputPertConfig(OutputPertConfig):
  """``naive_output_pert``: Gaussian output perturbation, sensitivity 2G/(mu n)."""
  noise_multiplier: Optional[float] = config_key("explicit z (refused above the budget)")
