"""dpsco_jax: differentially private stochastic convex optimization in JAX/Optax.

Per-user gradients (``grads``) feed optax chains (``transforms``: clip -> filter/aggregate ->
noise -> step) whose state is the privacy state; drivers in ``algorithms`` implement the
papers' methods; ``privacy`` holds the mechanisms and the accountant ledger.
"""

from dpsco_jax import algorithms, grads, privacy, problems, transforms
from dpsco_jax.grads import (per_example_grads, per_user_grads, per_user_grads_two_points,
                             shard_users, user_mesh)
from dpsco_jax.privacy import (PrivacyBudgetExceeded, PrivacyLedger, PrivacyReport, Provenance,
                               calibrate_noise_multiplier, epsilon_of, pure_dp_event)
from dpsco_jax.problems import SCOProblem, make_problem
from dpsco_jax.result import Result
from dpsco_jax.transforms import (AcsaState, ClipState, GaussianNoiseState, ProjectedSGDState,
                                  acsa, add_gaussian_noise, add_prox_to_anchor, aggregate,
                                  aggregation_sensitivity, clip_and_aggregate, clip_per_user,
                                  project_l2_ball, projected_sgd, projection, released_params,
                                  tree_global_norms, tree_gaussian_like)

__version__ = "0.1.0"
