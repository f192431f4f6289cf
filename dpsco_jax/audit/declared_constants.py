"""Canary audit of a declared constant the guarantee rests on: ``naive_output_pert``'s L.

Its noise is calibrated to ``2L/(mu n)`` (Chaudhuri et al.), true only when every gradient is
L-bounded; on a user's loss L is a declaration the library does not check, so the report says
``declared`` and names L. The audit runs ``dpsco_jax.fit``'s problem through
``output_perturbation_releases``: users of one item, loss ``mu/2 ||w||^2 - <x, w>``, declared
``L = 1``, every ``x = 0`` but the canary's. Honest: canary ``e_0`` replaced by ``-e_0``
(the minimizer moves by exactly ``2/(mu n)``); twin ``lipschitz_violated``: canary ``4 e_0``
under the same claim (:func:`run_report`). Score: the release's ``e_0`` coordinate.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax.audit.canary import DELTA, HI, check_broken
from dpsco_jax.audit.harness import AuditSpec

__all__ = ["TWINS", "TRIALS", "declared_lipschitz_driver", "run_report"]

TWINS = ("lipschitz_violated",)
TRIALS = 100_000
_DECLARED_L = 1.0
_BROKEN_NORM = 4.0   # the canary's true gradient norm in the twin (> the declared L)


def _loss(mu: float):
  def loss(p, ex):
    w = p["w"]
    return 0.5 * mu * jnp.dot(w, w, precision=HI) - jnp.dot(ex["x"], w, precision=HI)
  return loss


def _data(users: int, dim: int, canary: float):
  from dpsco_jax.data import UserData
  x = np.zeros((users, dim), np.float32)
  x[0, 0] = canary
  return UserData.from_arrays({"x": x}, np.arange(users), max_items_per_user=1)


def _setup(broken: str | None, users: int, dim: int, epsilon: float, mu: float):
  norm = _BROKEN_NORM if broken == "lipschitz_violated" else _DECLARED_L
  constants = {"lipschitz": _DECLARED_L, "smoothness": mu, "strong_convexity": mu,
               "radius": 1.0}
  cfg = {"epsilon": epsilon, "delta": DELTA}
  params = {"w": jnp.zeros((dim,), jnp.float32)}
  return (_loss(mu), params, _data(users, dim, norm), _data(users, dim, -norm), constants,
          cfg)


def run_report(broken: str | None = None, *, users: int = 8, dim: int = 2,
               epsilon: float = 2.5, mu: float = 1.0):
  """The :class:`~dpsco_jax.privacy.PrivacyReport` of ``dpsco_jax.fit("naive_output_pert",
  ...)`` on the audit's dataset with the canary: what the user is told."""
  import dpsco_jax
  loss, params, d_in, _, constants, cfg = _setup(broken, users, dim, epsilon, mu)
  return dpsco_jax.fit("naive_output_pert", cfg, loss, params, d_in, jax.random.key(0),
                       constants=constants).privacy


def declared_lipschitz_driver(relation: str = "replace_one", broken: str | None = None, *,
                              users: int = 8, dim: int = 2, epsilon: float = 2.5,
                              mu: float = 1.0) -> AuditSpec:
  """``naive_output_pert`` on a user's loss with a declared L, through
  ``output_perturbation_releases``; the twin's canary has 4x the declared L."""
  from dpsco_jax.algorithms.output_perturbation import driver as op
  from dpsco_jax.data import UserDataProblem
  if relation != "replace_one":
    raise ValueError("relation: naive output perturbation (paper 001) is replace_one")
  check_broken(broken, TWINS, "declared_lipschitz_driver")
  loss, params, d_in, d_out, constants, cfg = _setup(broken, users, dim, epsilon, mu)
  problem = UserDataProblem(loss, params, d_in, level="user", constants=constants)
  out = UserDataProblem(loss, params, d_out, level="user", constants=constants)
  report = run_report(broken, users=users, dim=dim, epsilon=epsilon, mu=mu)

  def release(key, data):
    prob = copy.copy(problem)   # the same plan and loss on the dataset under test
    prob.data = data
    return op.output_perturbation_releases("naive_output_pert", prob, cfg, key)[0]["release"]

  canary = _BROKEN_NORM if broken else _DECLARED_L
  return AuditSpec(f"naive_output_pert/declared_L[{broken or 'honest'}]", relation, release,
                   problem.data, out.data, lambda r: r[0], float(report.epsilon), DELTA,
                   f"dpsco_jax.fit('naive_output_pert', ...).privacy.epsilon (target "
                   f"{epsilon:g}; provenance {report.provenance}; declared L={_DECLARED_L:g}, "
                   f"canary gradient norm {canary:g})")
