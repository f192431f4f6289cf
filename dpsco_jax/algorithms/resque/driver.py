"""ReSQue parallel and private SCO (paper 002: Carmon, Jambulapati, Jin, Lee, Liu, Sidford,
Tian, "ReSQueing Parallel and Private Stochastic Convex Optimization", 2023).

Importing this module registers ``resque_parallel_sco``, ``minibatch_sgd`` (:mod:`.parallel`,
Theorem 1, non-private) and ``resque_private_sco`` (:mod:`.private`, Theorems 3-4, item
level, replace-one; its plan in :mod:`.plan`), and re-exports the public names of
:mod:`.solvers` (Algs 3-7), :mod:`.accounting` (Lemma 7, Theorem 3) and the ball oracles."""

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
