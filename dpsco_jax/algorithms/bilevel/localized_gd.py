"""DP-Loc-GD and DP-Loc-SGD: localized, projected, averaged noisy (S)GD for strongly convex ERM.

Reference: Kornowski, "Differentially Private Bilevel Optimization" (paper 004), Algorithm 2
(DP-Loc-GD, Thm 8.2) and Algorithm 4 (DP-Loc-SGD, Thm A.1); spec ``004_dp_bilevel.md`` §2.2,
§2.4, §3.4. The paper uses it as the private lower-level solver of its bilevel algorithms; it
is a general private solver for any ``mu``-strongly convex ``h(y) = (1/n) sum_i h(y; xi_i)``.

Algorithm (round ``m = 0..M-1``, step ``t = 0..T-1`` restarting every round)::

    y^m_{t+1} = Pi_{B(y^m_0, R_m)}[ y^m_t - eta_t (clipmean_i grad h(y^m_t; xi_i) + nu^m_t) ]
    y^{m+1}_0 = (1/T) sum_{t=0}^{T-1} y^m_t          (Alg 2 line 7: includes y^m_0)

as two core chains: the privatizer ``clip_per_user(C) -> aggregate("mean", denominator)
-> add_gaussian_noise(z C / denominator)`` (its output is the per-step release) and the public
step ``add_public_gradient(grad r) -> projected_sgd(eta_t, radius=R_m, center=y^m_0,
averaging="uniform")``; one example = one row (item-level privacy).

Privacy contract.
  * Relation: ``replace_one`` only (the paper's adjacency: one example replaced by an arbitrary
    one). Public: ``n`` (the number of examples; it sets the full-batch denominator and the
    sampling rate), every field of :class:`LocGDConfig` and ``r(y)``. Other relations are
    refused by :func:`check_loc_gd_relation` (``add_remove`` would make ``n`` private and the
    denominator ``n`` data dependent).
  * Sensitivity: each per-example gradient is clipped to ``C`` (spec §3.4/E7: the paper assumes
    L-Lipschitz losses *on Y* but queries gradients anywhere in the ball, so clipping is what
    makes the sensitivity unconditional); the clipped sum has replace-one sensitivity ``2C``. In
    the library's convention the noise multiplier is ``z = sigma / C`` and the ledger's
    accountant applies the replace-one doubling (``dpsco_jax.privacy.relations``).
  * Events: full batch, one step is ``GaussianDpEvent(z)``; DP-Loc-SGD samples each example
    independently with probability ``q = b / n`` (Poisson; ``b`` the declared expected batch,
    the fixed denominator) and one step is ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``. A
    solve is ``SelfComposedDpEvent(step, M T)`` (:func:`loc_gd_event`), composed by the PLD
    accountant, which supports the Poisson-subsampled Gaussian under replace-one. Why Poisson
    and not a fixed-size subset: dp_accounting 0.6.0 accounts sampling without replacement only
    with RDP (Wang et al.'s bound), which at ``n=400, b=40, 600`` steps, delta = 1e-6 gives
    epsilon 16.5 / 44.2 at z = 4 / 2 where PLD on the Poisson event gives 6.1 / 14.0 (2.7x /
    3.2x tighter; issue 11 measured the RDP path ~2.3x above a realizable lower bound). The
    price: static shapes mean the Poisson mask is applied to all ``n`` per-example gradients
    (``n`` gradient evaluations per step instead of ``b``). The paper samples ``b`` points with
    replacement (spec E4); it notes the rates are the same for other samplers.
  * Declared constants (issue 23.3): **enforced**. The declared L is only the default clip
    ``C`` (clipping bounds the per-step sensitivity ``2C/denominator`` for any loss), the
    declared mu only the steps ``eta_t`` and the radii, the declared R only ``radius0``: none
    enters the accounting, so the provenance stays ``accountant`` on a user's loss
    (``tests/test_declared_constants.py``).
  * Noise is drawn only by the core ``add_gaussian_noise`` stage (fresh ``fold_in`` key per step,
    never reused). A data-independent term ``r(y)`` is added *after* the noise: no sensitivity.
    Radii, steps and rounds are functions of public constants only: a wrong radius costs
    utility, never privacy.
  * Calibration: the presets build the solve's event and call the one calibrator
    ``dpsco_jax.privacy.calibrate_noise_multiplier``; an explicit ``noise_multiplier`` whose
    epsilon exceeds the configured epsilon is refused before anything is released
    (:func:`run_dp_loc_gd`).
  * Audit hook: :func:`dp_loc_gd_releases` returns the per-step noisy clipped means; with
    ``forced=`` it replays a given release history (the adaptive-composition view: the query
    points are post-processing of earlier releases).

Deviations from the paper (each documented where it is implemented):
  * exact accounting (PLD via ``dp_accounting``) instead of Lemma 2.1/2.2 constants (spec E2);
    the paper's own per-step sigma is reported by :func:`paper_loc_gd_stddev`;
  * the radii ``R_m = Theta~(sqrt(R_{m-1} L/(mu eps' n)) + L sqrt(d)/(mu eps' n))`` have no
    stated constants: we use ``A = max(s, C) sqrt(1 + ln T)/(mu sqrt(T))`` (``s`` = noise std of
    the mean gradient; for ``T = n^2`` and the calibrated ``s ~ L/eps'`` this is the paper's
    ``L/(mu eps' n)`` up to logs) and ``R_m = min(2 R_{m-1}, c (sqrt(R_{m-1} A) + A sqrt(d)))``
    with ``c = radius_const`` (spec §3.4, default 4);
  * ``T_GD = n^2`` in the ``theory`` preset; the ``practical`` preset uses
    ``min(n^2, ceil(c rho n^2 / d))`` steps (spec §3.4, E9) and may use the smooth step rule
    ``eta_t = 1/(beta + mu t)`` instead of ``1/(mu (t+1))``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax import config_families as cf
from dpsco_jax.algorithms.registration import register
from dpsco_jax._checks import (check_choice, check_delta, check_epsilon, check_int,
                               check_nonnegative, check_positive)
from dpsco_jax.algorithms.common import required_delta
from dpsco_jax.data.problem import MissingConstant
from dpsco_jax.grads import per_example_grads
from dpsco_jax.privacy.calibrate import calibrate_noise_multiplier
from dpsco_jax.privacy.ledger import PrivacyLedger, Provenance
from dpsco_jax.privacy.relations import PUBLIC, check_relation
from dpsco_jax.transforms.clipping import aggregate, clip_per_user
from dpsco_jax.transforms.noise import add_gaussian_noise
from dpsco_jax.transforms.post_processing import add_public_gradient
from dpsco_jax.transforms.steps import projected_sgd, released_params, tree_l2_norm

PyTree = Any
ExampleLoss = Callable[[PyTree, PyTree], jax.Array]
RELATION = "replace_one"  # the paper's adjacency (spec §1)
SUPPORTED_RELATIONS = (RELATION,)

__all__ = [
    "LocGDConfig", "LocGDAux", "dp_loc_gd", "dp_loc_sgd", "dp_loc_gd_releases",
    "loc_gd_stddev", "loc_gd_radii", "loc_gd_event", "loc_gd_step_event", "loc_gd_rounds",
    "loc_gd_theory_config", "loc_gd_practical_config", "with_calibrated_noise",
    "check_loc_gd_relation", "plan_dp_loc_gd", "paper_loc_gd_stddev", "advanced_composition_step",
    "add_public_gradient", "run_dp_loc_gd", "LocGDRunPlan", "loc_gd_plan_for_problem",
    "charge_loc_gd", "loc_gd_report",
]


def check_loc_gd_relation(relation: object) -> str:
  """The relation DP-Loc-(S)GD honours: ``replace_one`` (``n`` public); others raise."""
  return check_relation(relation, supported=SUPPORTED_RELATIONS, mechanism="DP-Loc-(S)GD")


# --------------------------------------------------------------------------------------------
# Configuration (all fields public and static; nothing here depends on data)
# --------------------------------------------------------------------------------------------

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


def _denominator(cfg: LocGDConfig, n: int) -> int:
  if cfg.batch_size is None:
    return n
  if cfg.batch_size > n:
    raise ValueError(f"batch_size ({cfg.batch_size}) must be <= the number of examples ({n})")
  return cfg.batch_size


def loc_gd_stddev(cfg: LocGDConfig, n: int) -> float:
  """Per-coordinate noise std on the clipped mean gradient: ``z C / denominator``."""
  return cfg.noise_multiplier * cfg.clip_norm / _denominator(cfg, n)


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
  """One step on a clipped sum with noise std ``z C``, in the library's convention
  ``z = sigma / C`` (``C`` the per-example clip; the ledger applies replace-one's ``2C``):
  ``GaussianDpEvent(z)`` for full batch, ``PoissonSampledDpEvent(batch / n, ...)`` for
  DP-Loc-SGD (``n`` public under replace-one)."""
  check_positive(z, "noise_multiplier")
  base = dp_accounting.GaussianDpEvent(z)
  if batch is None:
    return base
  n = check_int(n, "n")
  if not 1 <= check_int(batch, "batch_size") <= n:
    raise ValueError(f"batch_size must lie in [1, n={n}], got {batch}")
  return dp_accounting.PoissonSampledDpEvent(batch / n, base)


def loc_gd_event(cfg: LocGDConfig, n: int) -> dp_accounting.DpEvent:
  """The event of one solve: ``M T`` steps (:func:`loc_gd_step_event`). Data free: ``n`` is
  the public number of examples. A zero noise multiplier has no event (raises)."""
  if cfg.noise_multiplier == 0:
    raise ValueError("noise_multiplier=0 is not private: no privacy event exists for it")
  step = loc_gd_step_event(cfg.noise_multiplier, n=n,
                           batch=None if cfg.batch_size is None else _denominator(cfg, n))
  return dp_accounting.SelfComposedDpEvent(step, cfg.rounds * cfg.steps)


def with_calibrated_noise(cfg: LocGDConfig, n: int, *, epsilon: float, delta: float
                          ) -> LocGDConfig:
  """``cfg`` with the smallest noise multiplier for which one solve is ``(epsilon, delta)``-DP
  under replace-one, found by the library's one calibrator on :func:`loc_gd_event`."""
  z = calibrate_noise_multiplier(
      lambda z: loc_gd_event(dataclasses.replace(cfg, noise_multiplier=z), n),
      epsilon=epsilon, delta=delta, relation=RELATION)
  return dataclasses.replace(cfg, noise_multiplier=z)


# --------------------------------------------------------------------------------------------
# The paper's own composition (Lemma 2.1 + Lemma 2.2), reported beside the exact accountant
# --------------------------------------------------------------------------------------------

def advanced_composition_step(epsilon: float, delta: float, k: int) -> tuple[float, float]:
  """Per-step ``(eps_0, delta_0)`` such that Lemma 2.1 (advanced composition) over ``k`` steps
  gives ``(epsilon, delta)``: ``delta_0 = delta/(k+1)`` and ``eps_0`` solves
  ``sqrt(2 k ln(1/delta_0)) eps_0 + 2 k eps_0^2 = epsilon``."""
  d0 = delta / (k + 1)
  b = math.sqrt(2.0 * k * math.log(1.0 / d0))
  e0 = (-b + math.sqrt(b * b + 8.0 * k * epsilon)) / (4.0 * k)
  return e0, d0


def paper_loc_gd_stddev(cfg: LocGDConfig, n: int, *, epsilon: float, delta: float) -> float:
  """The noise std the paper's own analysis prescribes for an ``(epsilon, delta)`` solve:
  Lemma 2.2 ``sigma^2 = 2 ln(5/(4 delta_0)) Delta^2 / eps_0^2`` per step (``Delta = 2C/denom``),
  with ``(eps_0, delta_0)`` from Lemma 2.1 over ``M T`` steps (full batch). For DP-Loc-SGD the
  paper first amplifies by ``b/n`` (Lemma 2.3, ``eps ~ b eps_0 / n``), so the step budget is
  ``eps_0 n / b``. Constants exactly as printed (the paper's "Õ" hides them)."""
  e0, d0 = advanced_composition_step(epsilon, delta, cfg.rounds * cfg.steps)
  denom = _denominator(cfg, n)
  if cfg.batch_size is not None:
    e0 = e0 * n / denom
  sens = 2.0 * cfg.clip_norm / denom
  return math.sqrt(2.0 * math.log(5.0 / (4.0 * d0))) * sens / e0


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------

def loc_gd_theory_config(*, mu: float, lipschitz: float, n: int, epsilon: float,
                         delta: float, radius0: float, batch_size: int | None = None,
                         radius_const: float = 4.0) -> LocGDConfig:
  """Thm 8.2 / A.1 parameters: ``M = log2 log(mu eps n / L)``, ``T = n^2``,
  ``eta_t = 1/(mu(t+1))``, ``C = L`` (clipping inactive under the assumption), noise calibrated
  exactly for ``(epsilon, delta)``. Warns-by-error on the precondition of Thm 8.2 only through
  :func:`check_loc_gd_precondition` (spec E10 makes it a warning)."""
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
  """Laptop-scale preset: ``T = min(n^2, ceil(c rho n^2/d), max_steps)`` (spec §3.4: under exact
  calibration the noise term of the App. A bound is ``T``-free), smooth step rule when a
  smoothness is given, rounds from Thm 8.2, exact calibration."""
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


# --------------------------------------------------------------------------------------------
# The solver
# --------------------------------------------------------------------------------------------

def _schedule(cfg: LocGDConfig) -> Callable[[jax.Array], jax.Array]:
  mu = cfg.mu
  if cfg.step_rule == "paper":
    return lambda t: 1.0 / (mu * (t + 1.0))          # Thm 8.2: eta_t = 1/(mu (t+1))
  beta = cfg.smoothness
  return lambda t: 1.0 / (beta + mu * t)            # practical: stable for beta-smooth h


def _num_examples(data: PyTree) -> int:
  sizes = {x.shape[0] for x in jax.tree.leaves(data)}
  if len(sizes) != 1:
    raise ValueError(f"data leaves disagree on the example axis: {sorted(sizes)}")
  return sizes.pop()


def _round_chains(cfg: LocGDConfig, n: int, key: jax.Array, radius: float, center: PyTree,
                  reg_grad: Callable | None):
  """The privatizer (clip -> fixed-denominator mean -> Gaussian; its output is the release) and
  the public step of one round."""
  denom = _denominator(cfg, n)
  privatizer = optax.chain(clip_per_user(cfg.clip_norm), aggregate("mean", denominator=denom),
                           add_gaussian_noise(loc_gd_stddev(cfg, n), key))
  stepper = optax.chain(add_public_gradient(reg_grad),
                        projected_sgd(_schedule(cfg), radius=radius, center=center,
                                      averaging="uniform"))
  return privatizer, stepper


def _solve(loss_ex: ExampleLoss, y0: PyTree, data: PyTree, key: jax.Array, cfg: LocGDConfig,
           reg_fn: Callable | None, forced: PyTree | None):
  """The solver; returns ``(y_out, aux, releases)`` with ``releases`` leaves ``[M, T, ...]``.
  ``forced`` (same shape as ``releases``): advance with these releases instead of this run's
  own (replay of a release history; the audit / sensitivity view)."""
  n = _num_examples(data)
  q = None if cfg.batch_size is None else _denominator(cfg, n) / n
  dim = sum(int(np.prod(jnp.shape(x))) for x in jax.tree.leaves(y0))
  radii = loc_gd_radii(cfg, n, dim)
  reg_grad = None if reg_fn is None else jax.grad(reg_fn)
  center, max_dists, centers, releases = y0, [], [], []
  for m in range(cfg.rounds):  # M is a small static number (log log n): unrolled
    k_noise, k_sample = jax.random.split(jax.random.fold_in(key, m))
    privatizer, stepper = _round_chains(cfg, n, k_noise, radii[m], center, reg_grad)
    forced_m = None if forced is None else jax.tree.map(lambda r, m=m: r[m], forced)

    def step(carry, xs, privatizer=privatizer, stepper=stepper, center=center,
             k_sample=k_sample):
      y, pst, sst, md = carry
      t, forced_t = xs
      mask = None
      if q is not None:  # Alg 4's B^m_t: Poisson sample at the public rate b/n (static shape)
        mask = jax.random.bernoulli(jax.random.fold_in(k_sample, t), q, (n,))
      grads = per_example_grads(loss_ex, y, data)
      release, pst = privatizer.update(grads, pst, y, user_mask=mask)
      used = release if forced_t is None else forced_t
      upd, sst = stepper.update(used, sst, y)
      y_new = optax.apply_updates(y, upd)
      dist = tree_l2_norm(jax.tree.map(jnp.subtract, y_new, center))
      return (y_new, pst, sst, jnp.maximum(md, dist)), release

    init = (center, privatizer.init(center), stepper.init(center),
            jnp.zeros((), jnp.result_type(float)))
    (y_last, _, sst, max_dist), rel = jax.lax.scan(step, init,
                                                   (jnp.arange(cfg.steps), forced_m))
    max_dists.append(max_dist)
    releases.append(rel)
    avg = released_params(sst, y_last)  # uniform mean of y_1..y_T (core convention)
    if cfg.average == "paper":
      # Alg 2 line 7 averages y_0..y_{T-1}: the same sum with y_T swapped for y_0.
      avg = jax.tree.map(lambda a, c, l: a + (c - l) / cfg.steps, avg, center, y_last)
    centers.append(avg)
    center = avg
  aux = LocGDAux(radii=jnp.asarray(radii), stddev=jnp.asarray(loc_gd_stddev(cfg, n)),
                 max_dist=jnp.stack(max_dists),
                 centers=jax.tree.map(lambda *c: jnp.stack(c), *centers))
  return center, aux, jax.tree.map(lambda *r: jnp.stack(r), *releases)


def dp_loc_gd(loss_ex: ExampleLoss, y0: PyTree, data: PyTree, key: jax.Array,
              cfg: LocGDConfig, *, reg_fn: Callable[[PyTree], jax.Array] | None = None
              ) -> tuple[PyTree, LocGDAux]:
  """One DP-Loc-GD (``cfg.batch_size is None``) or DP-Loc-SGD solve. Jittable (``cfg`` static).

  Accounting is the caller's (:func:`loc_gd_event` on a replace-one ledger, charged before).

  Args:
    loss_ex: ``loss_ex(y, example) -> scalar``, the per-example part of ``h``.
    y0: the start ``y_0`` (any pytree); must be a private/public quantity, never an exact
      data-dependent minimizer.
    data: examples, leaves ``[n, ...]``.
    key: PRNG key; every round and every step gets its own folded key.
    cfg: :class:`LocGDConfig`.
    reg_fn: optional data-independent term ``r(y)`` of ``h``; its gradient is added after the
      noise (no sensitivity).

  Returns:
    ``(y_out, aux)`` with ``y_out = y^M_0``.
  """
  y, aux, _ = _solve(loss_ex, y0, data, key, cfg, reg_fn, None)
  return y, aux


def dp_loc_gd_releases(loss_ex: ExampleLoss, y0: PyTree, data: PyTree, key: jax.Array,
                       cfg: LocGDConfig, *, reg_fn: Callable[[PyTree], jax.Array] | None = None,
                       forced: PyTree | None = None) -> PyTree:
  """Audit hook: the per-step privatized releases of a solve, the noisy clipped means
  ``clipmean(grad h(y_t)) + nu_t`` (leaves ``[M, T, *y.shape]``), for ``data`` and ``key``.

  Each release is the Gaussian mechanism at the query point ``y_t``, itself post-processing of
  the earlier releases. ``forced`` (a release history of the same shape, e.g. from a
  neighbouring dataset) makes the solver advance with those releases, so both datasets are
  queried at the same points: with the same ``key`` the noise and Poisson masks coincide, and
  ``cfg.noise_multiplier = 0`` exposes the noiseless aggregates (per-step difference at most
  ``2 C / denominator`` under replace-one). Same keys as :func:`dp_loc_gd`."""
  return _solve(loss_ex, y0, data, key, cfg, reg_fn, forced)[2]


def dp_loc_sgd(loss_ex: ExampleLoss, y0: PyTree, data: PyTree, key: jax.Array,
               cfg: LocGDConfig, *, reg_fn: Callable[[PyTree], jax.Array] | None = None
               ) -> tuple[PyTree, LocGDAux]:
  """DP-Loc-SGD (Alg 4): :func:`dp_loc_gd` with Poisson samples of expected size
  ``cfg.batch_size`` (must be set)."""
  if cfg.batch_size is None:
    raise ValueError("dp_loc_sgd needs cfg.batch_size (use dp_loc_gd for full batch)")
  return dp_loc_gd(loss_ex, y0, data, key, cfg, reg_fn=reg_fn)


# --------------------------------------------------------------------------------------------
# Runner entry (strongly convex SCO problems of the core, item-level)
# --------------------------------------------------------------------------------------------

def _item_level_data(problem) -> PyTree:
  """Flattens ``[n_users, m, ...]`` to ``[n_users*m, ...]``: one item = one example."""
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), problem.data)


def plan_dp_loc_gd(cfg: dict, *, n: int, dim: int, clip: float, radius0: float
                   ) -> tuple[LocGDConfig, dp_accounting.DpEvent]:
  """Data-free plan of a runner solve: the config (schedule, noise multiplier) and its event,
  from the config dict and public numbers only (``n`` public under replace-one). An explicit
  ``noise_multiplier`` is kept as given (the caller checks it against the budget)."""
  check_loc_gd_relation(cfg.get("relation", RELATION))
  eps = check_epsilon(cfg.get("epsilon"), "epsilon")
  delta = required_delta(cfg)
  mu = check_positive(cfg.get("mu"), "mu")
  preset = check_choice(cfg.get("preset", "practical"), "preset", ("practical", "theory"))
  batch = cfg.get("batch_size")
  if preset == "theory":
    lcfg = loc_gd_theory_config(mu=mu, lipschitz=clip, n=n, epsilon=eps, delta=delta,
                                radius0=radius0, batch_size=batch)
  else:
    lcfg = loc_gd_practical_config(mu=mu, clip_norm=clip, n=n, dim=dim, epsilon=eps,
                                   delta=delta, radius0=radius0,
                                   smoothness=cfg.get("smoothness"), steps=cfg.get("num_steps"),
                                   rounds=cfg.get("rounds"), batch_size=batch,
                                   radius_const=cfg.get("radius_const", 4.0))
  if cfg.get("noise_multiplier") is not None:
    lcfg = dataclasses.replace(
        lcfg, noise_multiplier=check_positive(cfg["noise_multiplier"], "noise_multiplier"))
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


def _public_mu(problem, cfg: dict) -> float:
  """``mu``: the config's, else the declared ``meta['strong_convexity']`` (MissingConstant)."""
  mu = cfg.get("mu")
  if mu is None:
    mu = (getattr(problem, "meta", None) or {}).get("strong_convexity")
  if mu is None:
    raise MissingConstant("mu: dp_loc_gd needs the strong convexity mu of the loss: give the "
                          "config key mu or declare constants={'strong_convexity': ...}")
  return check_positive(mu, "mu")


def loc_gd_plan_for_problem(problem, cfg: dict) -> LocGDRunPlan:
  """:func:`plan_dp_loc_gd` from public facts only (``n_users * m`` items, ``d``; where the
  config does not give them: L for ``clip_norm``, a finite R for ``radius0 = 2R``, the declared
  strong convexity for ``mu``): a :class:`~dpsco_jax.data.PublicFacts` suffices."""
  required_delta(cfg)  # a missing delta is named before any constant is read
  n, dim = int(problem.n_users) * int(problem.m), int(problem.d)
  clip = cfg.get("clip_norm")
  clip = check_positive(problem.lipschitz if clip is None else clip, "clip_norm")
  radius0 = cfg.get("radius0")
  if radius0 is None:
    if not math.isfinite(float(problem.radius)):
      raise MissingConstant("radius0: dp_loc_gd needs the initial localization radius: give "
                            "radius0 or declare a finite constants={'radius': ...} (2R)")
    radius0 = 2.0 * float(problem.radius)
  radius0 = check_positive(radius0, "radius0")
  l2 = check_nonnegative(cfg.get("l2") or 0.0, "l2")
  lcfg, event = plan_dp_loc_gd({**cfg, "mu": _public_mu(problem, cfg)}, n=n, dim=dim,
                               clip=clip, radius0=radius0)
  return LocGDRunPlan(n, float(cfg["epsilon"]), float(cfg["delta"]), l2,  # checked
                      cfg.get("preset") or "practical", lcfg, event)


def charge_loc_gd(plan: LocGDRunPlan) -> PrivacyLedger:
  """A fresh ledger charged with the solve (raises first when ``noise_multiplier`` is over)."""
  ledger = PrivacyLedger(delta=plan.delta, epsilon_budget=plan.epsilon, relation=RELATION)
  ledger.spend(plan.event, label="dp_loc_gd solve")
  return ledger


def loc_gd_report(plan: LocGDRunPlan, ledger: PrivacyLedger):
  """The run's guarantee (item level, accountant) with the paper-formula sigma in the notes."""
  lcfg, n = plan.config, plan.n
  paper_sigma = paper_loc_gd_stddev(lcfg, n, epsilon=plan.epsilon, delta=plan.delta)
  sampling = "full batch" if lcfg.batch_size is None else f"Poisson rate {lcfg.batch_size}/{n}"
  return ledger.report(
      provenance=Provenance.ACCOUNTANT, level="item", mechanisms=("dp_loc_gd solve",),
      notes=(f"{lcfg.rounds}x{lcfg.steps} clipped-mean Gaussian steps ({sampling}), "
             f"z={lcfg.noise_multiplier:.4g}, replace-one (public: {PUBLIC[RELATION]}); "
             f"paper-formula sigma {paper_sigma:.4g} vs ours {loc_gd_stddev(lcfg, n):.4g}"))


@functools.lru_cache(maxsize=32)
def _compiled_solve(loss_fn: ExampleLoss, lcfg: LocGDConfig, l2: float) -> Callable:
  """One jitted solve per (loss, config, ridge): the data and the key are arguments, so a
  sweep over seeds compiles once (a per-call ``jax.jit(lambda ...)`` compiled every call)."""
  reg = (None if l2 <= 0 else
         lambda y: 0.5 * l2 * sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(y)))
  return jax.jit(lambda y, data, k: dp_loc_gd(loss_fn, y, data, k, lcfg, reg_fn=reg))


@register("dp_loc_gd", config=cf.LocGdConfig, paper="004")
def run_dp_loc_gd(problem, cfg: dict, key: jax.Array):
  """Runner entry: DP-Loc-(S)GD on a core ``SCOProblem`` (item-level, replace-one).

  Config keys: ``epsilon`` (the budget), ``delta`` (required), ``mu`` (public strong convexity;
  default the problem's declared ``strong_convexity``), ``relation`` (only ``replace_one``),
  ``noise_multiplier`` (explicit; refused if its epsilon exceeds ``epsilon``), ``clip_norm``
  (default ``problem.lipschitz``), ``preset`` (``practical`` | ``theory``), ``num_steps`` (per
  round), ``rounds, batch_size, radius0`` (default ``2 problem.radius``), ``radius_const``,
  ``l2`` (a data-independent ridge term ``l2/2 ||y||^2`` added to ``h``), ``debug``. The plan
  (:func:`loc_gd_plan_for_problem`) uses only the public ``n`` and the config; the ledger is
  charged before the solve runs.
  """
  from dpsco_jax.result import Result

  plan = loc_gd_plan_for_problem(problem, cfg)
  ledger = charge_loc_gd(plan)  # raises before anything is computed
  data, lcfg, n, l2 = _item_level_data(problem), plan.config, plan.n, plan.l2
  y_out, aux = _compiled_solve(problem.loss_fn, lcfg, float(l2))(problem.init_params(), data,
                                                                 key)
  debug = ({"max_dist_per_round": np.asarray(aux.max_dist).tolist()}
           if cfg.get("debug", False) else None)
  record = {"noise_multiplier": lcfg.noise_multiplier, "batch_size": lcfg.batch_size,
            "noise_std": loc_gd_stddev(lcfg, n),
            "paper_noise_std": paper_loc_gd_stddev(lcfg, n, epsilon=plan.epsilon,
                                                   delta=plan.delta),
            "rounds": lcfg.rounds, "num_steps": lcfg.steps,
            "radii": list(map(float, aux.radii)), "preset": plan.preset}
  # Poisson masks keep shapes static: every step evaluates all n per-example gradients.
  evals = lcfg.rounds * lcfg.steps * n
  return Result(params=y_out, privacy=loc_gd_report(plan, ledger),
                gradient_evaluations=int(evals), record=record, debug=debug)


@register("dp_loc_sgd", config=cf.LocSgdConfig, paper="004")
def _run_dp_loc_sgd(problem, cfg: dict, key: jax.Array):
  if cfg.get("batch_size") is None:
    raise ValueError("batch_size is required for dp_loc_sgd")
  return run_dp_loc_gd(problem, cfg, key)
