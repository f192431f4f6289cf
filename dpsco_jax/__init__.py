"""dpsco_jax: differentially private stochastic convex optimization in JAX/Optax.

Per-user gradients (``grads``) feed optax chains (``transforms``: clip -> filter/aggregate ->
noise -> step) whose state is the privacy state; drivers in ``algorithms`` implement the
papers' methods (``algorithms.user_level_filter`` 000, ``output_perturbation`` 001,
``resque`` 002, ``srgd`` 003, ``bilevel`` 004, ``baselines``); ``privacy`` holds the
mechanisms and the accountant ledger; ``dpsco_jax.flax`` (imported on demand) trains Flax nnx
models with fast per-user clipping.
"""

from dpsco_jax import algorithms, grads, privacy, problems, transforms
from dpsco_jax.grads import (per_example_grads, per_user_grads, per_user_grads_two_points,
                             shard_users, user_mesh)
from dpsco_jax.privacy import (PrivacyBudgetExceeded, PrivacyLedger,
                               PrivacyReport, Provenance, PureDpEvent, above_threshold_init,
                               above_threshold_step, calibrate_noise_multiplier, epsilon_of,
                               for_accountant, laplace_test, pure_dp_event, tdlap_pmf,
                               tdlap_sample)
from dpsco_jax.problems import SCOProblem, make_problem
from dpsco_jax.result import Result
from dpsco_jax.smoothing import sample_uniform_ball, smoothing_offsets
from dpsco_jax.transforms.resque import resque
from dpsco_jax.transforms import (AcsaState, ClipState, GaussianNoiseState, ProjectedSGDState,
                                  acsa, add_gaussian_noise, add_prox_to_anchor, aggregate,
                                  aggregation_sensitivity, clip_and_aggregate, clip_per_user,
                                  project_l2_ball, projected_sgd, projection, released_params,
                                  tree_global_norms, tree_gaussian_like)
from dpsco_jax.transforms import (accelerated_projected_step, filter_points,
                                  independent_prefix_sum_noise, outlier_filter, prefix_sum_noise,
                                  reweight, sample_queries, scale_by_srg_weight,
                                  srg_differences, tree_prefix_sum_noise)

__version__ = "0.1.0"
