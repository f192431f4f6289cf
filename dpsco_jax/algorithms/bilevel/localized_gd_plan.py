"""DP-Loc-(S)GD decided before any data: its static config, noise and radii schedule, events and
calibration, the presets (paper 004, Alg 2 / Alg 4), the runner's plan from public facts and
the planner ``dpsco_jax.plan`` calls. :mod:`.localized_gd` re-exports every name and describes
the algorithm, the accounting and the deviations."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import dp_accounting
import jax

from dpsco_jax._checks import (check_choice, check_delta, check_epsilon, check_int,
                               check_nonnegative, check_positive)
from dpsco_jax.algorithms.bilevel.config import LocGdConfig
from dpsco_jax.algorithms.registration import Planned
from dpsco_jax.config.families import Schema
from dpsco_jax.data.problem import MissingConstant
from dpsco_jax.privacy.calibrate import calibrate_noise_multiplier
from dpsco_jax.privacy.ledger import PrivacyLedger, PrivacyReport, Provenance
from dpsco_jax.privacy.relations import PUBLIC, check_relation
from dpsco_jax.privacy.sensitivity import GaussianStage, clipped_mean_sensitivity

#: a pytree of params or data
PyTree = Any

RELATION = "replace_one"  # the paper's adjacency (spec §1)
SUPPORTED_RELATIONS = (RELATION,)


def check_loc_gd_relation(relation: object) -> str:
  """The relation DP-Loc-(S)GD honours: ``replace_one`` (``n`` public); others raise."""
  return check_relation(relation, supported=SUPPORTED_RELATIONS, mechanism="DP-Loc-(S)GD")


# --- Configuration (all fields public and static; nothing here depends on data) -------------------

@dataclasses.dataclass(frozen=True)
class LocGDConfig:
  """Static configuration of one DP-Loc-(S)GD solve (Alg 2 / Alg 4).

  Attributes:
    mu: public strong-convexity modulus of ``h``.
    clip_norm: per-example gradient clip ``C`` (``= L`` in the theory preset: then clipping is
      inactive whenever the Lipschitz assumption holds on the ball).
    noise_multiplier: ``z``; the noise std on the clipped mean is ``z C / denominator``.
    rounds: localization rounds ``M``.
    steps: steps per round ``T_GD`` (``T_SGD``).
    radius0: ``R_0`` with ``y* in B(y_0, R_0)`` (public assumption).
    radius_const: the absolute constant of the radius schedule (spec §3.4).
    batch_size: ``None`` = full batch (Alg 2); ``b`` = the expected batch of Poisson sampling
      at rate ``b / n`` and the fixed denominator (Alg 4; see the module docstring).
    step_rule: ``"paper"`` ``eta_t = 1/(mu (t+1))`` or ``"smooth"`` ``1/(smoothness + mu t)``.
    smoothness: the smoothness of ``h`` (required by ``step_rule="smooth"``).
    localize: ``False`` keeps one ball ``B(y_0, R_0)`` for every round (spec §3.4).
    average: ``"paper"`` averages ``y_0..y_{T-1}`` (Alg 2 line 7); ``"core"`` averages
      ``y_1..y_T`` (the core ``projected_sgd`` convention).
  """
  mu: float
  clip_norm: float
  noise_multiplier: float
  rounds: int = 1
  steps: int = 100
  radius0: float = 1.0
  radius_const: float = 4.0
  batch_size: int | None = None
  step_rule: str = "paper"
  smoothness: float | None = None
  localize: bool = True
  average: str = "paper"

  def __post_init__(self):
    check_positive(self.mu, "mu")
    check_positive(self.clip_norm, "clip_norm")
    check_nonnegative(self.noise_multiplier, "noise_multiplier")
    check_int(self.rounds, "rounds", minimum=1)
    check_int(self.steps, "steps", minimum=1)
    check_positive(self.radius0, "radius0")
    check_positive(self.radius_const, "radius_const")
    if self.batch_size is not None:
      check_int(self.batch_size, "batch_size", minimum=1)
    check_choice(self.step_rule, "step_rule", ("paper", "smooth"))
    check_choice(self.average, "average", ("paper", "core"))
    if self.step_rule == "smooth":
      if self.smoothness is None:
        raise ValueError("smoothness is required when step_rule='smooth'")
      check_positive(self.smoothness, "smoothness")


class LocGDAux(NamedTuple):
  """Diagnostics of a solve. ``radii`` and ``stddev`` are public; ``max_dist`` (``[M]``, the
  largest distance of an iterate to its round's center) and ``centers`` (``y^1_0..y^M_0``) are
  data-dependent and for tests / ``debug`` only."""
  radii: jax.Array
  stddev: jax.Array
  max_dist: jax.Array
  centers: PyTree


def noise_denominator(cfg: LocGDConfig, n: int) -> int:
  """The clipped mean's denominator: the batch size, or ``n`` for full-batch steps."""
  if cfg.batch_size is None:
    return n
  if cfg.batch_size > n:
    raise ValueError(f"batch_size ({cfg.batch_size}) must be <= the number of examples ({n})")
  return cfg.batch_size


def loc_gd_stage(cfg: LocGDConfig, n: int) -> GaussianStage:
  """The step's noise stage: ``z`` on the clipped mean's sensitivity ``C / denominator``."""
  return GaussianStage(cfg.noise_multiplier,
                       clipped_mean_sensitivity(cfg.clip_norm, noise_denominator(cfg, n)),
                       "DP-Loc-GD step")


def loc_gd_stddev(cfg: LocGDConfig, n: int) -> float:
  """Per-coordinate noise std on the clipped mean gradient: the stage's ``z C / denominator``."""
  return loc_gd_stage(cfg, n).std


def loc_gd_radii(cfg: LocGDConfig, n: int, dim: int) -> tuple[float, ...]:
  """Radii ``(R_0, ..., R_{M-1})`` of the localization balls (public; see module docstring)."""
  radii = [float(cfg.radius0)]
  if not cfg.localize:
    return tuple(radii * cfg.rounds)
  s = loc_gd_stddev(cfg, n)
  a = max(s, cfg.clip_norm) * math.sqrt((1.0 + math.log(cfg.steps)) / cfg.steps) / cfg.mu
  for _ in range(1, cfg.rounds):
    prev = radii[-1]
    radii.append(min(2.0 * prev, cfg.radius_const * (math.sqrt(prev * a) + a * math.sqrt(dim))))
  return tuple(radii)


def loc_gd_rounds(mu: float, lipschitz: float, n: int, epsilon: float) -> int:
  """``M = log2 log(mu eps' n / L)`` (Thm 8.2), rounded up, at least 1 (the log base of the
  inner log is not stated; natural log, spec §3.4)."""
  ratio = mu * epsilon * n / lipschitz
  if ratio <= math.e:
    return 1
  return max(1, math.ceil(math.log2(math.log(ratio))))


def loc_gd_step_event(z: float, *, n: int | None = None, batch: int | None = None
                      ) -> dp_accounting.DpEvent:
  """One step in the convention ``z = sigma / C`` (the ledger applies replace-one's ``2C``):
  ``GaussianDpEvent(z)``, or ``PoissonSampledDpEvent(batch / n, ...)`` for DP-Loc-SGD."""
  check_positive(z, "noise_multiplier")
  base = dp_accounting.GaussianDpEvent(z)
  if batch is None:
    return base
  n = check_int(n, "n")
  if not 1 <= check_int(batch, "batch_size") <= n:
    raise ValueError(f"batch_size must lie in [1, n={n}], got {batch}")
  return dp_accounting.PoissonSampledDpEvent(batch / n, base)


def loc_gd_event(cfg: LocGDConfig, n: int) -> dp_accounting.DpEvent:
  """One solve: ``M T`` steps (:func:`loc_gd_step_event`). A zero multiplier has no event
  (raises)."""
  if cfg.noise_multiplier == 0:
    raise ValueError("noise_multiplier=0 is not private: no privacy event exists for it")
  step = loc_gd_step_event(cfg.noise_multiplier, n=n,
                           batch=None if cfg.batch_size is None else noise_denominator(cfg, n))
  return dp_accounting.SelfComposedDpEvent(step, cfg.rounds * cfg.steps)


def with_calibrated_noise(cfg: LocGDConfig, n: int, *, epsilon: float, delta: float
                          ) -> LocGDConfig:
  """``cfg`` with the smallest noise multiplier for which one solve is ``(epsilon, delta)``-DP
  under replace-one, found by the library's one calibrator on :func:`loc_gd_event`."""
  z = calibrate_noise_multiplier(
      lambda z: loc_gd_event(dataclasses.replace(cfg, noise_multiplier=z), n),
      epsilon=epsilon, delta=delta, relation=RELATION,
      key=("loc_gd", dataclasses.replace(cfg, noise_multiplier=1.0), int(n)))
  return dataclasses.replace(cfg, noise_multiplier=z)


# --- The paper's own composition (Lemma 2.1 + Lemma 2.2), reported beside the exact accountant ----

def advanced_composition_step(epsilon: float, delta: float, k: int) -> tuple[float, float]:
  """Per-step ``(eps_0, delta_0)`` such that Lemma 2.1 (advanced composition) over ``k`` steps
  gives ``(epsilon, delta)``: ``delta_0 = delta/(k+1)`` and ``eps_0`` solves
  ``sqrt(2 k ln(1/delta_0)) eps_0 + 2 k eps_0^2 = epsilon``."""
  d0 = delta / (k + 1)
  b = math.sqrt(2.0 * k * math.log(1.0 / d0))
  e0 = (-b + math.sqrt(b * b + 8.0 * k * epsilon)) / (4.0 * k)
  return e0, d0


def paper_loc_gd_stddev(cfg: LocGDConfig, n: int, *, epsilon: float, delta: float) -> float:
  """The std the paper prescribes for an ``(epsilon, delta)`` solve: Lemma 2.2
  ``sigma^2 = 2 ln(5/(4 delta_0)) Delta^2 / eps_0^2`` per step (``Delta = 2C/denom``),
  ``(eps_0, delta_0)`` from Lemma 2.1 over ``M T`` steps; DP-Loc-SGD first amplifies by
  ``b/n`` (Lemma 2.3), so the step budget is ``eps_0 n / b``. Constants as printed."""
  e0, d0 = advanced_composition_step(epsilon, delta, cfg.rounds * cfg.steps)
  denom = noise_denominator(cfg, n)
  if cfg.batch_size is not None:
    e0 = e0 * n / denom
  sens = clipped_mean_sensitivity(cfg.clip_norm, denom).under(RELATION)   # 2 C / denom
  return math.sqrt(2.0 * math.log(5.0 / (4.0 * d0))) * sens / e0


# --- Presets --------------------------------------------------------------------------------------

def loc_gd_theory_config(*, mu: float, lipschitz: float, n: int, epsilon: float,
                         delta: float, radius0: float, batch_size: int | None = None,
                         radius_const: float = 4.0) -> LocGDConfig:
  """Thm 8.2 / A.1 parameters: ``M = log2 log(mu eps n / L)``, ``T = n^2``,
  ``eta_t = 1/(mu(t+1))``, ``C = L``, noise calibrated exactly (the precondition is
  :func:`check_loc_gd_precondition`, a warning per spec E10)."""
  check_positive(mu, "mu")
  check_positive(lipschitz, "lipschitz")
  n = check_int(n, "n")
  rounds = loc_gd_rounds(mu, lipschitz, n, epsilon)
  cfg = LocGDConfig(mu=mu, clip_norm=lipschitz, noise_multiplier=0.0, rounds=rounds,
                    steps=n * n, radius0=radius0, radius_const=radius_const,
                    batch_size=batch_size, step_rule="paper")
  return with_calibrated_noise(cfg, n, epsilon=epsilon, delta=delta)


def check_loc_gd_precondition(cfg: LocGDConfig, n: int, dim: int, epsilon: float) -> bool:
  """Thm 8.2 precondition ``n >= L R_0^{2/log d} / (mu eps')`` (spec E10: warning only)."""
  expo = 2.0 / math.log(dim) if dim > 1 else 0.0
  return n >= cfg.clip_norm * cfg.radius0 ** expo / (cfg.mu * epsilon)


def loc_gd_practical_config(*, mu: float, clip_norm: float, n: int, dim: int, epsilon: float,
                            delta: float, radius0: float, smoothness: float | None = None,
                            steps: int | None = None, rounds: int | None = None,
                            batch_size: int | None = None, radius_const: float = 4.0,
                            steps_const: float = 1.0, max_steps: int = 2000) -> LocGDConfig:
  """Laptop-scale preset: ``T = min(n^2, ceil(c rho n^2/d), max_steps)`` (spec §3.4: under
  exact calibration the noise term is ``T``-free), the smooth step rule when a smoothness is
  given, rounds from Thm 8.2, exact calibration."""
  n = check_int(n, "n")
  check_epsilon(epsilon)
  check_delta(delta)
  if steps is None:
    rho = (math.sqrt(math.log(1 / delta) + epsilon) - math.sqrt(math.log(1 / delta))) ** 2
    steps = int(min(n * n, math.ceil(steps_const * rho * n * n / dim), max_steps))
    steps = max(steps, 10)
  if rounds is None:
    rounds = loc_gd_rounds(mu, clip_norm, n, epsilon)
  cfg = LocGDConfig(mu=mu, clip_norm=clip_norm, noise_multiplier=0.0, rounds=rounds,
                    steps=steps, radius0=radius0, radius_const=radius_const,
                    batch_size=batch_size,
                    step_rule="smooth" if smoothness is not None else "paper",
                    smoothness=smoothness)
  return with_calibrated_noise(cfg, n, epsilon=epsilon, delta=delta)


# --- The runner's plan (public facts only), its charge and report ---------------------------------

def plan_dp_loc_gd(cfg: Mapping | Any, *, n: int, dim: int, clip: float, radius0: float,
                   mu: float | None = None) -> tuple[LocGDConfig, dp_accounting.DpEvent]:
  """The solve's config and event from the config and public numbers only (``mu``: the
  config's unless given); an explicit ``noise_multiplier`` is kept (the plan's charge checks
  it against the budget)."""
  cfg = LocGdConfig.of(cfg)   # dp_loc_sgd's LocSgdConfig is one (batch_size required)
  check_loc_gd_relation(cfg.relation)
  eps, delta, batch = float(cfg.epsilon), float(cfg.delta), cfg.batch_size
  mu = check_positive(cfg.mu if mu is None else mu, "mu")
  if cfg.preset == "theory":
    lcfg = loc_gd_theory_config(mu=mu, lipschitz=clip, n=n, epsilon=eps, delta=delta,
                                radius0=radius0, batch_size=batch)
  else:
    lcfg = loc_gd_practical_config(mu=mu, clip_norm=clip, n=n, dim=dim, epsilon=eps,
                                   delta=delta, radius0=radius0,
                                   smoothness=cfg.smoothness, steps=cfg.num_steps,
                                   rounds=cfg.rounds, batch_size=batch,
                                   radius_const=cfg.radius_const)
  if cfg.noise_multiplier is not None:
    lcfg = dataclasses.replace(
        lcfg, noise_multiplier=check_positive(cfg.noise_multiplier, "noise_multiplier"))
  return lcfg, loc_gd_event(lcfg, n)


@dataclasses.dataclass(frozen=True)
class LocGDRunPlan:
  """Data-free plan of a run: the solve's config and event for ``n = n_users * m`` items."""
  n: int
  epsilon: float
  delta: float
  l2: float
  preset: str
  config: LocGDConfig
  event: dp_accounting.DpEvent

  @property
  def num_steps(self) -> int:
    """The solve's ``rounds * steps`` (progress reports)."""
    return self.config.rounds * self.config.steps

  @property
  def stages(self) -> tuple[GaussianStage, ...]:
    return (loc_gd_stage(self.config, self.n),)

  @property
  def events(self) -> tuple[dp_accounting.DpEvent, ...]:
    return (self.event,)

  def charge(self) -> PrivacyReport:
    """Charges a fresh budgeted ledger with the solve (raises first over budget); returns the
    guarantee (item level, accountant) with the paper-formula sigma in the notes."""
    ledger = PrivacyLedger(delta=self.delta, epsilon_budget=self.epsilon, relation=RELATION)
    ledger.spend(self.event, label="dp_loc_gd solve")
    lcfg, n = self.config, self.n
    paper_sigma = paper_loc_gd_stddev(lcfg, n, epsilon=self.epsilon, delta=self.delta)
    sampling = "full batch" if lcfg.batch_size is None else f"Poisson rate {lcfg.batch_size}/{n}"
    return ledger.report(
        provenance=Provenance.ACCOUNTANT, level="item", mechanisms=("dp_loc_gd solve",),
        notes=(f"{lcfg.rounds}x{lcfg.steps} clipped-mean Gaussian steps ({sampling}), "
               f"z={lcfg.noise_multiplier:.4g}, replace-one (public: {PUBLIC[RELATION]}); "
               f"paper-formula sigma {paper_sigma:.4g} vs ours {loc_gd_stddev(lcfg, n):.4g}"))


def _public_mu(problem, cfg: Schema) -> float:
  """``mu``: the config's, else the declared ``meta['strong_convexity']`` (MissingConstant)."""
  mu = cfg.mu
  if mu is None:
    mu = (getattr(problem, "meta", None) or {}).get("strong_convexity")
  if mu is None:
    raise MissingConstant("mu: dp_loc_gd needs the strong convexity mu of the loss: give the "
                          "config key mu or declare constants={'strong_convexity': ...}")
  return check_positive(mu, "mu")


def loc_gd_plan_for_problem(problem, cfg: dict) -> LocGDRunPlan:
  """The runner's plan from public facts only: ``n_users * m`` items, ``d``, and where the
  config does not give them L (``clip_norm``), a finite R (``radius0 = 2R``) and the declared
  strong convexity (``mu``)."""
  cfg = LocGdConfig.of(cfg)   # dp_loc_sgd's LocSgdConfig is one (batch_size required)
  n, dim = int(problem.n_users) * int(problem.m), int(problem.d)
  # derived defaults (the schema's docs give them): L, 2R -- read only when not given
  clip = cfg.clip_norm
  clip = check_positive(problem.lipschitz if clip is None else clip, "clip_norm")
  radius0 = cfg.radius0
  if radius0 is None:
    if not math.isfinite(float(problem.radius)):
      raise MissingConstant("radius0: dp_loc_gd needs the initial localization radius: give "
                            "radius0 or declare a finite constants={'radius': ...} (2R)")
    radius0 = 2.0 * float(problem.radius)
  radius0 = check_positive(radius0, "radius0")
  lcfg, event = plan_dp_loc_gd(cfg, n=n, dim=dim, clip=clip, radius0=radius0,
                               mu=_public_mu(problem, cfg))
  return LocGDRunPlan(n, float(cfg.epsilon), float(cfg.delta), float(cfg.l2), cfg.preset,
                      lcfg, event)


def loc_gd_planner(facts, cfg: dict) -> Planned:
  """``dpsco_jax.plan``'s planner: the plan and its charge (item level, replace-one)."""
  p = loc_gd_plan_for_problem(facts, cfg)
  c = p.config
  schedule = {"rounds": c.rounds, "num_steps": c.steps, "batch_size": c.batch_size,
              "clip_norm": c.clip_norm, "mu": c.mu, "radius0": c.radius0,
              "noise_std": loc_gd_stddev(c, p.n)}
  return Planned(p.charge(), c.noise_multiplier, schedule, p)
