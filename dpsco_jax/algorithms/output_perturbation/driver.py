"""User-level output perturbation via local deletion sensitivity (paper 001).

Ghazi, Kamath, Kumar, Manurangsi, Meka, Zhang, "On User-Level Private Convex Optimization",
ICML 2023 (arXiv 2305.04912). Spec: ``shared/specs/001_ghazi_user_level.md`` (formula tags
[V]/[R]/[A] refer to it).

Algorithms (all user-level, replace-one neighbours):

* ``sc_output_pert``: SCOutputPert (Alg. 2) = DelOutputPert (Alg. 1) around the minimizer of a
  mu-strongly convex ERM; the App. C certificate as fast path, the exact stability test
  (:mod:`.deletion_stability`) as fallback. (eps, delta) by Thm 3.3.
* ``phased_erm_output_pert``: Phased-ERM (Alg. 3), ``T = ceil(log2(nm))`` calls at
  ``(eps/T, delta/T)`` on prox-regularised objectives, projected anchors.
* ``phased_sco_output_pert``: Phased-SCO (Alg. 4), disjoint user blocks
  ``(n/2^i, n/2^{i-1}]``, each at the full (eps, delta) (parallel composition).
* ``sc_erm_output_pert`` / ``sc_sco_output_pert``: Algs 5-6, SCOutputPert at (eps/2, delta/2)
  for a warm start, then Phased-ERM / Phased-SCO at (eps/2, delta/2) with lambda from the
  localization radius R'.
* ``naive_output_pert``: the baseline ``θ*(x) + N(0, σ² I)``, replace-one sensitivity
  ``2G/(μ n)`` (+ the solver's a-priori error), flat in ``m`` (:mod:`.naive`).

**The solver** (f of Alg. 1, :mod:`.solver`) runs a data-independent number of iterations that
certifies accuracy ``τ`` on every sub-dataset, in displacement coordinates ``u = θ - anchor``
from the public anchor: Thm 3.3 needs f to be a function of the sub-dataset alone.

**Deviations**: kappa rounded up (Def. 3.4, §7.1); the constants of Alg. 2 (line 2) and the
certificate are the explicit ones of spec §2.3/§2.4 with inexact-solver and constrained-K
terms (§3.3(b), §3.4); ``T`` uses log2 with ceil/floor (§7.3); anchors are projected onto K
and each phase solves over K (its ball K_i is inactive, §2.5); Phased-SCO/Alg. 6 use
``λ = (G/R) max{√d/(n√m), 1/√(nm)}`` (§7.6); outputs are projected onto K (post-processing);
⊥ inside the phased algorithms keeps the previous anchor (§7.9); smooth losses only (the
certified solver needs a finite smoothness; the paper needs none).

**Presets.** ``theory``: the paper's formulas (Dwork–Roth Gaussian ``sqrt(2 ln(2/δ'))·8κΔ/ε'``,
γ of Lemma 3.8) and preconditions (``ε <= 1``, ``δ <= 1/2``, ``n >= 2(4κ+1)`` per call,
``β < 1/e``). ``practical``: analytic Gaussian calibration (Balle–Wang, every ε) and a
Hoeffding-type ``γ = 2G(1 + sqrt(2 ln(n/β)))/√m``. γ never affects privacy (the test with any
data-independent Δ is DP, Thm 3.3).

**Provenance.** ``theorem`` when every call can fall back to the exact test (``n <=
max_exact_users`` users per call): the release is exactly Alg. 1's output. With
``on_certificate_failure="raise"`` a failed certificate aborts the run, a data-dependent event
outside any proof: ``heuristic``. The exact test rests on no constant of the loss; the App. C
certificate concludes ``Delta_{4 kappa} f(x) <= Delta_cert`` (Lemma C.1, spec §3.3(b)/§3.4)
from the strong convexity of every sub-dataset objective (mu0 plus the prox lambda, which needs
a convex loss) and the solver's a-priori accuracy (beta-smoothness, mu, and the distance ``D =
min(2R, 2G/(2 lambda + mu0))``, which may read L). Those cannot be enforced, so on a user's
loss a run that may take the certificate path reports ``declared``, conditional on the
constants named in its notes; ``stability_test="exact"`` gives the unconditional ``theorem``.

**Neighbouring relation and accounting.** Replace-one user (Def. 1.1), ``n`` and ``m``
public: the sensitivities divide by the public ``n`` and the test deletes users from a dataset
of known size, so other relations are refused. Each call is an ``ApproxDpEvent(eps_i,
delta_i)`` block (:meth:`.base.OutputPertPlan.charge`), all spent before the first release
against ``min(epsilon, epsilon_budget)``. Audit hook: :func:`output_perturbation_releases`.

**Privacy diagnostics.** R1, |S|, the certificate flag and norms live only in ``Result.debug``
(``cfg["debug"] = True``); ⊥ flags and σ, Δ, κ are part of the released output / public.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dpsco_jax.algorithms.output_perturbation.config import OutputPertConfig
from dpsco_jax._checks import check_bool, check_choice
from dpsco_jax.algorithms.registration import register, registered
# re-exported: tests and the audits read them here
from dpsco_jax.algorithms.output_perturbation.base import (  # noqa: F401
    ReleaseHook, plan_sc_output_pert, release_debug, sc_output_pert_release, settings_from_cfg)
from dpsco_jax.algorithms.output_perturbation.naive import (  # noqa: F401
    crossover_m, naive_output_pert, naive_sigma, noise_ratio)
from dpsco_jax.algorithms.output_perturbation.phased import (  # noqa: F401
    phased_erm_output_pert, phased_erm_schedule, phased_sco_output_pert, phased_sco_schedule,
    sc_erm_output_pert, sc_sco_output_pert)
from dpsco_jax.algorithms.output_perturbation.solver import solver_plan  # noqa: F401
from dpsco_jax.algorithms.output_perturbation.plan import planner_of, sc_output_pert_plan
from dpsco_jax.problems import SCOProblem
from dpsco_jax.problems.output_perturbation import l2_logistic  # noqa: F401
from dpsco_jax.result import Result
from dpsco_jax.transforms.steps import project_l2_ball


@register("sc_output_pert", config=OutputPertConfig, paper="001", mesh=True,
          planner=planner_of(sc_output_pert_plan))
def sc_output_pert(plan: Any, problem: SCOProblem, key: jax.Array, *,
                   _hook: ReleaseHook | None = None) -> Result:
  """SCOutputPert (Alg. 2, Thm 3.1) on a mu-strongly convex problem (``meta['strong_convexity']``
  or ``cfg['l2']`` via the ``l2_logistic`` problem). Config: ``epsilon, delta, beta (1e-3),
  preset, stability_test, on_certificate_failure, max_exact_users, solver_tol, debug``."""
  p = plan.detail
  settings, (info,) = p.settings, p.infos
  anchor = jnp.zeros((problem.d,), jnp.float32)
  theta, bottom, dbg, cert = sc_output_pert_release(
      problem.loss_fn, problem.data, key, info=info, lam=0.0, anchor=anchor,
      radius=problem.radius, center=None, settings=settings, hook=_hook,
      mesh=getattr(problem, "mesh", None))
  return Result(params=project_l2_ball(theta, problem.radius), privacy=plan.privacy,
                gradient_evaluations=info.gradient_evaluations,
                record={"is_bottom": bool(bottom), "sigma": info.sigma, "Delta": info.Delta,
                        "kappa": info.kappa, "gamma": info.gamma,
                        "solver_iterations": info.plan.iterations, "preset": settings.preset,
                        "sigma_naive": p.schedule["sigma_naive"]},
                debug=release_debug([dbg], [cert]) if settings.debug else None)


def output_perturbation_releases(algorithm: str, problem: SCOProblem, cfg: dict,
                                 key: jax.Array, *, add_noise: bool = True) -> list[dict]:
  """Audit hook: every privatized release of a paper-001 driver, in order, before the
  post-processing projection (the registered planner and runner, the same keys).

  One dict per DelOutputPert call (``{"release": anchor + f + N(0, σ²I)`` or the anchor when
  ⊥, ``"bottom"``, ``"anchor"``, ``"sigma"``, ``"Delta"}``), or for ``naive_output_pert`` the
  noisy minimizer (``"sigma"``, ``"sensitivity"``). ``add_noise=False`` (tests) sets σ = 0."""
  runners = {fn.__name__: fn for fn in (
      sc_output_pert, phased_erm_output_pert, phased_sco_output_pert, sc_erm_output_pert,
      sc_sco_output_pert, naive_output_pert)}
  name = check_choice(algorithm, "algorithm", tuple(runners))
  hook = ReleaseHook([], check_bool(add_noise, "add_noise"))
  runners[name](registered()[name].planner(problem, cfg), problem, key, _hook=hook)
  return hook.releases
