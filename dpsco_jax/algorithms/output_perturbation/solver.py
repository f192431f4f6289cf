"""The certified solver of paper 001 (f of DelOutputPert): an optax chain in displacement
coordinates, with a data-independent iteration count that certifies accuracy ``tau`` on every
sub-dataset: one masked solve, the table of every deletion set's solve (the exact test) and
Lemma C.1's certificate. SCOutputPert's release (:mod:`.base`) and the naive baseline
(:mod:`.naive`) call them.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpsco_jax._checks import check_positive
from dpsco_jax.algorithms.output_perturbation import deletion_stability as ds
from dpsco_jax.grads import per_user_grads
from dpsco_jax.precision import at_guarantee_precision
from dpsco_jax.transforms.steps import acsa, add_prox_to_anchor, released_params

__all__ = ["SolverPlan", "solver_plan", "solve_masked", "solve_all_subsets",
           "certify_solution"]


class SolverPlan(NamedTuple):
  """Static solver schedule with its a-priori accuracy ``tau`` on every sub-dataset."""
  smoothness: float        # L_F
  strong_convexity: float  # mu_F
  stage_length: int        # N0 >= sqrt(8 L_F / mu_F)
  stages: int              # k: ||x - x*|| <= D 2^{-k/2}
  distance: float          # D >= ||u0 - u*(y)|| for every sub-dataset y
  tau: float               # D 2^{-stages/2}

  @property
  def iterations(self) -> int:
    return self.stage_length * self.stages


def solver_plan(*, smoothness: float, strong_convexity: float, distance: float,
                tau: float) -> SolverPlan:
  """Multi-stage AC-SA (EXT A.3(a), policy ``alpha_t = 2/(t+1)``, ``gamma_t = 4L/(t(t+1))``).

  One stage of ``N0`` iterations from ``x_s``: ``F - F* <= 2 L ||x_s - x*||²/(N0(N0+1))
  <= (4L/(μ N0²)) (F(x_s) - F*)``, a halving when ``N0(N0+1) >= 8 L/μ``; the first stage gives
  ``F - F* <= μ D²/4``, so after ``k`` stages ``||x - x*||² <= 2(F-F*)/μ <= D² 2^{-k}``.
  ``N0`` is rounded up to a power of two and ``k`` to a multiple of 4 (shared compilations).
  """
  L = check_positive(smoothness, "smoothness")
  mu = check_positive(strong_convexity, "strong_convexity")
  D = check_positive(distance, "distance")
  t = check_positive(tau, "tau")
  n0 = max(2, math.ceil(math.sqrt(8.0 * L / mu)))
  n0 = 1 << (n0 - 1).bit_length()
  k = max(1, math.ceil(2.0 * math.log2(D / t))) if D > t else 1
  k = 4 * math.ceil(k / 4)
  return SolverPlan(L, mu, n0, k, D, D * 2.0 ** (-k / 2.0))


def _user_grads(loss_fn, anchor, u, data, mask):
  """Per-user mean gradients at ``anchor + u``; NaN/Inf users contribute zero
  (non-negotiable 4)."""
  g = per_user_grads(lambda uu, ex: loss_fn(anchor + uu, ex), u, data, user_mask=mask)
  return jnp.where(jnp.all(jnp.isfinite(g), axis=-1, keepdims=True), g, 0.0)


@at_guarantee_precision
@functools.partial(jax.jit, static_argnames=("loss_fn", "lam", "plan", "radius"))
def solve_masked(data, mask, anchor, center_u, *, loss_fn, lam: float, plan: SolverPlan,
                 radius: float):
  """``u(y) = argmin_{anchor+u in K} L(anchor+u; y) + lam/2 ||u||²`` from ``u0 = 0``.

  Chain: ``add_prox_to_anchor(lam, 0) -> acsa(L_F, mu_F, ball(center_u, R), restarts)``; the
  masked mean divides by the number of kept users (``f`` of the sub-dataset ``y``)."""
  tx = optax.chain(add_prox_to_anchor(lam, jnp.zeros_like(anchor)),
                   acsa(plan.smoothness, strong_convexity=plan.strong_convexity,
                        radius=radius, center=center_u, stage_length=plan.stage_length))
  u0 = jnp.zeros_like(anchor)
  count = jnp.maximum(jnp.sum(mask), 1).astype(anchor.dtype)

  def body(carry, _):
    u, state = carry
    g = jnp.sum(_user_grads(loss_fn, anchor, u, data, mask), axis=0) / count
    upd, state = tx.update(g, state, u)
    return (optax.apply_updates(u, upd), state), None

  (u, state), _ = jax.lax.scan(body, (u0, tx.init(u0)), None, length=plan.iterations)
  return released_params(state, u)


@at_guarantee_precision
@functools.partial(jax.jit, static_argnames=("loss_fn", "lam", "plan", "radius", "n_users"))
def solve_all_subsets(data, anchor, center_u, *, loss_fn, lam, plan, radius, n_users):
  """``[2^n, d]`` table of ``f(x_{-S})`` for every deletion set (exact test), chunked. Rows
  of ``data`` past ``n_users`` (a mesh's padding) are in no subset."""
  masks = ds.subset_keep_masks(n_users)
  pad = jax.tree.leaves(data)[0].shape[0] - n_users
  if pad:
    masks = jnp.pad(masks, ((0, 0), (0, pad)))
  one = lambda mk: solve_masked(data, mk, anchor, center_u, loss_fn=loss_fn, lam=lam,
                                plan=plan, radius=radius)
  return jax.lax.map(one, masks, batch_size=min(1024, masks.shape[0]))


@at_guarantee_precision
@functools.partial(jax.jit, static_argnames=("loss_fn", "lam", "mu", "gamma", "e_max",
                                             "radius", "n_real"))
def certify_solution(data, u, anchor, center_u, *, loss_fn, lam, mu, gamma, e_max, radius,
                     n_real=None):
  """Lemma C.1's certificate at ``u`` over the real users: rows from ``n_real`` on (a mesh's
  padding) are dropped before its means and maxima."""
  n = jax.tree.leaves(data)[0].shape[0]
  g = _user_grads(loss_fn, anchor, u, data, jnp.ones((n,), bool))
  if n_real is not None:
    g = g[:n_real]
  return ds.lemma_c1_certificate(g, lam * u, u, mu=mu, gamma=gamma, e_max=e_max,
                                 radius=radius, center=center_u)


