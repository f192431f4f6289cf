"""Accelerated DP-SRGD (paper 003): single-epoch DP-SCO with ~sqrt(n) large-batch steps.

Choquette-Choo, Ganesh, Thakurta, "Optimal Rates for O(1)-Smooth DP-SCO with a Single Epoch
and Large Batches" (2024), Algorithm 1; decoded in spec 003.

One pass over the data in ``T`` disjoint consecutive batches of ``B`` examples (users). At step
``t`` every example of batch ``t`` gives the SRG difference
``delta_t(d) = (t+1) grad f(x_t, d) - t grad f(x_{t-1}, d)`` (two gradients, Alg. 1 line 4);
the chain is

    clip_per_user(C) -> aggregate(mean, B) -> prefix_sum_noise(z C/B, T, "tree")   [release]
    -> scale_by_srg_weight() -> accelerated_projected_step(beta, R, z_scale)       [post-proc.]

and the released model is ``y_T``. Variants from the same parts (:func:`srgd_chain`):
  * ``accelerated=False``: the unaccelerated §4.3 sketch — the same noisy SRG fed to projected
    SGD with step ``1/beta`` (last iterate; AMBIG: the paper does not write the update out).
  * ``srg=False``: plain clipped gradients with independent noise and the accelerated step
    (§5.5, Thm 5.13 "accelerated DP-SGD"), or with projected SGD: single-epoch DP-SGD.
  * ``noise="independent"``: the SRG with independent per-step noise (the spec §2.2 warning:
    prefix variance grows like ``t`` instead of ``O(log t)``).

Privacy (spec §3.2, §4.4): a zero-out (or add/remove) neighbour changes exactly one increment
``Delta_i`` by at most ``C/B`` for *any* loss (the clip acts on the difference); the tree
release is then ``mu``-GDP with ``mu = sqrt(T.bit_length())/z``, converted exactly to
(epsilon, delta) by dp_accounting (``GaussianDpEvent(1/mu)``, PLD); independent noise gives
``mu = 1/z``. Replace-one adjacency doubles the sensitivity (``adjacency="replace_one"``, the
ledger's ``replace_one`` relation). The paper's own conversion ``mu = eps/sqrt(2 ln(1.25/delta))``
(Cor. 5.7, classical Gaussian bound, valid for eps <= 1) is reported beside it
(``paper_epsilon``). Provenance: ``accountant``.

Presets:
  * ``theory`` reproduces Eq. (19)/Thm 5.8 (``variant="interior"``, x-dagger in C) or Thm 5.12
    (``variant="constrained"``) — T, B, beta, clip, and the paper's sigma (Cor. 5.7 / 5.11) —
    and refuses with a ValueError naming the violated condition when they are vacuous (e.g.
    ``T = c_DP n^{1/4} > n`` for every practical n; spec §2.3 table).
  * ``practical``: ``B = floor(sqrt n)``, ``T = floor(n/B)``, ``beta = M max(1, beta_scale T)``
    (variant-B style, spec §7.4, floored at Thm 5.1's ``beta >= M``), clip and beta tunable,
    ``z`` calibrated to (epsilon, delta).

Config keys of the ``ALGORITHMS`` entries (runner contract): ``epsilon`` (``null``: non-private,
provenance ``none``), ``delta`` (default ``1/n^2``), ``preset``, ``variant``, ``adjacency``
(``zero_out`` | ``replace_one``), ``noise_mechanism`` (``tree`` | ``independent``; ``noise`` is
the problem's label noise), ``batch_size``, ``num_steps``, ``beta`` or ``beta_scale``,
``clip_norm`` (default L), ``noise_multiplier`` (skip calibration; the ledger still refuses a
run above ``epsilon``), ``z_scale``, ``learning_rate`` / ``averaging`` (projected-SGD variants;
default step ``1/beta``), ``debug``. Records carry ``batch_gradient_steps``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax._checks import (check_choice, check_delta, check_epsilon, check_int,
                               check_nonnegative, check_positive)
from dpsco_jax.grads import per_user_grads
from dpsco_jax.privacy import (PrivacyLedger, PrivacyReport, Provenance,
                                      calibrate_noise_multiplier)
from dpsco_jax.privacy.mechanisms import gaussian_sigma_analytic
from dpsco_jax.result import Result
from dpsco_jax.transforms.clipping import (aggregate, aggregation_sensitivity, clip_per_user,
                                           tree_global_norms)
from dpsco_jax.transforms.noise import add_gaussian_noise
from dpsco_jax.transforms.srg import (accelerated_projected_step, check_z_scale,
                                      scale_by_srg_weight, srg_differences)
from dpsco_jax.transforms.steps import projected_sgd, released_params
from dpsco_jax.transforms.tree_noise import (MECHANISMS, TreePrefixNoiseState,
                                             prefix_noise_event, prefix_noise_mu,
                                             prefix_sum_noise, tree_levels)

PyTree = Any
VARIANTS = ("interior", "constrained")
PRESETS = ("practical", "theory")
ADJACENCY_TO_RELATION = {"zero_out": "add_remove", "add_remove": "add_remove",
                         "replace_one": "replace_one"}


# ----------------------------------------------------------------------------- accounting
def paper_epsilon(mu: float, delta: float) -> float:
  """The paper's GDP -> DP step (Cor. 5.7): ``mu = eps / sqrt(2 ln(1.25/delta'))`` gives
  (eps, delta')-DP (classical Gaussian bound; only guaranteed for eps <= 1). Here ``delta' =
  delta`` because the library always clips (no TV term, spec §3.4)."""
  return float(mu) * math.sqrt(2.0 * math.log(1.25 / check_delta(delta)))


def calibrate_srgd_noise(epsilon: float, delta: float, num_steps: int, *,
                         mechanism: str = "tree", adjacency: str = "zero_out",
                         levels: str = "exact") -> float:
  """Smallest noise multiplier ``z`` (node std ``= z C/B``) whose single-epoch run is
  (epsilon, delta)-DP by the exact PLD conversion of ``GaussianDpEvent(1/mu)``."""
  check_epsilon(epsilon)
  check_delta(delta)
  relation = ADJACENCY_TO_RELATION[check_choice(adjacency, "adjacency",
                                                tuple(ADJACENCY_TO_RELATION))]
  check_choice(mechanism, "mechanism", MECHANISMS)
  lv = tree_levels(num_steps, levels) if mechanism == "tree" else 1
  # The run is one Gaussian mechanism of multiplier z/sqrt(levels) (on sensitivity-1 units):
  # calibrate that, then scale. Replace-one doubles the sensitivity, which for a Gaussian is
  # exactly the add/remove curve at half the multiplier (the ledger cross-checks it under its
  # replace_one relation). The analytic Gaussian (Balle-Wang) sigma seeds the search bracket:
  # PLD at tiny multipliers is very slow.
  factor = 2.0 if relation == "replace_one" else 1.0
  seed = gaussian_sigma_analytic(1.0, epsilon, delta)
  g = calibrate_noise_multiplier(lambda s: prefix_noise_event(s, 1, mechanism="independent"),
                                 epsilon=epsilon, delta=delta, relation="add_remove",
                                 accountant="pld", lower=0.8 * seed)
  return factor * g * math.sqrt(lv)


# ----------------------------------------------------------------------------- presets
@dataclasses.dataclass(frozen=True)
class SRGDParams:
  """Every number a run needs, and where it came from.

  ``noise_multiplier`` is ``z``: node (or per-step) std ``= z * clip_norm / batch_size``.
  ``paper`` holds the paper's own formulas (theory preset) for comparison.
  """
  num_steps: int
  batch_size: int
  beta: float
  clip_norm: float
  noise_multiplier: float
  preset: str
  variant: str | None = None
  paper: dict | None = None

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def interior_c_dp(n: int, delta: float) -> float:
  """``c_DP = 4 sqrt2 log2^{3/2}(n) sqrt(ln(2n/delta)) ln(2.5/delta)`` (Eq. 19; log2 for the
  paper's ``log``, ln where it writes ``ln``, AMBIG-6). Eq. (19) then sets
  ``T = c_DP n^{1/4}``, which exceeds n for every practical n (spec §2.3 table)."""
  n = check_int(n, "n", minimum=2)
  delta = check_delta(delta)
  return (4 * math.sqrt(2) * math.log2(n) ** 1.5 * math.sqrt(math.log(2 * n / delta))
          * math.log(2.5 / delta))


def theory_params(n: int, p: int, *, lipschitz: float, smoothness: float, radius: float,
                  epsilon: float, delta: float, variant: str = "constrained",
                  batch_size: int | None = None) -> SRGDParams:
  """The paper's parameters, exactly, with its preconditions checked.

  ``variant="interior"``: Eq. (19) / Cor. 5.7 / Thm 5.8 (needs x-dagger in C, delta <= 1/n,
  p <= eps^2 n^2), with ``c_DP = 4 sqrt2 log2^{3/2}(n) sqrt(ln(2n/delta)) ln(2.5/delta)``,
  ``T = ceil(c_DP n^{1/4})``, ``B = floor(n/T)``, ``beta = c_DP^2 L max(1, sqrt p/(eps sqrt n))/R``,
  clip ``c_DP L``, node std (Delta units) ``c_DP L sqrt(log2 T ln(2.5/delta))/(eps B)``.

  ``variant="constrained"``: Thm 5.12 / Cor. 5.10–5.11 with ``c_M = M R / L``: ``B <= sqrt n``
  (default ``floor(sqrt n)``), ``T = floor(n/B)``, ``beta = (16 c_M + 8) L n^{3/2}/(R B^2)``,
  clip ``(8 c_M + 4) L``, node std ``(16 sqrt2 c_M + 8 sqrt2) L sqrt(log2 T ln(2.5/delta))/(eps
  B)``, dimension condition ``p <= B^2 beta^2 eps^2/(32 M^2 log2^3 T ln(2T/delta) ln(2.5/
  delta))``.

  Raises:
    ValueError: naming the violated condition when the setting is vacuous or outside the
      theorem (the paper's constants make variant "interior" vacuous for every practical n).
  """
  n = check_int(n, "n", minimum=2)
  p = check_int(p, "p", minimum=1)
  L = check_positive(lipschitz, "lipschitz")
  M = check_positive(smoothness, "smoothness")
  R = check_positive(radius, "radius")
  eps = check_epsilon(epsilon)
  delta = check_delta(delta)
  check_choice(variant, "variant", VARIANTS)
  c_m = M * R / L
  ln25 = math.log(2.5 / delta)
  where = "theory preset, variant " + repr(variant)
  if variant == "interior":
    if batch_size is not None:
      raise ValueError(f"{where}: batch_size is fixed by Eq. (19) (B = n/T); leave it unset")
    if delta > 1.0 / n:
      raise ValueError(f"{where} (Thm 5.8): needs delta <= 1/n = {1 / n:.3g}, got "
                       f"delta={delta:g}")
    if p > eps ** 2 * n ** 2:
      raise ValueError(f"{where} (Thm 5.8): needs p <= eps^2 n^2 = {eps ** 2 * n ** 2:.3g}, "
                       f"got p={p}")
    c_dp = interior_c_dp(n, delta)
    T = math.ceil(c_dp * n ** 0.25)
    if T > n:
      raise ValueError(
          f"{where} (Eq. 19): T = c_DP n^(1/4) = {T:.3g} exceeds n = {n} (c_DP = {c_dp:.3g}), "
          f"so the batch size n/T < 1 and the single-epoch schedule does not exist — the "
          f"paper's constants are vacuous at this n (spec 003 §2.3); use preset='practical'")
    B = n // T
    beta = c_dp ** 2 * L * max(1.0, math.sqrt(p) / (eps * math.sqrt(n))) / R
    clip = c_dp * L
    node_std = c_dp * L * math.sqrt(max(math.log2(T), 1.0) * ln25) / (eps * B)
    paper = dict(c_DP=c_dp, c_M=c_m, sigma_b_units=node_std / beta,
                 b_max=c_dp ** 2 * L * math.sqrt(p) / (eps * B * beta),
                 mu_paper=eps / math.sqrt(2 * ln25), reference="Eq. (19), Cor. 5.7, Thm 5.8")
  else:
    B = math.isqrt(n) if batch_size is None else check_int(batch_size, "batch_size")
    if B > math.sqrt(n):
      raise ValueError(f"{where} (Thm 5.12): needs batch_size <= sqrt(n) = "
                       f"{math.sqrt(n):.4g}, got {B}")
    T = n // B
    if T < 2:
      raise ValueError(f"{where} (Lemma 5.6): needs T = n/B >= 2, got T={T}")
    beta = (16 * c_m + 8) * L * n ** 1.5 / (R * B ** 2)
    clip = (8 * c_m + 4) * L
    log_t = math.log2(T)
    node_std = (16 * math.sqrt(2) * c_m + 8 * math.sqrt(2)) * L * math.sqrt(
        log_t * ln25) / (eps * B)
    p_max = (B ** 2 * beta ** 2 * eps ** 2
             / (32 * M ** 2 * log_t ** 3 * math.log(2 * T / delta) * ln25))
    if p > p_max:
      raise ValueError(
          f"{where} (Cor. 5.10/5.11): needs p <= B^2 beta^2 eps^2/(32 M^2 log^3 T ln(2T/delta) "
          f"ln(2.5/delta)) = {p_max:.3g}, got p={p}; the guarantee is vacuous here")
    paper = dict(c_M=c_m, sigma_b_units=node_std / beta, p_max=p_max,
                 mu_paper=eps / math.sqrt(2 * ln25), reference="Thm 5.12, Cor. 5.10-5.11")
  z = node_std * B / clip
  paper.update(T=T, B=B, beta=beta, clip=clip, sigma_node=node_std, noise_multiplier=z)
  return SRGDParams(num_steps=T, batch_size=B, beta=beta, clip_norm=clip, noise_multiplier=z,
                    preset="theory", variant=variant, paper=paper)


def practical_params(n: int, *, smoothness: float, clip_norm: float,
                     epsilon: float | None, delta: float, batch_size: int | None = None,
                     num_steps: int | None = None, beta: float | None = None,
                     beta_scale: float = 1.0, mechanism: str = "tree",
                     adjacency: str = "zero_out", noise_multiplier: float | None = None
                     ) -> SRGDParams:
  """``B = floor(sqrt n)``, ``T = floor(n/B)``, ``beta = M max(1, beta_scale T)`` unless given
  (spec §7.4; Thm 5.1 needs ``beta >= M``), ``z`` calibrated to (epsilon, delta) unless
  ``noise_multiplier`` is given;
  ``epsilon=None`` is the non-private run (``z = 0``)."""
  n = check_int(n, "n", minimum=1)
  B = math.isqrt(n) if batch_size is None else check_int(batch_size, "batch_size")
  T = n // B if num_steps is None else check_int(num_steps, "num_steps")
  if T * B > n:
    raise ValueError(f"num_steps * batch_size = {T * B} exceeds n = {n}: a single epoch "
                     f"uses every example at most once")
  if T < 1:
    raise ValueError(f"batch_size={B} leaves no full batch of n={n} examples")
  if beta is None:
    # Thm 5.1 needs beta >= M whatever the scale: floor it there (matters for small T).
    M = check_positive(smoothness, "smoothness")
    beta = M * max(1.0, check_positive(beta_scale, "beta_scale") * T)
  beta = check_positive(beta, "beta")
  clip = check_positive(clip_norm, "clip_norm")
  if noise_multiplier is not None:
    z = check_nonnegative(noise_multiplier, "noise_multiplier")
  elif epsilon is None:
    z = 0.0
  else:
    z = calibrate_srgd_noise(epsilon, delta, T, mechanism=mechanism, adjacency=adjacency)
  return SRGDParams(num_steps=T, batch_size=B, beta=beta, clip_norm=clip, noise_multiplier=z,
                    preset="practical")


# ----------------------------------------------------------------------------- the chain
def srgd_privatizer(*, clip_norm: float, batch_size: int, noise_multiplier: float,
                    num_steps: int, key: jax.Array, srg: bool = True, noise: str = "tree"
                    ) -> optax.GradientTransformationExtraArgs:
  """The release half: per-example clip -> fixed-``B`` mean -> noise. With ``srg`` the noise
  stage emits noisy prefix sums (tree or independent); without, noisy increments (the core
  Gaussian stage: DP-SGD). Node/step std ``= z * C / B`` (zero-out sensitivity)."""
  check_choice(noise, "noise", MECHANISMS)
  std = check_nonnegative(noise_multiplier, "noise_multiplier") * aggregation_sensitivity(
      clip_norm, mode="mean", denominator=batch_size, relation="add_remove")
  stages = [clip_per_user(clip_norm), aggregate("mean", batch_size)]
  if srg:
    stages.append(prefix_sum_noise(std, num_steps, key, mechanism=noise))
  else:
    if noise != "independent":
      raise ValueError("srg=False feeds plain gradients, whose noise is independent per step "
                       "(DP-SGD / Thm 5.13); use noise='independent'")
    stages.append(add_gaussian_noise(std, key))
  return optax.chain(*stages)


def srgd_stepper(*, beta: float, radius: float | None, srg: bool = True,
                 accelerated: bool = True, z_scale: float = 1.0,
                 learning_rate: float | None = None, averaging: str = "none"
                 ) -> optax.GradientTransformationExtraArgs:
  """The post-processing half: ``/eta_t`` (with SRG) then the accelerated (y, z, x) step, or
  projected SGD with step ``learning_rate`` (default ``1/beta``)."""
  stages = [scale_by_srg_weight()] if srg else []
  if accelerated:
    stages.append(accelerated_projected_step(beta, radius=radius, z_scale=z_scale))
  else:
    lr = 1.0 / check_positive(beta, "beta") if learning_rate is None else learning_rate
    stages.append(projected_sgd(lr, radius=radius, averaging=averaging))
  return optax.chain(*stages)


def srgd_chain(*, clip_norm: float, batch_size: int, noise_multiplier: float, num_steps: int,
               key: jax.Array, beta: float, radius: float | None, srg: bool = True,
               noise: str = "tree", accelerated: bool = True, z_scale: float = 1.0,
               learning_rate: float | None = None, averaging: str = "none"
               ) -> optax.GradientTransformationExtraArgs:
  """The whole Algorithm 1 chain (spec §7.2) as one optax transformation. Input: stacked
  per-example ``delta_t(d)`` (:func:`~dpsco_jax.transforms.srg.srg_differences`) or plain
  per-example gradients (``srg=False``); ``update`` needs ``params = x_t``."""
  return optax.chain(
      srgd_privatizer(clip_norm=clip_norm, batch_size=batch_size,
                      noise_multiplier=noise_multiplier, num_steps=num_steps, key=key, srg=srg,
                      noise=noise),
      srgd_stepper(beta=beta, radius=radius, srg=srg, accelerated=accelerated,
                   z_scale=z_scale, learning_rate=learning_rate, averaging=averaging))


# ----------------------------------------------------------------------------- the driver
def single_epoch_batches(data: PyTree, num_steps: int, batch_size: int) -> PyTree:
  """``[n, ...] -> [T, B, ...]``: consecutive disjoint batches, remainder dropped, so every
  example is used at most once (the premise of the one-changed-increment accounting)."""
  def split(x):
    if x.shape[0] < num_steps * batch_size:
      raise ValueError(f"data has {x.shape[0]} examples < num_steps * batch_size = "
                       f"{num_steps * batch_size}")
    return x[:num_steps * batch_size].reshape((num_steps, batch_size) + x.shape[1:])
  return jax.tree.map(split, data)


_RUNNERS: dict = {}


def _make_runner(loss_fn: Callable, settings: tuple) -> Callable:
  cache_key = (loss_fn, settings)
  if cache_key in _RUNNERS:
    return _RUNNERS[cache_key]
  s = dict(settings)
  T, B = s["num_steps"], s["batch_size"]

  def run(data, params0, key):
    batches = single_epoch_batches(data, T, B)
    privatizer = srgd_privatizer(clip_norm=s["clip_norm"], batch_size=B,
                                 noise_multiplier=s["noise_multiplier"], num_steps=T, key=key,
                                 srg=s["srg"], noise=s["noise"])
    stepper = srgd_stepper(beta=s["beta"], radius=s["radius"], srg=s["srg"],
                           accelerated=s["accelerated"], z_scale=s["z_scale"],
                           learning_rate=s["learning_rate"], averaging=s["averaging"])
    state0 = (privatizer.init(params0), stepper.init(params0))

    def body(carry, xs):
      params, prev, (p_state, s_state) = carry
      batch, t = xs
      if s["srg"]:
        rows = srg_differences(loss_fn, params, prev, batch, t)
      else:
        rows = per_user_grads(loss_fn, params, batch)
      released, p_state = privatizer.update(rows, p_state, params)
      updates, s_state = stepper.update(released, s_state, params)
      diag = {}
      if s["debug"]:  # data-dependent: only ever returned under debug=True
        diag["max_row_norm"] = jnp.max(tree_global_norms(rows))
        diag["clipped_fraction"] = jnp.mean(tree_global_norms(rows) > s["clip_norm"])
        noise_state = p_state[-1]
        if isinstance(noise_state, TreePrefixNoiseState):
          diag["noise_norm"] = jnp.sqrt(sum(
              jnp.sum(jnp.square(a - b)) for a, b in zip(
                  jax.tree.leaves(released), jax.tree.leaves(noise_state.prefix))))
      new_params = optax.apply_updates(params, updates)
      return (new_params, params, (p_state, s_state)), diag

    (params, _, (p_state, s_state)), diags = jax.lax.scan(
        body, (params0, params0, state0), (batches, jnp.arange(T)))
    return released_params(s_state, params), params, diags

  runner = jax.jit(run)
  _RUNNERS[cache_key] = runner
  return runner


def run_srgd(loss_fn: Callable, data: PyTree, params0: PyTree, key: jax.Array, *,
             num_steps: int, batch_size: int, beta: float, clip_norm: float,
             noise_multiplier: float, radius: float | None, srg: bool = True,
             noise: str = "tree", accelerated: bool = True, z_scale: float = 1.0,
             learning_rate: float | None = None, averaging: str = "none",
             debug: bool = False) -> tuple[PyTree, PyTree, dict]:
  """Runs one single-epoch pass in one jitted ``lax.scan``.

  ``data`` leaves ``[n, m, ...]`` (users x items; ``m = 1`` item level). Returns
  ``(released, last_query_point, diagnostics)``; ``released`` is ``y_T`` (accelerated) or the
  projected-SGD output. ``diagnostics`` is empty unless ``debug``. Compiled runners are cached
  per (loss_fn, settings); ``key`` and the data are traced (vmap-able over keys).
  """
  check_int(num_steps, "num_steps")
  check_int(batch_size, "batch_size")
  check_z_scale(z_scale)
  check_choice(noise, "noise", MECHANISMS)
  settings = tuple(sorted(dict(
      num_steps=int(num_steps), batch_size=int(batch_size), beta=float(beta),
      clip_norm=float(clip_norm), noise_multiplier=float(noise_multiplier),
      radius=None if radius is None else float(radius), srg=bool(srg), noise=noise,
      accelerated=bool(accelerated), z_scale=float(z_scale),
      learning_rate=None if learning_rate is None else float(learning_rate),
      averaging=averaging, debug=bool(debug)).items()))
  released, last, diags = _make_runner(loss_fn, settings)(data, params0, key)
  return released, last, diags


# ----------------------------------------------------------------------------- ALGORITHMS
_DEFAULTS = {
    # name: (srg, noise, accelerated)
    "accelerated_dp_srgd": (True, "tree", True),
    "dp_srgd_unaccelerated": (True, "tree", False),
    "accelerated_dp_srgd_independent_noise": (True, "independent", True),
    "accelerated_dp_sgd": (False, "independent", True),
    "single_epoch_dp_sgd": (False, "independent", False),
}


def _problem_constants(problem) -> tuple[float, float, float]:
  return float(problem.lipschitz), float(problem.smoothness), float(problem.radius)


def _resolve_params(problem, cfg: dict, name: str) -> SRGDParams:
  srg, noise, accelerated = _DEFAULTS[name]
  noise = cfg.get("noise_mechanism", noise)
  preset = check_choice(cfg.get("preset", "practical"), "preset", PRESETS)
  L, M, R = _problem_constants(problem)
  n = int(problem.n_users)
  delta = check_delta(cfg.get("delta", 1.0 / n ** 2))
  epsilon = cfg.get("epsilon")
  if preset == "theory":
    if name != "accelerated_dp_srgd":
      raise ValueError(f"preset='theory' exists only for accelerated_dp_srgd (Algorithm 1); "
                       f"{name} has no theorem in the paper")
    if epsilon is None:
      raise ValueError("preset='theory' needs a finite epsilon")
    if noise != "tree":
      raise ValueError("preset='theory' uses the binary tree mechanism (Lemma 5.6); "
                       f"noise={noise!r} is outside the theorem")
    return theory_params(n, int(problem.d), lipschitz=L, smoothness=M, radius=R,
                         epsilon=epsilon, delta=delta,
                         variant=cfg.get("variant", "constrained"),
                         batch_size=cfg.get("batch_size"))
  clip = cfg.get("clip_norm")
  if clip is None:
    # Data-independent default: the Lipschitz constant. Lemma 5.9's worst case 2(2MR + L)
    # (beta >= 2MT, no noise) is ~10x the norms seen in practice (spec T12), and an inactive
    # clip only adds noise; tune clip_norm per problem (public data / a held-out seed).
    clip = L
  return practical_params(
      n, smoothness=M, clip_norm=clip, epsilon=epsilon, delta=delta,
      batch_size=cfg.get("batch_size"), num_steps=cfg.get("num_steps"),
      beta=cfg.get("beta"), beta_scale=cfg.get("beta_scale", 1.0), mechanism=noise,
      adjacency=cfg.get("adjacency", "zero_out"),
      noise_multiplier=cfg.get("noise_multiplier"))


def _run_named(name: str, problem, cfg: dict, key: jax.Array) -> Result:
  srg, noise, accelerated = _DEFAULTS[name]
  # validate everything cheap before calibrating or touching data
  noise = check_choice(cfg.get("noise_mechanism", noise), "noise_mechanism", MECHANISMS)
  n = int(problem.n_users)
  delta = check_delta(cfg.get("delta", 1.0 / n ** 2))
  adjacency = check_choice(cfg.get("adjacency", "zero_out"), "adjacency",
                           tuple(ADJACENCY_TO_RELATION))
  z_scale = check_z_scale(cfg.get("z_scale", 1.0))
  check_choice(cfg.get("preset", "practical"), "preset", PRESETS)
  if cfg.get("epsilon") is not None:
    check_epsilon(cfg["epsilon"])
  prm = _resolve_params(problem, cfg, name)
  relation = ADJACENCY_TO_RELATION[adjacency]
  z = prm.noise_multiplier
  debug = bool(cfg.get("debug", False))
  levels = tree_levels(prm.num_steps) if (srg and noise == "tree") else 1
  mechanism = "tree" if (srg and noise == "tree") else "independent"
  mech_label = (f"{'binary-tree' if mechanism == 'tree' else 'independent'} Gaussian "
                f"prefix noise, z={z:.4g}, T={prm.num_steps}, levels={levels}, "
                f"sensitivity C/B={prm.clip_norm / prm.batch_size:.4g}")

  private = z > 0
  if private:
    budget = cfg.get("epsilon")
    ledger = PrivacyLedger(delta=delta, epsilon_budget=budget, relation=relation,
                           accountant="pld")
    event = prefix_noise_event(z, prm.num_steps, mechanism=mechanism)
    ledger.spend(event, label=mech_label)  # raises before anything is computed or released
  lr = cfg.get("learning_rate")
  released, _, diags = run_srgd(
      problem.loss_fn, problem.data, problem.init_params(), key,
      num_steps=prm.num_steps, batch_size=prm.batch_size, beta=prm.beta,
      clip_norm=prm.clip_norm, noise_multiplier=z, radius=float(problem.radius), srg=srg,
      noise=noise, accelerated=accelerated, z_scale=z_scale, learning_rate=lr,
      averaging=cfg.get("averaging", "none"), debug=debug)
  notes = (f"{name}: single epoch, {prm.num_steps} batches of {prm.batch_size} "
           f"(adjacency {adjacency}); preset {prm.preset}")
  if private:
    mu = prefix_noise_mu(z, prm.num_steps, mechanism=mechanism)
    mu_eff = 2 * mu if relation == "replace_one" else mu
    report = ledger.report(provenance=Provenance.ACCOUNTANT,
                           level="user" if int(problem.m) > 1 else "item",
                           mechanisms=(mech_label,), paper_epsilon=paper_epsilon(mu_eff, delta),
                           notes=notes + f"; mu-GDP with mu={mu_eff:.4g} converted by PLD")
  else:
    report = PrivacyReport(epsilon=float("inf"), delta=0.0,
                           provenance=Provenance.NONE.value, level="none",
                           mechanisms=(), notes=notes + "; NOT private (noise_multiplier=0)")
  per_example = 2 if srg else 1
  record = dict(batch_gradient_steps=prm.num_steps, batch_size=prm.batch_size,
                examples_used=prm.num_steps * prm.batch_size, beta=prm.beta,
                clip_norm=prm.clip_norm, noise_multiplier=z, tree_levels=levels,
                srg=srg, noise=noise, accelerated=accelerated, z_scale=z_scale,
                preset=prm.preset, variant=prm.variant)
  if prm.paper is not None:
    record["paper_params"] = prm.paper
  debug_out = None
  if debug:
    debug_out = {k: np.asarray(v).tolist() for k, v in diags.items()}
  return Result(params=released, privacy=report,
                gradient_evaluations=per_example * prm.num_steps * prm.batch_size
                * int(problem.m),
                record=record, debug=debug_out)


def _algorithm(name: str) -> Callable:
  def fn(problem, cfg: dict, key: jax.Array) -> Result:
    return _run_named(name, problem, cfg, key)
  fn.__name__ = name
  fn.__doc__ = f"{name}: see dpsco_jax.algorithms.srgd ({_DEFAULTS[name]})."
  return fn


ALGORITHMS = {name: _algorithm(name) for name in _DEFAULTS}


# ----------------------------------------------------------------------------- PROBLEMS
def ill_conditioned_least_squares(cfg: dict, key: jax.Array):
  """Least squares whose feature covariance has spectrum ``logspace(-log10 cond, 0, d)``:
  the regime where acceleration pays (the core problem is isotropic, Hessian ``I/d``).

  ``x = r * sqrt(lambda)`` with Rademacher ``r`` (so ``E xx^T = diag(lambda)`` and
  ``||x||^2 = sum lambda`` exactly), ``y = <w*, x> + U[-s, s]``, ``||w*|| = R/2``. Population
  risk ``0.5 sum_i lambda_i (w - w*)_i^2 + s^2/6`` exactly; per-example smoothness
  ``M = sum lambda``; Lipschitz over the ball ``sqrt(M)(1.5 R sqrt(M) + s)``.
  Config keys: ``n_users, m (1), d (8), radius (2), noise (0.5), condition (1e3)``.
  """
  from dpsco_jax.problems import SCOProblem, least_squares_loss
  n = check_int(cfg["n_users"], "n_users")
  m = check_int(cfg.get("m", 1), "m")
  d = check_int(cfg.get("d", 8), "d")
  R = check_positive(cfg.get("radius", 2.0), "radius")
  s = check_nonnegative(cfg.get("noise", 0.5), "noise")
  cond = check_positive(cfg.get("condition", 1e3), "condition")
  lam = jnp.logspace(-math.log10(cond), 0.0, d)
  k_w, k_x, k_y = jax.random.split(key, 3)
  w_star = jax.random.normal(k_w, (d,))
  w_star = 0.5 * R * w_star / jnp.linalg.norm(w_star)
  x = jax.random.rademacher(k_x, (n, m, d), jnp.float32) * jnp.sqrt(lam)
  y = jnp.einsum("umd,d->um", x, w_star) + s * jax.random.uniform(k_y, (n, m), minval=-1.0,
                                                                   maxval=1.0)
  smooth = float(jnp.sum(lam))
  risk = jax.jit(lambda w: 0.5 * jnp.sum(lam * jnp.square(w - w_star)) + s * s / 6.0)
  return SCOProblem("ill_conditioned_least_squares", least_squares_loss, {"x": x, "y": y}, d,
                    n, m, R, math.sqrt(smooth) * (1.5 * R * math.sqrt(smooth) + s), smooth,
                    w_star, risk, float(risk(w_star)), meta={"spectrum": np.asarray(lam)})


PROBLEMS = {"ill_conditioned_least_squares": ill_conditioned_least_squares}
