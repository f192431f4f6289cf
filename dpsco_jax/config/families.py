"""The shared config schemas: the runner's keys, one frozen dataclass per problem, a user
problem's and its data files' keys, :class:`AlgorithmKeys` (every algorithm config's base) and
the Flax trainer's config. Each algorithm family's schema is its package's ``config.py``,
built with :func:`config_key` / :func:`refused_key`. A field is one key: its annotation the
accepted YAML type, its default the one that runs (``None`` on a non-Optional field: derived,
the doc says how), ``metadata["doc"]`` its doc, ``metadata["required"]`` whether it must be
given.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal, Optional, Union

from dpsco_jax.config.types import Schema  # re-exported

__all__ = ["AlgorithmKeys", "PROBLEM_SCHEMAS", "RunnerKeys", "Schema", "USER_PROBLEM",
           "UserProblemKeys", "DataFileKeys", "DPTrainerConfig", "CONFIG_ONLY_ALGORITHMS",
           "Relation", "Preset", "Averaging", "config_key", "refused_key"]


def config_key(doc: str, default: Any = None, *, required: bool = False) -> Any:
  return dataclasses.field(default=default, metadata={"doc": doc, "required": required})


def refused_key(why: str) -> Any:
  """A vocabulary key this family cannot honour: listed, and a value raises ``why``."""
  return dataclasses.field(default=None, metadata={"doc": f"not accepted: {why}",
                                                   "required": False, "refused": why})


Relation = Literal["add_remove", "replace_one", "zero_out"]
Preset = Literal["practical", "theory"]
Averaging = Literal["none", "uniform"]


@dataclasses.dataclass(frozen=True)
class RunnerKeys(Schema):
  """Keys the runner itself reads (every run)."""
  algorithm: str = config_key("registered algorithm (`dpsco list`)", required=True)
  problem: str = config_key("registered problem (`dpsco list`)", required=True)
  seed: int = config_key("seed of the run's key (problem: fold_in 0, algorithm: fold_in 1)", 0)
  debug: bool = config_key(
      "put data-dependent diagnostics (never part of a release) in the record", False)
  name: Optional[str] = config_key("title of the config file's table")
  description: Optional[str] = config_key("free text describing the config file")


@dataclasses.dataclass(frozen=True)
class SizedProblem(Schema):
  """Planted problems: n users x m items in R^d, optimum inside the ball of radius R."""
  n_users: int = config_key("number of users n", required=True)
  m: int = config_key("items per user m", required=True)
  d: int = config_key("dimension d", required=True)
  radius: float = config_key("radius R of the constraint ball (||w*|| = R/2)", 2.0)
  n_eval: int = config_key("evaluation features for the population risk", 20000)


@dataclasses.dataclass(frozen=True)
class HingeProblem(SizedProblem):
  """``hinge`` (paper 000's non-smooth example): logistic labels, hinge loss."""
  n_eval: int = config_key("evaluation features for the population risk", 3000)


@dataclasses.dataclass(frozen=True)
class LogisticProblem(SizedProblem):
  """``logistic``: labels ~ Bernoulli(sigmoid(<w*_u, x>)) (no label-noise key)."""
  heterogeneity: float = config_key("std h of each user's shift of w* (0: i.i.d. users)", 0.0)


@dataclasses.dataclass(frozen=True)
class NoisyProblem(LogisticProblem):
  """``least_squares`` (uniform label noise) and ``absolute`` (Laplace label noise)."""
  noise: float = config_key("label-noise scale s of the problem (not privacy noise)", 0.5)


@dataclasses.dataclass(frozen=True)
class L2LogisticProblem(LogisticProblem):
  """``l2_logistic`` (paper 001): logistic plus (l2/2)||w||^2, strongly convex."""
  l2: float = config_key("ridge weight = strong convexity mu", 0.1)


@dataclasses.dataclass(frozen=True)
class CorruptedLogisticProblem(LogisticProblem):
  """``logistic_corrupted`` (paper 000): a fraction of adversarial users."""
  corruption: float = config_key("fraction of corrupted users", 0.05)
  corruption_mode: Literal["flip", "huge", "random"] = config_key(
      "flip labels / scale features by corruption_scale / random data", "flip")
  corruption_scale: float = config_key("feature scale of 'huge' users", 100.0)


@dataclasses.dataclass(frozen=True)
class IllConditionedProblem(Schema):
  """``ill_conditioned_least_squares`` (paper 003): spectrum logspace(-log10 cond, 0, d)."""
  n_users: int = config_key("number of users n", required=True)
  m: int = config_key("items per user", 1)
  d: int = config_key("dimension", 8)
  radius: float = config_key("constraint radius R", 2.0)
  noise: float = config_key("label-noise scale s (uniform on [-s, s])", 0.5)
  condition: float = config_key("condition number of the feature covariance", 1e3)


@dataclasses.dataclass(frozen=True)
class RidgeTuningProblem(Schema):
  """``ridge_tuning`` (paper 004): tune a ridge penalty on a validation split."""
  dataset: Literal["synthetic", "diabetes", "noisy_inputs"] = config_key(
      "synthetic data, scikit-learn diabetes, or noisy_inputs (synthetic, validated on noisy "
      "inputs: optimal penalty ~ input_noise^2 at every n)", "synthetic")
  omega_bounds: tuple[float, float] = config_key(
      "interval X of the penalty (default [1e-3, 5], diabetes [1e-2, 5]); write [[lo, hi]]")
  omega0: float = config_key("initial penalty", 1.0)
  clip_norm: Optional[float] = config_key(
      "clip norm of the per-example data terms (null: the problem's bound)")
  d: int = config_key("features (synthetic only)", 10)
  n_train: int = config_key("training examples (synthetic only)", 2000)
  n_val: int = config_key("validation examples (synthetic only)", 2000)
  label_noise: float = config_key("label-noise std (synthetic, noisy_inputs)", 3.0)
  input_noise: Optional[float] = config_key(
      "std tau per coordinate of the validation inputs' noise (noisy_inputs only; null: "
      "sqrt(0.5), optimal penalty ~ tau^2)")


#: The problem name of your own model, loss and data (:mod:`dpsco_jax.runner.user`).
USER_PROBLEM = "user"


@dataclasses.dataclass(frozen=True)
class UserProblemKeys(Schema):
  """``user``: your own problem, named by import path (``module:function``) and data file."""
  factory: Optional[str] = config_key(
      "'module:function' building the problem (called with args, and seed / key / rngs if it "
      "takes them): a mapping {loss, model, data, eval_data, metrics, constants, n_users}, a "
      "(loss, model_or_params, data[, metric]) tuple, or a problem object with excess_risk")
  args: Optional[dict] = config_key("keyword arguments of the factory (without one: of model)")
  model: Optional[str] = config_key(
      "'module:callable' returning an nnx.Module (run through fit_model / flax.DPTrainer) or "
      "a params pytree (run through dpsco_jax.fit); called with args, and seed / key / rngs if "
      "it takes them")
  loss: Optional[str] = config_key(
      "'module:function' loss(model_or_params, example) -> scalar, one item")
  data: Optional[Union[str, dict]] = config_key(
      "training data file: PATH or {path, user_column, columns, max_items_per_user, selection, "
      "seed} (.npz, .csv, .parquet)")
  eval_data: Optional[Union[str, dict]] = config_key(
      "data file the metrics read (same form as data; default: the training data)")
  eval_data_public: bool = config_key(
      "declare eval_data public: its users are not the training users and are not covered by "
      "the guarantee; a private selection (select.private) may then score candidates on it",
      False)
  metric: Optional[Union[str, dict]] = config_key(
      "'module:function' metric(model_or_params, data) -> float (record field: its name), or "
      "{field: 'module:function', ...}")
  n_users: Optional[int] = config_key("declared public number of users (algorithms read it under "
                                      "add_remove)")
  lipschitz: Optional[float] = config_key("declared constant L of your loss")
  smoothness: Optional[float] = config_key("declared constant beta of your loss")
  radius: Optional[float] = config_key("declared radius R of the constraint ball (default: none)")
  strong_convexity: Optional[float] = config_key("declared constant mu of your loss")


@dataclasses.dataclass(frozen=True)
class DataFileKeys(Schema):
  """A user problem's ``data:`` / ``eval_data:`` mapping (a PATH alone is ``{path: PATH}``)."""
  path: str = config_key(
      "the file: .npz (arrays of N rows), .csv or .parquet (one row per item)", required=True)
  user_column: Optional[str] = config_key("the array / column of user ids (.npz default: user_ids; "
                                          "required for a table)")
  columns: Optional[Union[list, dict]] = config_key(
      "the example's leaves: a list of arrays / columns, or {leaf: column or [columns]} "
      "(stacked into one vector); default: every one but user_column")
  max_items_per_user: Optional[int] = config_key(
      "declared contribution bound m (default: measured, which algorithms that read m refuse)")
  selection: Optional[Literal["random", "first"]] = config_key("which items a user beyond m keeps",
                                                               "random")
  seed: Optional[int] = config_key("seed of the random selection", 0)
  user_id_dtype: Optional[Literal["str", "int"]] = config_key(
      "how a .csv reads its user ids: str (default; the exact text, surrounding spaces "
      "stripped) or int (01 and 1 are one user)")


PROBLEM_SCHEMAS: dict[str, type] = {
    "least_squares": NoisyProblem, "absolute": NoisyProblem, "logistic": LogisticProblem,
    "logistic_corrupted": CorruptedLogisticProblem, "hinge": HingeProblem,
    "l2_logistic": L2LogisticProblem, "ill_conditioned_least_squares": IllConditionedProblem,
    "ridge_tuning": RidgeTuningProblem,
    USER_PROBLEM: UserProblemKeys,
}


@dataclasses.dataclass(frozen=True)
class AlgorithmKeys(Schema):
  """Keys every algorithm's config holds besides its own, written once: the declared number
  of users and ``debug`` (in a run config, the problem's and the runner's keys)."""
  n_users: Optional[int] = config_key(
      "declared (public) number of users; the planners read it under "
      "add_remove, where the realized count is private")
  debug: Optional[bool] = config_key(
      "put data-dependent diagnostics (never released) in the record / Result.debug", False)


@dataclasses.dataclass(frozen=True)
class DPTrainerConfig(AlgorithmKeys):
  """``flax.DPTrainer`` from a config (user problems with an nnx model only): DP-SGD step by
  step, fast clipping, accounted as it goes (:class:`dpsco_jax.flax.DPTrainer`): Poisson
  sampling, or the cyclic schedule with independent / banded / BLT noise (issue #27)."""
  requires_one_of: ClassVar[tuple] = (("epsilon", "noise_multiplier"),)
  epsilon: Optional[float] = config_key("target epsilon of num_steps steps (calibrates z; also a "
                                        "budget); null with noise_multiplier: report its epsilon")
  delta: float = config_key("target delta", required=True)
  clip_norm: Union[float, Literal["adaptive"]] = config_key(
      "clip norm C of each user's (item's) mean gradient, or adaptive: C follows "
      "target_quantile of the users' norms from initial_clip_norm (Andrew et al. 2021)",
      required=True)
  sampling: Literal["poisson", "cyclic"] = config_key(
      "poisson (rate sampling_rate) or cyclic (fixed-order epochs of batch_size users)",
      "poisson")
  sampling_rate: Optional[float] = config_key(
      "declared Poisson rate q (sampling: poisson, where it is required)")
  batch_size: Optional[int] = config_key(
      "users per step B (sampling: cyclic, where it is required)")
  num_steps: int = config_key("number of steps", required=True)
  learning_rate: float = config_key("step size of the optimizer", required=True)
  optimizer: Literal["sgd", "momentum", "adam"] = config_key(
      "optax optimizer on the privatized gradient (momentum: 0.9)", "sgd")
  expected_batch_size: Optional[float] = config_key(
      "declared denominator D, poisson only (default sampling_rate x the declared n_users; "
      "under zero_out / replace_one: q n)")
  relation: Optional[Relation] = config_key("neighbouring relation (default add_remove under "
                                            "poisson, zero_out under cyclic)")
  noise_mechanism: Literal["independent", "banded", "blt", "tree"] = config_key(
      "noise: independent Gaussian, or banded / BLT matrix factorization or the binary tree "
      "(sampling: cyclic)", "independent")
  bands: Optional[int] = config_key("bands b of the banded strategy (default dp_sgd_user's: "
                                    "min(32, steps per epoch))")
  buffers: Optional[int] = config_key(
      "buffers of the BLT strategy, at most (default dp_sgd_user's)")
  mf_strategy: Optional[Literal["auto", "sqrt", "optimized"]] = config_key(
      "MF strategy: jax_privacy's optimizer (optimized), the built-in sqrt one, or auto "
      "(default dp_sgd_user's)")
  noise_multiplier: Optional[float] = config_key(
      "explicit z (skips calibration; checked vs budget)")
  epsilon_budget: Optional[float] = config_key("hard cap of the ledger")
  level: Literal["user", "item"] = config_key("user- or item-level DP", "user")
  method: Literal["fast", "vmap", "auto"] = config_key(
      "per-user clipping: taps, vmap, or timed", "fast")
  batch_capacity: Optional[int] = config_key("users processed at once (default D + 4 sqrt(D) + 1; "
                                             "cyclic: B)")
  accumulation_steps: int = config_key("micro-batches accumulated under one noise draw", 1)
  accountant: Literal["pld", "rdp", "auto"] = config_key("privacy accountant", "pld")
  report_every: Optional[int] = config_key("steps per accounting block / progress report (default "
                                           "num_steps / 20)")
  # adaptive clipping: dp_sgd_user's keys
  target_quantile: Optional[float] = config_key(
      "clip_norm: adaptive: fraction gamma in (0, 1) of users left unclipped (default 0.5)")
  clip_learning_rate: Optional[float] = config_key(
      "clip_norm: adaptive: step eta_C of C <- C exp(-eta_C (b - gamma)) (default 0.2)")
  initial_clip_norm: Optional[float] = config_key(
      "clip_norm: adaptive: the first clip norm C_0 (required there)")
  count_stddev: Optional[float] = config_key(
      "clip_norm: adaptive: std sigma_b of the unclipped count's noise, in users (default "
      "max(D / 20, z)); 2 sigma_b must exceed z")


#: Algorithms a config may name that are not registered drivers (a user problem's nnx model).
CONFIG_ONLY_ALGORITHMS: dict[str, type] = {"flax.DPTrainer": DPTrainerConfig}
