"""Optax ``GradientTransformation`` stages: clip -> filter/aggregate -> noise -> step."""

from dpsco_jax.transforms.clipping import (ClipState, aggregate, aggregation_sensitivity,
                                           clip_and_aggregate, clip_per_user, clip_rows,
                                           tree_global_norms)
from dpsco_jax.transforms.noise import (GaussianNoiseState, add_gaussian_noise,
                                        tree_gaussian_like)
from dpsco_jax.transforms.steps import (AcsaState, ProjectedSGDState, ProxToAnchorState, acsa,
                                        add_prox_to_anchor, project_l2_ball, projected_sgd,
                                        projection, released_params, tree_l2_norm)
from dpsco_jax.transforms.filtering import filter_points, outlier_filter
from dpsco_jax.transforms.post_processing import add_public_gradient, track_min_step
# ``resque`` (the transformation) is re-exported at the package root only: here the name is
# the submodule ``dpsco_jax.transforms.resque``.
from dpsco_jax.transforms.resque import reweight, sample_queries
from dpsco_jax.transforms.srg import (accelerated_projected_step, scale_by_srg_weight,
                                      srg_differences)
from dpsco_jax.transforms.tree_noise import (independent_prefix_sum_noise, prefix_noise_event,
                                             prefix_noise_mu, prefix_sum_noise,
                                             tree_prefix_sum_noise)
from dpsco_jax.transforms.matrix_factorization import banded_noise, blt_noise
from dpsco_jax.transforms.adaptive_clipping import AdaptiveClipState, adaptive_clip_and_noise
