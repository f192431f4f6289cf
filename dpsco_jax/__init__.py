"""dpsco_jax: differentially private stochastic convex optimization in JAX/Optax.

Layers, in the order data flows: ``data`` (your users: :class:`UserData`) and ``grads``
(per-user gradients) feed optax chains in ``transforms`` (clip -> filter/aggregate -> noise ->
step) whose state is the privacy state; ``privacy`` holds the mechanisms, the relations and
the one accountant ledger; ``algorithms`` registers the papers' drivers (000 FILTER, 001
output perturbation, 002 ReSQue, 003 SRGD, 004 bilevel, and the DP-SGD baselines);
:func:`plan` / :func:`run` / :func:`fit` run any of them on your loss, params and data;
``problems`` has synthetic problems with known optima; ``dpsco_jax.flax`` (imported on demand)
trains Flax nnx models.
"""

from dpsco_jax import algorithms, data, grads, privacy, problems, transforms
from dpsco_jax.api import (Plan, Progress, UndeclaredFact, algorithm_config, execute, fit,
                           plan, plan_problem, print_progress, run, run_grid, run_seeds)
from dpsco_jax.data import DataSpec, MissingConstant, ProblemConstants, UserData
from dpsco_jax.grads import (per_example_grads, per_user_grads, per_user_grads_two_points,
                             shard_users, user_mesh)
from dpsco_jax.privacy import (PrivacyBudgetExceeded, PrivacyLedger, PrivacyReport, Provenance,
                               PureDpEvent, above_threshold_init, above_threshold_step,
                               calibrate_noise_multiplier, epsilon_of, for_accountant,
                               laplace_test, pure_dp_event, tdlap_pmf, tdlap_sample)
from dpsco_jax.problems import SCOProblem, make_problem
from dpsco_jax.result import FallbackRelease, Result
from dpsco_jax.smoothing import sample_uniform_ball, smoothing_offsets
from dpsco_jax.transforms import (AcsaState, ClipState, GaussianNoiseState, ProjectedSGDState,
                                  accelerated_projected_step, acsa, add_gaussian_noise,
                                  add_prox_to_anchor, aggregate, aggregation_sensitivity,
                                  clip_and_aggregate, clip_per_user, filter_points,
                                  independent_prefix_sum_noise, outlier_filter,
                                  prefix_noise_event, prefix_noise_mu, prefix_sum_noise,
                                  project_l2_ball, projected_sgd, projection,
                                  released_params, reweight, sample_queries,
                                  scale_by_srg_weight, srg_differences, tree_gaussian_like,
                                  tree_global_norms, tree_prefix_sum_noise)
from dpsco_jax.transforms.resque import resque
from dpsco_jax.transforms.adaptive_clipping import AdaptiveClipState, adaptive_clip_and_noise
from dpsco_jax.tuning import private_select, private_select_cost

__version__ = "0.1.0"

__all__ = [
    # your model and data: plan -> run
    "UserData", "DataSpec", "ProblemConstants", "MissingConstant", "UndeclaredFact", "Plan",
    "plan", "run", "fit", "run_seeds", "run_grid",
    # private hyper-parameter selection over plans (training and selection in one guarantee)
    "private_select", "private_select_cost",
    # the built-in problems (the runner's path): plan_problem -> execute
    "plan_problem", "execute",
    "algorithm_config", "Result", "FallbackRelease", "Progress", "print_progress",
    # per-user gradients
    "per_user_grads", "per_example_grads", "per_user_grads_two_points", "shard_users",
    "user_mesh", "sample_uniform_ball", "smoothing_offsets",
    # transformations (each a GradientTransformation). Each noise stage comes with its
    # accounting: add_gaussian_noise(z * aggregation_sensitivity(...)) is a GaussianDpEvent(z)
    # per release; the prefix-sum (tree) stages' whole run is prefix_noise_event(z, T)
    "clip_per_user", "aggregate", "clip_and_aggregate", "aggregation_sensitivity",
    "tree_global_norms", "outlier_filter", "filter_points", "reweight", "add_gaussian_noise",
    "tree_gaussian_like", "prefix_sum_noise", "tree_prefix_sum_noise",
    "independent_prefix_sum_noise", "prefix_noise_event", "prefix_noise_mu", "srg_differences", "scale_by_srg_weight",
    "sample_queries", "resque", "projected_sgd", "project_l2_ball", "projection", "acsa",
    "accelerated_projected_step", "add_prox_to_anchor", "released_params",
    "ClipState", "GaussianNoiseState", "ProjectedSGDState", "AcsaState",
    "adaptive_clip_and_noise", "AdaptiveClipState",
    # privacy
    "PrivacyLedger", "PrivacyReport", "Provenance", "PrivacyBudgetExceeded", "PureDpEvent",
    "pure_dp_event", "for_accountant", "calibrate_noise_multiplier", "epsilon_of",
    "laplace_test", "above_threshold_init", "above_threshold_step", "tdlap_pmf",
    "tdlap_sample",
    # synthetic problems (known optimum)
    "SCOProblem", "make_problem",
    # subpackages
    "algorithms", "data", "grads", "privacy", "problems", "transforms",
]
