"""The data-free plan of the DP-SGD baselines: relation, public numbers, schedule, noise, events.

:func:`plan_dp_sgd` turns a config and the *public* number of rows (users for ``dp_sgd_user``,
items for ``dp_sgd_item`` / ``dp_sgd_group``) into everything a run releases under: sampling
rate ``q``, the fixed denominator ``D`` of the mean, the noise std ``z C / D``, the steps and
the dp_accounting event, before any data is read. :func:`dp_sgd_plan` reads those numbers off
a problem (a :class:`~dpsco_jax.data.PublicFacts` suffices); :meth:`DpSgdPlan.charge` checks
the budget on a fresh ledger and returns the report.

Neighbouring relations and what is public (see :mod:`dpsco_jax.privacy.relations`):

========  ===========================  ==============================================
sampling  relations (default first)    public numbers the plan uses
========  ===========================  ==============================================
poisson   add_remove, zero_out,        ``q`` (``sampling_rate``, else ``batch_size /
          replace_one                  n_users``), ``D = q * n_users`` (the expected
                                       batch; Abadi et al. 2016, Opacus, jax_privacy)
full      zero_out, replace_one,       ``D = n_users`` (every row, each step)
          add_remove
fixed     replace_one, zero_out        ``n``, ``batch_size = D`` (dp_accounting's
                                       sampling-without-replacement bound is replace-one)
cyclic    zero_out, replace_one        ``n``, ``batch_size = D`` (below)
banded_   zero_out, replace_one        ``n``, ``b = min_separation``, ``p``
poisson                                (``sampling_rate``, else ``batch_size / G``),
                                       ``D = p * G``, ``G = ceil(n / b)`` (below)
========  ===========================  ==============================================

Steps: ``num_steps``, else ``round(epochs / q)``. Under ``add_remove`` the number of rows is
private: the plan reads only the declared ``n_users`` (a public upper bound, at which the
Poisson slot capacity and its truncation probability are computed), and a run refuses more
rows. Under ``replace_one`` / ``zero_out`` the realized ``n`` is public (and must match a
declared ``n_users``). The step's sensitivity is ``C / D`` (the accountant doubles it under
replace-one; ``z = sigma / (C / D)``), carried by the plan's ``stage``. Provenance
``accountant``. A configured ``epsilon`` is a budget: an explicit ``noise_multiplier`` over it
raises :class:`~dpsco_jax.privacy.PrivacyBudgetExceeded` before anything runs. Poisson
sampling fills a static slot capacity; its truncation probability ``p`` enters delta as
``(1 + e^eps) p`` (total variation). ``dp_sgd_group`` is calibrated at the item-level
:func:`group_privacy_targets`; with an explicit ``noise_multiplier`` it reports the lift of
its item-level curve (``inf`` when that gives no finite epsilon).

``sampling="cyclic"``: a public permutation of the row slots (from the run's key) cut into
``P = ceil(n / B)`` batches; step ``t`` uses batch ``t mod P`` (``D = B``): every row at most
``k = ceil(T / P)`` times, ``P`` steps apart. add_remove is refused (removing a row would
shift every later batch). ``noise_mechanism``: ``independent``, ``banded``, ``blt`` (the MF
noise of :mod:`dpsco_jax.transforms.matrix_factorization`) or ``tree`` (paper 003's binary
tree as increments; exact sensitivity over the fixed order,
:func:`~dpsco_jax.privacy.cyclic_participation.tree_cyclic_sensitivity`). MF noise needs
bounded participation (``cyclic``, ``full``: ``k = T``, separation 1, or banded noise with
``banded_poisson``); its event is one Gaussian of multiplier ``z / sens``, ``sens`` the
strategy's participation sensitivity (independent noise under ``cyclic``: ``z / sqrt(k)``).

``sampling="banded_poisson"`` (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
Factorization", Thm 4, b-min-sep sampling) with banded noise: the row slots are partitioned
(from the run's key alone, :mod:`.banded_poisson`) into ``b = min_separation`` groups of
``G = ceil(n / b)`` or ``G - 1`` rows; step ``t`` activates group ``t mod b``, each of its rows
joining with probability ``p``; ``D = p * G``; steps default to ``round(epochs * n / D)``.
``bands <= b`` (refused otherwise): a row's participations are ``>= b`` apart and touch
disjoint rows of ``C x + Z``, so the run is exactly ``k = ceil(T / b)`` compositions of a
Poisson-subsampled Gaussian of rate ``p`` and multiplier ``z / ||c||`` (the largest column
norm; :func:`dpsco_jax.privacy.matrix_factorization.amplified_banded_event`). ``bands = b =
1`` is Poisson DP-SGD exactly. Truncation as for ``poisson``, at ``(G, p)``. add_remove is
refused (removing a row redraws the partition and changes ``G`` and ``D``), and so is a BLT
(``T`` bands: the rounds are not independent).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import dp_accounting
import jax
import numpy as np

from dpsco_jax._checks import (check_choice, check_delta, check_int, check_positive,
                               check_probability)
from dpsco_jax.algorithms.dpsgd.config import (ADAPTIVE, DEFAULT_CLIP_LEARNING_RATE,
                                               DEFAULT_TARGET_QUANTILE, DpSgdConfig,
                                               SgdSchedule)
from dpsco_jax.algorithms.common import (poisson_capacity, poisson_truncation_probability,
                                         required_delta, sampling_setup)
from dpsco_jax.algorithms.registration import Planned
from dpsco_jax.config.families import Schema
from dpsco_jax.config.types import MAX_COUNT
from dpsco_jax.data.problem import PublicFacts
from dpsco_jax.privacy import (PUBLIC, PrivacyBudgetExceeded, PrivacyLedger, PrivacyReport,
                               Provenance, calibrate_noise_multiplier, check_relation)
from dpsco_jax.privacy.group import group_privacy_epsilon
from dpsco_jax.privacy.sensitivity import (AdaptiveClipSplit, GaussianStage,
                                           adaptive_clip_split, clipped_mean_sensitivity)
from dpsco_jax.privacy import matrix_factorization as mf
from dpsco_jax.privacy import cyclic_participation as cyclic
from dpsco_jax.problems import SCOProblem

DEFAULT_BANDS = 32


# the correlated-noise part: MF strategies of bounded-participation schedules (banded, BLT,
# or paper 003's binary tree) and their participation sensitivity
class MfNoise(NamedTuple):
  """The correlated-noise part of a plan: ``kind`` (``banded`` | ``blt``), the strategy's
  Toeplitz ``coefs`` (length ``steps`` for a BLT), BLT parameters, where they come from, and
  the participation schema they are priced for."""
  kind: str
  coefs: tuple
  buf_decay: tuple
  output_scale: tuple
  source: str
  participations: int
  min_sep: int
  sensitivity: float

  def stage_spec(self) -> tuple:
    """Hashable static description of the noise stage (the chain's compile key)."""
    if self.kind == "banded":
      return ("banded", self.coefs)
    if self.kind == "tree":
      return ("tree",)
    return ("blt", self.buf_decay, self.output_scale)


def _tree_sensitivity(steps: int, participations: int, min_sep: int) -> float:
  """The binary tree's exact sensitivity when every user takes part at most
  ``participations`` times, at one fixed offset ``p, p + P, ...`` of the public order
  (``P = min_sep``; ``full``: ``P = 1``): :func:`~dpsco_jax.privacy.cyclic_participation.
  tree_cyclic_sensitivity` (one participation: ``sqrt(levels)``, paper 003's Lemma 5.6)."""
  period = min(min_sep, steps)
  return cyclic.tree_cyclic_sensitivity(steps, period, min(participations,
                                                           -(-steps // period)))


def _mf_noise(cfg: Schema, kind: str, steps: int, participations: int, min_sep: int,
              amplified: bool = False) -> MfNoise:
  """The MF strategy for the schedule. Default bands: ``min(32, steps)`` for one
  participation, else ``min(32, min_sep)`` (bands within the separation keep the columns
  disjoint: no overlap penalty; under ``full`` that is 1, i.e. independent noise).
  ``amplified`` (b-min-sep sampling, ``min_sep = b``): banded only, ``bands <= b`` (refused
  otherwise), default ``min(32, b)``; its sensitivity factor is the largest column norm."""
  if kind == "tree":   # the paper-003 tree, no strategy to optimize
    return MfNoise("tree", (), (), (), "binary tree (paper 003, Lemma 5.6)", participations,
                   min_sep, _tree_sensitivity(steps, participations, min_sep))
  strategy = check_choice(cfg.mf_strategy, "mf_strategy", mf.STRATEGIES)
  if kind == "banded":
    default = min(DEFAULT_BANDS, min_sep if amplified or participations != 1 else steps)
    bands = check_int(cfg.get("bands", default), "bands")
    if amplified and bands > min_sep:
      raise ValueError(f"bands ({bands}) must be <= min_separation ({min_sep}), the number of "
                       f"groups of sampling={AMPLIFIED!r}: a row's participations are b steps "
                       "apart, and more bands would overlap their columns (the amplified "
                       "accounting needs disjoint ones)")
    s = mf.banded_strategy(steps, bands, strategy=strategy)
    coefs, th, om, source = tuple(float(c) for c in s.coefs), (), (), s.source
  else:
    b = mf.blt_strategy(steps, check_int(cfg.buffers, "buffers"),
                        participations=participations, min_sep=min_sep, strategy=strategy)
    coefs = tuple(float(c) for c in mf.blt_coefs(b.buf_decay, b.output_scale, steps))
    th, om, source = tuple(map(float, b.buf_decay)), tuple(map(float, b.output_scale)), b.source
  schema = {} if amplified else dict(participations=participations, min_sep=min_sep)
  sens = mf.participation_sensitivity(np.asarray(coefs), steps, **schema)
  return MfNoise(kind, coefs, th, om, source, participations, min_sep, sens)


SAMPLING_RELATIONS = {
    "poisson": ("add_remove", "zero_out", "replace_one"),
    "full": ("zero_out", "replace_one", "add_remove"),
    "fixed": ("replace_one", "zero_out"),
    "cyclic": ("zero_out", "replace_one"),
    "banded_poisson": ("zero_out", "replace_one"),
}
LEVELS = ("user", "item", "group")
NOISES = ("independent", "banded", "blt", "tree")
MF_SAMPLINGS = ("cyclic", "full")   # bounded participation: what MF noise is priced for
AMPLIFIED = "banded_poisson"        # b-min-sep Poisson: banded noise only (amplified)


class AdaptivePlan(NamedTuple):
  """``clip_norm: adaptive`` (Andrew et al. 2021): the tracker's public constants and the
  pair's split of ``z`` (:func:`~dpsco_jax.privacy.sensitivity.adaptive_clip_split`)."""
  target_quantile: float
  clip_learning_rate: float
  initial_clip_norm: float
  split: AdaptiveClipSplit

  def stage_spec(self, noise: bool = True) -> tuple:
    """The driver's static noise spec: ``("adaptive", gamma, eta, z_Delta, sigma_b)``
    (``noise=False``, the audit hook's noiseless run: both noises 0)."""
    s = self.split
    return ("adaptive", self.target_quantile, self.clip_learning_rate,
            s.sum_multiplier if noise else 0.0, s.count_stddev if noise else 0.0)

  def note(self) -> str:
    s = self.split
    return (f"adaptive clipping (Andrew et al. 2021, Thm 1): target quantile "
            f"gamma={self.target_quantile:g}, clip learning rate eta={self.clip_learning_rate:g}"
            f", initial clip C_0={self.initial_clip_norm:g}, count noise sigma_b="
            f"{s.count_stddev:.4g}, sum multiplier z_Delta={s.sum_multiplier:.4g} (with the "
            f"count's 2 sigma_b it composes to one Gaussian of z={s.noise_multiplier:.4g})")


class DpSgdPlan(NamedTuple):
  """Everything a DP-SGD run releases under, computed from the config and public numbers.

  ``capacity`` is the static number of row slots per step (``None``: every row, full batch);
  ``event`` is ``None`` when the noise is off (``noise_multiplier == 0``)."""
  level: str
  relation: str
  sampling: str
  n_public: int
  sampling_rate: float
  batch: int
  denominator: float
  capacity: int | None
  steps: int
  clip: float
  noise_multiplier: float
  stage: GaussianStage   # z on the clipped mean's sensitivity C / D (the step's noise)
  noise_std: float       # stage.std, formed in privacy/ (gaussian_noise_std)
  lr: float
  averaging: str
  epsilon: float | None            # the target epsilon, a budget (None: explicit z, no target)
  delta: float
  event: Any
  truncation_probability: float
  group_size: int
  item_delta_target: float | None  # group level, calibrated runs: the item delta aimed at
  noise: str = "independent"
  mf: MfNoise | None = None        # banded / blt: strategy and participation schema
  participations: int | None = None  # cyclic / full / banded_poisson: most contributions
  min_sep: int | None = None         # ... any two at least this many steps apart
  group_rows: int | None = None      # banded_poisson: rows G of the largest group
  adaptive: AdaptivePlan | None = None  # clip_norm: adaptive (clip is then C_0)

  @property
  def stages(self) -> tuple[GaussianStage, ...]:
    """The step's noise stage (none when the noise is off)."""
    return () if self.event is None else (self.stage,)

  @property
  def events(self) -> tuple[Any, ...]:
    """The run's composed event (none when the noise is off)."""
    return () if self.event is None else (self.event,)

  def charge(self) -> PrivacyReport:
    """Checks the budget and charges a fresh ledger BEFORE any release; returns the report."""
    if self.event is None:
      if self.epsilon is not None:
        raise PrivacyBudgetExceeded("noise_multiplier=0 releases without noise (epsilon = inf) "
                                    f"> budget {self.epsilon}; nothing was released")
      return NONPRIVATE_REPORT
    label = (f"{self.level}-level DP-SGD ({self.sampling}, z={self.noise_multiplier:.4g}, "
             f"D={self.denominator:.6g}, steps={self.steps}"
             + ("" if self.mf is None else f", {self.noise} noise")
             + ("" if self.adaptive is None else ", adaptive clipping") + ")")
    notes = (f"relation={self.relation}: public are {PUBLIC[self.relation]}; denominator "
             f"D={self.denominator:.6g}, q={self.sampling_rate:.6g}")
    if self.participations is not None:
      notes += (f"; participation: at most {self.participations} per user, >= {self.min_sep} "
                "steps apart")
    if self.adaptive is not None:
      notes += "; " + self.adaptive.note()
    if self.sampling == "banded_poisson":
      notes += (f"; b-min-sep Poisson sampling (Choquette-Choo et al. 2023, Thm 4): "
                f"{self.min_sep} public groups of <= {self.group_rows} rows, rate "
                f"p={self.sampling_rate:.6g} within the active group; banded MF noise "
                f"({self.mf.source}, {len(self.mf.coefs)} bands <= b), max column norm "
                f"{self.mf.sensitivity:.4g}: {self.participations} rounds of a Poisson-"
                "subsampled Gaussian of multiplier z/colnorm")
    elif self.mf is not None:
      notes += (f"; {self.noise} MF noise ({self.mf.source}), sensitivity factor "
                f"{self.mf.sensitivity:.4g}: one Gaussian of multiplier z/sens")
    trunc = self.truncation_probability
    if self.level == "group":
      gp = group_privacy_epsilon(
          self.event, group_size=self.group_size, delta=self.delta, relation=self.relation,
          tv_distance=trunc, epsilon_budget=self.epsilon,
          candidates=() if self.item_delta_target is None else (self.item_delta_target,))
      item = PrivacyLedger(delta=gp.item_delta if gp.item_delta > 0 else self.delta,
                           relation=self.relation, accountant=gp.accountant)
      item.spend(self.event, label=label)
      notes += (f"; item-level (eps={gp.item_epsilon:.4g}, delta={gp.item_delta:.3g}) lifted to "
                f"user level by group privacy over m={self.group_size} items")
      if not math.isfinite(gp.epsilon):
        notes += "; group privacy gives no finite epsilon for this noise multiplier"
      return PrivacyReport(epsilon=gp.epsilon, delta=self.delta, provenance="accountant",
                           level="user", relation=self.relation, mechanisms=(label,),
                           notes=notes)
    ledger = PrivacyLedger(delta=self.delta, epsilon_budget=self.epsilon,
                           relation=self.relation)
    ledger.spend(self.event, label=label)
    return ledger.report(provenance=Provenance.ACCOUNTANT, level=self.level, notes=notes,
                         tv_distance=trunc)

  def event_after(self, steps: int) -> Any:
    """The event of the first ``steps`` steps (progress reports): the plan's own event
    rebuilt for the shorter run (MF: the strategy's sensitivity over ``steps`` steps)."""
    k = None if self.participations is None else min(
        self.participations, mf.participations_of(steps, self.min_sep))
    return dp_sgd_event(self.noise_multiplier, sampling=self.sampling, q=self.sampling_rate,
                        n=self.n_public, batch=self.batch, steps=steps, mf_noise=self.mf,
                        participations=k, min_sep=self.min_sep)


def dp_sgd_event(noise_multiplier: float, *, sampling: str, q: float, n: int, batch: int,
                 steps: int, mf_noise: MfNoise | None = None,
                 participations: int | None = None,
                 min_sep: int | None = None) -> dp_accounting.DpEvent:
  """The DpEvent of ``steps`` DP-SGD steps with the given row sampling and noise.

  Full batch: ``steps`` Gaussian mechanisms of multiplier ``z`` compose exactly to one of
  multiplier ``z / sqrt(steps)`` (Dong, Roth & Su 2019, Cor. 2), which PLD accounts without
  the discretization error of a ``steps``-fold composition. MF noise (``mf_noise``): one
  Gaussian of multiplier ``z / sens``, ``sens`` the strategy's sensitivity for at most
  ``participations`` contributions ``min_sep`` apart (module docstring)."""
  z = noise_multiplier
  if mf_noise is not None and mf_noise.kind == "tree":   # exact over the participation offsets
    return mf.mf_event(z, _tree_sensitivity(steps, participations, min_sep))
  if mf_noise is not None and sampling == AMPLIFIED:   # k rounds of a Poisson-subsampled Gaussian
    return mf.amplified_banded_event(z, np.asarray(mf_noise.coefs), steps, sampling_rate=q,
                                     min_sep=min_sep)
  if mf_noise is not None:
    coefs = np.asarray(mf_noise.coefs)
    if mf_noise.kind == "blt" and coefs.size < steps:   # a longer run: extend the BLT's column
      coefs = mf.blt_coefs(np.asarray(mf_noise.buf_decay), np.asarray(mf_noise.output_scale),
                           steps)
    return mf.mf_event(z, mf.participation_sensitivity(coefs, steps, min_sep=min_sep,
                                                       participations=participations))
  if sampling == "full":
    return dp_accounting.GaussianDpEvent(z / math.sqrt(steps))
  if sampling == "cyclic":   # independent noise, each user once per epoch of ceil(n/B) steps
    k = mf.participations_of(steps, -(-n // batch))
    return dp_accounting.GaussianDpEvent(z / math.sqrt(k))
  gauss = dp_accounting.GaussianDpEvent(z)
  if sampling == "poisson":
    one = dp_accounting.PoissonSampledDpEvent(q, gauss)
  else:
    one = dp_accounting.SampledWithoutReplacementDpEvent(n, batch, gauss)
  return dp_accounting.SelfComposedDpEvent(one, steps)


_BLT_NOT_BANDED = ("BLT has T bands (every coefficient of C is nonzero), so two "
                   "participations b steps apart overlap in its columns and the rounds are not "
                   "independent: no amplification-by-sampling theorem covers it")


def check_mf_sampling(noise: str, sampling: str, *,
                      allowed: tuple = MF_SAMPLINGS + (AMPLIFIED,)) -> None:
  """Refuses MF noise on a schedule it is not priced for, and ``banded_poisson`` with any
  noise but banded (also DPTrainer's refusal: one reason, one place)."""
  if sampling == AMPLIFIED and AMPLIFIED in allowed:
    if noise == "blt":
      raise ValueError(f"noise_mechanism='blt' cannot use sampling={AMPLIFIED!r}: "
                       f"a {_BLT_NOT_BANDED}; use noise_mechanism='banded' (bands <= "
                       "min_separation), or the BLT with sampling='cyclic'")
    if noise != "banded":
      raise ValueError(f"sampling={AMPLIFIED!r} is b-min-sep Poisson sampling for "
                       "noise_mechanism='banded' (bands=1 is independent noise); for "
                       "independent noise over all rows use sampling='poisson'")
    return
  if noise != "independent" and sampling not in allowed:
    use = " or ".join(repr(s) for s in allowed if s != AMPLIFIED)
    amp = (f"for Poisson sampling with banded noise use sampling={AMPLIFIED!r} (b-min-sep, "
           "amplified; Choquette-Choo et al. 2023)" if AMPLIFIED in allowed
           else f"Poisson sampling with banded amplification (sampling={AMPLIFIED!r}) is not "
           "implemented in DPTrainer: it runs in dp_sgd_user / dp_sgd_item")
    if noise == "blt":
      amp = f"a BLT takes no Poisson sampling: a {_BLT_NOT_BANDED}"
    raise ValueError(f"noise_mechanism={noise!r} is priced for a bounded-participation "
                     f"schedule: use sampling={use} (fixed-order epochs), not {sampling!r}. "
                     f"{amp}; noise_mechanism='independent' works with any sampling but "
                     f"{AMPLIFIED!r}")


def group_privacy_targets(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
  """Item-level (eps', delta') whose group-of-``k`` lift is (epsilon, delta):
  ``eps' = eps/k``, ``delta' = delta / (k e^{(k-1) eps'})`` (the form of
  :mod:`dpsco_jax.privacy.group`)."""
  k = check_int(group_size, "group_size")
  eps_item = epsilon / k
  return eps_item, delta / (k * math.exp((k - 1) * eps_item))


def config_view(cfg: Mapping | Any) -> Schema:
  """The DP-SGD family's config: :class:`~.config.DpSgdConfig`'s fields with their defaults
  and the declared ``n_users`` the runner and ``dp.fit`` add; any other key raises."""
  return DpSgdConfig.of(cfg)


def public_rows(declared: int | None, relation: str, *, realized_rows: int,
                rows_per_user: int) -> int:
  """The number of rows the plan may read under ``relation``, from the config's declared
  ``n_users`` (``None``: not declared); the planner passes that number, not the config.

  ``add_remove``: the declared ``n_users`` (times ``rows_per_user``), never the realized count.
  ``replace_one`` / ``zero_out``: the realized count (public), checked against a declared one.
  """
  if declared is not None:
    declared = check_int(declared, "n_users") * rows_per_user
  if relation == "add_remove":
    if declared is None:
      raise ValueError("relation='add_remove' treats the number of users as private: declare "
                       "n_users in the config (a public, data-independent number; the denominator"
                       " and sampling rate are derived from it), or use relation='zero_out'")
    return declared
  if declared is not None and declared != realized_rows:
    raise ValueError(f"n_users declares {declared} rows but the data has {realized_rows}; under"
                     f" relation={relation!r} n is public and must match")
  return realized_rows


def _sampling(sampling: str, n: int, groups: int | None, rate: float | None,
              batch_size: int | None) -> tuple[float, int, float, int | None]:
  """(q, batch, denominator D, capacity) from the public row count ``n`` and the config's
  ``sampling_rate`` and ``batch_size`` (``None``: not given; default ``round(sqrt(n))``).
  b-min-sep sampling (``groups`` = b) draws from one group of ``G = ceil(n / b)`` rows: rate
  ``p``, expected batch ``p G = D``."""
  if sampling == "full":
    return 1.0, n, float(n), None
  size = -(-n // groups) if groups else n
  if sampling in ("poisson", AMPLIFIED) and rate is not None:
    q = check_probability(rate, "sampling_rate")   # in (0, 1]
  else:
    batch = check_int(batch_size if batch_size is not None
                      else max(1, min(size, round(math.sqrt(n)))), "batch_size")
    if batch > size:
      raise ValueError(f"batch_size ({batch}) " + (
          "is the expected batch p * G of b-min-sep sampling and must be <= G = ceil(n / "
          f"min_separation) = {size}" if groups else f"must be <= n_users ({n})"))
    q = batch / size
  if sampling in ("fixed", "cyclic"):
    return q, batch, float(batch), batch
  return q, max(1, round(q * size)), q * size, poisson_capacity(size, q)


def plan_dp_sgd(cfg: Mapping | Schema, *, level: str, realized_rows: int,
                rows_per_user: int, default_clip: float | None, radius: float) -> DpSgdPlan:
  """The plan of one DP-SGD run from the config and public numbers.

  ``realized_rows`` is read only where the relation makes it public (:func:`public_rows`);
  ``rows_per_user`` is 1 for user rows, the public ``m`` for item rows (the group size of
  ``dp_sgd_group``)."""
  check_choice(level, "level", LEVELS)
  cfg = DpSgdConfig.of(cfg)
  sampling = check_choice(cfg.sampling, "sampling", tuple(SAMPLING_RELATIONS))
  if sampling == AMPLIFIED and cfg.relation == "add_remove":
    raise ValueError(f"sampling={AMPLIFIED!r} cannot honour relation='add_remove': its "
                     "partition into groups is by slot and drawn over the public n, so "
                     "removing a row would redraw every other row's group and change G and "
                     "D; use relation='zero_out' (default) or 'replace_one'")
  # derived default: the relation the sampling scheme is analysed under
  relation = check_relation(cfg.relation or SAMPLING_RELATIONS[sampling][0],
                            supported=SAMPLING_RELATIONS[sampling],
                            mechanism=f"DP-SGD with sampling={sampling!r}")
  rows_per_user = check_int(rows_per_user, "rows_per_user")
  n = public_rows(cfg.n_users, relation, realized_rows=realized_rows,
                  rows_per_user=rows_per_user)
  group_size = rows_per_user if level == "group" else 1
  delta = required_delta(cfg.delta)
  noise = check_choice(cfg.noise_mechanism, "noise_mechanism", NOISES)
  check_mf_sampling(noise, sampling)
  groups = None
  if sampling == AMPLIFIED:   # b = min_separation (default: bands, else 32)
    groups = check_int(cfg.get("min_separation", min(
        n, cfg.bands if cfg.bands is not None else DEFAULT_BANDS)), "min_separation")
    if groups > n:
      raise ValueError(f"min_separation ({groups}) must be <= the number of rows ({n}): each "
                       "of the b groups holds at least one row")
  q, batch, denominator, capacity = _sampling(sampling, n, groups, cfg.sampling_rate,
                                              cfg.batch_size)
  if cfg.num_steps is not None:
    steps = check_int(cfg.num_steps, "num_steps")
  else:
    epochs = check_positive(cfg.epochs, "epochs")
    steps = (epochs * -(-n // batch) if sampling == "cyclic"  # ceil(n/B) steps an epoch
             else epochs * n / denominator if groups  # n rows, D = p G a step
             else epochs / q)
    if not steps <= MAX_COUNT:
      raise ValueError(f"epochs={epochs:g} derives {steps:.3g} steps, above the largest step "
                       f"count {MAX_COUNT} (2^31 - 1): lower epochs or give num_steps")
    steps = max(1, round(steps))
  # derived: L (the config's clip_norm was range-checked when it was built); adaptive: C_0
  if cfg.clip_norm == ADAPTIVE:
    initial = cfg.initial_clip_norm
    clip = check_positive(default_clip if initial is None else initial, "initial_clip_norm")
  else:
    clip = check_positive(default_clip if cfg.clip_norm is None else cfg.clip_norm, "clip_norm")
  group_rows = -(-n // groups) if groups else None
  # the Bernoulli draw of a step covers n rows (poisson) or one group of <= G (banded_poisson)
  trunc = (poisson_truncation_probability(group_rows or n, q, capacity, steps)
           if sampling in ("poisson", AMPLIFIED) else 0.0)
  # bounded participation: at most k contributions a user, >= min_sep steps apart
  # (cyclic: P = ceil(n / B); full: every step; banded_poisson: b)
  min_sep = {"cyclic": -(-n // batch), "full": 1, AMPLIFIED: groups}.get(sampling)
  participations = None if min_sep is None else mf.participations_of(steps, min_sep)
  mf_noise = (None if noise == "independent"
              else _mf_noise(cfg, noise, steps, participations, min_sep, bool(groups)))
  schedule = dict(sampling=sampling, q=q, n=n, batch=batch, steps=steps, mf_noise=mf_noise,
                  participations=participations, min_sep=min_sep)
  make_event = functools.partial(dp_sgd_event, **schedule)
  # z: an explicit noise_multiplier as is (charge() checks the budget), else calibrated on
  # make_event, memoized on the schedule (public numbers: a sweep's seeds calibrate once). At
  # group level the item target is the one whose lift is the target, with room for the
  # truncation term (1 + e^{eps_i}) tv that group_privacy_epsilon adds.
  target = None if cfg.epsilon is None else float(cfg.epsilon)
  item_delta = None
  if cfg.noise_multiplier is not None:
    z = float(cfg.noise_multiplier)
  elif target is None:
    raise ValueError("epsilon is required unless noise_multiplier is given")
  else:
    eps_c, delta_c = target, delta
    if level == "group":
      eps_c, delta_i = group_privacy_targets(target, delta, group_size)
      delta_c = item_delta = (delta_i - (1.0 + math.exp(eps_c)) * trunc) * (1.0 - 1e-9)
      if delta_c <= 0:
        raise ValueError("the Poisson truncation probability leaves no item delta for group "
                         "privacy: raise delta or the slot capacity")
    z = calibrate_noise_multiplier(make_event, epsilon=eps_c, delta=delta_c,
                                   relation=relation,
                                   key=("dp_sgd", tuple(sorted(schedule.items()))))
  if cfg.learning_rate is None and not math.isfinite(radius):
    raise ValueError("learning_rate: its default R / (C sqrt(num_steps)) needs a finite "
                     "radius R (the problem is unconstrained): give learning_rate")
  # derived default R / (C sqrt(T)), computed only when no rate is given
  lr = check_positive(cfg.learning_rate if cfg.learning_rate is not None
                      else radius / (clip * math.sqrt(steps)), "learning_rate")
  averaging = check_choice(cfg.averaging, "averaging", ("none", "uniform"))
  # the step's noise stage: z on the clipped mean's sensitivity C / D (the accountant doubles
  # it under replace-one); tree and MF noise take the same std per node / coordinate of Z,
  # their events price the strategy's sensitivity
  if cfg.clip_norm == ADAPTIVE:
    adaptive = adaptive_plan(cfg, z, clip, denominator, level=level, noise=noise)
    stage = adaptive.split.sum_stage(clip, denominator)
  else:
    adaptive = None
    stage = GaussianStage(z, clipped_mean_sensitivity(clip, denominator), "step")
  return DpSgdPlan(level=level, relation=relation, sampling=sampling, n_public=n,
                   sampling_rate=q, batch=batch, denominator=denominator, capacity=capacity,
                   steps=steps, clip=clip, noise_multiplier=z, stage=stage,
                   noise_std=stage.std, lr=lr, averaging=averaging, epsilon=target,
                   delta=delta, event=make_event(z) if z > 0 else None,
                   truncation_probability=trunc, group_size=group_size,
                   item_delta_target=item_delta, noise=noise, mf=mf_noise,
                   participations=participations, min_sep=min_sep, group_rows=group_rows,
                   adaptive=adaptive)


def adaptive_plan(cfg: Schema, z: float, clip: float, denominator: float, *, level: str,
                  noise: str) -> AdaptivePlan:
  """``clip_norm: adaptive``'s plan, refused (naming why) where it would break the
  mechanism's sensitivity (public: ``flax.DPTrainer``'s Poisson plan takes it too). The
  count's default std is the paper's ``D / 20`` (§4), raised to ``z`` when ``D`` is small
  (then ``z_Delta = 1.15 z``) so that the default never refuses."""
  if level == "group":
    raise ValueError("clip_norm: adaptive is refused for dp_sgd_group: its user-level "
                     "guarantee is the group lift of an item-level step whose clip norm is a "
                     "fixed constant, and a user's m items would each move the shared clip "
                     "norm; use dp_sgd_user (each user's mean gradient clipped and counted "
                     "once)")
  if noise != "independent":
    raise ValueError(f"clip_norm: adaptive is refused with noise_mechanism={noise!r}: "
                     "correlated (matrix-factorization / tree) noise prices the sensitivity of "
                     "a fixed clip norm C across the steps a noise draw covers, and an adaptive "
                     "C_t changes between them; use noise_mechanism: independent")
  sigma_b = cfg.count_stddev if cfg.count_stddev is not None else max(denominator / 20.0, z)
  gamma = check_delta(cfg.get("target_quantile", DEFAULT_TARGET_QUANTILE), "target_quantile")
  eta = check_positive(cfg.get("clip_learning_rate", DEFAULT_CLIP_LEARNING_RATE),
                       "clip_learning_rate")
  return AdaptivePlan(gamma, eta, clip, adaptive_clip_split(z, sigma_b))


# ------------------------------------------ the plan of a problem, its charge, the planners

NONPRIVATE_REPORT = PrivacyReport(epsilon=math.inf, delta=1.0 - 1e-12, provenance="none",
                                  level="none",
                                  notes="non-private (reference or noise switched off)")


def level_rows(problem: SCOProblem, level: str, data: dict | None) -> dict:
  """The rows ``dp_sgd_{level}`` clips: the users of ``data`` (default ``problem.data``), or
  every item as its own row (a 'user' with one item)."""
  data = problem.data if data is None else data
  return data if level == "user" else jax.tree.map(
      lambda x: x.reshape((-1, 1) + x.shape[2:]), data)


def dp_sgd_plan(problem: SCOProblem, cfg: dict, *, level: str = "user",
                data: dict | None = None) -> DpSgdPlan:
  """The plan of ``dp_sgd_{level}`` from the problem's public facts (a
  :class:`~dpsco_jax.data.PublicFacts` suffices) or, for the audit hooks, the rows of
  ``data`` (their count enters only where the relation makes it public)."""
  check_choice(level, "level", LEVELS)
  per_user = 1 if level == "user" else problem.m
  realized = (problem.n_users * per_user if data is None
              else jax.tree.leaves(level_rows(problem, level, data))[0].shape[0])
  cfg = DpSgdConfig.of(cfg)
  # the derived default clip reads L only when no (initial) clip is given
  reads_l = cfg.clip_norm is None or (cfg.clip_norm == ADAPTIVE
                                      and cfg.initial_clip_norm is None)
  return plan_dp_sgd(cfg, level=level, realized_rows=realized, rows_per_user=per_user,
                     default_clip=problem.lipschitz if reads_l else None,
                     radius=problem.radius)


def dp_sgd_planner(level: str) -> Callable[[PublicFacts, dict], Planned]:
  """The registered planner of ``dp_sgd_{level}``: its plan (the ``detail`` its runner
  executes) and its charge, from the public facts alone (or a built-in problem's)."""
  def planner(facts: PublicFacts, cfg: dict) -> Planned:
    p = dp_sgd_plan(facts, cfg, level=level)
    schedule = {"num_steps": p.steps, "batch_size": p.batch, "sampling": p.sampling,
                "sampling_rate": p.sampling_rate, "denominator": p.denominator,
                "clip_norm": p.clip, "learning_rate": p.lr, "noise_std": p.noise_std}
    return Planned(p.charge(), p.noise_multiplier, schedule, p)
  return planner


class SgdPlan(NamedTuple):
  """``nonprivate_sgd``'s schedule: sampling, rows per step (and slots), steps, step size."""
  sampling: str
  batch: int
  capacity: int
  steps: int
  lr: float
  averaging: str
  stages = ()   # non-private: no noise stage, no event
  events = ()

  def charge(self) -> PrivacyReport:
    return NONPRIVATE_REPORT


def nonprivate_planner(facts: PublicFacts, cfg: SgdSchedule) -> Planned:
  """``nonprivate_sgd``'s plan: it may read the realized ``n_users``; ``lipschitz`` only for
  the default step size ``R / (L sqrt(T))`` (no ``learning_rate`` given)."""
  n = facts.n_users
  sampling, batch, capacity, _ = sampling_setup(cfg.sampling, cfg.batch_size, n)
  if cfg.num_steps is not None:
    steps = check_int(cfg.num_steps, "num_steps")
  else:
    steps = max(1, round(check_positive(cfg.epochs, "epochs") * n / batch))
  lr = check_positive(facts.radius / (facts.lipschitz * math.sqrt(steps))
                      if cfg.learning_rate is None else cfg.learning_rate, "learning_rate")
  averaging = check_choice(cfg.averaging, "averaging", ("none", "uniform"))
  schedule = {"num_steps": steps, "batch_size": batch, "sampling": sampling,
              "learning_rate": lr}
  return Planned(NONPRIVATE_REPORT, None, schedule,
                 SgdPlan(sampling, batch, capacity, steps, lr, averaging))
