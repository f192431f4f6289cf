"""Your data: user-partitioned arrays (:class:`UserData`), the public facts a plan reads
(:class:`DataSpec`, :class:`PublicFacts`) and the problem object built from your loss and
params (:class:`UserDataProblem`, with declared :class:`ProblemConstants`)."""

from dpsco_jax.data.problem import (MissingConstant, ProblemConstants, PublicFacts,
                                    UserDataProblem)
from dpsco_jax.data.user_data import DataSpec, UserData, weighted_loss

__all__ = ["DataSpec", "UserData", "weighted_loss", "MissingConstant", "ProblemConstants",
           "PublicFacts", "UserDataProblem"]
