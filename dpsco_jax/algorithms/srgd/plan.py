"""Paper 003 plan: relation, schedule, noise and privacy event of a run, computed before data.

:func:`plan_srgd` maps a config and the *public* facts (``n``, ``p``, ``L``, ``M``, ``R``) to
an :class:`SRGDPlan`: the schedule ``(T, B)``, ``beta``, the clip ``C``, the noise multiplier
``z``, the increment's sensitivity, the run's one privacy event and the compiled scan's static
``settings``; :meth:`SRGDPlan.charge` is its guarantee. The runners (:mod:`.driver`) execute
the plan and neither plan, calibrate nor charge.

Neighbouring relations (:mod:`dpsco_jax.privacy.relations`):

* ``zero_out`` (default; the paper's notion, §2): one example keeps its slot but contributes
  ``grad f(., d) = 0``. ``n`` is public, so the batches and the denominator ``B`` are the same
  on both datasets and only the increment of the example's own batch changes, by at most
  ``C/B``: the clip acts on the SRG *difference* ``delta_i(d)`` (Alg. 1 line 4). That is
  Lemma 5.6's premise with ``C = C_Delta / B`` (Cor. 5.7: ``C_Delta = c_DP L``; Cor. 5.10:
  ``C_Delta = (8 c_M + 4) L``).
* ``replace_one``: ``n`` public; the same increment changes by at most ``2C/B``; the ledger
  accounts replace-one from the add/remove multiplier (the noise is not doubled here).
* ``add_remove`` is **refused**: removing one example shifts every later example into the
  previous batch and changes every later increment. Use ``zero_out``.

Privacy (spec §3.3, §4.4). One increment lies in ``levels = T.bit_length()`` tree nodes, so the
run (adaptive choices included) is ``mu``-GDP with ``mu = sqrt(levels)/z`` (Lemma 5.6 with the
exact level count; the paper's ``1 + ceil(log2 T)`` is >= it): one ``GaussianDpEvent(z /
sqrt(levels))`` on sensitivity-1 units, converted exactly by PLD. Independent noise (and
DP-SGD without the SRG) is ``GaussianDpEvent(z)``; matrix-factorization prefix noise
(``banded`` / ``blt``, not in the paper) ``GaussianDpEvent(z / ||c||)``. An explicit
``noise_multiplier`` above the ``epsilon`` budget is refused before anything is released.
Provenance: ``accountant``.

Multi-epoch (``epochs: k``, practical preset, SRG variants only; a deviation from paper 003's
single epoch, §1 and Lemma 5.6's "only one ``Delta_i`` changes"): ``T = k P`` steps, step ``t``
reads batch ``t mod P`` of one fixed public order, so each example is in ``k`` increments ``P``
apart; the stream's sensitivity is the exact worst case ``||C 1_pattern||``
(:mod:`dpsco_jax.privacy.cyclic_participation`) and the run is one ``GaussianDpEvent(z /
sens)``. Multi-epoch DP-SGD is ``dp_sgd_user`` with ``sampling: cyclic``.

Declared constants: **enforced**. L enters only as the default clip, beta and R only the step
and the projection: the clip bounds every SRG difference, so the sensitivity holds for any
loss and provenance stays ``accountant`` on a user's loss."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dpsco_jax.algorithms.srgd.config import SrgdConfig
from dpsco_jax._checks import (check_bool, check_choice, check_epsilon, check_int,
                               check_nonnegative, check_positive)
from dpsco_jax.algorithms.common import required_delta
from dpsco_jax.algorithms.registration import Planned
from dpsco_jax.algorithms.srgd.presets import (PRESETS, SRGDParams, practical_params,
                                               theory_params)
from dpsco_jax.data.problem import PublicFacts
from dpsco_jax.privacy import (PUBLIC, RELATIONS, PrivacyBudgetExceeded, PrivacyLedger,
                               PrivacyReport, Provenance, calibrate_noise_multiplier,
                               check_relation, gaussian_sensitivity_factor)
from dpsco_jax.privacy.sensitivity import GaussianStage, clipped_mean_sensitivity
from dpsco_jax.config.families import Schema
from dpsco_jax.transforms.srg import check_z_scale
from dpsco_jax.privacy import cyclic_participation as cyclic
from dpsco_jax.privacy import matrix_factorization as mf
from dpsco_jax.transforms.tree_noise import MECHANISMS, prefix_noise_event, tree_levels

NOISES = MECHANISMS + ("banded", "blt")

SUPPORTED_RELATIONS = ("zero_out", "replace_one")
AVERAGING = ("none", "uniform")
ACCOUNTANT = "pld"  # one Gaussian event: PLD is exact

#: name -> (srg, noise, accelerated): Algorithm 1 and the paper's ablations / baseline.
VARIANTS = {
    "accelerated_dp_srgd": (True, "tree", True),
    "dp_srgd_unaccelerated": (True, "tree", False),
    "accelerated_dp_srgd_independent_noise": (True, "independent", True),
    "accelerated_dp_sgd": (False, "independent", True),
    "single_epoch_dp_sgd": (False, "independent", False),
}


@dataclasses.dataclass(frozen=True)
class SRGDPlan:
  """A data-free plan. ``stage``: ``z`` on the increment's sensitivity ``C/B``; ``event``:
  the whole run's privacy (``None`` when non-private); ``public``: what the relation treats
  as public."""
  name: str
  relation: str
  epsilon: float | None
  delta: float
  params: SRGDParams
  srg: bool
  noise: str
  accelerated: bool
  levels: int
  stage: GaussianStage   # z on the increment's sensitivity C/B (node / step / Z std)
  event: Any
  label: str
  public: str
  radius: float | None = None
  z_scale: float = 1.0
  learning_rate: float | None = None
  averaging: str = "none"
  mf: tuple = ()            # banded: ("banded", coefs); blt: ("blt", decay, scale); else ()
  mf_sensitivity: float = 1.0
  mf_source: str = ""
  epochs: int = 1
  stream_sensitivity: float | None = None  # epochs > 1: exact ||C 1_pattern|| (units C/B)
  settings: tuple = ()      # the compiled scan's static numbers (scan_settings), debug off
  level: str = "item"       # of the report: "user" when a row holds m > 1 items

  @property
  def stages(self) -> tuple[GaussianStage, ...]:
    return () if self.event is None else (self.stage,)

  @property
  def events(self) -> tuple[Any, ...]:
    return () if self.event is None else (self.event,)

  def charge(self) -> PrivacyReport:
    """Charges a fresh budgeted ledger with the plan's event (raises before any release if over
    budget); returns the run's guarantee."""
    prm = self.params
    passes = ("single epoch" if self.epochs == 1 else
              f"{self.epochs} epochs in one fixed public order ({prm.period} steps each; each "
              f"example in {self.epochs} increments {prm.period} steps apart; exact stream "
              f"sensitivity {self.stream_sensitivity:.4g} x C/B; not paper 003's single epoch)")
    notes = (f"{self.name}: {passes}, {prm.num_steps} batches of {prm.batch_size}; preset "
             f"{prm.preset}; relation {self.relation} (public: {self.public}; n fixes the "
             f"batches); per-step release sensitivity {self.sensitivity:.4g}")
    if not self.private:
      return PrivacyReport(epsilon=float("inf"), delta=0.0, provenance=Provenance.NONE.value,
                           level="none", relation=self.relation, mechanisms=(),
                           notes=notes + "; NOT private (noise_multiplier=0)")
    ledger = PrivacyLedger(delta=self.delta, epsilon_budget=self.epsilon,
                           relation=self.relation, accountant=ACCOUNTANT)
    ledger.spend(self.event, label=self.label)
    mu = self.gdp_factor / prm.noise_multiplier
    return ledger.report(provenance=Provenance.ACCOUNTANT, level=self.level,
                         mechanisms=(self.label,), paper_epsilon=paper_epsilon(self),
                         notes=notes + f"; mu-GDP with mu={mu:.4g} (in units of the zero-out "
                         "sensitivity C/B) converted exactly by PLD")

  @property
  def private(self) -> bool:
    return self.event is not None

  @property
  def noise_std(self) -> float:
    """Node (tree), step (independent) or ``Z`` (MF) std: the stage's ``z C / B``."""
    return self.stage.std

  @property
  def sensitivity(self) -> float:
    """The increment's L2 bound under the plan's relation."""
    return self.stage.sensitivity_under(self.relation)

  @property
  def gdp_factor(self) -> float:
    """``mu * z``: ``sqrt(levels)`` (tree), ``||c||`` (MF), 1 (independent), or the exact
    multi-epoch stream sensitivity."""
    if self.stream_sensitivity is not None:
      return self.stream_sensitivity
    return self.mf_sensitivity if self.mf else math.sqrt(self.levels)


def config_view(cfg: Mapping | Any) -> Schema:
  """Paper 003's config (:class:`~dpsco_jax.algorithms.srgd.config.SrgdConfig` with its
  defaults); reading any other key raises."""
  return SrgdConfig.of(cfg)


def resolve_relation(cfg: Mapping | Any, name: str = "accelerated_dp_srgd") -> str:
  """``relation``; ``add_remove`` is refused with the reason and the alternative."""
  rel = check_choice(config_view(cfg).relation, "relation", RELATIONS)
  if rel == "add_remove":
    raise ValueError(
        f"{name} cannot honour relation='add_remove': its single epoch cuts the stream into "
        "consecutive batches, so removing one example shifts every later example into "
        "another batch and changes every later increment, not one (Lemma 5.6's premise). "
        "Use relation='zero_out' (the paper's notion: n public, the example contributes a "
        "zero SRG difference in its own batch) or relation='replace_one'")
  return check_relation(rel, supported=SUPPORTED_RELATIONS, mechanism=name)


def run_event(noise_multiplier: float, num_steps: int, mechanism: str,
              mf_sensitivity: float = 1.0, stream_sensitivity: float | None = None) -> Any:
  """The whole run as one event on sensitivity-1 units: ``GaussianDpEvent(z/sqrt(levels))``
  (tree; Lemma 5.6), ``GaussianDpEvent(z)`` (independent), ``GaussianDpEvent(z / ||c||)``
  (banded / BLT) or ``GaussianDpEvent(z / stream_sensitivity)`` (multi-epoch)."""
  if stream_sensitivity is not None:
    return cyclic.cyclic_event(noise_multiplier, stream_sensitivity)
  if mechanism in ("banded", "blt"):
    return mf.mf_event(noise_multiplier, mf_sensitivity)
  return prefix_noise_event(noise_multiplier, num_steps, mechanism=mechanism)


def _calibrate(epsilon: float, delta: float, T: int, mechanism: str, relation: str,
               mf_sensitivity: float = 1.0, stream_sensitivity: float | None = None) -> float:
  return calibrate_noise_multiplier(
      lambda z: run_event(z, T, mechanism, mf_sensitivity, stream_sensitivity),
      epsilon=epsilon, delta=delta, relation=relation, accountant=ACCOUNTANT,
      key=("srgd_run_event", int(T), mechanism, float(mf_sensitivity),
           None if stream_sensitivity is None else float(stream_sensitivity)))


def _mf_strategy(cfg: Schema, noise: str, T: int, epochs: int = 1
                 ) -> tuple[tuple, float, str]:
  """(stage spec, sensitivity over ``T`` steps, source) of the MF noise: ``||c||`` for one
  epoch, else the exact sensitivity of ``epochs`` participations ``T / epochs`` apart."""
  strategy = check_choice(cfg.mf_strategy, "mf_strategy", mf.STRATEGIES)
  P = T // epochs
  if noise == "banded":   # derived default: min(32, T) bands (multi-epoch: min(32, P),
    # so that the columns of one example's participations are disjoint whatever the signs)
    s = mf.banded_strategy(T, check_int(cfg.get("bands", min(32, T if epochs == 1 else P)),
                                        "bands"), strategy=strategy)
    spec, coefs, source = ("banded", tuple(map(float, s.coefs))), s.coefs, s.source
  else:
    kw = {} if epochs == 1 else dict(participations=epochs, min_sep=P)
    b = mf.blt_strategy(T, check_int(cfg.buffers, "buffers"), strategy=strategy, **kw)
    spec = ("blt", tuple(map(float, b.buf_decay)), tuple(map(float, b.output_scale)))
    coefs, source = mf.blt_coefs(b.buf_decay, b.output_scale, T), b.source
  if epochs == 1:
    return spec, mf.participation_sensitivity(np.asarray(coefs), T), source
  return spec, cyclic.cyclic_sensitivity(noise, T, P, epochs, coefs=np.asarray(coefs)), source


def _schedule(name: str, cfg: Schema, noise: str, *, n: int, p: int, lipschitz: float,
              smoothness: float, radius: float, epsilon: float | None, delta: float,
              relation: str, epochs: int = 1) -> SRGDParams:
  preset = check_choice(cfg.preset, "preset", PRESETS)
  if preset == "theory":
    if epochs != 1:
      raise ValueError(f"preset='theory' is paper 003's single epoch (§1; Lemma 5.6's "
                       f"premise: only one Delta_i changes); epochs={epochs} is outside its "
                       "theorem: use preset='practical' for multi-epoch SRGD")
    if name != "accelerated_dp_srgd":
      raise ValueError(f"preset='theory' exists only for accelerated_dp_srgd (Algorithm 1); "
                       f"{name} has no theorem in the paper")
    if epsilon is None:
      raise ValueError("preset='theory' needs a finite epsilon")
    if noise != "tree":
      raise ValueError("preset='theory' uses the binary tree mechanism (Lemma 5.6); "
                       f"noise_mechanism={noise!r} is outside the theorem")
    if relation != "zero_out":
      raise ValueError("preset='theory' states the paper's zero-out guarantee (§2); "
                       f"relation={relation!r} is outside the theorem (use preset='practical')")
    return theory_params(n, p, lipschitz=lipschitz, smoothness=smoothness, radius=radius,
                         epsilon=epsilon, delta=delta,
                         variant=cfg.variant, batch_size=cfg.batch_size)
  # Default clip: L. Lemma 5.9's worst case 2(2MR + L) is ~10x the norms seen in practice
  # (spec T12); tune clip_norm on public data.
  clip = cfg.get("clip_norm", lipschitz)
  return practical_params(n, smoothness=smoothness, clip_norm=clip,
                          batch_size=cfg.batch_size, num_steps=cfg.num_steps,
                          beta=cfg.beta, beta_scale=cfg.beta_scale, epochs=epochs)


def _noise_multiplier(cfg: Schema, prm: SRGDParams, epsilon: float | None, delta: float,
                      mechanism: str, relation: str, sens: float,
                      stream: float | None) -> float:
  """The run's ``z``: the config's explicit one, the theory preset's paper sigma, else
  calibrated to ``epsilon`` (non-private is ``noise_multiplier: 0``)."""
  if cfg.noise_multiplier is not None:
    return check_nonnegative(cfg.noise_multiplier, "noise_multiplier")
  if prm.noise_multiplier is not None:
    return prm.noise_multiplier                   # theory preset: the paper's sigma
  if epsilon is None:
    return 0.0
  return _calibrate(epsilon, delta, prm.num_steps, mechanism, relation, sens, stream)


def scan_settings(*, num_steps, batch_size, beta, clip_norm, noise_std, radius, srg, noise,
                  accelerated, z_scale, learning_rate, averaging, debug=False, releases=False,
                  mf: tuple = (), epochs: int = 1) -> tuple:
  """The compiled scan's static numbers, checked, as the sorted tuple its cache keys on;
  ``noise_std``: the increment stage's (:attr:`SRGDPlan.noise_std`)."""
  if check_int(num_steps, "num_steps") % check_int(epochs, "epochs"):
    raise ValueError(f"num_steps={num_steps} is not a whole number of epochs={epochs}")
  check_int(batch_size, "batch_size")
  check_positive(beta, "beta")
  check_positive(clip_norm, "clip_norm")
  check_nonnegative(noise_std, "noise_std")
  check_z_scale(z_scale)
  check_choice(noise, "noise", NOISES)
  return tuple(sorted(dict(mf=tuple(mf),
      num_steps=int(num_steps), batch_size=int(batch_size), beta=float(beta),
      clip_norm=float(clip_norm), noise_std=float(noise_std),
      radius=None if radius is None else float(radius), srg=check_bool(srg, "srg"),
      noise=noise, accelerated=check_bool(accelerated, "accelerated"), z_scale=float(z_scale),
      learning_rate=None if learning_rate is None else float(learning_rate),
      averaging=averaging, debug=check_bool(debug, "debug"), releases=releases,
      epochs=int(epochs)).items()))


def plan_srgd(name: str, cfg: Mapping | Any, *, n: int, p: int, lipschitz: float, smoothness: float,
              radius: float | None) -> SRGDPlan:
  """The plan of driver ``name`` from ``cfg`` and public facts only (no data).

  ``cfg`` is read through :func:`config_view` (:class:`~.config.SrgdConfig`'s keys and
  defaults). ``radius`` is the public constraint set (``None``: unconstrained; the theory
  preset needs it).

  Raises:
    ValueError: a bad parameter (named) or an unsupported relation.
    PrivacyBudgetExceeded: an explicit ``noise_multiplier`` (0 included) whose run would
      exceed the ``epsilon`` budget, before any data is touched."""
  check_choice(name, "name", tuple(VARIANTS))
  n, p = check_int(n, "n"), check_int(p, "p")
  cfg = config_view(cfg)
  srg, noise, accelerated = VARIANTS[name]
  # derived default: the variant's own noise (tree for the SRG variants, else independent)
  noise = check_choice(cfg.get("noise_mechanism", noise), "noise_mechanism", NOISES)
  if not srg and noise != "independent":
    raise ValueError(f"{name} feeds plain gradients, whose noise is independent per step "
                     "(DP-SGD / Thm 5.13); noise_mechanism must be 'independent'")
  relation = resolve_relation(cfg, name)
  epochs = check_int(cfg.epochs, "epochs")
  if epochs != 1 and not srg:
    raise ValueError(f"{name} is single-epoch DP-SGD (Thm 5.13 / §5.5); epochs={epochs} is "
                     "refused here: multi-epoch SRGD is accelerated_dp_srgd and its SRG "
                     "ablations, multi-epoch DP-SGD is dp_sgd_user with sampling: cyclic")
  epsilon = None if cfg.epsilon is None else check_epsilon(cfg.epsilon)
  private = epsilon is not None or bool(cfg.noise_multiplier)
  # a non-private run (no epsilon, noise_multiplier 0) has no delta to read
  delta = required_delta(cfg.delta) if private or cfg.delta is not None else 0.0
  prm = _schedule(name, cfg, noise, n=n, p=p, lipschitz=lipschitz, smoothness=smoothness,
                  radius=radius, epsilon=epsilon, delta=delta, relation=relation,
                  epochs=epochs)
  T, B, C = prm.num_steps, prm.batch_size, prm.clip_norm
  lr = cfg.learning_rate
  spec, sens, source = ((), 1.0, "") if noise in MECHANISMS else _mf_strategy(cfg, noise, T,
                                                                               epochs)
  # epochs > 1: the exact sensitivity of k participations P apart (MF: ``sens`` already is)
  stream = None if epochs == 1 else (
      sens if spec else cyclic.cyclic_sensitivity(noise, T, prm.period, epochs))
  z = _noise_multiplier(cfg, prm, epsilon, delta, noise, relation, sens, stream)
  if z == 0.0 and epsilon is not None:
    raise PrivacyBudgetExceeded(f"noise_multiplier=0 releases the data without noise "
                                f"(epsilon = inf > budget {epsilon:g}); nothing was released")
  levels = tree_levels(T) if noise == "tree" else 1
  event = run_event(z, T, noise, sens, stream) if z > 0 else None
  if event is not None and epsilon is not None:   # the budget check of the planned run
    PrivacyLedger(delta=delta, epsilon_budget=epsilon, relation=relation,
                  accountant=ACCOUNTANT).check(event, label=name)
  kind = {"tree": "binary-tree", "independent": "independent", "banded": "banded MF",
          "blt": "BLT MF"}[noise]
  label = (f"{kind} Gaussian {'prefix ' if srg else ''}noise, z={z:.4g}, T={T}, "
           + (f"levels={levels}, " if not spec else f"||c||={sens:.4g} ({source}), ")
           + f"increment sensitivity C/B={C / B:.4g} (zero-out)")
  if stream is not None:
    label += (f"; {epochs} epochs of {prm.period} steps in one fixed public order, each "
              f"example in {epochs} increments {prm.period} apart: exact stream sensitivity "
              f"{stream:.4g} x C/B")
  step = dict(radius=radius, z_scale=check_z_scale(cfg.z_scale),
              learning_rate=None if lr is None else check_positive(lr, "learning_rate"),
              averaging=check_choice(cfg.averaging, "averaging", AVERAGING))
  stage = GaussianStage(z, clipped_mean_sensitivity(C, B), "increment")
  settings = scan_settings(num_steps=T, batch_size=B, beta=prm.beta, clip_norm=C,
                           noise_std=stage.std, srg=srg, noise=noise, accelerated=accelerated,
                           mf=spec, epochs=epochs, **step)
  return SRGDPlan(name=name, relation=relation, epsilon=epsilon, delta=delta,
                  params=dataclasses.replace(prm, noise_multiplier=z), srg=srg, noise=noise,
                  accelerated=accelerated, levels=levels, stage=stage, event=event, label=label,
                  public=PUBLIC[relation], mf=spec, mf_sensitivity=sens, mf_source=source,
                  epochs=epochs, stream_sensitivity=stream, settings=settings, **step)


def paper_epsilon(plan: SRGDPlan) -> float | None:
  """The paper's own GDP -> DP step (Cor. 5.7): ``eps = mu sqrt(2 ln(1.25/delta))`` (valid
  only for eps <= 1; reported beside the accountant's epsilon, never the guarantee). ``None``
  for a multi-epoch plan, outside the paper."""
  if not plan.private or plan.epochs != 1:
    return None
  z = plan.params.noise_multiplier
  mu = plan.gdp_factor / z * gaussian_sensitivity_factor(plan.relation)
  return mu * math.sqrt(2.0 * math.log(1.25 / plan.delta))


def plan_for_problem(name: str, problem, cfg: Mapping | Any) -> SRGDPlan:
  """The plan from a problem's public facts only (``n_users``, ``m``, ``d``, and ``lipschitz``,
  ``smoothness``, ``radius`` where the config leaves them out), never its data; an infinite
  radius is unconstrained. The report is user level when ``m > 1``."""
  cfg = config_view(cfg)
  theory = cfg.preset == "theory"
  # the declared constants are read only when the practical preset's config leaves them out
  lipschitz = (cfg.clip_norm if not theory and cfg.clip_norm is not None
               else problem.lipschitz)
  smoothness = (cfg.beta if not theory and cfg.beta is not None  # then unused
                else problem.smoothness)
  radius = float(problem.radius)
  if not math.isfinite(radius):
    if theory:
      raise ValueError("radius: preset='theory' needs the finite radius R of the constraint "
                       "set (Thm 5.1/5.12)")
    radius = None
  plan = plan_srgd(name, cfg, n=int(problem.n_users), p=int(problem.d),
                   lipschitz=float(lipschitz), smoothness=float(smoothness), radius=radius)
  return dataclasses.replace(plan, level="user" if int(problem.m) > 1 else "item")


def srgd_planner(name: str) -> Callable[[PublicFacts, dict], Planned]:
  """``dpsco_jax.plan``'s planner of ``name``: the plan (its ``detail``) and its charge."""
  def planner(facts: PublicFacts, cfg: dict) -> Planned:
    p = plan_for_problem(name, facts, cfg)
    prm = p.params
    schedule = {"num_steps": prm.num_steps, "batch_size": prm.batch_size, "beta": prm.beta,
                "clip_norm": prm.clip_norm, "tree_levels": p.levels, "noise_std": p.noise_std}
    return Planned(p.charge(), prm.noise_multiplier, schedule, p)
  return planner
