"""The problems: synthetic SCO problems with a known optimum and the papers' own instances.

:func:`problems` is the one table of problem factories ``factory(cfg: dict, key) -> problem``;
a problem provides ``excess_risk(params)``, ``n_users``, ``m``, ``d``. Problems build data;
they release nothing.
"""

from __future__ import annotations

import functools
from typing import Callable

from dpsco_jax.problems.synthetic import (PROBLEM_KEYS, PROBLEM_NAMES, SCOProblem, absolute,
                                          absolute_loss, least_squares, least_squares_loss,
                                          logistic, logistic_loss, make, make_problem)

__all__ = ["SCOProblem", "make", "make_problem", "PROBLEM_NAMES", "PROBLEM_KEYS",
           "least_squares", "logistic", "absolute", "least_squares_loss", "logistic_loss",
           "absolute_loss", "problems"]


def _core(name: str, cfg: dict, key) -> SCOProblem:
  return make_problem({**cfg, "problem": name}, key)


def problems() -> dict[str, Callable]:
  """Every problem factory by name: ``factory(cfg, key) -> problem``."""
  from dpsco_jax.problems import ill_conditioned, output_perturbation, ridge_tuning, user_level
  out: dict[str, Callable] = {name: functools.partial(_core, name) for name in PROBLEM_NAMES}
  out.update({
      "logistic_corrupted": user_level.logistic_corrupted,
      "hinge": user_level.hinge,
      "l2_logistic": output_perturbation.l2_logistic,
      "ill_conditioned_least_squares": ill_conditioned.ill_conditioned_least_squares,
      "ridge_tuning": ridge_tuning.ridge_tuning,
  })
  return out
