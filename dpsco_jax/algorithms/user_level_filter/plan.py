"""Data-free privacy plans of paper 000's drivers (Algorithm 1; Algorithms 2-3): from the
config and the *public* facts (:class:`PublicSpec`) before any data is touched, the schedule,
every phase's sensitivity, noise multiplier and std, and the events
:meth:`FilterPlan.charge` spends before the first release; and the planners
:func:`dpsco_jax.plan` calls.

Neighbouring relation: **replace-one user** (paper 000, Definition 1.3), ``n`` and ``m``
public, the only one honoured: FILTER averages over a public number of users (``C`` groups,
``K_i`` sampled users, phase sizes from ``n``) and its analysis (Lemmas B.2/C.2) couples the
kept sets of two inputs of the same size. Under ``add_remove`` those sizes would depend on the
private ``n``; ``zero_out`` is refused too (sound, but with another noise convention).

Noise convention: the sensitivities of :mod:`.schedules` are replace-one shifts ``Delta`` of
the filtered mean; ``z = sigma / C`` with ``C = Delta / 2`` the add/remove-equivalent
sensitivity (the ledger, under ``replace_one``, accounts for ``2 C = Delta`` itself).

Accounting: per phase (disjoint users: ``group=phase``, parallel composition) a pure-DP test
(Alg. 1's Laplace test or Alg. 2's AboveThreshold) and the Gaussian release(s), composed at
``delta/2``; the other ``delta/2`` covers the coupling's bad events (``extra_delta``). The
noise is calibrated with the test as a ``fixed`` event, so a phase spends exactly the target.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import dp_accounting

from dpsco_jax.algorithms.user_level_filter.config import (
    AcceleratedErmConfig, AcceleratedErmSmoothedConfig, PhasedSgdConfig)
from dpsco_jax._checks import check_bool, check_choice, check_epsilon, check_positive
from dpsco_jax.algorithms.common import required_delta
from dpsco_jax.algorithms.registration import Planned
from dpsco_jax.algorithms.user_level_filter.schedules import (Alg1Schedule, Alg3Schedule,
                                                       alg1_schedule, alg3_schedule,
                                                       certified_sensitivity,
                                                       good_event_failure,
                                                       typical_sensitivity)
from dpsco_jax.privacy import (PrivacyLedger, PrivacyReport, Provenance,
                               calibrate_noise_multiplier, check_relation, pure_dp_event)
from dpsco_jax.config.families import Schema
from dpsco_jax.data.problem import MissingConstant, PublicFacts
from dpsco_jax.privacy.sensitivity import GaussianStage, Sensitivity, noise_multiplier_for_std
from dpsco_jax.privacy.sparse_vector import above_threshold_epsilon, laplace_test_epsilon

RELATION = "replace_one"           # Definition 1.3: neighbouring datasets replace one user
SUPPORTED_RELATIONS = (RELATION,)
SENSITIVITIES = ("certified", "typical")
PUBLIC = ("the number of users n, the items per user m, d, L, R, beta (replace-one "
          "adjacency: n is public); the phase sizes, group sizes and K_i follow from them")

__all__ = ["RELATION", "SUPPORTED_RELATIONS", "PublicSpec", "Options", "PhaseNoise",
           "FilterPlan", "read_options", "plan_alg1", "plan_alg3", "gauss_event",
           "plan_phased_sgd", "plan_accelerated_erm", "filter_planner", "provenance_note"]


class PublicSpec(NamedTuple):
  """The public facts a plan may read (never the data)."""
  n_users: int
  m: int
  d: int
  lipschitz: float
  radius: float
  smoothness: float

  @classmethod
  def of(cls, problem: Any) -> "PublicSpec":
    return cls(problem.n_users, problem.m, problem.d, problem.lipschitz, problem.radius,
               problem.smoothness)


class Options(NamedTuple):
  epsilon: float
  delta: float
  preset: str
  sensitivity: str
  noise: bool
  debug: bool
  relation: str
  noise_multiplier: float | None


#: Each paper-000 algorithm's schema: what :func:`config_view` reads for it.
SCHEMAS: dict[str, type] = {
    "user_level_phased_sgd": PhasedSgdConfig,
    "user_level_accelerated_erm": AcceleratedErmConfig,
    "user_level_accelerated_erm_smoothed": AcceleratedErmSmoothedConfig,
}


def config_view(cfg: Mapping | Any, algorithm: str) -> Schema:
  """``algorithm``'s config: its schema's fields with their defaults and the runner's
  ``debug``; any other key raises."""
  return SCHEMAS[algorithm].of(cfg)


def read_options(cfg: Mapping | Any, mechanism: str) -> Options:
  """The privacy-relevant config keys of ``mechanism``, validated (errors name the key)."""
  cfg = config_view(cfg, mechanism)
  eps = check_epsilon(cfg.epsilon)
  delta = required_delta(cfg.delta)
  preset = check_choice(cfg.preset, "preset", ("theory", "practical"))
  sens = check_choice(cfg.sensitivity, "sensitivity", SENSITIVITIES)
  # "privacy_noise", not "noise": the problems' label-noise key is "noise"
  noise = check_bool(cfg.privacy_noise, "privacy_noise")
  debug = check_bool(cfg.get("debug", False), "debug")
  relation = check_relation(cfg.relation, supported=SUPPORTED_RELATIONS,
                            mechanism=f"{mechanism} (FILTER averages over a public number of "
                                      "users; paper 000 is replace-one)")
  z = cfg.noise_multiplier
  if z is not None:
    z = check_positive(z, "noise_multiplier")
    if preset == "theory":
      raise ValueError("noise_multiplier: the theory preset uses the paper's sigma_i")
  return Options(eps, delta, preset, sens, noise, debug, relation, z)


@dataclasses.dataclass(frozen=True)
class PhaseNoise:
  """One phase's public privacy parameters."""
  index: int
  sensitivity: float          # replace-one l2 shift Delta of the phase's Gaussian release
  noise_multiplier: float     # z = sigma / (Delta / 2)  (nan when noise is off)
  sigma: float                # std of the Gaussian added to the release
  steps: int                  # Gaussian releases in the phase (1 for Alg. 1)
  test_event: Any             # pure-DP test (Laplace test / AboveThreshold), None if noise off
  gaussian_event: Any         # dp_accounting event of the phase's releases, None if noise off
  bad_event_probability: float

  @property
  def stage(self) -> GaussianStage | None:
    """The phase's Gaussian stage (``None`` when the noise is off). Its std is ``sigma``
    except under the theory preset, whose ``sigma`` is the paper's and ``z`` derived from it."""
    if self.gaussian_event is None:
      return None
    return GaussianStage(self.noise_multiplier, phase_sensitivity(self.sensitivity),
                         f"phase {self.index}")


@dataclasses.dataclass(frozen=True)
class FilterPlan:
  """Everything the run needs that does not depend on the data."""
  algorithm: str
  options: Options
  schedule: Alg1Schedule | Alg3Schedule
  epsilon_test: float
  phases: tuple[PhaseNoise, ...]
  #: the run's non-privacy knobs, read from the config here so that the run reads no config:
  #: ``clip_norm`` as a number (``None``: no clip), Alg. 1's ``project_output``, and the
  #: point released on a halt (``fallback``)
  clip: float | None = None
  project_output: bool = False
  fallback: str = "zero"

  @property
  def accountant_delta(self) -> float:
    return self.options.delta / 2.0

  @property
  def phase_steps(self) -> tuple[int, ...]:
    """The steps of each phase's loop (progress reports): Algorithm 1's one pass of SGD in
    every group (the groups run side by side), Algorithm 3's AC-SA steps."""
    if isinstance(self.schedule, Alg1Schedule):
      return tuple(int(ph.steps) for ph in self.schedule.phases)
    return tuple(int(ph.steps) for ph in self.phases)

  @property
  def num_steps(self) -> int:
    """The run's step count: the phases' steps summed."""
    return sum(self.phase_steps)

  @property
  def worst_bad(self) -> float:
    return max((p.bad_event_probability for p in self.phases), default=0.0)

  @property
  def stages(self) -> tuple[GaussianStage, ...]:
    """The phases' Gaussian stages, in order (none when the noise is off)."""
    return tuple(ph.stage for ph in self.phases if ph.stage is not None)

  @property
  def events(self) -> tuple[Any, ...]:
    """Per phase its pure-DP test and its Gaussian release(s) (none when the noise is off);
    the phases' disjoint users compose in parallel (:meth:`charge`)."""
    return tuple(e for ph in self.phases for e in (ph.test_event, ph.gaussian_event)
                 if e is not None)

  def charge(self) -> PrivacyReport:
    """Charges every phase's events to a fresh ledger at ``delta/2`` BEFORE anything is
    released (per phase ``group=phase``: parallel composition) and returns the guarantee.

    practical: budget = the configured epsilon. theory: the guarantee is the paper's theorem at
    the configured epsilon; the events are composed without a budget and the accountant's
    epsilon for the paper's sigma is reported beside it. Provenance: ``theorem`` (theory),
    ``heuristic`` (typical sensitivity), and with the certified sensitivity ``accountant`` only
    when the coupling's bad events fit in ``delta/2`` (:func:`provenance_note`). The noise
    off (``privacy_noise: false``): not private.

    Raises:
      PrivacyBudgetExceeded: an explicit ``noise_multiplier`` is over the budget (practical).
    """
    opt = self.options
    if not opt.noise:
      return PrivacyReport(epsilon=math.inf, delta=1.0 - 1e-12, provenance="none",
                           level="none", relation=RELATION,
                           notes="non-private ablation: filter on, sigma = 0")
    budget = opt.epsilon if opt.preset == "practical" else None
    ledger = PrivacyLedger(delta=self.accountant_delta, epsilon_budget=budget,
                           relation=opt.relation)
    record = ledger.spend if budget is not None else ledger.compose
    for ph in self.phases:
      g = f"phase{ph.index}"
      record(ph.test_event, label=f"{g} pure-DP test", group=g)
      record(ph.gaussian_event, label=f"{g}: {ph.steps} x Gaussian (z="
             f"{ph.noise_multiplier:.4g}, Delta={ph.sensitivity:.4g})", group=g)
    theorem, typical, mechanisms = _REPORTS[self.algorithm]
    acc_eps = ledger.epsilon(exact=True)
    if opt.preset == "theory":
      prov, note = Provenance.THEOREM.value, f"{theorem} gives eps={acc_eps:.4g}"
    elif opt.sensitivity == "typical":
      prov, note = Provenance.HEURISTIC.value, typical
    else:
      prov, note = provenance_note(self.worst_bad, opt.delta / 2)
    rep = ledger.report(provenance=prov, level="user", mechanisms=mechanisms,
                        paper_epsilon=opt.epsilon, notes=note,
                        extra_delta=opt.delta - ledger.delta)
    # theory: the guarantee is the paper's theorem at the configured epsilon
    return dataclasses.replace(rep, epsilon=opt.epsilon) if opt.preset == "theory" else rep


#: Each algorithm's report: (the theorem, the typical sensitivity's caveat, mechanisms).
_REPORTS = {
    "user_level_phased_sgd": (
        "Theorem B.1 (paper constants, preconditions checked); accountant with explicit Delta",
        "typical sensitivity 2 r_h / C (no membership flips) is not a worst-case bound",
        ("laplace_test", "filter", "gaussian_output_perturbation")),
    "user_level_accelerated_erm": (
        "Theorem C.1/D.3 (paper constants, preconditions checked); accountant with the "
        "explicit coupled Delta",
        "typical sensitivity 2 r_h / K (no membership flips) is not a worst-case bound",
        ("above_threshold", "filter", "subsampled_gaussian_wor")),
}


def gauss_event(z: float, n_i: int, k_i: int, steps: int) -> dp_accounting.DpEvent:
  """``steps`` Gaussian releases of a uniformly random ``K_i``-subset of ``n_i`` users."""
  g = dp_accounting.GaussianDpEvent(z)
  one = g if k_i >= n_i else dp_accounting.SampledWithoutReplacementDpEvent(n_i, k_i, g)
  return dp_accounting.SelfComposedDpEvent(one, steps) if steps > 1 else one


def _sensitivity(opt: Options, r_h: float, k: int, zeta: float, kept: float) -> float:
  if opt.sensitivity == "certified":
    return certified_sensitivity(r_h, k, zeta, min_kept_fraction=kept)
  return typical_sensitivity(r_h, k)


def phase_sensitivity(sens: float) -> Sensitivity:
  """A phase release's sensitivity: FILTER's coupled replace-one shift ``Delta``, entered as
  the replace-one bound it is (its add/remove-equivalent ``Delta / 2`` is the std's unit)."""
  return Sensitivity.from_replace_one(sens, "FILTER's coupled shift Delta")


def _noise(opt: Options, make, test_event, sens: float, sigma_paper: float, key: Any
           ) -> tuple[float, float]:
  """``(z, sigma)``: paper sigma (theory), explicit z, or the calibrated z (``sigma`` the
  stage's std ``z Delta / 2``). ``key``: ``make``'s description, the calibrator's memo key."""
  if opt.preset == "theory":
    return noise_multiplier_for_std(sigma_paper, phase_sensitivity(sens)), sigma_paper
  z = opt.noise_multiplier
  if z is None:
    z = calibrate_noise_multiplier(make, epsilon=opt.epsilon, delta=opt.delta / 2.0,
                                   relation=opt.relation, fixed=[test_event], key=key)
  return z, GaussianStage(z, phase_sensitivity(sens)).std


def plan_alg1(spec: PublicSpec, opt: Options, sched: Alg1Schedule, **knobs: Any
              ) -> FilterPlan:
  """Algorithm 1: per phase a Laplace test (score sensitivity 2) and one Gaussian release.
  ``knobs``: the run's non-privacy fields of :class:`FilterPlan`."""
  eps_test = laplace_test_epsilon(sched.laplace_scale, 2.0)
  if opt.noise and eps_test >= opt.epsilon:
    raise ValueError(f"epsilon: the Laplace test alone spends {eps_test:.3g} >= "
                     f"epsilon={opt.epsilon}")
  test = pure_dp_event(eps_test)
  make = lambda z: dp_accounting.GaussianDpEvent(z)
  zeta = opt.delta / (4.0 * len(sched.phases))
  phases = []
  for ph in sched.phases:
    bad = good_event_failure(sched.num_groups, math.inf, sched.laplace_scale, 1,
                             2.0 / 15.0) + zeta
    if not opt.noise:
      phases.append(PhaseNoise(ph.index, math.nan, math.nan, 0.0, 1, None, None, bad))
      continue
    sens = _sensitivity(opt, 2.0 * ph.tau, sched.num_groups, zeta, 2.0 / 3.0)
    # the same event in every phase: the calibrator's memo answers all but the first
    z, sigma = _noise(opt, make, test, sens, ph.sigma_paper, key=("gaussian",))
    phases.append(PhaseNoise(ph.index, sens, z, sigma, 1, test, make(z), bad))
  return FilterPlan("user_level_phased_sgd", opt, sched, eps_test, tuple(phases), **knobs)


def plan_alg3(spec: PublicSpec, opt: Options, sched: Alg3Schedule,
              max_steps: int | None, **knobs: Any) -> FilterPlan:
  """Algorithms 2-3: per phase AboveThreshold (query sensitivity 2) and ``T_i`` Gaussian
  releases of a ``K_i``-of-``n_i`` sample without replacement. ``knobs``: the run's
  non-privacy fields of :class:`FilterPlan`."""
  eps_at = above_threshold_epsilon(sched.threshold_scale, sched.query_scale, 2.0)
  if opt.noise and eps_at >= opt.epsilon:
    raise ValueError(f"epsilon: AboveThreshold alone spends {eps_at:.3g} >= "
                     f"epsilon={opt.epsilon}")
  test = pure_dp_event(eps_at)
  phases = []
  for ph in sched.phases:
    steps = ph.steps if max_steps is None else min(ph.steps, int(max_steps))
    zeta = opt.delta / (4.0 * steps * len(sched.phases))
    bad = good_event_failure(ph.batch, sched.threshold_scale, sched.query_scale, steps,
                             1.0 / 20.0) + steps * zeta
    if not opt.noise:
      phases.append(PhaseNoise(ph.index, math.nan, math.nan, 0.0, steps, None, None, bad))
      continue
    sens = _sensitivity(opt, 2.0 * sched.tau, ph.batch, zeta, 0.1)
    make = lambda z, n_i=ph.n_users, k_i=ph.batch, t=steps: gauss_event(z, n_i, k_i, t)
    z, sigma = _noise(opt, make, test, sens, ph.sigma_paper,
                      key=("gaussian_wor", ph.n_users, ph.batch, steps))
    phases.append(PhaseNoise(ph.index, sens, z, sigma, steps, test, make(z), bad))
  return FilterPlan("user_level_accelerated_erm", opt, sched, eps_at, tuple(phases), **knobs)


def provenance_note(bad: float, delta_slack: float) -> tuple[str, str]:
  """``(provenance, note)`` of a typical-preset run: ``accountant`` when the coupling's bad
  events (probability ``bad``) fit in ``delta_slack``, ``heuristic`` otherwise."""
  if bad <= delta_slack:
    return (Provenance.ACCOUNTANT.value,
            f"good events hold except w.p. {bad:.3g} <= delta/2; Gaussian parts by the "
            "accountant (replace-one), pure parts by basic composition")
  return (Provenance.HEURISTIC.value,
          f"the coupling's bad events (Laplace noise beyond the K/20 margins, flip tails) "
          f"have probability {bad:.3g} > delta/2 = {delta_slack:.3g} at this scale, so the "
          "accountant's number is not a proven (eps, delta); needs larger K_i (spec 000 §3.2)")


def _run_knobs(spec: PublicSpec, cfg: Schema) -> dict:
  """The run's non-privacy knobs (:class:`FilterPlan`'s ``clip`` and ``fallback``):
  ``clip_norm`` a number, ``true`` (the declared L), or ``null`` / ``false`` (no clip; FILTER
  bounds the sensitivity either way)."""
  clip = cfg.clip_norm
  clip = None if clip in (None, False) else check_positive(
      spec.lipschitz if clip is True else clip, "clip_norm")
  return {"clip": clip, "fallback": check_choice(cfg.fallback, "fallback", ("zero", "init"))}


def plan_phased_sgd(spec: PublicSpec, cfg: dict) -> FilterPlan:
  """Algorithm 1's data-free plan (schedule, Delta_i, z, sigma_i, events) from public facts."""
  c = config_view(cfg, "user_level_phased_sgd")   # validated once, read by both
  opt = read_options(c, "user_level_phased_sgd")
  project = bool(c.get("project_output", opt.preset == "practical"))   # derived default
  sched = alg1_schedule(n=spec.n_users, m=spec.m, d=spec.d, epsilon=opt.epsilon,
                        delta=opt.delta, lipschitz=spec.lipschitz, radius=spec.radius,
                        smoothness=spec.smoothness, preset=opt.preset, q_exp=c.q_exp,
                        p_exp=c.p_exp, eta=c.learning_rate, num_groups=c.num_groups,
                        num_phases=c.num_phases)
  return plan_alg1(spec, opt, sched, project_output=project, **_run_knobs(spec, c))


def plan_accelerated_erm(spec: PublicSpec, cfg: dict, *, smoothed: bool = False
                         ) -> FilterPlan:
  """Algorithm 3's data-free plan (schedule, Delta_i, z_i, sigma_i, events)."""
  name = "user_level_accelerated_erm" + ("_smoothed" if smoothed else "")
  cfg = config_view(cfg, name)    # derived defaults: alg3_schedule's
  opt = read_options(cfg, name)
  if cfg.max_steps is not None and opt.preset == "theory":
    raise ValueError("max_steps is a practical-preset option (theory uses the paper's T_i)")
  if cfg.lam_scale is not None and opt.preset == "theory":
    raise ValueError("lam_scale is a practical-preset option")
  sched = alg3_schedule(n=spec.n_users, m=spec.m, d=spec.d, epsilon=opt.epsilon,
                        delta=opt.delta, lipschitz=spec.lipschitz, radius=spec.radius,
                        smoothness=math.inf if smoothed else spec.smoothness,
                        preset=opt.preset, q_exp=cfg.q_exp, p_exp=cfg.p_exp, lam=cfg.lam,
                        lam_scale=cfg.lam_scale,
                        batch_size=cfg.batch_size, num_phases=cfg.num_phases, tau=cfg.tau,
                        smoothing_radius=cfg.smoothing_radius if smoothed else None)
  return plan_alg3(spec, opt, sched, cfg.max_steps, **_run_knobs(spec, cfg))


def filter_planner(name: str) -> Callable[[PublicFacts, dict], Planned]:
  """``dpsco_jax.plan``'s planner of Algorithm 1 or 3 (its ``detail``: the
  :class:`FilterPlan`)."""
  def planner(facts: PublicFacts, cfg: dict) -> Planned:
    if not math.isfinite(facts.radius):
      raise MissingConstant(f"{name} needs a finite radius R (its phases localize in balls "
                            "around the previous phase): declare constants={'radius': ...}")
    spec = PublicSpec.of(facts)
    if name == "user_level_phased_sgd":
      p = plan_phased_sgd(spec, cfg)
    else:
      p = plan_accelerated_erm(spec, cfg, smoothed=name.endswith("_smoothed"))
    phases = [{"sigma": ph.sigma, "noise_multiplier": ph.noise_multiplier,
               "sensitivity": ph.sensitivity} for ph in p.phases]
    z = p.phases[0].noise_multiplier if p.phases else None
    return Planned(p.charge(), z, {"phases": phases, "epsilon_test": p.epsilon_test}, p)
  return planner
