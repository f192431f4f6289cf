"""Paper 004's plan: the bilevel configuration, presets (Thm 4.1 / 5.1 / 6.1), privacy events and
the paper's own noise/composition formulas (reported beside the accountant, never the
guarantee).

Everything here is computed from the config and public numbers before any data is touched:
``n`` (public under replace-one), the shapes and the problem's constants. The noise is
calibrated by :func:`dpsco_jax.privacy.calibrate_noise_multiplier` on the run's own events
(:func:`bilevel_events`): ``2T`` DP-Loc-(S)GD solves and ``T`` outer Gaussian steps (Poisson
subsampled for Alg 3), composed by PLD under replace-one. The planners read the built-in
:class:`BilevelProblem` as their public facts; ``dp_loc_gd``'s is in :mod:`.localized_gd_plan`."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import dp_accounting
from jax.extend.core import Literal as _Literal
import jax

from dpsco_jax._checks import (check_delta, check_epsilon, check_int,
                               check_nonnegative, check_positive)
from dpsco_jax.algorithms.bilevel.config import (BilevelConfig as BilevelSchema,
                                                  NonPrivatePenaltyConfig)
from dpsco_jax.algorithms.registration import Planned
from dpsco_jax.config.families import Schema
from dpsco_jax.problems.bilevel import BilevelProblem, ProblemConstants
from dpsco_jax.algorithms.bilevel.localized_gd_plan import (
    LocGDConfig, loc_gd_event, loc_gd_rounds, loc_gd_stage, loc_gd_stddev, loc_gd_step_event,
    paper_loc_gd_stddev)
from dpsco_jax.privacy.calibrate import calibrate_noise_multiplier
from dpsco_jax.privacy.ledger import PrivacyLedger, PrivacyReport, Provenance
from dpsco_jax.privacy.relations import PUBLIC, check_relation
from dpsco_jax.privacy.sensitivity import GaussianStage, clipped_mean_sensitivity

RELATION = "replace_one"  # paper §2: neighbouring datasets differ in one replaced point


@dataclasses.dataclass(frozen=True)
class BilevelConfig:
  """Static configuration of Alg 1 (``batch_out=None``, inner ``batch_size=None``) or Alg 3.
  ``outer_data_terms=False`` (no outer mechanism) only when the data terms provably do not
  depend on ``x`` (§7; checked structurally by :func:`bilevel_config`)."""
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


def bilevel_events(bcfg: BilevelConfig, n: int) -> list[tuple[str, dp_accounting.DpEvent, int]]:
  """``(label, event, count)`` of every mechanism of a run (count ``T``), replace-one, data free.
  A zero multiplier on a data-dependent mechanism has no event: raises."""
  out = [("lower-level y* solves (DP-Loc-(S)GD on g)", loc_gd_event(bcfg.inner_y, n),
          bcfg.steps),
         ("penalized y^lam solves (DP-Loc-(S)GD on f/lam+g)", loc_gd_event(bcfg.inner_lam, n),
          bcfg.steps)]
  if bcfg.outer_data_terms:
    if bcfg.outer_noise_multiplier == 0:
      raise ValueError("outer_noise_multiplier=0 with x-dependent data terms is not private")
    out.append(("outer penalty hypergradient (Gaussian)",
                loc_gd_step_event(bcfg.outer_noise_multiplier, n=n, batch=bcfg.batch_out),
                bcfg.steps))
  return out


def composed_events(bcfg: BilevelConfig, n: int) -> list[dp_accounting.DpEvent]:
  """:func:`bilevel_events` as a list of self-composed events (one per mechanism)."""
  return [dp_accounting.SelfComposedDpEvent(e, c) for _, e, c in bilevel_events(bcfg, n)]


def noise_ratios(bcfg: BilevelConfig, shares: tuple[float, float, float]
                 ) -> tuple[float, float, float]:
  """Relative multipliers ``(r_y, r_lam, r_out)``, the smallest positive one ``1``.

  The paper splits the budget equally per iteration; in zCDP form (spec §3.4) mechanism ``k``
  with ``c_k`` Gaussian steps and share ``s_k`` gets ``z_k = z sqrt(c_k / s_k)``. ``shares[2] =
  0`` means no outer noise (``r_out = 0``)."""
  if len(shares) != 3 or any(s < 0 for s in shares) or abs(sum(shares) - 1) > 1e-9:
    raise ValueError(f"shares must be three non-negative numbers summing to 1, got {shares}")
  if shares[0] == 0 or shares[1] == 0:
    raise ValueError("shares of the two inner solves must be > 0")
  counts = (bcfg.inner_y.rounds * bcfg.inner_y.steps, bcfg.inner_lam.rounds
            * bcfg.inner_lam.steps, 1)
  ratios = [math.sqrt(c / s) if s > 0 else 0.0 for c, s in zip(counts, shares)]
  r_min = min(r for r in ratios if r > 0)
  return tuple(r / r_min for r in ratios)


def with_noise(bcfg: BilevelConfig, z: float, ratios: tuple[float, float, float]
               ) -> BilevelConfig:
  """``bcfg`` with multipliers ``z * ratios`` (the outer one only if it has data terms)."""
  return dataclasses.replace(
      bcfg, inner_y=dataclasses.replace(bcfg.inner_y, noise_multiplier=z * ratios[0]),
      inner_lam=dataclasses.replace(bcfg.inner_lam, noise_multiplier=z * ratios[1]),
      outer_noise_multiplier=z * ratios[2] if bcfg.outer_data_terms else 0.0)


def outer_stage(bcfg: BilevelConfig, n: int) -> GaussianStage:
  """The outer Gaussian mechanism (Alg 1/3 line 4): ``z_out`` on the clipped mean of the
  per-example ``v_i``, sensitivity ``C_out / denominator`` (``n``, or ``b_out`` for Alg 3;
  the ledger doubles it under replace-one)."""
  return GaussianStage(bcfg.outer_noise_multiplier, clipped_mean_sensitivity(
      bcfg.clip_out, n if bcfg.batch_out is None else bcfg.batch_out), "outer")


def paper_bilevel_noise(bcfg: BilevelConfig, n: int, *, epsilon: float, delta: float) -> dict:
  """The paper's own per-mechanism noise for target ``(epsilon, delta)``: every mechanism gets
  ``(eps/sqrt(18T), delta/(3(T+1)))`` (Alg 1 line 3, §8.4); outer std from Lemma 2.2 with
  sensitivity ``2 C_out / n`` (for Alg 3 the amplified ``2C/b`` at ``eps_0 n/b`` gives the same
  std, §5); inner std from :func:`paper_loc_gd_stddev`."""
  t = bcfg.steps
  e0, d0 = epsilon / math.sqrt(18 * t), delta / (3 * (t + 1))
  # Lemma 2.2 with the replace-one sensitivity 2 C_out / n
  sens = clipped_mean_sensitivity(bcfg.clip_out, n).under(RELATION)
  out_sigma = math.sqrt(2.0 * math.log(5.0 / (4.0 * d0))) * sens / e0
  return {"outer_std": out_sigma,
          "inner_y_std": paper_loc_gd_stddev(bcfg.inner_y, n, epsilon=e0, delta=d0),
          "inner_lam_std": paper_loc_gd_stddev(bcfg.inner_lam, n, epsilon=e0, delta=d0),
          "eps_per_mechanism": e0, "delta_per_mechanism": d0}


def _lemma22_eps(sens: float, sigma: float, delta: float) -> float:
  return sens * math.sqrt(2 * math.log(5 / (4 * delta))) / sigma


def _lemma21(eps0: float, delta0: float, k: int) -> float:
  return math.sqrt(2 * k * math.log(1 / delta0)) * eps0 + 2 * k * eps0 ** 2


def _amplify(eps0: float, b: int, n: int) -> float:
  """Lemma 2.3's amplification for the Poisson rate ``q = b/n`` the driver samples at."""
  q = b / n
  return math.log1p(q * math.expm1(min(eps0, 700.0)))


def paper_composition_epsilon(bcfg: BilevelConfig, n: int, *, delta: float) -> float:
  """The epsilon the paper's own analysis certifies for OUR noise: Lemma 2.2 per step, Lemma 2.3
  for minibatches, Lemma 2.1 over each solve's ``M T_in`` steps and over ``T`` iterations, basic
  composition of the 3 mechanisms per iteration, with the paper's delta split. Reported beside
  the accountant's epsilon to show the slack of the loose composition (E2)."""
  t = bcfg.steps
  d0 = delta / (3 * (t + 1))
  # (stage, Poisson batch, steps per solve: None for the outer one-step mechanism)
  mechanisms = [(loc_gd_stage(c, n), c.batch_size, c.rounds * c.steps)
                for c in (bcfg.inner_y, bcfg.inner_lam)]
  if bcfg.outer_data_terms:
    mechanisms.append((outer_stage(bcfg, n), bcfg.batch_out, None))
  eps_it = 0.0
  for stage, batch, k in mechanisms:
    if stage.noise_multiplier == 0:
      return math.inf
    d_step = d0 if k is None else d0 / (k + 1)
    e_step = _lemma22_eps(stage.sensitivity_under(RELATION), stage.std, d_step)
    if batch is not None:
      e_step = _amplify(e_step, batch, n)
    eps_it += e_step if k is None else _lemma21(e_step, d_step, k)
  return _lemma21(eps_it, delta / (t + 1), t)


def _x_grad_is_data_free(problem: BilevelProblem) -> bool:
  """True when ``f_ex`` and ``g_ex`` provably do not depend on ``x`` (a sound jaxpr dependency
  walk); the outer estimator is then post-processing of the private ``y``'s (§7)."""
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


def _schedule(problem: BilevelProblem, cfg: Schema, *, preset: str, eps: float, delta: float,
              batch_in: int | None, batch_out: int | None, population: bool, use_outer: bool,
              info: dict) -> BilevelConfig:
  """The preset's public schedule, uncalibrated (every multiplier 0): ``lam, eta, steps,
  clip_out`` and the two inner solves (no data is read)."""
  n, c_in, c_lam, r0 = problem.n, None, None, None
  if preset == "theory":
    tp = theory_params(problem.consts, epsilon=eps, delta=delta, n=n, d_x=problem.d,
                       d_y=problem.d_y, population=population, batch_out=batch_out)
    info.update(tp)
    lam, eta, steps, clip_out = tp["lam"], tp["eta"], tp["steps"], tp["clip_out"]
    inner_steps = n * n                       # Thm 8.2: T_GD = n^2
    rounds = (tp["rounds_y"], tp["rounds_lam"])
    work = steps * (rounds[0] + rounds[1]) * inner_steps * (n if batch_in is None else batch_in)
    limit = float(cfg.max_theory_work)
    if work > limit:
      raise ValueError(
          f"preset='theory' needs T={steps} outer steps of 2 DP-Loc-GD solves with T_GD=n^2="
          f"{inner_steps} steps: {work:.3g} example-gradients > max_theory_work={limit:.3g}; "
          f"use preset='practical' or raise max_theory_work")
    step_rule, radius_const = "paper", 4.0
  else:
    lam, eta = check_positive(cfg.lam, "lam"), float(cfg.learning_rate)
    steps = check_int(cfg.num_steps, "num_steps")
    # derived default: 5 l kappa
    clip_out = float(cfg.get("outer_clip_norm", 5 * problem.consts.ell * problem.consts.kappa))
    inner_steps = check_int(cfg.inner_num_steps, "inner_num_steps")
    rounds = (check_int(cfg.inner_rounds, "inner_rounds"),) * 2
    step_rule = cfg.inner_step_rule
    radius_const = check_positive(cfg.radius_const, "radius_const")
    c_in = cfg.inner_clip_norm
    c_lam = cfg.get("inner_clip_norm_lam", c_in)
    if cfg.inner_radius0 is not None:
      r0 = check_positive(cfg.inner_radius0, "inner_radius0")
  c = problem.consts
  r_y = problem.y_radius if problem.y_radius is not None else 2 * c.l0g / c.mu_g

  def solve(mu, clip, smooth, radius0, rounds_k):   # derived defaults: clip, radius0
    return LocGDConfig(mu=mu, clip_norm=float(clip), noise_multiplier=0.0, rounds=rounds_k,
                       steps=inner_steps, radius0=radius0 if r0 is None else r0,
                       radius_const=radius_const, batch_size=batch_in, step_rule=step_rule,
                       smoothness=smooth if step_rule == "smooth" else None)
  inner_y = solve(c.mu_g, c.l0g if c_in is None else c_in, c.l1g, r_y, rounds[0])
  # Spec §2.2 [ours]: solve f/lam + g: same argmin, mu_g/2, Lipschitz L0f/lam + L0g.
  inner_lam = solve(c.mu_g / 2, c.l0f / lam + c.l0g if c_lam is None else c_lam,
                    c.l1f / lam + c.l1g, r_y + c.l0f / (lam * c.mu_g), rounds[1])
  return BilevelConfig(lam=lam, eta=eta, steps=steps, clip_out=clip_out,
                       outer_noise_multiplier=0.0, inner_y=inner_y, inner_lam=inner_lam,
                       batch_out=batch_out, warm_start=bool(cfg.warm_start),
                       outer_data_terms=use_outer)


def config_view(cfg: Mapping | Any) -> Schema:
  """The bilevel drivers' config: :class:`~dpsco_jax.algorithms.bilevel.config.BilevelConfig`
  (the schema) with its defaults; any other key raises."""
  return BilevelSchema.of(cfg)


def bilevel_config(problem: BilevelProblem, cfg: Mapping | Any, *, minibatch: bool = False,
                   population: bool = False) -> tuple[BilevelConfig, dict]:
  """A calibrated :class:`BilevelConfig` from a config (``preset`` ``practical`` | ``theory``).
  Returns ``(bcfg, info)``; ``info`` holds the preset's derived values. ``minibatch``
  (``dp_bilevel_minibatch``): each batch size defaults to ``n // 10``; ``population``
  (``dp_bilevel_population``, §6 / Thm 6.1): the theory preset adds ``K3 sqrt(d_x/n)`` to alpha.

  Keys: :class:`~dpsco_jax.algorithms.bilevel.config.BilevelConfig`. ``shares`` split the
  budget between the three mechanisms (:func:`noise_ratios`); ``outer_noise`` ``auto`` turns
  the outer noise off only when the data terms provably do not depend on ``x``;
  ``noise_multiplier`` is an explicit base ``z`` (default: calibrated). Reads only public
  numbers, never the data's values."""
  cfg = config_view(cfg)
  check_relation(cfg.relation, supported=(RELATION,), mechanism="DP bilevel (Alg 1/3)")
  eps, delta, preset, n = float(cfg.epsilon), float(cfg.delta), cfg.preset, problem.n
  b = max(1, n // 10) if minibatch else None
  batch_in, batch_out = cfg.get("inner_batch_size", b), cfg.get("outer_batch_size", b)
  for name, b in (("inner_batch_size", batch_in), ("outer_batch_size", batch_out)):
    if b is not None and not 1 <= check_int(b, name) <= n:
      raise ValueError(f"{name} must lie in [1, n={n}], got {b}")
  outer_noise = cfg.outer_noise
  data_free = _x_grad_is_data_free(problem)
  if outer_noise is False and not data_free:
    raise ValueError("outer_noise=false is private only when f_ex and g_ex do not depend on x "
                     "(§7 observation); this problem's data terms depend on x")
  use_outer = (outer_noise is True) or (outer_noise == "auto" and not data_free)
  info: dict = {"preset": preset, "outer_noise": use_outer}

  base = _schedule(problem, cfg, preset=preset, eps=eps, delta=delta, batch_in=batch_in,
                   batch_out=batch_out, population=population or bool(cfg.population),
                   use_outer=use_outer, info=info)
  # derived default: equal shares of the mechanisms that run
  shares = tuple(cfg.get("shares", (1 / 3, 1 / 3, 1 / 3) if use_outer else (0.5, 0.5, 0.0)))
  if not use_outer:
    shares = (shares[0] / (shares[0] + shares[1]), shares[1] / (shares[0] + shares[1]), 0.0)
  elif len(shares) == 3 and shares[2] == 0:
    raise ValueError("shares[2] (outer) must be > 0 when the outer estimator is noised")
  ratios = noise_ratios(base, shares)
  if cfg.noise_multiplier is not None:  # explicit: the driver checks it against eps
    z = check_positive(cfg.noise_multiplier, "noise_multiplier")
  else:  # the library's one calibrator on the run's own events
    z = calibrate_noise_multiplier(lambda z: composed_events(with_noise(base, z, ratios), n),
                                   epsilon=eps, delta=delta, relation=RELATION)
  info["noise_multiplier"] = z
  bcfg = with_noise(base, z, ratios)
  # Spec §6.4 invariants (warnings, recorded): lam and eta within the analysis' range.
  c = problem.consts
  info["lam_below_theory_min"] = base.lam < max(2 * c.kappa, c.l0f / c.l0g, c.l1f / c.l1g)
  info["eta_above_theory_max"] = base.eta > 1.0 / (2.0 * c.ell * c.kappa ** 3)
  return bcfg, info


# --- The planners: what a run executes, its charge and its report ---------------------------------

@dataclasses.dataclass(frozen=True)
class BilevelPlan:
  """What a bilevel run executes: the calibrated ``bcfg`` for the public ``n``, the target
  ``(epsilon, delta)``, every mechanism's ``(label, event, count)``, the paper's composition
  epsilon for this noise, and the record's public numbers."""
  bcfg: BilevelConfig
  n: int
  epsilon: float
  delta: float
  mechanisms: tuple
  paper_epsilon: float
  notes: str
  record: dict

  @property
  def stages(self) -> tuple[GaussianStage, ...]:
    b = self.bcfg
    inner = (loc_gd_stage(b.inner_y, self.n), loc_gd_stage(b.inner_lam, self.n))
    return inner + ((outer_stage(b, self.n),) if b.outer_data_terms else ())

  @property
  def events(self) -> tuple[dp_accounting.DpEvent, ...]:
    return tuple(dp_accounting.SelfComposedDpEvent(e, c) for _, e, c in self.mechanisms)

  def charge(self, ledger: PrivacyLedger | None = None) -> PrivacyReport:
    """Charges every mechanism BEFORE anything runs and returns the guarantee (item level,
    ``accountant``, the paper's epsilon beside it). ``ledger``: a caller's replace-one ledger
    that composes other releases (default a fresh one with ``epsilon_budget = epsilon``); the
    budget is checked on a scratch copy, so a refused run leaves it untouched."""
    if ledger is None:
      ledger = PrivacyLedger(delta=self.delta, epsilon_budget=self.epsilon, relation=RELATION)
    trial = copy.deepcopy(ledger)
    for label, event, count in self.mechanisms[:-1]:
      trial.compose(event, label=label, count=count)
    last = self.mechanisms[-1]
    trial.spend(last[1], label=last[0], count=last[2])  # raises if exceeded
    for label, event, count in self.mechanisms:
      ledger.compose(event, label=label, count=count)
    return ledger.report(provenance=Provenance.ACCOUNTANT, level="item",
                         paper_epsilon=self.paper_epsilon, notes=self.notes)


def _public_record(bcfg: BilevelConfig, info: dict, n: int, *, eps: float, delta: float,
                   paper_eps: float) -> dict:
  paper = paper_bilevel_noise(bcfg, n, epsilon=eps, delta=delta)
  return {
      "lam": bcfg.lam, "learning_rate": bcfg.eta, "num_steps": bcfg.steps,
      "outer_clip_norm": bcfg.clip_out, "inner_num_steps": bcfg.inner_y.steps,
      "inner_rounds": [bcfg.inner_y.rounds, bcfg.inner_lam.rounds],
      "outer_noise_std": outer_stage(bcfg, n).std,
      "inner_y_noise_std": loc_gd_stddev(bcfg.inner_y, n),
      "inner_lam_noise_std": loc_gd_stddev(bcfg.inner_lam, n),
      "paper_outer_noise_std": paper["outer_std"] if info["outer_noise"] else None,
      "paper_inner_y_noise_std": paper["inner_y_std"],
      "paper_inner_lam_noise_std": paper["inner_lam_std"],
      "paper_epsilon_for_our_noise": paper_eps,
      # the preset's derived values (the theory preset's eta, steps, clip_out are above as
      # learning_rate, num_steps, outer_clip_norm)
      **{k: v for k, v in info.items() if isinstance(v, (int, float, bool, str))
         and k not in ("eta", "steps", "clip_out")},
  }


def bilevel_planner(facts: BilevelProblem, cfg: Mapping | Any, **variant: bool) -> Planned:
  """``dp_bilevel``'s planner: the calibrated :class:`BilevelConfig` and its ``3T`` mechanisms
  charged on a fresh budgeted ledger (an explicit ``noise_multiplier`` over the budget raises
  :class:`~dpsco_jax.privacy.PrivacyBudgetExceeded` here). ``facts``: the
  :class:`BilevelProblem` (its public ``n``, shapes and constants); ``variant``:
  :func:`bilevel_config`'s ``minibatch`` / ``population``."""
  cfg = config_view(cfg)
  bcfg, info = bilevel_config(facts, cfg, **variant)
  n, eps, delta = facts.n, float(cfg.epsilon), float(cfg.delta)   # checked by bilevel_config
  paper_eps = paper_composition_epsilon(bcfg, n, delta=delta)
  alg = "Alg 3 (Poisson mini-batches)" if (bcfg.batch_out or bcfg.inner_y.batch_size) else "Alg 1"
  outer = ("T outer Gaussian steps" if info["outer_noise"] else
           "no outer noise (data terms x-free: outer step is post-processing, §7)")
  notes = (f"{alg}, preset={info['preset']}; replace-one (public: {PUBLIC[RELATION]}) PLD "
           f"composition of 2T DP-Loc-(S)GD solves and {outer}; per-example clipping enforces "
           "every sensitivity (spec §3.4).")
  plan = BilevelPlan(bcfg, n, eps, delta, tuple(bilevel_events(bcfg, n)), paper_eps, notes,
                     _public_record(bcfg, info, n, eps=eps, delta=delta, paper_eps=paper_eps))
  schedule = {"num_steps": bcfg.steps, "learning_rate": bcfg.eta, "lam": bcfg.lam,
              "outer_batch_size": bcfg.batch_out, "inner_batch_size": bcfg.inner_y.batch_size,
              "inner_num_steps": bcfg.inner_y.steps,
              "inner_rounds": [bcfg.inner_y.rounds, bcfg.inner_lam.rounds]}
  return Planned(plan.charge(), info["noise_multiplier"], schedule, plan)


#: ``dp_bilevel_minibatch``: Alg 3, each batch size ``n // 10`` unless the config sets it
bilevel_minibatch_planner = functools.partial(bilevel_planner, minibatch=True)
#: ``dp_bilevel_population`` (§6 / Thm 6.1)
bilevel_population_planner = functools.partial(bilevel_planner, population=True)


class PenaltyPlan(NamedTuple):
  """What ``nonprivate_penalty`` runs: the config's schedule; no noise stage, no event."""
  lam: float
  learning_rate: float
  num_steps: int
  newton_steps: int
  stages = ()
  events = ()

  def charge(self) -> PrivacyReport:
    return PrivacyReport(epsilon=math.inf, delta=1.0 - 1e-12, provenance="none", level="none",
                         relation=RELATION, notes="NON-PRIVATE reference: exact inner solves")


def nonprivate_penalty_planner(facts: BilevelProblem, cfg: Mapping | Any) -> Planned:
  """``nonprivate_penalty``: no privacy (exact inner solves); the schedule is the config's."""
  cfg = NonPrivatePenaltyConfig.of(cfg)
  p = PenaltyPlan(cfg.lam, cfg.learning_rate, cfg.num_steps, cfg.newton_steps)
  return Planned(p.charge(), None, p._asdict(), p)
