"""Audit specs around the library's own stages, each with deliberately broken twins.

Each builder returns an :class:`~dpsco_jax.audit.harness.AuditSpec` of the real stages, the
neighbours of :mod:`dpsco_jax.audit.canary` and the library's own claim; ``broken=`` swaps in
one bug under the same claim: ``noise_halved`` (e.g. the wrong relation's sensitivity),
``no_clipping``, ``realized_count`` (sum over the realized count), ``independent_accounting``
(tree noise as one Gaussian), ``threshold_redrawn`` (AboveThreshold's threshold redrawn each
step), ``eps_not_split`` (TDLap at ``eps``, not ``eps/2``). Claims at ``delta = 1e-5``.
"""

from __future__ import annotations

import math
from typing import Callable

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax.audit.canary import (CANARY_NORM, CLIP, DELTA, HI, UserBatch, check_broken,
                                    check_relation, dirac_canary, neighbouring_pair)
from dpsco_jax.audit.harness import AUDITS, AuditSpec, build
from dpsco_jax.privacy.discrete_laplace import del_output_pert_params as _dop_params
from dpsco_jax.privacy.discrete_laplace import tdlap_sample_from_kappa
from dpsco_jax.privacy.ledger import epsilon_of
from dpsco_jax.privacy.mechanisms import gaussian_sigma_analytic
from dpsco_jax.privacy.sparse_vector import (above_threshold_epsilon, above_threshold_init,
                                             above_threshold_scales, above_threshold_step,
                                             laplace_test, laplace_test_epsilon)
from dpsco_jax.privacy.relations import gaussian_sensitivity_factor
from dpsco_jax.transforms.clipping import aggregate, aggregation_sensitivity, clip_and_aggregate
from dpsco_jax.transforms.filtering import filter_halted, filter_points, outlier_filter
from dpsco_jax.transforms.noise import add_gaussian_noise
from dpsco_jax.transforms.tree_noise import (prefix_nodes, prefix_noise_event,
                                             tree_prefix_sum_noise)

__all__ = ["MECHANISMS", "build", "gaussian_chain", "tree_noise", "laplace_test_audit",
           "above_threshold_audit", "output_perturbation", "tdlap_bottom", "gaussian_lr_weights",
           "check_broken", "tree_noise_covariance", "chain_releases", "canary_stream", "e0_sum"]

def chain_releases(tx, data: UserBatch, dim: int, steps: int | None = None) -> jax.Array:
  """``tx``'s outputs stacked over steps: one per leading row of ``data`` (per-step batches),
  or ``steps`` runs on the same batch."""
  params = jnp.zeros((dim,), jnp.float32)

  def body(state, batch):
    grads, mask = (data.grads, data.mask) if batch is None else batch
    out, state = tx.update(grads, state, params, user_mask=mask)
    return state, out
  xs = None if steps is not None else (data.grads, data.mask)
  return jax.lax.scan(body, tx.init(params), xs, length=steps)[1]


def e0_sum(releases) -> jax.Array:
  """The releases' ``e_0`` coordinate summed over steps (one array leaf)."""
  (leaf,) = jax.tree.leaves(releases)
  return jnp.sum(leaf[..., 0])


def gaussian_chain(relation: str = "add_remove", broken: str | None = None, *,
                   steps: int = 4, users: int = 8, dim: int = 2,
                   mu_target: float = 0.5) -> AuditSpec:
  """``clip_and_aggregate(C, "mean", D) -> add_gaussian_noise`` for ``steps`` steps, noise
  calibrated to ``mu_target``-GDP; claim ``epsilon_of(Gaussian)^steps`` (zero-out accounted
  as add/remove: same sensitivity ``C/D``). Background users push ``-10 C e_0``: the worst
  case for a realized-count denominator."""
  check_relation(relation)
  twins = ("noise_halved", "no_clipping") + (("realized_count",)
                                             if relation == "add_remove" else ())
  check_broken(broken, twins, f"gaussian_chain({relation})")
  denom = float(users + 1)  # declared (public) batch size
  acc_rel = "replace_one" if relation == "replace_one" else "add_remove"
  sens = aggregation_sensitivity(CLIP, mode="mean", denominator=denom, relation=acc_rel)
  z_eff = math.sqrt(steps) / mu_target
  sigma = z_eff * sens
  claim = epsilon_of(dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(sigma / (CLIP / denom)), steps), delta=DELTA,
      relation=acc_rel)
  background = -jnp.tile(dirac_canary(dim, CANARY_NORM)[None], (users, 1))
  d_in, d_out = neighbouring_pair(background, dirac_canary(dim, CANARY_NORM), relation)
  z_count = z_eff * gaussian_sensitivity_factor(relation)

  def release(key, data: UserBatch):
    std, scale = (sigma / 2.0 if broken == "noise_halved" else sigma), 1.0
    if broken == "no_clipping":
      agg = aggregate("mean", denom)
    elif broken == "realized_count":
      count = jnp.sum(data.mask).astype(jnp.float32)
      agg, scale, std = clip_and_aggregate(CLIP, "sum"), 1.0 / count, z_count * CLIP / count
    else:
      agg = clip_and_aggregate(CLIP, "mean", denom)
    tx = optax.chain(agg, optax.scale(scale), add_gaussian_noise(std, key))
    return chain_releases(tx, data, dim, steps)

  return AuditSpec(f"gaussian_chain[{broken or 'honest'}]", relation, release, d_in, d_out,
                   e0_sum, claim, DELTA,
                   f"epsilon_of(SelfComposed(Gaussian(z={sigma / (CLIP / denom):.3g}), "
                   f"{steps}), {acc_rel})")


def gaussian_lr_weights(cov: np.ndarray, shift: np.ndarray) -> np.ndarray:
  """``cov^{-1} shift``: the Neyman-Pearson linear score for a mean shift of correlated
  Gaussian noise (float64, host)."""
  return np.linalg.solve(np.asarray(cov, np.float64), np.asarray(shift, np.float64))


def tree_noise_covariance(steps: int) -> np.ndarray:
  """Covariance of the tree's prefix noises in node variances: the nodes two prefixes share."""
  nodes = [set(prefix_nodes(t + 1)) for t in range(steps)]
  return np.asarray([[len(a & b) for b in nodes] for a in nodes], np.float64)


def canary_stream(relation: str, steps: int, pattern: np.ndarray, users: int, dim: int
                  ) -> tuple[UserBatch, UserBatch]:
  """``(D, D')`` of ``[steps, users, dim]`` batches: the canary in slot 0 at the ``pattern``
  steps (masked out at the others), the background users pushing ``-10 C e_0``."""
  background = -jnp.tile(dirac_canary(dim, CANARY_NORM)[None], (users - 1, 1))
  b_in, b_out = neighbouring_pair(background, dirac_canary(dim, CANARY_NORM), relation)
  on = jnp.zeros((steps,), bool).at[jnp.asarray(pattern)].set(True)

  def stack(b: UserBatch) -> UserBatch:
    grads = jnp.tile(b.grads[None], (steps, 1, 1))
    mask = jnp.tile(b.mask[None], (steps, 1)).at[:, 0].set(b.mask[0] & on)
    return UserBatch(grads, mask)
  return stack(b_in), stack(b_out)


def tree_noise(relation: str = "add_remove", broken: str | None = None, *, steps: int = 8,
               users: int = 4, dim: int = 2, noise_multiplier: float = 2.0) -> AuditSpec:
  """``clip_and_aggregate -> tree_prefix_sum_noise`` over ``steps`` batches, the canary in
  batch 0 (so in every prefix); score: the tree covariance's likelihood-ratio weights. Claim:
  ``prefix_noise_event(z, T, "tree")`` (mu = sqrt(levels)/z); the twin claims
  ``"independent"`` (mu = 1/z)."""
  check_relation(relation, ("add_remove", "zero_out"),
                 "the tree audit uses add_remove or zero_out (spec 003)")
  check_broken(broken, ("independent_accounting",), "tree_noise")
  denom = float(users)
  std = noise_multiplier * CLIP / denom
  mech = "independent" if broken == "independent_accounting" else "tree"
  claim = epsilon_of(prefix_noise_event(noise_multiplier, steps, mechanism=mech),
                     delta=DELTA, relation="add_remove")
  d_in, d_out = canary_stream(relation, steps, np.zeros(1, int), users, dim)
  weights = jnp.asarray(gaussian_lr_weights(tree_noise_covariance(steps), np.ones(steps)),
                        jnp.float32)

  def release(key, data: UserBatch):
    return chain_releases(optax.chain(clip_and_aggregate(CLIP, "mean", denom),
                                      tree_prefix_sum_noise(std, steps, key)), data, dim)

  return AuditSpec(f"tree_noise[{broken or 'honest'}]", relation, release, d_in, d_out,
                   lambda r: jnp.dot(weights, r[:, 0], precision=HI), claim, DELTA,
                   f"epsilon_of(prefix_noise_event(z={noise_multiplier}, T={steps}, {mech}))")


def _cluster_pair(users: int, dim: int, radius: float) -> tuple[UserBatch, UserBatch]:
  """``D``: all users at the origin; ``D'``: the canary moved far (the score moves by ~2)."""
  background = jnp.zeros((users - 1, dim), jnp.float32)
  d_in, _ = neighbouring_pair(background, jnp.zeros((dim,), jnp.float32), "replace_one")
  far = dirac_canary(dim, 100.0 * radius)
  return d_in, UserBatch(d_in.grads.at[0].set(far), d_in.mask)


def _score(data: UserBatch, radius: float) -> jax.Array:
  return filter_points(data.grads, jax.random.key(0), score_radius=radius,
                       user_mask=data.mask).score


def laplace_test_audit(relation: str = "replace_one", broken: str | None = None, *,
                       users: int = 10, dim: int = 2, epsilon: float = 1.0,
                       radius: float = 1.0) -> AuditSpec:
  """Algorithm 1's test ``s + Lap(2/eps) >= threshold`` on the FILTER score, the threshold
  at the two scores' midpoint (the worst case); the twin calibrates for sensitivity 1."""
  check_relation(relation, ("replace_one",),
                 "the FILTER score is audited under replace_one (paper 000)")
  check_broken(broken, ("noise_halved",), "laplace_test")
  d_in, d_out = _cluster_pair(users, dim, radius)
  threshold = 0.5 * float(_score(d_in, radius) + _score(d_out, radius))
  scale = 2.0 / epsilon
  claim = laplace_test_epsilon(scale, 2.0)
  used = scale / 2.0 if broken == "noise_halved" else scale

  def release(key, data):
    return laplace_test(key, _score(data, radius), threshold, used).astype(jnp.float32)

  return AuditSpec(f"laplace_test[{broken or 'honest'}]", relation, release, d_in, d_out,
                   lambda r: r, claim, DELTA, f"laplace_test_epsilon(b={scale:g}, s=2)",
                   thresholds=(0.5,))


def above_threshold_audit(relation: str = "replace_one", broken: str | None = None, *,
                          users: int = 10, dim: int = 2, epsilon: float = 8.0,
                          steps: int = 30, radius: float = 1.0) -> AuditSpec:
  """``outlier_filter``'s halting flags over ``steps`` steps (score: steps survived), ``D'``'s
  score exactly at the threshold. Claim: the stage's AboveThreshold budget ``eps/2``; the
  twin redraws the noisy threshold every step (spec 000 §7 item 1)."""
  check_relation(relation, ("replace_one",),
                 "the FILTER stage is audited under replace_one (paper 000)")
  check_broken(broken, ("threshold_redrawn",), "above_threshold")
  d_in, d_out = _cluster_pair(users, dim, radius)
  frac = float(_score(d_out, radius)) / users
  b_thr, b_q = above_threshold_scales(0.5 * epsilon, sensitivity=2.0)
  claim = above_threshold_epsilon(b_thr, b_q, 2.0)

  def honest(key, data):
    tx = outlier_filter(users, radius, key=key, epsilon=epsilon, threshold_fraction=frac)
    params = jnp.zeros((dim,), jnp.float32)

    def body(state, _):
      _, state = tx.update(data.grads, state, params, user_mask=data.mask)
      return state, filter_halted(state)
    return jax.lax.scan(body, tx.init(params), None, length=steps)[1]

  def redrawn(key, data):
    def body(halted, t):
      k_thr, k_q = jax.random.split(jax.random.fold_in(key, t))
      thr = above_threshold_init(k_thr, frac * users, b_thr)
      halted = above_threshold_step(k_q, _score(data, radius), thr, b_q, halted)
      return halted, halted
    return jax.lax.scan(body, jnp.zeros((), bool), jnp.arange(steps))[1]

  release = redrawn if broken == "threshold_redrawn" else honest
  return AuditSpec(f"above_threshold[{broken or 'honest'}]", relation, release, d_in, d_out,
                   lambda h: jnp.sum(~h).astype(jnp.float32), claim, DELTA,
                   f"above_threshold_epsilon({b_thr:g}, {b_q:g}, s=2)",
                   thresholds=tuple(float(k) for k in range(1, steps + 1)))


def output_perturbation(relation: str = "replace_one", broken: str | None = None, *,
                        users: int = 8, dim: int = 2, epsilon: float = 2.0) -> AuditSpec:
  """Output perturbation of the minimizer ``mean_u clip_G(x_u)`` (replace-one sensitivity
  ``2G/n``) with ``gaussian_sigma_analytic``'s noise; the twin uses ``G/n`` (add/remove)."""
  check_relation(relation, ("replace_one",),
                 "output perturbation (paper 001) is audited under replace_one")
  check_broken(broken, ("noise_halved",), "output_perturbation")
  sens = 2.0 * CLIP / users
  sigma = gaussian_sigma_analytic(sens, epsilon, DELTA)
  claim = epsilon_of(dp_accounting.GaussianDpEvent(sigma / (sens / 2.0)), delta=DELTA,
                     relation="replace_one")
  used = sigma / 2.0 if broken == "noise_halved" else sigma
  background = jnp.tile(dirac_canary(dim, 0.5)[None], (users - 1, 1))
  d_in, d_out = neighbouring_pair(background, dirac_canary(dim, CANARY_NORM), relation)

  def release(key, data: UserBatch):
    agg = clip_and_aggregate(CLIP, "mean", float(users))
    theta, _ = agg.update(data.grads, agg.init(None), user_mask=data.mask)
    return theta + used * jax.random.normal(key, theta.shape, theta.dtype)

  return AuditSpec(f"output_perturbation[{broken or 'honest'}]", relation, release, d_in,
                   d_out, e0_sum, claim, DELTA,
                   f"epsilon_of(Gaussian(sigma/(G/n)), replace_one), sigma={sigma:.3g}")


def tdlap_bottom(relation: str = "replace_one", broken: str | None = None, *,
                 epsilon: float = 2.0) -> AuditSpec:
  """DelOutputPert's abstention bit ``s_min > R1``, ``R1 ~ TDLap(eps', delta')``, ``s_min``
  moved from ``kappa + 1`` to ``kappa`` (where the test is tight). Claim: ``eps'`` (property
  (P2) in Thm 3.3's proof); the twin draws ``R1`` at ``eps``."""
  check_relation(relation, ("replace_one",),
                 "DelOutputPert (paper 001) is audited under replace_one")
  check_broken(broken, ("eps_not_split",), "tdlap_bottom")
  p = _dop_params(epsilon, DELTA)
  used = epsilon if broken == "eps_not_split" else p.epsilon_prime

  def release(key, s_min):
    return (s_min > tdlap_sample_from_kappa(key, used, p.kappa)).astype(jnp.float32)

  return AuditSpec(f"tdlap_bottom[{broken or 'honest'}]", relation, release,
                   jnp.int32(p.kappa + 1), jnp.int32(p.kappa), lambda r: r,
                   float(p.epsilon_prime), DELTA,
                   f"eps' = eps/2 of del_output_pert_params({epsilon}, {DELTA})",
                   thresholds=(0.5,))


MECHANISMS: dict[str, tuple[Callable[..., AuditSpec], tuple[str, ...], tuple[str, ...]]] = {
    # name: (builder, relations, broken twins)
    "gaussian_chain": (gaussian_chain, ("add_remove", "replace_one", "zero_out"),
                       ("noise_halved", "no_clipping", "realized_count")),
    "tree_noise": (tree_noise, ("add_remove", "zero_out"), ("independent_accounting",)),
    "laplace_test": (laplace_test_audit, ("replace_one",), ("noise_halved",)),
    "above_threshold": (above_threshold_audit, ("replace_one",), ("threshold_redrawn",)),
    "output_perturbation": (output_perturbation, ("replace_one",), ("noise_halved",)),
    "tdlap_bottom": (tdlap_bottom, ("replace_one",), ("eps_not_split",)),
}
AUDITS.update(MECHANISMS)


# Gaussian (mu-GDP) claims: only there is the GDP-fit bound a test
GAUSSIAN = ("gaussian_chain", "tree_noise", "output_perturbation")
