"""Differentially private bilevel optimization (paper 004: Kornowski, "Differentially Private
Bilevel Optimization"; spec ``004_dp_bilevel.md``).

Problem (BO): ``min_{x in X} F(x) = f(x, y*(x))`` with ``y*(x) = argmin_y g(x, y)``, ``g(x, .)``
``mu_g``-strongly convex, both levels ERMs over one dataset ``S`` (footnote 1: per-level
membership through weights inside each example).

Pieces (spec §6.1):
  * :func:`penalty_hypergrad_per_example` — the Hessian-free penalty hypergradient (Eq. 3)
    ``grad_x f(x, y^lam) + lam (grad_x g(x, y^lam) - grad_x g(x, y*))`` per example, evaluated at
    PRIVATE lower-level estimates only (§3: evaluating it at the exact ``y*(x)`` leaks, see
    :func:`implicit_hypergrad` on Example 3.1);
  * the private lower-level solver DP-Loc-GD / DP-Loc-SGD (``localized_gd.py``);
  * Algorithm 1 (full batch) and Algorithm 3 (mini-batch) as the chain
    ``clip_per_user(C_out) -> aggregate(mean, n|b) -> add_gaussian_noise -> [public terms]
    -> projected_sgd(eta, X) -> track_min_step`` inside one ``lax.scan`` over ``T``, with warm
    starts of the inner solves and the min-norm output rule ``x_{t_out}``,
    ``t_out = argmin_t ||x_{t+1} - x_t||`` (Alg 1 lines 7-8; post-processing);
  * :func:`theory_params` (Thm 4.1 / 5.1 / 6.1 parameter assignment with its precondition) and a
    ``practical`` preset;
  * exact accounting: every mechanism (``2T`` inner solves of ``M*T_in`` Gaussian steps each and
    ``T`` outer Gaussian steps) is a ``dp_accounting`` event composed by the PLD accountant (RDP
    when minibatches are subsampled, or for huge epsilon) under
    the paper's replace-one adjacency; noise is calibrated so the composition meets the target
    exactly (spec §3.4 replaces the paper's loose Lemma 2.1 composition, E2). The paper's own
    noise formula (Lemma 2.2 with ``(eps/sqrt(18T), delta/(3(T+1)))``) and the epsilon its
    composition would certify for our noise are reported beside;
  * the §7 application, private ridge-penalty tuning, with the corrected sign (E1), as
    :func:`dp_ridge_tuning` and the ``ridge_tuning`` problem factory.

Sensitivity is enforced by per-example clipping at both levels (spec §3.4, E6, E7): the paper's
Lemma 4.5 bounds the outer per-example vector only at the exact ``y``'s and its Lipschitz
assumption for the inner problems only on ``Y``; clipping makes the bound unconditional. In the
``theory`` preset the clip norms are the paper's Lipschitz bounds (``C_out = 5 l kappa``, Lemma
4.5's proof constant), so clipping is inactive whenever the assumptions hold.

Vectors: ``x`` (upper level) and ``y`` (lower level) are flat ``jnp`` vectors.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import Literal as _Literal

from dpsco_jax._checks import (check_choice, check_delta, check_epsilon, check_int,
                               check_nonnegative, check_positive)
from dpsco_jax.algorithms.localized_gd import (LocGDConfig,
                                               calibrate_gaussian, calibrate_rdp, dp_loc_gd,
                                               gaussian_step_event,
                                               loc_gd_event, loc_gd_rounds,
                                               loc_gd_stddev, paper_loc_gd_stddev)
from dpsco_jax.grads import per_example_grads
from dpsco_jax.privacy.ledger import PrivacyLedger, PrivacyReport, Provenance, epsilon_of
from dpsco_jax.transforms.clipping import aggregate, clip_per_user
from dpsco_jax.transforms.noise import add_gaussian_noise
from dpsco_jax.transforms.steps import project_l2_ball, projected_sgd, tree_l2_norm

PyTree = Any
RELATION = "replace_one"  # paper §2: neighbouring datasets differ in one replaced point

__all__ = [
    "ProblemConstants", "BilevelProblem", "BilevelConfig", "BilevelOutput", "MinStepState",
    "track_min_step", "penalty_hypergrad_per_example", "penalty_hypergrad_public",
    "exact_lower_solve", "exact_penalty_hypergrad", "implicit_hypergrad", "hyperobjective",
    "gradient_mapping", "theory_params", "bilevel_config", "calibrate_bilevel",
    "bilevel_events", "bilevel_accountant", "paper_bilevel_noise", "paper_composition_epsilon", "dp_bilevel_run",
    "dp_bilevel", "dp_ridge_tuning", "ridge_tuning_problem", "synthetic_ridge_problem",
    "diabetes_ridge_problem", "nonprivate_penalty_method", "ALGORITHMS", "PROBLEMS",
]


# --------------------------------------------------------------------------------------------
# Problem specification
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProblemConstants:
  """Assumption 2.5/2.6 constants (public). ``ell = max(L0f, L1f, L0g, L1g, L2g)``,
  ``kappa = ell / mu_g``."""
  l0f: float
  l1f: float
  l0g: float
  l1g: float
  l2g: float
  mu_g: float
  delta_f: float = 1.0

  def __post_init__(self):
    for name in ("l0f", "l1f", "l0g", "l1g", "l2g", "mu_g", "delta_f"):
      check_positive(getattr(self, name), name)

  @property
  def ell(self) -> float:
    return max(self.l0f, self.l1f, self.l0g, self.l1g, self.l2g)

  @property
  def kappa(self) -> float:
    return self.ell / self.mu_g


@dataclasses.dataclass
class BilevelProblem:
  """A bilevel ERM instance.

  ``f(x, y) = (1/n) sum_i f_ex(x, y, xi_i) + f_reg(x, y)`` and likewise ``g``; ``f_reg`` and
  ``g_reg`` are data-independent (their gradients carry no sensitivity and are added after the
  noise). ``X = B(x_center, x_radius)`` (``x_radius=None``: ``R^{d_x}``; in one dimension a ball
  is an interval). ``hyperobjective_fn`` and ``population_fn`` are NON-PRIVATE evaluation oracles
  for experiments and tests; the algorithms never call them.
  """
  name: str
  f_ex: Callable[[jax.Array, jax.Array, PyTree], jax.Array]
  g_ex: Callable[[jax.Array, jax.Array, PyTree], jax.Array]
  data: PyTree
  x0: jax.Array
  y0: jax.Array
  consts: ProblemConstants
  f_reg: Callable[[jax.Array, jax.Array], jax.Array] | None = None
  g_reg: Callable[[jax.Array, jax.Array], jax.Array] | None = None
  x_radius: float | None = None
  x_center: jax.Array | None = None
  y_radius: float | None = None      # R_0 of the inner solves (default 2 L0g / mu_g)
  x_opt: jax.Array | None = None     # argmin_X F_S (evaluation only)
  opt_risk: float | None = None      # min_X F_S  (evaluation only)
  population_fn: Callable[[jax.Array], float] | None = None
  population_opt: float | None = None
  meta: dict = dataclasses.field(default_factory=dict)

  @property
  def n(self) -> int:
    return int(jax.tree.leaves(self.data)[0].shape[0])

  @property
  def n_users(self) -> int:  # runner interface: item-level, one example = one user
    return self.n

  m = 1

  @property
  def d(self) -> int:
    return int(self.x0.shape[0])

  @property
  def d_y(self) -> int:
    return int(self.y0.shape[0])

  def init_params(self) -> jax.Array:
    return self.x0

  def hyperobjective(self, x) -> float:
    closed = self.meta.get("_closed_form")
    if closed is not None:  # (theta, F, F') in float64 (ridge)
      return float(closed[1](float(np.asarray(x).reshape(-1)[0])))
    return float(hyperobjective(self, jnp.asarray(x)))

  def excess_risk(self, x) -> float:
    """``F_S(x) - min_X F_S`` (the validation-loss gap for ridge tuning)."""
    opt = self.opt_risk if self.opt_risk is not None else 0.0
    return self.hyperobjective(x) - opt

  def population_risk(self, x) -> float:
    if self.population_fn is None:
      return self.hyperobjective(x)
    return float(self.population_fn(jnp.asarray(x)))

  def gradient_mapping_norm(self, x, eta: float) -> float:
    """``||G_{F_S, eta}(x)||`` with the exact (non-private) hypergradient: the quantity the
    theorems bound."""
    closed = self.meta.get("_closed_form")
    if closed is not None:
      xv = np.asarray(x, np.float64).reshape(-1)
      g = np.array([closed[2](float(xv[0]))])
      xp = np.asarray(_project_x(self, jnp.asarray(xv - eta * g, self.x0.dtype)), np.float64)
      return float(np.linalg.norm((xv - xp) / eta))
    return float(jnp.linalg.norm(gradient_mapping(self, jnp.asarray(x), eta)))

  def metrics(self, x, eta: float | None = None) -> dict:
    """Evaluation metrics (non-private oracles; for the experimenter, never released)."""
    out = {"hyperobjective": self.hyperobjective(x), "excess_risk": self.excess_risk(x)}
    if self.population_fn is not None:
      out["population_risk"] = self.population_risk(x)
      if self.population_opt is not None:
        out["population_excess_risk"] = out["population_risk"] - self.population_opt
    if self.x_opt is not None:
      out["dist_to_opt"] = float(jnp.linalg.norm(jnp.asarray(x) - self.x_opt))
    if eta is not None:
      out["gradient_mapping_norm"] = self.gradient_mapping_norm(x, eta)
    return out

  def describe(self) -> dict:
    public_meta = {k: v for k, v in self.meta.items() if not k.startswith("_")}
    return {"problem": self.name, "n": self.n, "d_x": self.d, "d_y": self.d_y,
            "x_radius": self.x_radius, **public_meta}


def _mean_ex(fn, x, y, data):
  return jnp.mean(jax.vmap(fn, in_axes=(None, None, 0))(x, y, data))


def full_f(problem: BilevelProblem, x, y):
  out = _mean_ex(problem.f_ex, x, y, problem.data)
  return out if problem.f_reg is None else out + problem.f_reg(x, y)


def full_g(problem: BilevelProblem, x, y):
  out = _mean_ex(problem.g_ex, x, y, problem.data)
  return out if problem.g_reg is None else out + problem.g_reg(x, y)


def _project_x(problem: BilevelProblem, x):
  return project_l2_ball(x, problem.x_radius, problem.x_center)


# --------------------------------------------------------------------------------------------
# Hypergradients
# --------------------------------------------------------------------------------------------

def penalty_hypergrad_per_example(problem: BilevelProblem, lam: float):
  """Per-example penalty hypergradient, the data part of Eq. (3) (Alg 1 line 4 / Alg 3 line 4):

      v_i = grad_x f_i(x, y_lam) + lam (grad_x g_i(x, y_lam) - grad_x g_i(x, y_star))

  Returns ``fn(x, y_lam, y_star, batch) -> [B, d_x]``. All three terms use the same batch.
  """
  def loss(x, ex, y_lam, y_star):
    return (problem.f_ex(x, y_lam, ex)
            + lam * (problem.g_ex(x, y_lam, ex) - problem.g_ex(x, y_star, ex)))

  def fn(x, y_lam, y_star, batch):
    return per_example_grads(lambda xx, ex: loss(xx, ex, y_lam, y_star), x, batch)
  return fn


def penalty_hypergrad_public(problem: BilevelProblem, lam: float):
  """The data-independent part of Eq. (3): ``grad_x [f_reg(x, y_lam) + lam (g_reg(x, y_lam) -
  g_reg(x, y_star))]``; zero when the problem has no regularizers."""
  def fn(x, y_lam, y_star):
    def reg(xx):
      out = jnp.zeros((), x.dtype)
      if problem.f_reg is not None:
        out = out + problem.f_reg(xx, y_lam)
      if problem.g_reg is not None:
        out = out + lam * (problem.g_reg(xx, y_lam) - problem.g_reg(xx, y_star))
      return out
    return jax.grad(reg)(x)
  return fn


def exact_lower_solve(problem: BilevelProblem, x, lam: float | None = None, *,
                      newton_steps: int = 30):
  """NON-PRIVATE exact minimizer of ``g(x, .)`` (``lam=None``) or ``f/lam + g`` by Newton's
  method. For tests and evaluation only: releasing anything computed from it leaks (§3)."""
  def obj(y):
    out = full_g(problem, x, y)
    return out if lam is None else out + full_f(problem, x, y) / lam

  def body(y, _):
    grad = jax.grad(obj)(y)
    hess = jax.hessian(obj)(y)
    return y - jnp.linalg.solve(hess, grad), None

  y, _ = jax.lax.scan(body, problem.y0.astype(jnp.result_type(x)), None, length=newton_steps)
  return y


def exact_penalty_hypergrad(problem: BilevelProblem, lam: float, x, *, newton_steps: int = 30):
  """NON-PRIVATE ``grad L*_lam(x)`` (Eq. 3) with exact ``y*``, ``y^lam`` (tests/baselines)."""
  y_star = exact_lower_solve(problem, x, newton_steps=newton_steps)
  y_lam = exact_lower_solve(problem, x, lam, newton_steps=newton_steps)
  data_part = jnp.mean(penalty_hypergrad_per_example(problem, lam)(x, y_lam, y_star,
                                                                    problem.data), axis=0)
  return data_part + penalty_hypergrad_public(problem, lam)(x, y_lam, y_star)


def implicit_hypergrad(problem: BilevelProblem, x, y_star=None):
  """NON-PRIVATE ground truth, Eq. (1):
  ``grad F = grad_x f - grad2_xy g [grad2_yy g]^{-1} grad_y f`` at ``y*(x)``. Evaluated at the
  exact lower-level solution it is exactly what Example 3.1 shows to leak the data."""
  if y_star is None:
    y_star = exact_lower_solve(problem, x)
  gx_f = jax.grad(full_f, argnums=1)(problem, x, y_star)
  gy_f = jax.grad(full_f, argnums=2)(problem, x, y_star)
  hyy = jax.hessian(full_g, argnums=2)(problem, x, y_star)
  hxy = jax.jacfwd(jax.grad(full_g, argnums=1), argnums=2)(problem, x, y_star)  # [d_x, d_y]
  return gx_f - hxy @ jnp.linalg.solve(hyy, gy_f)


def hyperobjective(problem: BilevelProblem, x):
  """NON-PRIVATE ``F_S(x) = f(x, y*(x))`` (evaluation only)."""
  return full_f(problem, x, exact_lower_solve(problem, x))


def gradient_mapping(problem: BilevelProblem, x, eta: float):
  """``G_{F,eta}(x) = (x - Pi_X(x - eta grad F(x))) / eta`` with the exact hypergradient
  (Remark 4.2: equals ``grad F`` when ``X = R^d``). Evaluation only."""
  g = implicit_hypergrad(problem, x)
  return (x - _project_x(problem, x - eta * g)) / eta


# --------------------------------------------------------------------------------------------
# Min-step output rule (Alg 1 lines 7-8)
# --------------------------------------------------------------------------------------------

class MinStepState(NamedTuple):
  count: jax.Array
  best_norm: jax.Array
  best_t: jax.Array
  released: PyTree   # x_{t_out}: the PRE-step iterate of the smallest step


def track_min_step() -> optax.GradientTransformationExtraArgs:
  """Output rule ``t_out = argmin_t ||x_{t+1} - x_t||``, release ``x_{t_out}`` (not
  ``x_{t_out+1}``; Alg 1 line 8). Place it after the step stage: it sees the update
  ``x_{t+1} - x_t`` and ``params = x_t``, passes the update through, and keeps the best ``x_t``
  in ``released``. Uses only privatized iterates: post-processing."""
  def init_fn(params):
    return MinStepState(count=jnp.zeros((), jnp.int32),
                        best_norm=jnp.asarray(jnp.inf, jnp.result_type(float)),
                        best_t=-jnp.ones((), jnp.int32), released=params)

  def update_fn(updates, state, params=None, **extra):
    del extra
    if params is None:
      raise ValueError("track_min_step needs params")
    norm = tree_l2_norm(updates).astype(state.best_norm.dtype)
    better = norm < state.best_norm
    released = jax.tree.map(lambda p, r: jnp.where(better, p, r), params, state.released)
    return updates, MinStepState(count=state.count + 1,
                                 best_norm=jnp.where(better, norm, state.best_norm),
                                 best_t=jnp.where(better, state.count, state.best_t),
                                 released=released)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------------------------
# Configuration, presets and accounting
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BilevelConfig:
  """Static configuration of Alg 1 (``batch_out=None`` and inner ``batch_size=None``) or Alg 3.

  ``outer_data_terms=False`` (no per-example outer estimator, hence no outer mechanism) is set
  by :func:`bilevel_config` only for problems whose data-dependent terms provably do not depend
  on ``x`` (§7 observation; checked structurally). ``outer_noise_multiplier = 0`` with data terms
  is a NON-private outer step (accounted as a non-private event: epsilon = inf)."""
  lam: float
  eta: float
  steps: int                       # T
  clip_out: float                  # C_out
  outer_noise_multiplier: float    # z_out: std = z_out * C_out / denominator
  inner_y: LocGDConfig             # solve of g(x, .)
  inner_lam: LocGDConfig           # solve of f/lam + g
  batch_out: int | None = None     # fixed batch of Alg 3 (None: full batch)
  warm_start: bool = True
  outer_data_terms: bool = True    # False only when f_ex, g_ex are provably x-free (§7)

  def __post_init__(self):
    check_positive(self.lam, "lam")
    check_positive(self.eta, "eta")
    check_int(self.steps, "steps", minimum=1)
    check_positive(self.clip_out, "clip_out")
    check_nonnegative(self.outer_noise_multiplier, "outer_noise_multiplier")
    if self.batch_out is not None:
      check_int(self.batch_out, "batch_out", minimum=1)


def theory_params(consts: ProblemConstants, *, epsilon: float, delta: float, n: int,
                  d_x: int, d_y: int, population: bool = False, batch_out: int | None = None,
                  c_alpha: float = 1.0, c_smooth: float = 1.0) -> dict:
  """Thm 4.1 (and 5.1 / 6.1) parameter assignment with absolute constants exposed (``c = 1``).

  ``alpha = c_alpha [K1 (sqrt(d_x)/(eps n))^{1/2} + K2 (sqrt(d_y)/(eps n))^{1/3}]`` with
  ``K1 = Delta^{1/4} l^{3/4} kappa^{5/4}``, ``K2 = Delta^{1/6} l^{1/2} kappa^{11/6}`` (as printed in
  Thm 4.1; E5 notes ``l^{5/6}``), ``+ K3 sqrt(d_x/n)`` for the population bound (Thm 6.1) and
  ``+ K3 / b_out`` for Alg 3 (Thm 5.1; E3 notes ``1/sqrt(b_out)``), ``K3 = l kappa``.
  ``lam = 2 l kappa^3 / alpha`` (penalty bias ``l kappa^3/lam = alpha/2``), ``eta = 1/(2L)`` with
  ``L = c_smooth l kappa^3`` (Lemma 4.3(iii)), ``T = ceil(64 L Delta_F / (3 alpha^2))`` (proof of
  Prop 4.6), ``C_out = 5 l kappa`` (Lemma 4.5's proof), the paper's
  ``sigma^2 = l^2 kappa^2 T log(T/delta) / (eps n)^2`` (reported only), inner budget
  ``eps' = eps/sqrt(18T)`` for the rounds ``M``.

  Raises:
    ValueError: when the precondition
      ``alpha <= l kappa^3 min{1/(2 kappa), L0g/L0f, L1g/L1f, Delta_F/(l kappa)}`` fails.
  """
  check_epsilon(epsilon)
  check_delta(delta)
  n = check_int(n, "n")
  c = consts
  ell, kap = c.ell, c.kappa
  k1 = c.delta_f ** 0.25 * ell ** 0.75 * kap ** 1.25
  k2 = c.delta_f ** (1 / 6) * ell ** 0.5 * kap ** (11 / 6)
  k3 = ell * kap
  alpha = k1 * math.sqrt(math.sqrt(d_x) / (epsilon * n)) + k2 * (
      math.sqrt(d_y) / (epsilon * n)) ** (1 / 3)
  if population:
    alpha += k3 * math.sqrt(d_x / n)
  if batch_out is not None:
    alpha += k3 / batch_out
  alpha *= c_alpha
  cap = ell * kap ** 3 * min(1 / (2 * kap), c.l0g / c.l0f, c.l1g / c.l1f,
                             c.delta_f / (ell * kap))
  if alpha > cap:
    raise ValueError(
        f"precondition of Thm 4.1 violated: alpha={alpha:.4g} > l kappa^3 min{{1/(2kappa), "
        f"L0g/L0f, L1g/L1f, Delta_F/(l kappa)}} = {cap:.4g}; increase n or epsilon")
  lam = 2.0 * ell * kap ** 3 / alpha
  smooth = c_smooth * ell * kap ** 3
  eta = 1.0 / (2.0 * smooth)
  steps = int(math.ceil(64.0 * smooth * c.delta_f / (3.0 * alpha ** 2)))
  eps_inner = epsilon / math.sqrt(18.0 * steps)
  return {
      "alpha": alpha, "lam": lam, "eta": eta, "steps": steps, "smoothness": smooth,
      "clip_out": 5.0 * ell * kap,
      "paper_sigma": ell * kap * math.sqrt(steps * math.log(steps / delta)) / (epsilon * n),
      "eps_inner": eps_inner, "delta_inner": delta / (3 * (steps + 1)),
      "rounds_y": loc_gd_rounds(c.mu_g, c.l0g, n, eps_inner),
      "rounds_lam": loc_gd_rounds(c.mu_g / 2, c.l0f / lam + c.l0g, n, eps_inner),
      "lam_min": max(2 * kap, c.l0f / c.l0g, c.l1f / c.l1g),
  }


def bilevel_accountant(bcfg: BilevelConfig | None = None, *, epsilon: float, delta: float,
                       full_batch: bool | None = None) -> str:
  """The accountant that certifies a run: RDP when any step is subsampled (replace-one) or for
  large epsilon, else PLD (see :func:`calibrate_gaussian`)."""
  if full_batch is None:
    full_batch = (bcfg.batch_out is None and bcfg.inner_y.batch_size is None
                  and bcfg.inner_lam.batch_size is None)
  return calibrate_gaussian(epsilon, delta)[1] if full_batch else "rdp"


def bilevel_events(bcfg: BilevelConfig, n: int, *, accountant: str
                   ) -> list[tuple[str, dp_accounting.DpEvent, int]]:
  """``(label, event, count)`` of every mechanism of a run (count = ``T``), replace-one, in the
  representation ``accountant`` reads correctly (:func:`gaussian_step_event`)."""
  out = [("lower-level y* solves (DP-Loc-(S)GD on g)",
          loc_gd_event(bcfg.inner_y, n, accountant=accountant), bcfg.steps),
         ("penalized y^lam solves (DP-Loc-(S)GD on f/lam+g)",
          loc_gd_event(bcfg.inner_lam, n, accountant=accountant), bcfg.steps)]
  if bcfg.outer_data_terms:
    ev = (dp_accounting.NonPrivateDpEvent() if bcfg.outer_noise_multiplier == 0
          else gaussian_step_event(bcfg.outer_noise_multiplier, accountant, n=n,
                                   batch=bcfg.batch_out))
    out.append(("outer penalty hypergradient (Gaussian)", ev, bcfg.steps))
  return out


def calibrate_bilevel(*, steps: int, inner_y: LocGDConfig, inner_lam: LocGDConfig,
                      batch_out: int | None, n: int, epsilon: float, delta: float,
                      shares: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3)
                      ) -> tuple[float, float, float]:
  """Noise multipliers ``(z_y, z_lam, z_out)`` so the whole run is exactly
  ``(epsilon, delta)``-DP (replace-one; PLD for full batch, RDP with subsampling).

  The split follows the paper's equal 3-way split per iteration, in zCDP form (spec §3.4):
  mechanism ``k`` with ``c_k`` Gaussian steps gets ``z_k = z sqrt(c_k / s_k)``. For full batch
  the composition of Gaussians is exactly one Gaussian with ``z_eff^-2 = sum_k c_k / z_k^2``, so
  ``z`` is calibrated on a single ``GaussianDpEvent``; with subsampling ``z`` is calibrated (RDP) on
  the full composed event. ``shares[2] = 0`` means no outer noise.
  """
  if len(shares) != 3 or any(s < 0 for s in shares) or abs(sum(shares) - 1) > 1e-9:
    raise ValueError(f"shares must be three non-negative numbers summing to 1, got {shares}")
  counts = [steps * inner_y.rounds * inner_y.steps, steps * inner_lam.rounds * inner_lam.steps,
            steps]
  bs = [inner_y.batch_size, inner_lam.batch_size, batch_out]
  if shares[0] == 0 or shares[1] == 0:
    raise ValueError("shares of the two inner solves must be > 0")
  ratios = [math.sqrt(c / s) if s > 0 else 0.0 for c, s in zip(counts, shares)]
  if all(b is None for b in bs):
    z_eff, accountant = calibrate_gaussian(epsilon, delta)
    zs = [z_eff * r for r in ratios]
    # The PLD of a composition of differently-scaled Gaussians carries a (pessimistic)
    # discretization error of ~1e-4; nudge the noise up until the ledger's own accountant
    # certifies the target, so calibration and ledger always agree.
    for _ in range(20):
      event = dp_accounting.ComposedDpEvent(
          [dp_accounting.SelfComposedDpEvent(gaussian_step_event(z, accountant), int(c))
           for z, c in zip(zs, counts) if z > 0])
      got = epsilon_of(event, delta=delta, relation=RELATION, accountant=accountant)
      if got <= epsilon * (1 + 1e-10):
        break
      zs = [z * (1 + 2 * (got / epsilon - 1) + 1e-6) for z in zs]
  else:
    r_min = min(r for r in ratios if r > 0)
    ratios = [r / r_min for r in ratios]

    def make_event(z):
      parts = [dp_accounting.SelfComposedDpEvent(
          gaussian_step_event(z * r, "rdp", n=n, batch=b), int(c))
               for r, b, c in zip(ratios, bs, counts) if r > 0]
      return dp_accounting.ComposedDpEvent(parts)
    z = calibrate_rdp(make_event, epsilon=epsilon, delta=delta, lower=0.1)
    zs = [z * r for r in ratios]
  return zs[0], zs[1], zs[2]


def paper_bilevel_noise(bcfg: BilevelConfig, n: int, *, epsilon: float, delta: float) -> dict:
  """The paper's own per-mechanism noise for target ``(epsilon, delta)``: every mechanism gets
  ``(eps/sqrt(18T), delta/(3(T+1)))`` (Alg 1 line 3, §8.4); outer std from Lemma 2.2 with
  sensitivity ``2 C_out / n`` (for Alg 3 the amplified ``2C/b`` at ``eps_0 n/b`` gives the same
  std, §5); inner std from :func:`paper_loc_gd_stddev`."""
  t = bcfg.steps
  e0, d0 = epsilon / math.sqrt(18 * t), delta / (3 * (t + 1))
  out_sigma = math.sqrt(2 * math.log(5 / (4 * d0))) * 2 * bcfg.clip_out / n / e0
  return {"outer_std": out_sigma,
          "inner_y_std": paper_loc_gd_stddev(bcfg.inner_y, n, epsilon=e0, delta=d0),
          "inner_lam_std": paper_loc_gd_stddev(bcfg.inner_lam, n, epsilon=e0, delta=d0),
          "eps_per_mechanism": e0, "delta_per_mechanism": d0}


def _lemma22_eps(sens: float, sigma: float, delta: float) -> float:
  return sens * math.sqrt(2 * math.log(5 / (4 * delta))) / sigma


def _lemma21(eps0: float, delta0: float, k: int) -> float:
  return math.sqrt(2 * k * math.log(1 / delta0)) * eps0 + 2 * k * eps0 ** 2


def _amplify(eps0: float, b: int, n: int) -> float:
  """Lemma 2.3 (sampling with replacement)."""
  q = 1 - (1 - 1 / n) ** b
  return math.log1p(q * math.expm1(min(eps0, 700.0)))


def paper_composition_epsilon(bcfg: BilevelConfig, n: int, *, delta: float) -> float:
  """The epsilon the paper's own analysis certifies for OUR noise: Lemma 2.2 per step, Lemma 2.3
  for minibatches, Lemma 2.1 over each solve's ``M T_in`` steps and over ``T`` iterations, basic
  composition of the 3 mechanisms per iteration, with the paper's delta split. Reported beside
  the accountant's epsilon to show the slack of the loose composition (E2)."""
  t = bcfg.steps
  d0 = delta / (3 * (t + 1))
  eps_it = 0.0
  for icfg in (bcfg.inner_y, bcfg.inner_lam):
    if icfg.noise_multiplier == 0:
      return math.inf
    k = icfg.rounds * icfg.steps
    ds = d0 / (k + 1)
    denom = n if icfg.batch_size is None else icfg.batch_size
    e_step = _lemma22_eps(2 * icfg.clip_norm / denom, loc_gd_stddev(icfg, n), ds)
    if icfg.batch_size is not None:
      e_step = _amplify(e_step, icfg.batch_size, n)
    eps_it += _lemma21(e_step, ds, k)
  if bcfg.outer_data_terms:
    if bcfg.outer_noise_multiplier == 0:
      return math.inf
    denom = n if bcfg.batch_out is None else bcfg.batch_out
    sens = 2 * bcfg.clip_out / denom
    e_out = _lemma22_eps(sens, bcfg.outer_noise_multiplier * bcfg.clip_out / denom, d0)
    if bcfg.batch_out is not None:
      e_out = _amplify(e_out, bcfg.batch_out, n)
    eps_it += e_out
  return _lemma21(eps_it, delta / (t + 1), t)


def _x_grad_is_data_free(problem: BilevelProblem) -> bool:
  """True when ``f_ex`` and ``g_ex`` provably do not depend on ``x`` (a jaxpr dependency walk;
  any primitive with an ``x``-dependent input is treated as ``x``-dependent, so the check is
  sound). Then the outer estimator is post-processing of the private ``y``'s (§7 observation)."""
  ex = jax.tree.map(lambda v: v[0], problem.data)
  for fn in (problem.f_ex, problem.g_ex):
    jaxpr = jax.make_jaxpr(lambda x: fn(x, problem.y0, ex))(problem.x0).jaxpr
    dep = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
      if any(not isinstance(v, _Literal) and v in dep for v in eqn.invars):
        dep.update(eqn.outvars)
    if any(not isinstance(v, _Literal) and v in dep for v in jaxpr.outvars):
      return False
  return True


def _default_consts_inner(problem: BilevelProblem, lam: float) -> dict:
  c = problem.consts
  r0 = problem.y_radius if problem.y_radius is not None else 2 * c.l0g / c.mu_g
  return {
      "y": dict(mu=c.mu_g, clip=c.l0g, smooth=c.l1g, radius0=r0),
      # Spec §2.2 [ours]: solve f/lam + g: same argmin, mu_g/2, Lipschitz L0f/lam + L0g.
      "lam": dict(mu=c.mu_g / 2, clip=c.l0f / lam + c.l0g, smooth=c.l1f / lam + c.l1g,
                  radius0=r0 + c.l0f / (lam * c.mu_g)),
  }


def bilevel_config(problem: BilevelProblem, cfg: dict) -> tuple[BilevelConfig, dict]:
  """Builds a calibrated :class:`BilevelConfig` from a config dict (``preset`` = ``practical``
  (default) | ``theory``). Returns ``(bcfg, info)``; ``info`` holds the preset's derived values.

  Keys: ``epsilon, delta`` (required); ``lam, eta, T`` (practical: required-with-defaults
  ``30, 0.5, 30``); ``inner_steps, inner_rounds, inner_step_rule`` (``smooth`` | ``paper``),
  ``clip_in`` (both inner solves), ``clip_in_lam``, ``clip_out``, ``radius_const``,
  ``inner_radius0``, ``batch_in, batch_out`` (Alg 3), ``warm_start`` (True), ``shares``
  (``[1/3, 1/3, 1/3]``), ``outer_noise`` (``auto``: off only when the data terms provably do not
  depend on ``x``; ``true``; ``false``: requires that structure), ``population`` (theory preset:
  Thm 6.1 alpha).
  """
  eps = check_epsilon(cfg.get("epsilon"), "epsilon")
  delta = check_delta(cfg.get("delta", 1e-6), "delta")
  preset = check_choice(cfg.get("preset", "practical"), "preset", ("practical", "theory"))
  n = problem.n
  batch_in = cfg.get("batch_in")
  batch_out = cfg.get("batch_out")
  for name, b in (("batch_in", batch_in), ("batch_out", batch_out)):
    if b is not None and not 1 <= check_int(b, name) <= n:
      raise ValueError(f"{name} must lie in [1, n={n}], got {b}")
  outer_noise = cfg.get("outer_noise", "auto")
  if outer_noise not in ("auto", True, False):
    raise ValueError(f"outer_noise must be 'auto', true or false, got {outer_noise!r}")
  data_free = _x_grad_is_data_free(problem)
  if outer_noise is False and not data_free:
    raise ValueError("outer_noise=false is private only when f_ex and g_ex do not depend on x "
                     "(§7 observation); this problem's data terms depend on x")
  use_outer = (outer_noise is True) or (outer_noise == "auto" and not data_free)
  info: dict = {"preset": preset, "outer_noise": use_outer}

  if preset == "theory":
    tp = theory_params(problem.consts, epsilon=eps, delta=delta, n=n, d_x=problem.d,
                       d_y=problem.d_y, population=bool(cfg.get("population", False)),
                       batch_out=batch_out)
    info.update(tp)
    lam, eta, steps, clip_out = tp["lam"], tp["eta"], tp["steps"], tp["clip_out"]
    inner_steps = n * n                       # Thm 8.2: T_GD = n^2
    rounds = (tp["rounds_y"], tp["rounds_lam"])
    work = steps * (rounds[0] + rounds[1]) * inner_steps * (n if batch_in is None else batch_in)
    limit = float(cfg.get("max_theory_work", 1e10))
    if work > limit:
      raise ValueError(
          f"preset='theory' needs T={steps} outer steps of 2 DP-Loc-GD solves with T_GD=n^2="
          f"{inner_steps} steps: {work:.3g} example-gradients > max_theory_work={limit:.3g}; "
          f"use preset='practical' or raise max_theory_work")
    step_rule = "paper"
    inner = _default_consts_inner(problem, lam)
    clips = (inner["y"]["clip"], inner["lam"]["clip"])
    radius_const = 4.0
  else:
    lam = check_positive(cfg.get("lam", 30.0), "lam")
    eta = check_positive(cfg.get("eta", 0.5), "eta")
    steps = check_int(cfg.get("T", 30), "T")
    inner = _default_consts_inner(problem, lam)
    clip_out = check_positive(cfg.get("clip_out", 5 * problem.consts.ell * problem.consts.kappa),
                              "clip_out")
    inner_steps = check_int(cfg.get("inner_steps", 300), "inner_steps")
    r = cfg.get("inner_rounds", 2)
    rounds = (check_int(r, "inner_rounds"), check_int(r, "inner_rounds"))
    step_rule = check_choice(cfg.get("inner_step_rule", "smooth"), "inner_step_rule",
                             ("smooth", "paper"))
    c_in = cfg.get("clip_in")
    clips = (check_positive(c_in if c_in is not None else inner["y"]["clip"], "clip_in"),
             check_positive(cfg.get("clip_in_lam", c_in if c_in is not None
                                    else inner["lam"]["clip"]), "clip_in_lam"))
    radius_const = check_positive(cfg.get("radius_const", 4.0), "radius_const")
    if "inner_radius0" in cfg:
      r0 = check_positive(cfg["inner_radius0"], "inner_radius0")
      inner["y"]["radius0"] = r0
      inner["lam"]["radius0"] = r0
  shares = tuple(cfg.get("shares", (1 / 3, 1 / 3, 1 / 3) if use_outer else (0.5, 0.5, 0.0)))
  if not use_outer:
    shares = (shares[0] / (shares[0] + shares[1]), shares[1] / (shares[0] + shares[1]), 0.0)
  elif len(shares) == 3 and shares[2] == 0:
    raise ValueError("shares[2] (outer) must be > 0 when the outer estimator is noised")

  def mk(which, k):
    c = inner[which]
    return LocGDConfig(mu=c["mu"], clip_norm=clips[k], noise_multiplier=0.0, rounds=rounds[k],
                       steps=inner_steps, radius0=c["radius0"], radius_const=radius_const,
                       batch_size=batch_in, step_rule=step_rule,
                       smoothness=c["smooth"] if step_rule == "smooth" else None)
  iy, il = mk("y", 0), mk("lam", 1)
  z_y, z_l, z_o = calibrate_bilevel(steps=steps, inner_y=iy, inner_lam=il, batch_out=batch_out,
                                    n=n, epsilon=eps, delta=delta, shares=shares)
  info["accountant"] = bilevel_accountant(epsilon=eps, delta=delta,
                                          full_batch=batch_in is None and batch_out is None)
  bcfg = BilevelConfig(lam=lam, eta=eta, steps=steps, clip_out=clip_out,
                       outer_noise_multiplier=z_o if use_outer else 0.0,
                       inner_y=dataclasses.replace(iy, noise_multiplier=z_y),
                       inner_lam=dataclasses.replace(il, noise_multiplier=z_l),
                       batch_out=batch_out, warm_start=bool(cfg.get("warm_start", True)),
                       outer_data_terms=use_outer)
  # Spec §6.4 invariants (warnings, recorded): lam and eta within the analysis' range.
  c = problem.consts
  info["lam_below_theory_min"] = lam < max(2 * c.kappa, c.l0f / c.l0g, c.l1f / c.l1g)
  info["eta_above_theory_max"] = eta > 1.0 / (2.0 * c.ell * c.kappa ** 3)
  return bcfg, info


# --------------------------------------------------------------------------------------------
# The driver (Alg 1 / Alg 3): one jitted lax.scan over T
# --------------------------------------------------------------------------------------------

def outer_privatizer(bcfg: BilevelConfig, n: int, key: jax.Array
                     ) -> optax.GradientTransformationExtraArgs:
  """The outer Gaussian mechanism of Alg 1/3 line 4 as a core chain over the per-example
  ``v_i``: ``clip_per_user(C_out) -> aggregate(mean, n | b_out) -> add_gaussian_noise``.
  Replace-one sensitivity ``2 C_out / denominator``; std ``z_out C_out / denominator``."""
  denom = n if bcfg.batch_out is None else bcfg.batch_out
  return optax.chain(
      clip_per_user(bcfg.clip_out),
      aggregate("mean", denominator=denom),
      add_gaussian_noise(bcfg.outer_noise_multiplier * bcfg.clip_out / denom, key))


class BilevelOutput(NamedTuple):
  x_out: jax.Array        # x_{t_out}
  x_last: jax.Array       # x_T
  t_out: jax.Array
  xs: jax.Array           # x_0..x_{T-1}   (public: the privatized trajectory)
  step_norms: jax.Array   # ||x_{t+1} - x_t||  (public)
  y_star: jax.Array       # last private y estimates (public: DP outputs)
  y_lam: jax.Array


def dp_bilevel_run(problem: BilevelProblem, bcfg: BilevelConfig, key: jax.Array
                   ) -> BilevelOutput:
  """Runs Alg 1 (full batch) / Alg 3 (random fixed-size minibatches) with a calibrated ``bcfg``.
  Jittable with ``problem`` and ``bcfg`` static. Accounting is the caller's job
  (:func:`dp_bilevel`); nothing here calls a non-private exact solver."""
  data = problem.data
  n = problem.n
  lam = bcfg.lam
  k_loop, k_out_noise = jax.random.split(key)
  use_outer = bcfg.outer_data_terms
  per_ex = penalty_hypergrad_per_example(problem, lam)
  public = penalty_hypergrad_public(problem, lam)
  privatize = outer_privatizer(bcfg, n, k_out_noise)
  stepper = optax.chain(
      projected_sgd(bcfg.eta, radius=problem.x_radius, center=problem.x_center),
      track_min_step())
  x0 = _project_x(problem, problem.x0)
  y0 = problem.y0

  def body(carry, t):
    x, y_w, yl_w, p_state, s_state = carry
    k_y, k_l, k_s = jax.random.split(jax.random.fold_in(k_loop, t), 3)
    start_y, start_l = (y_w, yl_w) if bcfg.warm_start else (y0, y0)
    g_reg = None if problem.g_reg is None else (lambda y: problem.g_reg(x, y))

    def lam_reg(y):
      out = jnp.zeros((), y.dtype)
      if problem.f_reg is not None:
        out = out + problem.f_reg(x, y) / lam
      if problem.g_reg is not None:
        out = out + problem.g_reg(x, y)
      return out
    y_t, _ = dp_loc_gd(lambda y, ex: problem.g_ex(x, y, ex), start_y, data, k_y,
                       bcfg.inner_y, reg_fn=g_reg)
    yl_t, _ = dp_loc_gd(lambda y, ex: problem.f_ex(x, y, ex) / lam + problem.g_ex(x, y, ex),
                        start_l, data, k_l, bcfg.inner_lam,
                        reg_fn=lam_reg if (problem.f_reg or problem.g_reg) else None)
    if use_outer:
      batch = data
      if bcfg.batch_out is not None:  # Alg 3: one shared b_out-subset for all three terms
        idx = jax.random.choice(k_s, n, (bcfg.batch_out,), replace=False)
        batch = jax.tree.map(lambda v: v[idx], data)
      g_hat, p_state = privatize.update(per_ex(x, yl_t, y_t, batch), p_state, x)
    else:
      # Data terms provably x-free (checked in bilevel_config): their x-gradients are zero.
      g_hat = jnp.zeros_like(x)
    g_hat = g_hat + public(x, yl_t, y_t)
    upd, s_state = stepper.update(g_hat, s_state, x)
    x_new = optax.apply_updates(x, upd)
    return (x_new, y_t, yl_t, p_state, s_state), (x, tree_l2_norm(upd))

  p0 = privatize.init(x0)
  s0 = stepper.init(x0)
  (x_last, y_t, yl_t, _, s_state), (xs, norms) = jax.lax.scan(
      body, (x0, y0, y0, p0, s0), jnp.arange(bcfg.steps))
  min_state = s_state[1]
  return BilevelOutput(x_out=min_state.released, x_last=x_last, t_out=min_state.best_t, xs=xs,
                       step_norms=norms, y_star=y_t, y_lam=yl_t)


def _run_compiled(problem: BilevelProblem, bcfg: BilevelConfig, key: jax.Array):
  """One jitted executable per (problem, config), cached on the problem (seeds reuse it)."""
  cache = problem.meta.setdefault("_jit_cache", {})
  if bcfg not in cache:
    cache[bcfg] = jax.jit(lambda k: dp_bilevel_run(problem, bcfg, k))
  return cache[bcfg](key)


def dp_bilevel(problem: BilevelProblem, cfg: dict, key: jax.Array, *,
               ledger: PrivacyLedger | None = None):
  """Runner entry for Alg 1 / Alg 3 (``batch_in``/``batch_out`` set) with exact accounting.

  ``ledger`` (optional) is an existing replace-one ledger to spend on (composition with other
  releases; its budget is enforced before the run).

  Every mechanism is spent on a replace-one ledger BEFORE the run (the budget is checked
  first; nothing is released on failure). Provenance ``accountant``. The record holds public
  quantities only: the calibrated noise, the paper's formula beside it, the privatized step
  norms (``||x_{t+1}-x_t||/eta`` is the noisy gradient-mapping estimate of the output rule) and
  ``t_out``. With ``debug: true`` the last private ``y`` estimates' distance to the exact ones
  (non-private) goes to ``debug``.
  """
  from dpsco_jax.result import Result

  bcfg, info = bilevel_config(problem, cfg)
  eps = float(cfg["epsilon"])
  delta = float(cfg.get("delta", 1e-6))
  n = problem.n
  if ledger is None:
    ledger = PrivacyLedger(delta=delta, epsilon_budget=eps, relation=RELATION,
                           accountant=info["accountant"])
  elif ledger.relation != RELATION:
    raise ValueError(f"ledger.relation must be {RELATION!r} (the paper's adjacency)")
  events = bilevel_events(bcfg, n, accountant=info["accountant"])
  # Budget check of the whole composition BEFORE anything runs, on a scratch copy so that a
  # refused run leaves the caller's ledger untouched; then record every mechanism.
  trial = copy.deepcopy(ledger)
  for label, event, count in events[:-1]:
    trial.compose(event, label=label, count=count)
  trial.spend(events[-1][1], label=events[-1][0], count=events[-1][2])  # raises if exceeded
  for label, event, count in events:
    ledger.compose(event, label=label, count=count)
  out = _run_compiled(problem, bcfg, key)
  paper = paper_bilevel_noise(bcfg, n, epsilon=eps, delta=delta)
  paper_eps = paper_composition_epsilon(bcfg, n, delta=delta)
  alg = "Alg 3 (mini-batch)" if (bcfg.batch_out or bcfg.inner_y.batch_size) else "Alg 1"
  notes = (f"{alg}, preset={info['preset']}; replace-one {info['accountant'].upper()} composition of 2T DP-Loc-(S)GD "
           f"solves and {'T outer Gaussian steps' if info['outer_noise'] else 'no outer noise (data terms x-free: outer step is post-processing, §7)'}; "
           f"per-example clipping enforces every sensitivity (spec §3.4).")
  report = ledger.report(provenance=Provenance.ACCOUNTANT, level="item",
                         paper_epsilon=paper_eps, notes=notes)
  n_in = lambda c: c.rounds * c.steps * (n if c.batch_size is None else c.batch_size)
  evals = bcfg.steps * (n_in(bcfg.inner_y) + n_in(bcfg.inner_lam)
                        + (n if bcfg.batch_out is None else bcfg.batch_out))
  record = {
      "x_out": np.asarray(out.x_out).tolist(), "t_out": int(out.t_out),
      "min_step_norm_over_eta": float(np.min(np.asarray(out.step_norms))) / bcfg.eta,
      "lam": bcfg.lam, "eta": bcfg.eta, "T": bcfg.steps,
      "inner_steps": bcfg.inner_y.steps, "inner_rounds": [bcfg.inner_y.rounds,
                                                          bcfg.inner_lam.rounds],
      "outer_noise_std": bcfg.outer_noise_multiplier * bcfg.clip_out / (
          n if bcfg.batch_out is None else bcfg.batch_out),
      "inner_y_noise_std": loc_gd_stddev(bcfg.inner_y, n),
      "inner_lam_noise_std": loc_gd_stddev(bcfg.inner_lam, n),
      "paper_outer_noise_std": paper["outer_std"] if info["outer_noise"] else None,
      "paper_inner_y_noise_std": paper["inner_y_std"],
      "paper_inner_lam_noise_std": paper["inner_lam_std"],
      "paper_epsilon_for_our_noise": paper_eps,
      **{k: v for k, v in info.items() if isinstance(v, (int, float, bool, str))},
  }
  debug = None
  if cfg.get("debug", False):
    x_last_in = out.xs[-1]
    debug = {"inner_y_error_last": float(jnp.linalg.norm(
        out.y_star - exact_lower_solve(problem, x_last_in))),
             "inner_lam_error_last": float(jnp.linalg.norm(
                 out.y_lam - exact_lower_solve(problem, x_last_in, bcfg.lam))),
             "metrics": problem.metrics(out.x_out, bcfg.eta)}
  return Result(params=out.x_out, privacy=report, gradient_evaluations=int(evals),
                record=record, debug=debug)


def _dp_bilevel_minibatch(problem: BilevelProblem, cfg: dict, key: jax.Array):
  cfg = dict(cfg)
  n = problem.n
  cfg.setdefault("batch_out", max(1, n // 10))
  cfg.setdefault("batch_in", max(1, n // 10))
  return dp_bilevel(problem, cfg, key)


def _dp_bilevel_population(problem: BilevelProblem, cfg: dict, key: jax.Array):
  """§6 / Thm 6.1: the same algorithm; the theory preset adds ``K3 sqrt(d_x/n)`` to alpha and
  the record reports the population metrics the theorem bounds."""
  cfg = dict(cfg, population=True)
  res = dp_bilevel(problem, cfg, key)
  res.record["target"] = "population"
  return res


# --------------------------------------------------------------------------------------------
# Non-private reference (the "non-private optimum" of the experiments)
# --------------------------------------------------------------------------------------------

def nonprivate_penalty_method(problem: BilevelProblem, *, lam: float, eta: float, steps: int,
                              newton_steps: int = 30) -> jax.Array:
  """NON-PRIVATE projected penalty GD with exact inner solves (spec T8). Returns ``x_T``."""
  def body(x, _):
    g = exact_penalty_hypergrad(problem, lam, x, newton_steps=newton_steps)
    return _project_x(problem, x - eta * g), None
  x, _ = jax.jit(lambda x0: jax.lax.scan(body, x0, None, length=steps))(
      _project_x(problem, problem.x0))
  return x


def _nonprivate_runner(problem: BilevelProblem, cfg: dict, key: jax.Array):
  from dpsco_jax.result import Result
  del key
  x = nonprivate_penalty_method(problem, lam=float(cfg.get("lam", 1e3)),
                                eta=float(cfg.get("eta", 0.5)), steps=int(cfg.get("T", 300)),
                                newton_steps=int(cfg.get("newton_steps", 30)))
  report = PrivacyReport(epsilon=math.inf, delta=1.0 - 1e-12, provenance="none", level="none",
                         relation=RELATION, notes="NON-PRIVATE reference: exact inner solves")
  return Result(params=x, privacy=report, gradient_evaluations=0, record={"non_private": True})


# --------------------------------------------------------------------------------------------
# §7: private regularization (ridge penalty) tuning
# --------------------------------------------------------------------------------------------

def _sq(ex, theta):
  return 0.5 * jnp.square(jnp.dot(ex["a"], theta) - ex["b"])


def ridge_tuning_problem(a_tr, b_tr, a_val, b_val, *, omega_bounds=(1e-3, 5.0),
                         omega0: float = 1.0, clip: float | None = None,
                         curvature_bounds: tuple[float, float] = (0.0, 4.0),
                         theta_radius: float = 5.0, name: str = "ridge_tuning",
                         population_fn=None, meta: dict | None = None) -> BilevelProblem:
  """§7 (Eq. 4) with ridge: ``g(omega, theta) = (1/2n_tr)||A_tr theta - b_tr||^2 +
  (omega/2)||theta||^2``, ``f(theta) = (1/2n_val)||A_val theta - b_val||^2``,
  ``X = [omega_min, omega_max]`` (spec E12: ``omega_min > 0`` keeps strong convexity).

  The per-example split of footnote 1 (E12): each example carries ``val`` in {0, 1}; ``f_ex``
  weights validation rows by ``n/n_val`` and ``g_ex`` training rows by ``n/n_tr``. The ridge term
  is data-independent (``g_reg``), so the outer "gradient" ``lam (R(theta^lam) - R(theta))`` is
  post-processing of the two private solves (§7 observation: no outer noise needed).

  Public constants (assumptions, never read from the data): ``clip`` (per-example gradient clip,
  default ``n/n_tr * 3 sqrt(d)``), ``curvature_bounds = (h_min, h_max)`` on the eigenvalues of
  the train / validation second-moment matrices (``mu_g = omega_min + h_min``, smoothness
  ``h_max + omega_max``), ``theta_radius`` (``R_0`` of the inner solves).
  """
  a_tr, b_tr, a_val, b_val = map(jnp.asarray, (a_tr, b_tr, a_val, b_val))
  n_tr, d = a_tr.shape
  n_val = a_val.shape[0]
  n = n_tr + n_val
  lo, hi = map(float, omega_bounds)
  if not 0 < lo < hi:
    raise ValueError(f"omega_bounds must satisfy 0 < omega_min < omega_max, got {omega_bounds}")
  data = {"a": jnp.concatenate([a_tr, a_val]), "b": jnp.concatenate([b_tr, b_val]),
          "val": jnp.concatenate([jnp.zeros(n_tr), jnp.ones(n_val)]).astype(a_tr.dtype)}
  w_val, w_tr = n / n_val, n / n_tr

  def f_ex(x, theta, ex):
    del x
    return ex["val"] * w_val * _sq(ex, theta)

  def g_ex(x, theta, ex):
    del x
    return (1.0 - ex["val"]) * w_tr * _sq(ex, theta)

  def g_reg(x, theta):
    return 0.5 * x[0] * jnp.sum(jnp.square(theta))

  h_min, h_max = curvature_bounds
  clip = float(clip) if clip is not None else w_tr * 3.0 * math.sqrt(d)
  consts = ProblemConstants(l0f=clip * w_val / w_tr, l1f=h_max, l0g=clip, l1g=h_max + hi,
                            l2g=1e-12 + 1.0, mu_g=lo + h_min, delta_f=1.0)
  prob = BilevelProblem(name=name, f_ex=f_ex, g_ex=g_ex, data=data,
                        x0=jnp.asarray([omega0], a_tr.dtype), y0=jnp.zeros(d, a_tr.dtype),
                        consts=consts, g_reg=g_reg, x_radius=(hi - lo) / 2,
                        x_center=jnp.asarray([(hi + lo) / 2], a_tr.dtype),
                        y_radius=theta_radius, population_fn=population_fn,
                        meta=dict(meta or {}, n_train=n_tr, n_val=n_val, omega_bounds=[lo, hi]))
  _attach_ridge_optimum(prob, np.asarray(a_tr, np.float64), np.asarray(b_tr, np.float64),
                        np.asarray(a_val, np.float64), np.asarray(b_val, np.float64), lo, hi)
  return prob


def _ridge_closed_form(a_tr, b_tr, a_val, b_val):
  """NON-PRIVATE closed forms (numpy, float64; evaluation only): ``F(omega)`` and ``F'(omega)``
  with ``theta*(omega) = (H + omega I)^{-1} c`` (spec §5 R1)."""
  n_tr, d = a_tr.shape
  h = a_tr.T @ a_tr / n_tr
  c = a_tr.T @ b_tr / n_tr
  hv = a_val.T @ a_val / a_val.shape[0]
  cv = a_val.T @ b_val / a_val.shape[0]
  bb = float(b_val @ b_val) / a_val.shape[0]

  def theta(om):
    return np.linalg.solve(h + om * np.eye(d), c)

  def big_f(om):
    th = theta(om)
    return 0.5 * (th @ hv @ th) - cv @ th + 0.5 * bb

  def d_f(om):
    th = theta(om)
    grad_f = hv @ th - cv
    return -grad_f @ np.linalg.solve(h + om * np.eye(d), th)
  return theta, big_f, d_f


def _attach_ridge_optimum(prob, a_tr, b_tr, a_val, b_val, lo, hi):
  theta, big_f, d_f = _ridge_closed_form(a_tr, b_tr, a_val, b_val)
  grid = np.geomspace(lo, hi, 400)
  vals = np.array([big_f(g) for g in grid])
  i = int(np.argmin(vals))
  best = grid[i]
  if 0 < i < len(grid) - 1:  # interior: refine by bisection on F'
    a, b = grid[i - 1], grid[i + 1]
    for _ in range(100):
      mid = 0.5 * (a + b)
      if d_f(mid) > 0:
        b = mid
      else:
        a = mid
    best = 0.5 * (a + b)
  prob.x_opt = jnp.asarray([best], prob.x0.dtype)
  prob.opt_risk = float(big_f(best))
  prob.meta["omega_star"] = float(best)
  prob.meta["omega_star_interior"] = bool(0 < i < len(grid) - 1)
  prob.meta["_closed_form"] = (theta, big_f, d_f)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _synthetic_ridge_data(key, d, n_train, n_val, label_noise):
  k_w, k_tr, k_val, k_e1, k_e2 = jax.random.split(key, 5)
  w = jax.random.normal(k_w, (d,)) / math.sqrt(d)
  a_tr = jax.random.normal(k_tr, (n_train, d))
  a_val = jax.random.normal(k_val, (n_val, d))
  b_tr = a_tr @ w + label_noise * jax.random.normal(k_e1, (n_train,))
  b_val = a_val @ w + label_noise * jax.random.normal(k_e2, (n_val,))
  return w, a_tr, b_tr, a_val, b_val


def synthetic_ridge_problem(key: jax.Array, *, d: int = 10, n_train: int = 2000,
                            n_val: int = 2000, label_noise: float = 3.0,
                            omega_bounds=(1e-3, 5.0), omega0: float = 1.0,
                            clip: float | None = None) -> BilevelProblem:
  """Synthetic ridge tuning (spec §5 R2): ``w ~ N(0, I/d)``, ``a ~ N(0, I)``,
  ``b = a.w + N(0, label_noise^2)``. The optimal penalty is known (bisection on the closed-form
  ``F'``); the population (test) risk is ``1/2 ||theta*(omega) - w||^2 + label_noise^2/2``.
  Public curvature bounds from the Gaussian design: ``(1 -+ sqrt(d/n))^2`` with slack."""
  w, a_tr, b_tr, a_val, b_val = _synthetic_ridge_data(key, d, n_train, n_val, label_noise)
  r = math.sqrt(d / min(n_train, n_val))
  h_min, h_max = 0.8 * max(0.0, 1 - r) ** 2, 1.25 * (1 + r) ** 2
  n = n_train + n_val
  if clip is None:
    clip = n / n_train * 2.0 * label_noise * math.sqrt(d)
  w_np = np.asarray(w, np.float64)
  prob = ridge_tuning_problem(a_tr, b_tr, a_val, b_val, omega_bounds=omega_bounds,
                              omega0=omega0, clip=clip, curvature_bounds=(h_min, h_max),
                              theta_radius=2.0 + 2.0 * label_noise * math.sqrt(d / n_train),
                              name="ridge_synthetic",
                              meta={"d": d, "label_noise": label_noise})
  theta = prob.meta["_closed_form"][0]

  def pop(x):
    th = theta(float(np.asarray(x).reshape(-1)[0]))
    return 0.5 * float(np.sum((th - w_np) ** 2)) + 0.5 * label_noise ** 2
  prob.population_fn = pop
  grid = np.geomspace(*omega_bounds, 400)
  prob.population_opt = float(min(pop(np.array([g])) for g in grid))
  return prob


def diabetes_ridge_problem(key: jax.Array, *, omega_bounds=(1e-2, 5.0), omega0: float = 1.0,
                           val_fraction: float = 0.5, clip: float | None = None
                           ) -> BilevelProblem:
  """scikit-learn's diabetes data (442 x 10, ships with sklearn; imported lazily). Features as
  shipped times ``sqrt(442)`` (unit scale), target mapped by the PUBLIC affine map
  ``(b - 185.5)/160.5`` of its documented range [25, 346] (no data-dependent centering). A random
  train/validation split by ``key``."""
  try:
    from sklearn.datasets import load_diabetes
  except ImportError as e:  # sklearn is a dev extra
    raise ImportError("the diabetes problem needs scikit-learn (pip install "
                      "dpsco_jax[dev])") from e
  a, b = load_diabetes(return_X_y=True)
  a = np.asarray(a, np.float64) * math.sqrt(442.0)
  b = (np.asarray(b, np.float64) - 185.5) / 160.5
  perm = np.asarray(jax.random.permutation(key, a.shape[0]))
  n_val = int(round(val_fraction * a.shape[0]))
  iv, it = perm[:n_val], perm[n_val:]
  d = a.shape[1]
  n = a.shape[0]
  if clip is None:
    clip = n / len(it) * 1.0 * math.sqrt(d)
  dt = jnp.zeros(()).dtype
  return ridge_tuning_problem(a[it].astype(dt), b[it].astype(dt), a[iv].astype(dt),
                              b[iv].astype(dt), omega_bounds=omega_bounds, omega0=omega0,
                              clip=clip, curvature_bounds=(0.0, 4.0 * d), theta_radius=2.0,
                              name="ridge_diabetes", meta={"d": d})


def dp_ridge_tuning(a_tr, b_tr, a_val, b_val, *, epsilon: float, delta: float, key: jax.Array,
                    omega_bounds=(1e-3, 5.0), omega0: float = 1.0, lam: float = 30.0,
                    eta: float = 0.5, steps: int = 30, inner_steps: int = 300,
                    inner_rounds: int = 2, clip: float | None = None,
                    curvature_bounds: tuple[float, float] = (0.0, 4.0),
                    theta_radius: float = 5.0, debug: bool = False):
  """Tunes a ridge penalty privately (§7, corrected sign E1): the update is
  ``omega <- Pi_X(omega - eta lam (R(theta^lam) - R(theta)))`` with ``R = ||.||^2/2`` and
  ``theta, theta^lam`` from DP-Loc-GD. The whole budget goes to the two inner solves (the outer
  step is post-processing). Returns a ``Result`` whose ``params`` is ``[omega]``."""
  prob = ridge_tuning_problem(a_tr, b_tr, a_val, b_val, omega_bounds=omega_bounds,
                              omega0=omega0, clip=clip, curvature_bounds=curvature_bounds,
                              theta_radius=theta_radius)
  return dp_bilevel(prob, {"epsilon": epsilon, "delta": delta, "lam": lam, "eta": eta,
                           "T": steps, "inner_steps": inner_steps,
                           "inner_rounds": inner_rounds, "debug": debug}, key)


def _ridge_factory(cfg: dict, key: jax.Array) -> BilevelProblem:
  dataset = check_choice(cfg.get("dataset", "synthetic"), "dataset", ("synthetic", "diabetes"))
  bounds = tuple(cfg.get("omega_bounds", (1e-3, 5.0) if dataset == "synthetic" else (1e-2, 5.0)))
  if dataset == "diabetes":
    return diabetes_ridge_problem(key, omega_bounds=bounds, omega0=cfg.get("omega0", 1.0),
                                  clip=cfg.get("clip"))
  return synthetic_ridge_problem(key, d=int(cfg.get("d", 10)),
                                 n_train=int(cfg.get("n_train", 2000)),
                                 n_val=int(cfg.get("n_val", 2000)),
                                 label_noise=float(cfg.get("label_noise", 3.0)),
                                 omega_bounds=bounds, omega0=float(cfg.get("omega0", 1.0)),
                                 clip=cfg.get("clip"))


ALGORITHMS = {
    "dp_bilevel": dp_bilevel,
    "dp_bilevel_minibatch": _dp_bilevel_minibatch,
    "dp_bilevel_population": _dp_bilevel_population,
    "nonprivate_penalty": _nonprivate_runner,
}
PROBLEMS = {"ridge_tuning": _ridge_factory}
