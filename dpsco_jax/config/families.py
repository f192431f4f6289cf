"""The config schemas themselves: one frozen dataclass per algorithm family and per problem.

Each field is one config key a driver or problem factory reads: its annotation is the accepted
YAML type, its default is documentation (``None`` on a non-Optional field: derived by the
driver, the doc says how), ``metadata["doc"]`` is a one-line doc and ``metadata["required"]``
marks keys that must be given. Built by reading each driver (``cfg.get`` / ``cfg[...]`` /
``cfg_get`` / ``_cfg``); :mod:`dpsco_jax.config.schema` validates configs against them, and
``tests/test_config_schema.py`` greps the drivers so that a new key without a field fails.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal, Optional, Union

# the base of every schema lives one layer down, beside the check it runs; re-exported here
from dpsco_jax.config.types import Schema

__all__ = ["AlgorithmKeys", "PROBLEM_SCHEMAS", "RunnerKeys", "Schema", "USER_PROBLEM",
           "UserProblemKeys", "DataFileKeys", "DPTrainerConfig", "CONFIG_ONLY_ALGORITHMS"]


def _key(doc: str, default: Any = None, *, required: bool = False) -> Any:
  return dataclasses.field(default=default, metadata={"doc": doc, "required": required})


def _refused(why: str) -> Any:
  """A key of the shared vocabulary this family cannot honour: listed (``dpsco keys``), and a
  value raises ``why`` (which key to use instead) rather than an "unknown key"."""
  return dataclasses.field(default=None, metadata={"doc": f"not accepted: {why}",
                                                   "required": False, "refused": why})


Relation = Literal["add_remove", "replace_one", "zero_out"]
Preset = Literal["practical", "theory"]
Averaging = Literal["none", "uniform"]

# ------------------------------------------------------------------------------- runner keys


@dataclasses.dataclass(frozen=True)
class RunnerKeys(Schema):
  """Keys the runner itself reads (every run)."""
  algorithm: str = _key("registered algorithm (`dpsco list`)", required=True)
  problem: str = _key("registered problem (`dpsco list`)", required=True)
  seed: int = _key("seed of the run's key (problem: fold_in 0, algorithm: fold_in 1)", 0)
  debug: bool = _key("put data-dependent diagnostics (never part of a release) in the record",
                     False)
  name: Optional[str] = _key("title of the config file's table")
  description: Optional[str] = _key("free text describing the config file")


# ------------------------------------------------------------------------------- problems


@dataclasses.dataclass(frozen=True)
class SizedProblem(Schema):
  """Planted problems: n users x m items in R^d, optimum inside the ball of radius R."""
  n_users: int = _key("number of users n", required=True)
  m: int = _key("items per user m", required=True)
  d: int = _key("dimension d", required=True)
  radius: float = _key("radius R of the constraint ball (||w*|| = R/2)", 2.0)
  n_eval: int = _key("evaluation features for the population risk", 20000)


@dataclasses.dataclass(frozen=True)
class HingeProblem(SizedProblem):
  """``hinge`` (paper 000's non-smooth example): logistic labels, hinge loss."""
  # its risk is a mean over the evaluation features of a non-smooth loss: 3000 is what every
  # hinge run has used (the schema said 20000, inherited, and was never read)
  n_eval: int = _key("evaluation features for the population risk", 3000)


@dataclasses.dataclass(frozen=True)
class LogisticProblem(SizedProblem):
  """``logistic``: labels ~ Bernoulli(sigmoid(<w*_u, x>)) (no label-noise key)."""
  heterogeneity: float = _key("std h of each user's shift of w* (0: i.i.d. users)", 0.0)


@dataclasses.dataclass(frozen=True)
class NoisyProblem(LogisticProblem):
  """``least_squares`` (uniform label noise) and ``absolute`` (Laplace label noise)."""
  noise: float = _key("label-noise scale s of the problem (not privacy noise)", 0.5)


@dataclasses.dataclass(frozen=True)
class L2LogisticProblem(LogisticProblem):
  """``l2_logistic`` (paper 001): logistic plus (l2/2)||w||^2, strongly convex."""
  l2: float = _key("ridge weight = strong convexity mu", 0.1)


@dataclasses.dataclass(frozen=True)
class CorruptedLogisticProblem(LogisticProblem):
  """``logistic_corrupted`` (paper 000): a fraction of adversarial users."""
  corruption: float = _key("fraction of corrupted users", 0.05)
  corruption_mode: Literal["flip", "huge", "random"] = _key(
      "flip labels / scale features by corruption_scale / random data", "flip")
  corruption_scale: float = _key("feature scale of 'huge' users", 100.0)


@dataclasses.dataclass(frozen=True)
class IllConditionedProblem(Schema):
  """``ill_conditioned_least_squares`` (paper 003): spectrum logspace(-log10 cond, 0, d)."""
  n_users: int = _key("number of users n", required=True)
  m: int = _key("items per user", 1)
  d: int = _key("dimension", 8)
  radius: float = _key("constraint radius R", 2.0)
  noise: float = _key("label-noise scale s (uniform on [-s, s])", 0.5)
  condition: float = _key("condition number of the feature covariance", 1e3)


@dataclasses.dataclass(frozen=True)
class RidgeTuningProblem(Schema):
  """``ridge_tuning`` (paper 004): tune a ridge penalty on a validation split."""
  dataset: Literal["synthetic", "diabetes", "noisy_inputs"] = _key(
      "synthetic data, scikit-learn diabetes, or noisy_inputs (synthetic, validated on noisy "
      "inputs: optimal penalty ~ input_noise^2 at every n)", "synthetic")
  omega_bounds: tuple[float, float] = _key(
      "interval X of the penalty (default [1e-3, 5], diabetes [1e-2, 5]); write [[lo, hi]]")
  omega0: float = _key("initial penalty", 1.0)
  clip_norm: Optional[float] = _key(
      "clip norm of the per-example data terms (null: the problem's bound)")
  d: int = _key("features (synthetic only)", 10)
  n_train: int = _key("training examples (synthetic only)", 2000)
  n_val: int = _key("validation examples (synthetic only)", 2000)
  label_noise: float = _key("label-noise std (synthetic, noisy_inputs)", 3.0)
  input_noise: Optional[float] = _key(
      "std tau per coordinate of the validation inputs' noise (noisy_inputs only; null: "
      "sqrt(0.5), optimal penalty ~ tau^2)")


#: The problem name of your own model, loss and data (a config's ``problem:`` section with
#: ``factory:`` or ``model:`` / ``loss:`` / ``data:`` and no ``name``; see
#: :mod:`dpsco_jax.runner.user`).
USER_PROBLEM = "user"


@dataclasses.dataclass(frozen=True)
class UserProblemKeys(Schema):
  """``user``: your own problem, named by import path (``module:function``) and data file."""
  factory: Optional[str] = _key(
      "'module:function' building the problem (called with args, and seed / key / rngs if it "
      "takes them): a mapping {loss, model, data, eval_data, metrics, constants, n_users}, a "
      "(loss, model_or_params, data[, metric]) tuple, or a problem object with excess_risk")
  args: Optional[dict] = _key("keyword arguments of the factory (without one: of model)")
  model: Optional[str] = _key(
      "'module:callable' returning an nnx.Module (run through fit_model / flax.DPTrainer) or "
      "a params pytree (run through dpsco_jax.fit); called with args, and seed / key / rngs if "
      "it takes them")
  loss: Optional[str] = _key("'module:function' loss(model_or_params, example) -> scalar, one "
                             "item")
  data: Optional[Union[str, dict]] = _key(
      "training data file: PATH or {path, user_column, columns, max_items_per_user, selection, "
      "seed} (.npz, .csv, .parquet)")
  eval_data: Optional[Union[str, dict]] = _key(
      "data file the metrics read (same form as data; default: the training data)")
  metric: Optional[Union[str, dict]] = _key(
      "'module:function' metric(model_or_params, data) -> float (record field: its name), or "
      "{field: 'module:function', ...}")
  n_users: Optional[int] = _key("declared public number of users (algorithms read it under "
                                "add_remove)")
  lipschitz: Optional[float] = _key("declared constant L of your loss")
  smoothness: Optional[float] = _key("declared constant beta of your loss")
  radius: Optional[float] = _key("declared radius R of the constraint ball (default: none)")
  strong_convexity: Optional[float] = _key("declared constant mu of your loss")


@dataclasses.dataclass(frozen=True)
class DataFileKeys(Schema):
  """A user problem's ``data:`` / ``eval_data:`` mapping (a PATH alone is ``{path: PATH}``)."""
  path: str = _key("the file: .npz (arrays of N rows), .csv or .parquet (one row per item)",
                   required=True)
  user_column: Optional[str] = _key("the array / column of user ids (.npz default: user_ids; "
                                    "required for a table)")
  columns: Optional[Union[list, dict]] = _key(
      "the example's leaves: a list of arrays / columns, or {leaf: column or [columns]} "
      "(stacked into one vector); default: every one but user_column")
  max_items_per_user: Optional[int] = _key(
      "declared contribution bound m (default: measured, which algorithms that read m refuse)")
  selection: Optional[Literal["random", "first"]] = _key("which items a user beyond m keeps",
                                                         "random")
  seed: Optional[int] = _key("seed of the random selection", 0)


PROBLEM_SCHEMAS: dict[str, type] = {
    "least_squares": NoisyProblem, "absolute": NoisyProblem, "logistic": LogisticProblem,
    "logistic_corrupted": CorruptedLogisticProblem, "hinge": HingeProblem,
    "l2_logistic": L2LogisticProblem, "ill_conditioned_least_squares": IllConditionedProblem,
    "ridge_tuning": RidgeTuningProblem,
    USER_PROBLEM: UserProblemKeys,
}

# ------------------------------------------------------------------------------- algorithms


@dataclasses.dataclass(frozen=True)
class AlgorithmKeys(Schema):
  """Keys every algorithm's config holds besides its own, written once: the declared number
  of users (a problem's ``n_users`` in a run config; ``dp.fit``'s ``config``) and ``debug``.
  In a run config they are the problem's and the runner's keys (:func:`keys_of` keeps their
  specs there); the algorithm's typed config carries their values to its planner."""
  n_users: Optional[int] = _key("declared (public) number of users; the planners read it under "
                                "add_remove, where the realized count is private")
  debug: Optional[bool] = _key("put data-dependent diagnostics (never released) in the record "
                               "/ Result.debug", False)


# ------------------------------------------------------------------------------- baselines


@dataclasses.dataclass(frozen=True)
class SgdSchedule(AlgorithmKeys):
  """The schedule keys shared by DP-SGD and non-private SGD (``nonprivate_sgd``)."""
  sampling: Optional[Literal["poisson", "fixed", "full"]] = _key(
      "user sampling (DP-SGD's default: poisson)", "fixed")
  batch_size: Optional[int] = _key("users (rows) per step (default round(sqrt n))")
  num_steps: Optional[int] = _key("number of steps (default from epochs)")
  epochs: Optional[float] = _key("passes over the data when num_steps is not given", 1.0)
  learning_rate: Optional[float] = _key("step size (default R / (C sqrt(num_steps)))")
  averaging: Optional[Averaging] = _key("released point: last iterate or uniform average",
                                        "uniform")


@dataclasses.dataclass(frozen=True)
class DpSgdConfig(SgdSchedule):
  """``dp_sgd_user`` / ``dp_sgd_item`` / ``dp_sgd_group`` (accountant)."""
  requires_one_of: ClassVar[tuple] = (("epsilon", "noise_multiplier"),)
  epsilon: Optional[float] = _key("budget; null with noise_multiplier: report its epsilon")
  delta: float = _key("target delta", required=True)
  noise_multiplier: Optional[float] = _key("explicit z (skips calibration; checked vs budget)")
  clip_norm: Optional[float] = _key("clip norm C of each user's mean gradient (default L)")
  sampling_rate: Optional[float] = _key("Poisson rate q (overrides batch_size / n_users)")
  relation: Optional[Relation] = _key("neighbouring relation (default from sampling)")
  # issue #27: correlated (matrix-factorization) noise and the cyclic multi-epoch schedule
  sampling: Optional[Literal["poisson", "fixed", "full", "cyclic", "banded_poisson"]] = _key(
      "user sampling (cyclic: fixed-order epochs, each user once per epoch; banded_poisson: "
      "b-min-sep Poisson within min_separation public groups, for banded noise)", "poisson")
  noise_mechanism: Optional[Literal["independent", "banded", "blt", "tree"]] = _key(
      "noise: independent Gaussian, banded or BLT matrix factorization, or the binary tree",
      "independent")
  bands: Optional[int] = _key("bands b of the banded strategy (default min(32, steps per "
                              "epoch))")
  min_separation: Optional[int] = _key("groups b of sampling banded_poisson (group t mod b "
                                       "is active at step t; default bands, else 32)")
  buffers: Optional[int] = _key("buffers of the BLT strategy (at most)", 4)
  mf_strategy: Optional[Literal["auto", "sqrt", "optimized"]] = _key(
      "MF strategy: jax_privacy's optimizer (optimized), the built-in sqrt one, or auto", "auto")


# ------------------------------------------------------------------------------- paper 000


@dataclasses.dataclass(frozen=True)
class FilterCommon(AlgorithmKeys):
  """Keys of paper 000's drivers (replace-one; FILTER + private tests)."""
  epsilon: float = _key("privacy budget", required=True)
  delta: float = _key("target delta", required=True)
  preset: Optional[Preset] = _key("paper constants (theory) or laptop scale", "practical")
  sensitivity: Optional[Literal["certified", "typical"]] = _key(
      "coupled sensitivity bound (certified) or the heuristic typical one", "certified")
  privacy_noise: Optional[bool] = _key("privacy noise switch (false: non-private ablation)",
                                      True)
  relation: Optional[Relation] = _key("neighbouring relation (only replace_one)",
                                      "replace_one")
  noise_multiplier: Optional[float] = _key("explicit z (practical only)")
  fallback: Optional[Literal["zero", "init"]] = _key("point released on a halt", "zero")
  q_exp: Optional[float] = _key("phase-size exponent q (default per preset)")
  p_exp: Optional[float] = _key("step-size decay exponent p (default per preset)")
  num_phases: Optional[int] = _key("number of phases (default floor(log2 n) / preset)")


@dataclasses.dataclass(frozen=True)
class PhasedSgdConfig(FilterCommon):
  """``user_level_phased_sgd`` (Algorithm 1)."""
  learning_rate: Optional[float] = _key("base step size eta (default R/(L sqrt(d m n eps)))")
  num_groups: Optional[int] = _key("groups C per phase (practical)")
  clip_norm: Optional[Union[bool, float]] = _key(
      "clip norm C of each item's gradient in the groups' SGD (true: L; null/false: no "
      "clipping). FILTER, not the clip, bounds the sensitivity: the clip only keeps an item "
      "that breaks the declared L from moving its group's iterate")
  project_output: Optional[bool] = _key("project the output (default: practical preset)")


@dataclasses.dataclass(frozen=True)
class AcceleratedErmConfig(FilterCommon):
  """``user_level_accelerated_erm`` (Algorithms 2-3)."""
  lam: Optional[float] = _key("localization weight lambda (default Thm C.3)")
  lam_scale: Optional[float] = _key("practical: multiplies Thm C.3's lambda")
  batch_size: Optional[int] = _key("users K_i per phase batch (practical)")
  tau: Optional[float] = _key("concentration radius tau (default per preset)")
  max_steps: Optional[int] = _key("practical cap on AC-SA steps per phase")
  clip_norm: Optional[Union[bool, float]] = _key(
      "clip norm (true: L; null/false: no clipping)")


@dataclasses.dataclass(frozen=True)
class AcceleratedErmSmoothedConfig(AcceleratedErmConfig):
  """``user_level_accelerated_erm_smoothed`` (§4, uniform-ball smoothing)."""
  smoothing_radius: Optional[float] = _key("smoothing radius r (beta = L sqrt(d)/r)")


# ------------------------------------------------------------------------------- paper 001


@dataclasses.dataclass(frozen=True)
class OutputPertConfig(AlgorithmKeys):
  """Paper 001's output perturbation drivers (replace-one, n public)."""
  epsilon: float = _key("privacy budget (theory preset: in (0, 1])", required=True)
  delta: float = _key("target delta", required=True)
  preset: Optional[Preset] = _key("paper calibration (theory) or analytic Gaussian", "practical")
  stability_test: Optional[Literal["certificate", "exact"]] = _key(
      "App. C certificate or the exact 2^n test", "certificate")
  on_certificate_failure: Optional[Literal["exact", "raise"]] = _key(
      "exact fallback or abort (heuristic provenance)", "exact")
  max_exact_users: Optional[int] = _key("largest n for the exact test (<= 22)", 16)
  solver_tol: Optional[float] = _key("solver error as a fraction of Delta (<= 1)", 0.05)
  beta: Optional[float] = _key("failure probability (default per algorithm)")
  Delta: Optional[float] = _key("explicit data-independent Delta (practical, exact mode)")
  epsilon_budget: Optional[float] = _key("ledger budget if different from epsilon")
  relation: Optional[Relation] = _key("neighbouring relation (only replace_one)",
                                      "replace_one")
  clip_norm: Optional[float] = _refused(
      "paper 001's algorithms release a noisy minimizer of a strongly convex ERM, and their "
      "sensitivity (naive: 2G/(mu n); DelOutputPert: the stability test's Delta) rests on the "
      "loss's Lipschitz constant G, which no clip can enforce (clipped gradients are not the "
      "gradient of any loss, so there is no minimizer to perturb). Declare G as the problem's "
      "lipschitz (constants={'lipschitz': G}); for a clipped mechanism use dp_sgd_user")


@dataclasses.dataclass(frozen=True)
class NaiveOutputPertConfig(OutputPertConfig):
  """``naive_output_pert``: Gaussian output perturbation, sensitivity 2G/(mu n)."""
  noise_multiplier: Optional[float] = _key("explicit z (refused above the budget)")


# ------------------------------------------------------------------------------- paper 002


@dataclasses.dataclass(frozen=True)
class TargetKeys(AlgorithmKeys):
  target: Optional[float] = _key("excess-risk target (default target_frac x initial excess)")
  target_frac: Optional[float] = _key("target as a fraction of the initial excess risk", 0.1)


@dataclasses.dataclass(frozen=True)
class ResqueParallelConfig(TargetKeys):
  """``resque_parallel_sco`` (Theorem 1, non-private)."""
  eps_opt: Optional[float] = _key("accuracy eps_opt (default target)")
  c_ba: Optional[float] = _key("ball-acceleration constant", 1.0)
  oracle: Optional[Literal["epoch_sgd", "acsa"]] = _key("ball oracle", "epoch_sgd")
  ls_runs: Optional[int] = _key("EpochSGD repetitions", 1)
  lam_min_scale: Optional[float] = _key("multiplies lambda_star for lambda_min", 1.0)
  c_phi: Optional[float] = _key("ball-oracle phi constant", 1.0)
  max_iter: Optional[int] = _key("cap on accelerated iterations (default none)")


@dataclasses.dataclass(frozen=True)
class ResquePrivateConfig(AlgorithmKeys):
  """``resque_private_sco`` (Theorems 3-4, item level, replace-one)."""
  epsilon: float = _key("privacy budget", required=True)
  delta: float = _key("target delta", required=True)
  relation: Optional[Relation] = _key("neighbouring relation (only replace_one)",
                                      "replace_one")
  preset: Optional[Preset] = _key("theory checks Theorem 3's preconditions", "practical")
  constants: Optional[Literal["explicit", "c_priv"]] = _key(
      "explicit proof constants or the C_priv form", "explicit")
  c_priv: Optional[float] = _key("universal constant C_priv (default 60 theory / 1)")
  C: Optional[float] = _key("theory preset: Theorem 3's C", 1.0)
  c_ba: Optional[float] = _key("theory preset: ball-acceleration constant", 1.0)
  phases: Optional[int] = _key("localization phases", 2)
  phase_budget: Optional[Literal["paper", "parallel"]] = _key(
      "eps/2^i per phase (paper) or parallel composition", "paper")
  rho_over_r: Optional[float] = _key("rho / r", 4.0)
  eps_opt_scale: Optional[float] = _key("multiplies the eps_opt formula", 1.0)
  rho: Optional[float] = _key("practical override of eq. (30)'s rho (x L sqrt d)")
  T_frac: Optional[float] = _key("Alg. 4 T as a fraction of n_i (power of 2 floor)", 0.25)
  runs_ls: Optional[int] = _key("line-search solver runs", 1)
  mlmc_copies: Optional[int] = _key("MLMC estimator copies", 1)
  max_iter: Optional[int] = _key("accelerated iterations per phase", 20)
  max_bisection: Optional[int] = _key("bisection steps per iteration", 2)


@dataclasses.dataclass(frozen=True)
class MinibatchSgdConfig(TargetKeys):
  """``minibatch_sgd`` (paper 002's non-private query-depth baseline)."""
  num_steps: Optional[int] = _key("steps (= query depth)", 20000)
  batch_size: Optional[int] = _key("examples per step (with replacement)", 64)
  eval_every: Optional[int] = _key("steps between risk evaluations", 100)
  learning_rate: Optional[float] = _key("step size (default R/(L sqrt(num_steps)))")


# ------------------------------------------------------------------------------- paper 003


@dataclasses.dataclass(frozen=True)
class SrgdConfig(AlgorithmKeys):
  """Paper 003's drivers (accelerated_dp_srgd and its ablations)."""
  private_requires: ClassVar[tuple] = ("delta",)
  epsilon: Optional[float] = _key("budget; null: non-private unless noise_multiplier")
  delta: Optional[float] = _key("target delta (required for a private run: epsilon or "
                                "noise_multiplier given)")
  relation: Optional[Relation] = _key("zero_out or replace_one (add_remove refused)",
                                      "zero_out")
  preset: Preset = _key("theory (accelerated_dp_srgd only) or practical", "practical")
  variant: Literal["interior", "constrained"] = _key("theory preset's theorem", "constrained")
  noise_mechanism: Literal["tree", "independent", "banded", "blt"] = _key(
      "default per algorithm; banded / blt: matrix-factorization prefix noise (issue #27)")
  bands: Optional[int] = _key("bands of the banded strategy (default min(32, T))")
  buffers: Optional[int] = _key("buffers of the BLT strategy (at most)", 4)
  mf_strategy: Optional[Literal["auto", "sqrt", "optimized"]] = _key(
      "MF strategy: jax_privacy's optimizer (optimized), the built-in sqrt one, or auto", "auto")
  batch_size: Optional[int] = _key("B (default floor(sqrt n))")
  num_steps: Optional[int] = _key("steps of one epoch P (default floor(n / B)); T = epochs P")
  epochs: int = _key("passes in one fixed public order (practical preset, SRG variants; "
                     "theory: 1)", 1)
  beta: Optional[float] = _key("smoothness parameter of the step (default M max(1, scale T))")
  beta_scale: float = _key("practical: beta = M max(1, beta_scale T)", 1.0)
  clip_norm: float = _key("clip norm C (default L)")
  noise_multiplier: Optional[float] = _key("explicit z (refused above the budget)")
  z_scale: float = _key("post-processing scale of the accelerated step", 1.0)
  learning_rate: Optional[float] = _key("projected-SGD variants' step (default 1/beta)")
  averaging: Averaging = _key("projected-SGD variants' released point", "none")


# ------------------------------------------------------------------------------- paper 004


@dataclasses.dataclass(frozen=True)
class BilevelConfig(AlgorithmKeys):
  """``dp_bilevel`` / ``dp_bilevel_minibatch`` / ``dp_bilevel_population`` (replace-one)."""
  epsilon: float = _key("privacy budget", required=True)
  delta: float = _key("target delta", required=True)
  relation: Optional[Relation] = _key("only replace_one", "replace_one")
  preset: Preset = _key("Thm 4.1/5.1/6.1 constants or practical", "practical")
  inner_batch_size: Optional[int] = _key("inner Poisson batch (Alg 3)")
  outer_batch_size: Optional[int] = _key("outer Poisson batch (Alg 3)")
  outer_noise: Union[Literal["auto"], bool] = _key("noise the outer estimator", "auto")
  lam: float = _key("penalty lambda", 30.0)
  learning_rate: float = _key("outer step size eta", 0.5)
  num_steps: int = _key("outer steps T", 30)
  outer_clip_norm: float = _key("outer clip norm (default 5 ell kappa)")
  inner_num_steps: int = _key("steps per inner solve", 300)
  inner_rounds: int = _key("localization rounds per inner solve", 2)
  inner_step_rule: Literal["smooth", "paper"] = _key("inner step-size rule", "smooth")
  inner_clip_norm: Optional[float] = _key("inner clip norm of both solves (default per solve)")
  inner_clip_norm_lam: float = _key(
      "inner clip norm of the penalized solve (default inner_clip_norm)")
  radius_const: float = _key("localization radius constant", 4.0)
  inner_radius0: float = _key("initial inner radius (default per solve)")
  shares: tuple[float, float, float] = _key("budget shares (y, y^lam, outer); write [[a,b,c]]")
  warm_start: bool = _key("warm-start the inner solves", True)
  noise_multiplier: Optional[float] = _key("explicit base z (default: calibrated)")
  population: bool = _key("theory preset: Thm 6.1's population alpha", False)
  max_theory_work: float = _key("theory preset: refuse above this many gradients", 1e10)


@dataclasses.dataclass(frozen=True)
class NonPrivatePenaltyConfig(AlgorithmKeys):
  """``nonprivate_penalty``: exact inner solves, non-private reference."""
  lam: float = _key("penalty lambda", 1e3)
  learning_rate: float = _key("outer step size eta", 0.5)
  num_steps: int = _key("outer steps T", 300)
  newton_steps: int = _key("Newton steps per exact solve", 30)


@dataclasses.dataclass(frozen=True)
class LocGdConfig(AlgorithmKeys):
  """``dp_loc_gd`` (Alg 2), item level, replace-one."""
  epsilon: float = _key("privacy budget", required=True)
  delta: float = _key("target delta", required=True)
  mu: Optional[float] = _key("public strong-convexity constant (default: the declared "
                             "strong_convexity)")
  relation: Optional[Relation] = _key("only replace_one", "replace_one")
  preset: Preset = _key("Thm 8.2 constants or practical", "practical")
  batch_size: Optional[int] = _key("Poisson batch (dp_loc_sgd); null: full batch")
  noise_multiplier: Optional[float] = _key("explicit z (refused above the budget)")
  clip_norm: float = _key("clip norm (default the problem's L)")
  radius0: float = _key("initial radius (default 2R)")
  l2: float = _key("data-independent ridge term l2/2 ||y||^2", 0.0)
  smoothness: Optional[float] = _key("smooth step rule's beta (null: paper rule)")
  num_steps: Optional[int] = _key("steps per round (default from rho n^2/d)")
  rounds: Optional[int] = _key("localization rounds (default Thm 8.2)")
  radius_const: float = _key("localization radius constant", 4.0)


@dataclasses.dataclass(frozen=True)
class LocSgdConfig(LocGdConfig):
  """``dp_loc_sgd`` (Alg 4): Poisson mini-batches."""
  batch_size: int = _key("Poisson batch size", required=True)


# ------------------------------------------------------------------------------- flax trainer


@dataclasses.dataclass(frozen=True)
class DPTrainerConfig(AlgorithmKeys):
  """``flax.DPTrainer`` from a config (user problems with an nnx model only): DP-SGD step by
  step, fast clipping, accounted as it goes (:class:`dpsco_jax.flax.DPTrainer`): Poisson
  sampling, or the cyclic schedule with independent / banded / BLT noise (issue #27)."""
  requires_one_of: ClassVar[tuple] = (("epsilon", "noise_multiplier"),)
  epsilon: Optional[float] = _key("target epsilon of num_steps steps (calibrates z; also a "
                                  "budget); null with noise_multiplier: report its epsilon")
  delta: float = _key("target delta", required=True)
  clip_norm: float = _key("clip norm C of each user's (item's) mean gradient", required=True)
  sampling: Literal["poisson", "cyclic"] = _key(
      "poisson (rate sampling_rate) or cyclic (fixed-order epochs of batch_size users)",
      "poisson")
  sampling_rate: Optional[float] = _key("declared Poisson rate q (sampling: poisson, where it "
                                        "is required)")
  batch_size: Optional[int] = _key("users per step B (sampling: cyclic, where it is required)")
  num_steps: int = _key("number of steps", required=True)
  learning_rate: float = _key("step size of the optimizer", required=True)
  optimizer: Literal["sgd", "momentum", "adam"] = _key(
      "optax optimizer on the privatized gradient (momentum: 0.9)", "sgd")
  expected_batch_size: Optional[float] = _key(
      "declared denominator D, poisson only (default sampling_rate x the declared n_users; "
      "under zero_out / replace_one: q n)")
  relation: Optional[Relation] = _key("neighbouring relation (default add_remove under "
                                      "poisson, zero_out under cyclic)")
  noise_mechanism: Literal["independent", "banded", "blt", "tree"] = _key(
      "noise: independent Gaussian, or banded / BLT matrix factorization or the binary tree "
      "(sampling: cyclic)", "independent")
  bands: Optional[int] = _key("bands b of the banded strategy (default dp_sgd_user's: "
                              "min(32, steps per epoch))")
  buffers: Optional[int] = _key("buffers of the BLT strategy, at most (default dp_sgd_user's)")
  mf_strategy: Optional[Literal["auto", "sqrt", "optimized"]] = _key(
      "MF strategy: jax_privacy's optimizer (optimized), the built-in sqrt one, or auto "
      "(default dp_sgd_user's)")
  noise_multiplier: Optional[float] = _key("explicit z (skips calibration; checked vs budget)")
  epsilon_budget: Optional[float] = _key("hard cap of the ledger")
  level: Literal["user", "item"] = _key("user- or item-level DP", "user")
  method: Literal["fast", "vmap", "auto"] = _key("per-user clipping: taps, vmap, or timed", "fast")
  batch_capacity: Optional[int] = _key("users processed at once (default D + 4 sqrt(D) + 1; "
                                       "cyclic: B)")
  accumulation_steps: int = _key("micro-batches accumulated under one noise draw", 1)
  accountant: Literal["pld", "rdp", "auto"] = _key("privacy accountant", "pld")
  report_every: Optional[int] = _key("steps per accounting block / progress report (default "
                                     "num_steps / 20)")


#: Algorithms a config may name that are not registered drivers: they run only on a user
#: problem (``problem: user``) with an nnx model.
CONFIG_ONLY_ALGORITHMS: dict[str, type] = {"flax.DPTrainer": DPTrainerConfig}
