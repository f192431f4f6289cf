"""The runner's config vocabulary: one frozen, typed schema per algorithm family and problem.

Every registered algorithm and problem reads a flat config dict today; this module states, for
each of them, the keys it reads (type, default, one-line doc), so that the runner can refuse a
config *before* anything runs instead of silently ignoring a misspelled privacy key
(``epsilonn``, ``deltaa``, ``clip_norm`` where the driver reads ``clip``, ...).

A schema is a frozen dataclass whose fields are the keys. Field annotations are the accepted
YAML types:

* ``float``: a number (an int is a number; a bool or a string is not);
* ``int``: an integer (an integral float such as ``1e4`` is accepted and normalized to int);
* ``bool``: only ``true`` / ``false``;
* ``Literal[...]``: one of the named strings (or a bool where the union allows it);
* ``Optional[...]``: ``null`` allowed; ``null`` then means what the field's doc says (for most
  keys "use the default", for ``epsilon`` of the SRGD and DP-SGD families "non-private" /
  "report the accountant's epsilon of an explicit noise_multiplier"). A key without
  ``Optional`` refuses ``null``.
* ``tuple[float, ...]``: a sequence. The runner sweeps list values, so a sequence-valued key
  is written as a list inside a list (``shares: [[0.5, 0.3, 0.2]]``).

A field's default is documentation: ``None`` with a non-Optional type means "derived by the
driver" (the doc gives the formula). ``required`` fields must be given.

:func:`validate` checks one run's config (after the runner's sweep expansion): unknown keys
(with a "did you mean" over the keys of that algorithm and problem, aliases first), strict
types, required keys, keys that mean different things to the algorithm and to the problem
(paper 000's privacy ``noise`` switch vs the problem's label ``noise``), and aliases of one
idea given twice with different values. Errors are :class:`ConfigError` naming the key.

This is the first step of issue 13 (one typed config per algorithm): the drivers still read the
dict; the schemas are the contract they are checked against.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import typing
from typing import Any, ClassVar, Literal, Optional, Union

__all__ = ["ConfigError", "ALGORITHM_SCHEMAS", "PROBLEM_SCHEMAS", "RunnerKeys", "ALIASES",
           "validate", "keys_of", "describe", "typed"]


class ConfigError(ValueError):
  """A user error in a config: reported by the CLI as one line, exit code 2."""


def _key(doc: str, default: Any = None, *, required: bool = False) -> Any:
  return dataclasses.field(default=default, metadata={"doc": doc, "required": required})


Relation = Literal["add_remove", "replace_one", "zero_out"]
Preset = Literal["practical", "theory"]
Averaging = Literal["none", "uniform"]

# ------------------------------------------------------------------------------- runner keys


@dataclasses.dataclass(frozen=True)
class RunnerKeys:
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
class SizedProblem:
  """Planted problems: n users x m items in R^d, optimum inside the ball of radius R."""
  n_users: int = _key("number of users n", required=True)
  m: int = _key("items per user m", required=True)
  d: int = _key("dimension d", required=True)
  radius: float = _key("radius R of the constraint ball (||w*|| = R/2)", 2.0)
  n_eval: int = _key("evaluation features for the population risk", 20000)


@dataclasses.dataclass(frozen=True)
class HingeProblem(SizedProblem):
  """``hinge`` (paper 000's non-smooth example): logistic labels, hinge loss."""


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
class IllConditionedProblem:
  """``ill_conditioned_least_squares`` (paper 003): spectrum logspace(-log10 cond, 0, d)."""
  n_users: int = _key("number of users n", required=True)
  m: int = _key("items per user", 1)
  d: int = _key("dimension", 8)
  radius: float = _key("constraint radius R", 2.0)
  noise: float = _key("label-noise scale s (uniform on [-s, s])", 0.5)
  condition: float = _key("condition number of the feature covariance", 1e3)


@dataclasses.dataclass(frozen=True)
class RidgeTuningProblem:
  """``ridge_tuning`` (paper 004): tune a ridge penalty on a validation split."""
  dataset: Literal["synthetic", "diabetes"] = _key("synthetic data or scikit-learn diabetes",
                                                   "synthetic")
  omega_bounds: tuple[float, float] = _key(
      "interval X of the penalty (default [1e-3, 5], diabetes [1e-2, 5]); write [[lo, hi]]")
  omega0: float = _key("initial penalty", 1.0)
  clip: Optional[float] = _key("clip of the per-example data terms (null: the problem's bound)")
  d: int = _key("features (synthetic only)", 10)
  n_train: int = _key("training examples (synthetic only)", 2000)
  n_val: int = _key("validation examples (synthetic only)", 2000)
  label_noise: float = _key("label-noise std (synthetic only)", 3.0)


PROBLEM_SCHEMAS: dict[str, type] = {
    "least_squares": NoisyProblem, "absolute": NoisyProblem, "logistic": LogisticProblem,
    "logistic_corrupted": CorruptedLogisticProblem, "hinge": HingeProblem,
    "l2_logistic": L2LogisticProblem, "ill_conditioned_least_squares": IllConditionedProblem,
    "ridge_tuning": RidgeTuningProblem,
}

# ------------------------------------------------------------------------------- baselines


@dataclasses.dataclass(frozen=True)
class SgdSchedule:
  """The schedule keys shared by DP-SGD and non-private SGD (``nonprivate_sgd``)."""
  sampling: Optional[Literal["poisson", "fixed", "full"]] = _key(
      "user sampling (default: poisson for DP-SGD, fixed for nonprivate_sgd)")
  batch_users: Optional[int] = _key("users (rows) per step (default round(sqrt n))")
  steps: Optional[int] = _key("number of steps (default from epochs)")
  epochs: Optional[float] = _key("passes over the data when steps is not given", 1.0)
  lr: Optional[float] = _key("step size (default R / (C sqrt(steps)))")
  averaging: Optional[Averaging] = _key("released point: last iterate or uniform average",
                                        "uniform")


@dataclasses.dataclass(frozen=True)
class DpSgdConfig(SgdSchedule):
  """``dp_sgd_user`` / ``dp_sgd_item`` / ``dp_sgd_group`` (accountant)."""
  requires_one_of: ClassVar[tuple] = (("epsilon", "noise_multiplier"),)
  epsilon: Optional[float] = _key("budget; null with noise_multiplier: report its epsilon")
  delta: float = _key("target delta", required=True)
  noise_multiplier: Optional[float] = _key("explicit z (skips calibration; checked vs budget)")
  clip: Optional[float] = _key("clip norm C of each user's mean gradient (default L)")
  sampling_rate: Optional[float] = _key("Poisson rate q (overrides batch_users / n_users)")
  relation: Optional[Relation] = _key("neighbouring relation (default from sampling)")


# ------------------------------------------------------------------------------- paper 000


@dataclasses.dataclass(frozen=True)
class FilterCommon:
  """Keys of paper 000's drivers (replace-one; FILTER + private tests)."""
  epsilon: float = _key("privacy budget", required=True)
  delta: float = _key("target delta", required=True)
  preset: Optional[Preset] = _key("paper constants (theory) or laptop scale", "practical")
  sensitivity: Optional[Literal["certified", "typical"]] = _key(
      "coupled sensitivity bound (certified) or the heuristic typical one", "certified")
  noise: Optional[bool] = _key("PRIVACY noise switch (false: non-private ablation)", True)
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
  eta: Optional[float] = _key("base step size (default R/(L sqrt(d m n eps)))")
  num_groups: Optional[int] = _key("groups C per phase (practical)")
  project_output: Optional[bool] = _key("project the output (default: practical preset)")


@dataclasses.dataclass(frozen=True)
class AcceleratedErmConfig(FilterCommon):
  """``user_level_accelerated_erm`` (Algorithms 2-3)."""
  lam: Optional[float] = _key("localization weight lambda (default Thm C.3)")
  lam_scale: Optional[float] = _key("practical: multiplies Thm C.3's lambda")
  batch_users: Optional[int] = _key("users K_i per phase batch (practical)")
  tau: Optional[float] = _key("concentration radius tau (default per preset)")
  max_steps: Optional[int] = _key("practical cap on AC-SA steps per phase")
  clip: Optional[Union[bool, float]] = _key("clip norm (true: L; null/false: no clipping)")


@dataclasses.dataclass(frozen=True)
class AcceleratedErmSmoothedConfig(AcceleratedErmConfig):
  """``user_level_accelerated_erm_smoothed`` (§4, uniform-ball smoothing)."""
  smoothing_radius: Optional[float] = _key("smoothing radius r (beta = L sqrt(d)/r)")


# ------------------------------------------------------------------------------- paper 001


@dataclasses.dataclass(frozen=True)
class OutputPertConfig:
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


@dataclasses.dataclass(frozen=True)
class NaiveOutputPertConfig(OutputPertConfig):
  """``naive_output_pert``: Gaussian output perturbation, sensitivity 2G/(mu n)."""
  noise_multiplier: Optional[float] = _key("explicit z (refused above the budget)")


# ------------------------------------------------------------------------------- paper 002


@dataclasses.dataclass(frozen=True)
class TargetKeys:
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
class ResquePrivateConfig:
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
  steps: Optional[int] = _key("steps (= query depth)", 20000)
  batch: Optional[int] = _key("examples per step (with replacement)", 64)
  eval_every: Optional[int] = _key("steps between risk evaluations", 100)
  lr: Optional[float] = _key("step size (default R/(L sqrt(steps)))")


# ------------------------------------------------------------------------------- paper 003


@dataclasses.dataclass(frozen=True)
class SrgdConfig:
  """Paper 003's drivers (accelerated_dp_srgd and its ablations)."""
  epsilon: Optional[float] = _key("budget; null: non-private unless noise_multiplier")
  delta: float = _key("target delta (default 1/n^2)")
  relation: Optional[Relation] = _key("zero_out (default) or replace_one")
  adjacency: Optional[Relation] = _key("deprecated alias of relation")
  preset: Preset = _key("theory (accelerated_dp_srgd only) or practical", "practical")
  variant: Literal["interior", "constrained"] = _key("theory preset's theorem", "constrained")
  noise_mechanism: Literal["tree", "independent"] = _key("default per algorithm")
  batch_size: Optional[int] = _key("B (default floor(sqrt n))")
  num_steps: Optional[int] = _key("T (default floor(n / B))")
  beta: Optional[float] = _key("smoothness parameter of the step (default M max(1, scale T))")
  beta_scale: float = _key("practical: beta = M max(1, beta_scale T)", 1.0)
  clip_norm: float = _key("clip norm C (default L)")
  noise_multiplier: Optional[float] = _key("explicit z (refused above the budget)")
  z_scale: float = _key("post-processing scale of the accelerated step", 1.0)
  learning_rate: Optional[float] = _key("projected-SGD variants' step (default 1/beta)")
  averaging: Averaging = _key("projected-SGD variants' released point", "none")


# ------------------------------------------------------------------------------- paper 004


@dataclasses.dataclass(frozen=True)
class BilevelConfig:
  """``dp_bilevel`` / ``dp_bilevel_minibatch`` / ``dp_bilevel_population`` (replace-one)."""
  epsilon: float = _key("privacy budget", required=True)
  delta: float = _key("target delta", 1e-6)
  relation: Optional[Relation] = _key("only replace_one", "replace_one")
  preset: Preset = _key("Thm 4.1/5.1/6.1 constants or practical", "practical")
  batch_in: Optional[int] = _key("inner Poisson batch (Alg 3)")
  batch_out: Optional[int] = _key("outer Poisson batch (Alg 3)")
  outer_noise: Union[Literal["auto"], bool] = _key("noise the outer estimator", "auto")
  lam: float = _key("penalty lambda", 30.0)
  eta: float = _key("outer step size", 0.5)
  T: int = _key("outer steps", 30)
  clip_out: float = _key("outer clip (default 5 ell kappa)")
  inner_steps: int = _key("steps per inner solve", 300)
  inner_rounds: int = _key("localization rounds per inner solve", 2)
  inner_step_rule: Literal["smooth", "paper"] = _key("inner step-size rule", "smooth")
  clip_in: Optional[float] = _key("inner clip of both solves (default per solve)")
  clip_in_lam: float = _key("inner clip of the penalized solve (default clip_in)")
  radius_const: float = _key("localization radius constant", 4.0)
  inner_radius0: float = _key("initial inner radius (default per solve)")
  shares: tuple[float, float, float] = _key("budget shares (y, y^lam, outer); write [[a,b,c]]")
  warm_start: bool = _key("warm-start the inner solves", True)
  noise_multiplier: Optional[float] = _key("explicit base z (default: calibrated)")
  population: bool = _key("theory preset: Thm 6.1's population alpha", False)
  max_theory_work: float = _key("theory preset: refuse above this many gradients", 1e10)


@dataclasses.dataclass(frozen=True)
class NonPrivatePenaltyConfig:
  """``nonprivate_penalty``: exact inner solves, non-private reference."""
  lam: float = _key("penalty lambda", 1e3)
  eta: float = _key("outer step size", 0.5)
  T: int = _key("outer steps", 300)
  newton_steps: int = _key("Newton steps per exact solve", 30)


@dataclasses.dataclass(frozen=True)
class LocGdConfig:
  """``dp_loc_gd`` (Alg 2), item level, replace-one."""
  epsilon: float = _key("privacy budget", required=True)
  delta: float = _key("target delta", 1e-6)
  mu: float = _key("public strong-convexity constant", required=True)
  relation: Optional[Relation] = _key("only replace_one", "replace_one")
  preset: Preset = _key("Thm 8.2 constants or practical", "practical")
  batch_size: Optional[int] = _key("Poisson batch (dp_loc_sgd); null: full batch")
  noise_multiplier: Optional[float] = _key("explicit z (refused above the budget)")
  clip_norm: float = _key("clip norm (default the problem's L)")
  radius0: float = _key("initial radius (default 2R)")
  l2: float = _key("data-independent ridge term l2/2 ||y||^2", 0.0)
  smoothness: Optional[float] = _key("smooth step rule's beta (null: paper rule)")
  steps: Optional[int] = _key("steps per round (default from rho n^2/d)")
  rounds: Optional[int] = _key("localization rounds (default Thm 8.2)")
  radius_const: float = _key("localization radius constant", 4.0)


@dataclasses.dataclass(frozen=True)
class LocSgdConfig(LocGdConfig):
  """``dp_loc_sgd`` (Alg 4): Poisson mini-batches."""
  batch_size: int = _key("Poisson batch size", required=True)


ALGORITHM_SCHEMAS: dict[str, type] = {
    "nonprivate_sgd": SgdSchedule,
    "dp_sgd_item": DpSgdConfig, "dp_sgd_user": DpSgdConfig, "dp_sgd_group": DpSgdConfig,
    "user_level_phased_sgd": PhasedSgdConfig,
    "user_level_accelerated_erm": AcceleratedErmConfig,
    "user_level_accelerated_erm_smoothed": AcceleratedErmSmoothedConfig,
    **{name: OutputPertConfig for name in ("sc_output_pert", "phased_erm_output_pert",
                                           "phased_sco_output_pert", "sc_erm_output_pert",
                                           "sc_sco_output_pert")},
    "naive_output_pert": NaiveOutputPertConfig,
    "resque_parallel_sco": ResqueParallelConfig,
    "resque_private_sco": ResquePrivateConfig,
    "minibatch_sgd": MinibatchSgdConfig,
    **{name: SrgdConfig for name in ("accelerated_dp_srgd", "dp_srgd_unaccelerated",
                                     "accelerated_dp_sgd", "single_epoch_dp_sgd",
                                     "accelerated_dp_srgd_independent_noise")},
    "dp_bilevel": BilevelConfig, "dp_bilevel_minibatch": BilevelConfig,
    "dp_bilevel_population": BilevelConfig, "nonprivate_penalty": NonPrivatePenaltyConfig,
    "dp_loc_gd": LocGdConfig, "dp_loc_sgd": LocSgdConfig,
}

#: Names of one idea. A key that an algorithm does not read is suggested as the member of its
#: group that it does read; two members given with different values are refused.
ALIASES: tuple[tuple[str, ...], ...] = (
    ("clip", "clip_norm", "clip_in"),
    ("lr", "learning_rate", "eta"),
    ("batch_users", "batch_size", "batch", "batch_in"),
    ("steps", "num_steps", "T"),
    ("relation", "adjacency"),
    ("epsilon", "eps"),
)


# ------------------------------------------------------------------------------- validation


@dataclasses.dataclass(frozen=True)
class KeySpec:
  """One key of a schema: its accepted type, default (documentation), doc, requiredness."""
  name: str
  type: Any
  default: Any
  doc: str
  required: bool
  owner: str  # "runner", "algorithm" or "problem"


def _specs(schema: type, owner: str) -> dict[str, KeySpec]:
  hints = typing.get_type_hints(schema)
  return {f.name: KeySpec(f.name, hints[f.name], f.default, f.metadata.get("doc", ""),
                          bool(f.metadata.get("required", False)), owner)
          for f in dataclasses.fields(schema)}


def keys_of(algorithm: str, problem: str) -> dict[str, KeySpec]:
  """Every key a run of ``algorithm`` on ``problem`` reads (runner, algorithm, problem)."""
  out = _specs(RunnerKeys, "runner")
  out.update(_specs(PROBLEM_SCHEMAS[problem], "problem"))
  for name, spec in _specs(ALGORITHM_SCHEMAS[algorithm], "algorithm").items():
    if name in out and out[name].owner == "problem" and out[name].type != spec.type:
      # one key, two meanings (paper 000's privacy `noise` switch vs the label noise)
      spec = dataclasses.replace(spec, owner="ambiguous",
                                 doc=f"{spec.doc} / problem: {out[name].doc}")
    out[name] = spec
  return out


def _type_name(tp: Any) -> str:
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is Union:
    names = [_type_name(a) for a in args if a is not type(None)]
    return " or ".join(names) + (" or null" if type(None) in args else "")
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in args)
  if origin is tuple:
    return f"a list of {len(args)} numbers" if args[-1] is not Ellipsis else "a list of numbers"
  return {float: "a number", int: "an integer", bool: "true or false", str: "a string"}[tp]


def _is_number(v: Any) -> bool:
  return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _coerce(tp: Any, v: Any) -> tuple[bool, Any]:
  """(accepted, normalized value) of ``v`` under the annotation ``tp``."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is Union:
    for a in args:
      ok, out = (v is None, None) if a is type(None) else _coerce(a, v)
      if ok:
        return True, out
    return False, v
  if origin is Literal:
    return any(v is a or (type(v) is type(a) and v == a) for a in args), v
  if origin is tuple:
    if not isinstance(v, (list, tuple)) or not all(_is_number(x) for x in v):
      return False, v
    return (len(v) == len(args) or args[-1] is Ellipsis), tuple(v)
  if tp is float:
    return _is_number(v), v
  if tp is int:
    if isinstance(v, bool) or not _is_number(v):
      return False, v
    if isinstance(v, numbers.Integral):
      return True, int(v)
    return math.isfinite(v) and float(v).is_integer(), int(v) if math.isfinite(v) else v
  if tp is bool:
    return isinstance(v, bool), v
  if tp is str:
    return isinstance(v, str), v
  raise TypeError(f"unsupported schema annotation {tp!r}")


def _hint(spec: KeySpec, v: Any) -> str:
  """A suggestion for a value of the wrong type."""
  if isinstance(v, str):
    try:
      float(v)
      return f"; write it without quotes: {spec.name}: {v}"
    except ValueError:
      pass
  if isinstance(v, bool):
    return ("; YAML reads yes/no/on/off/true/false as booleans: write the value "
            f"({_type_name(spec.type)})")
  if v is None:
    return "; omit the key to use its default"
  if isinstance(v, float) and spec.type is int:
    return f"; write a whole number, e.g. {spec.name}: {int(v) if math.isfinite(v) else 1}"
  if isinstance(v, (list, tuple)) or typing.get_origin(spec.type) is tuple:
    return ("; the runner sweeps list values: write one sequence as a list inside a list, "
            f"e.g. {spec.name}: [[...]]")
  return ""


def _check_type(spec: KeySpec, v: Any) -> Any:
  ok, out = _coerce(spec.type, v)
  if ok:
    return out
  tp = spec.type
  base = [a for a in typing.get_args(tp) if a is not type(None)] if (
      typing.get_origin(tp) is Union) else [tp]
  what = ("a number" if base == [float] else "an integer" if base == [int]
          else "true or false" if base == [bool] else _type_name(tp))
  raise ConfigError(f"{spec.name} must be {what}, got {v!r} ({type(v).__name__})"
                    + _hint(spec, v))


def _suggest(key: str, allowed: dict[str, KeySpec]) -> str | None:
  for group in ALIASES:
    if key in group:
      for other in group:
        if other != key and other in allowed:
          return other
  hit = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
  return hit[0] if hit else None


def _check_name(cfg: dict, field: str, known: dict) -> str:
  if field not in cfg:
    raise ConfigError(f"config is missing the field {field!r}")
  value = cfg[field]
  if not isinstance(value, str) or value not in known:
    hint = difflib.get_close_matches(str(value), list(known), n=1)
    raise ConfigError(f"unknown {field} {value!r}" + (f" (did you mean {hint[0]!r}?)" if hint
                                                     else "")
                      + f"; known: {', '.join(sorted(known))}")
  return value


def validate(cfg: dict) -> dict:
  """Checks one run's config against its algorithm's and problem's schemas.

  Returns a copy with integral floats of integer keys made ints. Raises :class:`ConfigError`
  naming the key: unknown key (with a suggestion), wrong type, a key that means different
  things to the algorithm and the problem, aliases with different values, a missing required
  key."""
  if not isinstance(cfg, dict):
    raise ConfigError(f"a run config must be a mapping, got {type(cfg).__name__}")
  algorithm = _check_name(cfg, "algorithm", ALGORITHM_SCHEMAS)
  problem = _check_name(cfg, "problem", PROBLEM_SCHEMAS)
  allowed = keys_of(algorithm, problem)
  where = f"algorithm {algorithm!r} on problem {problem!r}"
  for key in cfg:
    if key not in allowed:
      s = _suggest(str(key), allowed)
      raise ConfigError(f"unknown key {key!r} for {where}"
                        + (f" (did you mean {s!r}?)" if s else "")
                        + f"; it reads: {', '.join(sorted(allowed, key=str.lower))}")
  for key, spec in allowed.items():
    if spec.owner == "ambiguous" and key in cfg:
      raise ConfigError(f"{key} is ambiguous for {where}: the algorithm reads it as "
                        f"{_type_name(spec.type)} ({spec.doc}); rename the problem's key or "
                        "leave it out")
  for group in ALIASES:
    given = [k for k in group if k in cfg and cfg[k] is not None]
    if len({repr(cfg[k]) for k in given}) > 1:
      raise ConfigError(f"{given[0]} and {given[1]} name one idea but differ "
                        f"({cfg[given[0]]!r} vs {cfg[given[1]]!r}); give only {given[0]}")
  out = {key: _check_type(allowed[key], value) for key, value in cfg.items()}
  for key, spec in allowed.items():
    if spec.required and out.get(key) is None:
      raise ConfigError(f"{where} needs {key} ({spec.doc})")
  schema = ALGORITHM_SCHEMAS[algorithm]
  for group in getattr(schema, "requires_one_of", ()):
    if all(out.get(k) is None for k in group):
      raise ConfigError(f"{where} needs one of {', '.join(group)}")
  return out


def typed(cfg: dict) -> tuple[Any, Any]:
  """The validated config as frozen instances ``(algorithm_config, problem_config)``."""
  cfg = validate(cfg)
  def build(schema):
    names = {f.name for f in dataclasses.fields(schema)}
    return schema(**{k: v for k, v in cfg.items() if k in names})
  return (build(ALGORITHM_SCHEMAS[cfg["algorithm"]]), build(PROBLEM_SCHEMAS[cfg["problem"]]))


def describe(algorithm: str, problem: str) -> str:
  """One line per key: ``name  type  default  doc`` (the CLI's ``dpsco keys``)."""
  rows = []
  for spec in keys_of(algorithm, problem).values():
    default = "required" if spec.required else ("derived" if spec.default is None
                                                else repr(spec.default))
    rows.append((spec.name, _type_name(spec.type), default, f"[{spec.owner}] {spec.doc}"))
  widths = [max(len(r[i]) for r in rows) for i in range(3)]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3]
                   for r in rows)
