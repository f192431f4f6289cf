"""Your data: user-partitioned arrays (:class:`UserData`), the public facts a plan reads
(:class:`DataSpec`, :class:`PublicFacts`), the problem object built from your loss and
params (:class:`UserDataProblem`, with declared :class:`ProblemConstants`), and host-side
Poisson sampling of users for data kept off the device (:class:`PoissonSampler`,
:func:`gather_batch`, :func:`iter_batches`)."""

from dpsco_jax.data.problem import (MissingConstant, ProblemConstants, PublicFacts,
                                    UserDataProblem)
from dpsco_jax.data.sampling import PoissonSampler, gather_batch, iter_batches
from dpsco_jax.data.user_data import DataSpec, UserData, weighted_loss

__all__ = ["DataSpec", "UserData", "weighted_loss", "MissingConstant", "ProblemConstants",
           "PublicFacts", "UserDataProblem", "PoissonSampler", "gather_batch", "iter_batches"]
