"""ReSQue parallel and private SCO (paper 002: Carmon, Jambulapati, Jin, Lee, Liu, Sidford,
Tian, "ReSQueing Parallel and Private Stochastic Convex Optimization", 2023).

This module is the paper's entry point: importing it registers the drivers
(``resque_parallel_sco``, ``minibatch_sgd``, ``resque_private_sco``, each decorated where it is
defined) and it re-exports every public name of the modules that implement them:

  * :mod:`.parallel` — parallel SCO (Theorem 1, non-private): ``resque_parallel_sco``
    and the ``minibatch_sgd`` baseline (query depth = steps).
  * :mod:`.plan` — private SCO's data-free plan (Theorems 3-4, item level, replace-one):
    ``resque_private_plan`` (schedule, ``beta``, the approximate-RDP events), its ledger
    charge and report: what ``dpsco_jax.plan`` reads.
  * :mod:`.private` — private SCO's run: ``resque_private_sco`` (runs the plan),
    ``private_erm`` and the audit hook
    ``resque_private_releases`` (every Alg. 4 call's per-phase noisy releases; replay on a
    neighbouring dataset).
  * :mod:`.solvers` — the private solvers: Alg. 3/4 ``localized_resque_sgd`` (and its
    audit view ``alg4_phase_releases``), Alg. 5 ``strongly_convex_resque``, Alg. 6
    ``mlmc_prox_estimator``, Alg. 7 ``high_probability_solver``.
  * :mod:`.accounting` — Lemma 7's charge ``alg4_rdp``, ``approx_rdp_events``,
    Theorem 3's parameters and preconditions, ``PrivacyPreconditionError``.
  * :mod:`.ball_acceleration` / :mod:`.ball_oracles` — the outer loop and the ball oracles.
"""

from __future__ import annotations

from dpsco_jax.algorithms.resque.accounting import (  # noqa: F401
    ACCOUNTANT_DELTA_SHARE, DELTA_PRIME_FRAC, LEMMA5_DRIFT, RELATION, PrivacyPreconditionError,
    alg4_rdp, approx_rdp_events, check_theorem3_preconditions, theorem3_params)
from dpsco_jax.algorithms.resque.parallel import minibatch_sgd, resque_parallel_sco
from dpsco_jax.algorithms.resque.plan import (  # noqa: F401
    PhasePlan, ResquePrivatePlan, resque_private_plan)
from dpsco_jax.algorithms.resque.private import (  # noqa: F401
    Alg4Call, ResqueReleases, private_erm, resque_private_releases, resque_private_sco)
from dpsco_jax.algorithms.resque.solvers import (  # noqa: F401
    Alg4Plan, alg4_phase_releases, alg4_plan, alg5_schedule, draw_queries, flat_items,
    high_probability_solver, localized_resque_sgd, mlmc_prox_estimator, phase_average,
    problem_items, strongly_convex_resque)

__all__ = [
    "ACCOUNTANT_DELTA_SHARE", "DELTA_PRIME_FRAC", "LEMMA5_DRIFT", "RELATION",
    "Alg4Call", "Alg4Plan", "PhasePlan", "PrivacyPreconditionError", "ResquePrivatePlan",
    "ResqueReleases", "alg4_phase_releases", "alg4_plan", "alg4_rdp", "alg5_schedule",
    "approx_rdp_events", "check_theorem3_preconditions", "draw_queries", "flat_items",
    "high_probability_solver", "localized_resque_sgd", "minibatch_sgd", "mlmc_prox_estimator",
    "phase_average", "private_erm", "problem_items", "resque_parallel_sco",
    "resque_private_plan", "resque_private_releases", "resque_private_sco",
    "strongly_convex_resque", "theorem3_params",
]
