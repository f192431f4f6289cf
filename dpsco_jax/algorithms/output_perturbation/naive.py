"""Paper 001's naive baseline and the crossover calculator (spec §5).

``naive_output_pert`` releases ``θ̃(x) + N(0, σ² I)`` under replace-one user adjacency (``n``
public): the minimizer of a ``μ``-strongly convex ERM over ``n`` users moves by at most
``Δ = 2G/(μ n)`` (+ ``2τ`` for the solver) when one user is replaced (Chaudhuri et al. 2011).
``z`` is calibrated by the one calibrator on ``C = Δ/2`` (the ledger doubles it under
replace-one), so ``σ = z Δ / 2``; :func:`naive_sigma` keeps the closed forms for the noise
ratio only.

**Declared, not enforced.** ``2G/(μn)`` needs G-bounded per-user gradients and a
``μ``-strongly convex loss, the ``2τ`` term the certified solver's accuracy (``β``-smoothness,
``μ``, ``D = min(2R, 2G/μ)``). Nothing cheap enforces them (a clipped gradient field has no
minimizer to speak of; strong convexity and smoothness are not checkable from samples); the
radius is enforced by projection. On a user's loss the provenance is ``declared``
(:mod:`dpsco_jax.algorithms.declared`); synthetic problems keep ``accountant``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from dpsco_jax.algorithms.output_perturbation.config import NaiveOutputPertConfig
from dpsco_jax.algorithms.registration import register
from dpsco_jax.algorithms.output_perturbation.base import (ReleaseHook, alg2_delta,
                                                           calibration, gamma_threshold)
from dpsco_jax.algorithms.output_perturbation.solver import solve_masked
from dpsco_jax.algorithms.output_perturbation.plan import naive_planner, naive_sigma
from dpsco_jax.privacy import discrete_laplace as tdl
from dpsco_jax.privacy.mechanisms import gaussian_sigma_analytic, gaussian_sigma_classic
from dpsco_jax.problems import SCOProblem
from dpsco_jax.result import Result
from dpsco_jax.transforms.noise import tree_gaussian_like
from dpsco_jax.transforms.steps import project_l2_ball

__all__ = ["naive_sigma", "naive_output_pert", "noise_ratio", "crossover_m"]


@register("naive_output_pert", config=NaiveOutputPertConfig, paper="001", planner=naive_planner,
          mesh=True)
def naive_output_pert(plan: Any, problem: SCOProblem, key: jax.Array, *,
                      _hook: ReleaseHook | None = None) -> Result:
  """Baseline: ``Π_K(θ̃(x) + N(0, σ²I))`` with replace-one sensitivity ``Δ = 2G/(μn) + 2τ``
  (``θ̃``: the certified solver, accuracy ``τ = tol · 2G/(μn)/4``); one Gaussian event,
  ``σ = z Δ/2``."""
  p = plan.detail
  n, sigma_ = problem.n_users, p.sigma
  anchor = jnp.zeros((problem.d,), jnp.float32)
  data, keep = problem.data, jnp.ones((n,), bool)
  mesh = getattr(problem, "mesh", None)
  if mesh is not None:   # users sharded over the mesh's users axis; the padding in no sum
    from dpsco_jax.algorithms.common import _on_mesh, real_rows_mask
    data, _ = _on_mesh(data, mesh, "users")
    keep = real_rows_mask(keep, n, jax.tree.leaves(data)[0].shape[0])
  u = solve_masked(data, keep, anchor, -anchor, loss_fn=problem.loss_fn,
                   lam=0.0, plan=p.solver, radius=float(problem.radius))
  noise_std = sigma_ if _hook is None or _hook.add_noise else 0.0
  released = anchor + u + tree_gaussian_like(key, u, noise_std)
  if _hook is not None:
    _hook.releases.append({"release": released, "sigma": sigma_,
                           "sensitivity": p.sensitivity})
  return Result(params=project_l2_ball(released, problem.radius), privacy=plan.privacy,
                gradient_evaluations=int(p.solver.iterations * n * problem.m),
                record={"sigma": sigma_, "sensitivity": p.sensitivity,
                        "noise_multiplier": p.noise_multiplier,
                        "solver_iterations": p.solver.iterations,
                        "preset": p.settings.preset})


def noise_ratio(*, n_users: int, m: int, epsilon: float, delta: float, beta: float = 1e-3,
                preset: str = "practical", lipschitz: float = 1.0, mu: float = 1.0,
                mode: str = "certificate") -> float:
  """``σ_paper / σ_naive`` for SCOutputPert vs the baseline (both ∝ 1/(μ n), so the ratio,
  ``≈ κ^{1.5..2} sqrt(log(n/β)) / √m``, does not depend on ``n``); < 1: the paper adds less."""
  p = tdl.del_output_pert_params(epsilon, delta)
  r = p.depth + 1
  gamma = gamma_threshold(lipschitz=lipschitz, n_users=n_users, m=m, beta=beta, preset=preset)
  if mode == "certificate":
    Delta = 2.0 * r * gamma / (mu * (n_users - r))
  else:
    Delta = alg2_delta(lipschitz=lipschitz, mu=mu, n_users=n_users, m=m, beta=beta,
                       kappa=p.kappa)
  s_paper = tdl.sigma(Delta, epsilon, delta, calibration(preset))
  sens = 2.0 * lipschitz / (mu * n_users)
  s_naive = (gaussian_sigma_classic if preset == "theory" else gaussian_sigma_analytic)(
      sens, epsilon, delta)
  return s_paper / s_naive


def crossover_m(*, n_users: int, epsilon: float, delta: float, beta: float = 1e-3,
                preset: str = "practical", mode: str = "certificate") -> float:
  """Smallest ``m`` (bisection over log m) where the paper's σ drops below the baseline's."""
  lo, hi = 0.0, 80.0  # log10 m
  f = lambda lm: noise_ratio(n_users=n_users, m=10 ** lm, epsilon=epsilon, delta=delta,
                             beta=beta, preset=preset, mode=mode) - 1.0
  if f(hi) > 0:
    return math.inf
  for _ in range(60):
    mid = 0.5 * (lo + hi)
    if f(mid) > 0:
      lo = mid
    else:
      hi = mid
  return 10 ** hi


