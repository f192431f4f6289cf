"""The ``ridge_tuning`` problem factory (paper 004, §7) over the bilevel ridge instances."""

from __future__ import annotations

import math

import jax

from dpsco_jax._checks import check_choice
from dpsco_jax.config.families import RidgeTuningProblem
from dpsco_jax.problems.bilevel import (BilevelProblem, diabetes_ridge_problem,
                                        synthetic_ridge_problem)
from dpsco_jax.problems.bilevel_noisy_inputs import noisy_inputs_ridge_problem

__all__ = ["ridge_tuning"]


def ridge_tuning(cfg: dict, key: jax.Array) -> BilevelProblem:
  """Factory of ``ridge_tuning``: the ``dataset`` ``synthetic``, ``diabetes`` or
  ``noisy_inputs`` (:mod:`~dpsco_jax.problems.bilevel_noisy_inputs`) from the config's keys."""
  view = RidgeTuningProblem.of(cfg)
  dataset = check_choice(view.dataset, "dataset", ("synthetic", "diabetes", "noisy_inputs"))
  if dataset != "noisy_inputs" and view.input_noise is not None:
    raise ValueError(f"input_noise is read only by dataset='noisy_inputs', not {dataset!r}")
  # derived defaults (the schema's None): the interval depends on the dataset
  bounds = tuple(view.get("omega_bounds", (1e-2, 5.0) if dataset == "diabetes"
                          else (1e-3, 5.0)))
  if dataset == "diabetes":
    return diabetes_ridge_problem(key, omega_bounds=bounds, omega0=view.omega0,
                                  clip=view.clip_norm)
  sizes = dict(d=int(view.d), n_train=int(view.n_train), n_val=int(view.n_val),
               label_noise=float(view.label_noise), omega_bounds=bounds,
               omega0=float(view.omega0), clip=view.clip_norm)
  if dataset == "noisy_inputs":
    tau = view.input_noise   # null in a config means the default, as for clip_norm
    return noisy_inputs_ridge_problem(
        key, input_noise=math.sqrt(0.5) if tau is None else float(tau), **sizes)
  return synthetic_ridge_problem(key, **sizes)
