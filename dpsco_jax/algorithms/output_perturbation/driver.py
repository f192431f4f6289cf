"""User-level output perturbation via local deletion sensitivity (paper 001).

Ghazi, Kamath, Kumar, Manurangsi, Meka, Zhang, "On User-Level Private Convex Optimization",
ICML 2023 (arXiv 2305.04912). Spec: ``shared/specs/001_ghazi_user_level.md`` (formula tags
[V]/[R]/[A] refer to it).

Algorithms (all user-level, replace-one neighbours):

* ``sc_output_pert`` — SCOutputPert (Alg. 2) = DelOutputPert (Alg. 1) around the minimizer of a
  mu-strongly convex ERM, with the App. C certificate as fast path and the exact stability test
  as fallback (:mod:`dpsco_jax.algorithms.output_perturbation.deletion_stability`). (eps, delta) by Thm 3.3.
* ``phased_erm_output_pert`` — Phased-ERM (Alg. 3), convex loss, ``T = ceil(log2(nm))`` calls of
  SCOutputPert at ``(eps/T, delta/T)`` on prox-regularised objectives, projected anchors.
* ``phased_sco_output_pert`` — Phased-SCO (Alg. 4), disjoint user blocks ``(n/2^i, n/2^{i-1}]``,
  each phase at the full (eps, delta) (parallel composition), lambda of spec §7 item 6.
* ``sc_erm_output_pert`` / ``sc_sco_output_pert`` — the strongly convex reductions (Algs 5–6):
  SCOutputPert at (eps/2, delta/2) for a warm start, then Phased-ERM / Phased-SCO at
  (eps/2, delta/2) with lambda from the localization radius R'.
* ``naive_output_pert`` — the baseline: ``θ*(x) + N(0, σ² I)`` with replace-one sensitivity
  ``2G/(μ n)`` (+ the solver's a-priori error), which does not improve with ``m``.

**Where the paper beats the baseline (spec §5).** Both noises scale like ``1/(μ n)``, so
their ratio does not depend on ``n``: ``σ_paper/σ_naive ≈ 8κ · Δ·μn/(2G) · c(ε', δ')/c(ε, δ)``
with ``Δ·μn/G ≈ 10 sqrt((4κ+1) ln n)/√m`` (Alg. 2) or ``≈ 2(4κ+1)γ/G`` (certificate,
``γ ∝ 1/√m``), i.e. ``≈ κ^{1.5..2} sqrt(log(n/β)) / √m``. The paper's mechanism wins only for
``m`` beyond :func:`crossover_m`: at ``ε = 1, δ = 1e-6, n = 10^4`` (theory preset) ``m ≈ 9·10^9``
with Alg. 2's Δ and ``≈ 8·10^12`` with the App. C certificate (the spec's §5 table, with
``G_eff = G``, gives 2·10^9 and 2·10^12); at ``ε = 4, δ = 1e-5`` (practical preset)
``m ≈ 2·10^8`` / ``6·10^9``. That regime is **not reachable** here (``n·m`` items must fit in
memory, and ``n >= 2(4κ+1)``); the experiment shows instead that the ratio falls like
``1/√m`` while the naive baseline is flat in ``m``.

**The solver** (f of Alg. 1) is an optax chain ``add_prox_to_anchor(λ) -> acsa(L, μ, ball K,
restarts)`` run for a data-independent number of iterations that certifies accuracy ``τ`` on
every sub-dataset (multi-stage AC-SA halves the gap per stage of ``N0 = ceil(sqrt(8L/μ))``
iterations: ``||x_k - x*|| <= D 2^{-k/2}``, EXT spec A.3(a)). It works in displacement
coordinates ``u = θ - anchor`` (the released value is ``anchor + u + noise``, post-processing),
so float32 resolves the tiny late-phase displacements of Phased-ERM. f starts from the public
anchor for every sub-dataset: Thm 3.3 needs f to be a function of the sub-dataset alone.

**Deviations** (each documented where it happens): kappa rounded up (Def. 3.4, §7.1); the
constants of Alg. 2 (line 2) and the certificate are the explicit ones of spec §2.3/§2.4 with
inexact-solver and constrained-K terms (§3.3(b), §3.4); ``T`` uses log2 with ceil/floor (§7.3);
anchors are projected onto K and each phase solves over K (its ball K_i is inactive, §2.5);
Phased-SCO/Alg. 6 use ``λ = (G/R) max{√d/(n√m), 1/√(nm)}`` (§7.6); outputs are projected onto
K (post-processing); ⊥ inside the phased algorithms keeps the previous anchor (§7.9); smooth
losses only (the certified solver needs a finite smoothness; the paper needs none).

**Presets.** ``theory``: paper formulas — Dwork–Roth Gaussian ``sqrt(2 ln(2/δ'))·8κΔ/ε'``,
γ from Lemma 3.8 (``10 G sqrt(ln(n/β)/m)``), and the paper's preconditions (``ε <= 1``,
``δ <= 1/2``, ``n >= 2(4κ+1)`` per call, ``β < 1/e``). ``practical``: analytic Gaussian
calibration (Balle–Wang; valid for every ε) and a Hoeffding-type
``γ = 2G(1 + sqrt(2 ln(n/β)))/√m``. The threshold γ never affects privacy (the test with any
data-independent Δ is DP, Thm 3.3); it trades certificate failures against noise.

**Provenance.** ``theorem`` whenever every DelOutputPert call can fall back to the exact test
(``n <= max_exact_users`` users per call): the released value is exactly Alg. 1's output.
With ``on_certificate_failure="raise"`` (needed beyond ~20 users) a failed certificate aborts
the run, a data-dependent event outside any proof: provenance ``heuristic``.

**Declared constants (issue 23.3).** Thm 3.3 makes DelOutputPert (eps, delta)-DP for *any*
deterministic f and any data-independent Delta: the exact stability test measures the local
deletion sensitivity of f itself, so with ``stability_test="exact"`` (or whenever a call has
``n <= 4 kappa + 1`` users, where no certificate is tried) the guarantee rests on no constant
of the loss: L, beta, R and mu only shape f, Delta and the solver's budget (utility).
The App. C certificate is different: it concludes ``Delta_{4 kappa} f(x) <= Delta_cert``
(Lemma C.1 with spec §3.3(b)/§3.4: ``||theta~ - theta*(x_{-S})|| <= e0 + s gamma/(mu (n - s))``,
plus ``2 tau`` for the solver on sub-datasets) from the *strong convexity* mu of every
sub-dataset objective (the declared mu0 plus the prox lambda, which needs a convex loss) and
the solver's a-priori accuracy tau (multi-stage AC-SA: beta-smoothness, mu, and the distance
``D = min(2R, 2G/(2 lambda + mu0))``, which reads L when the second term is the smaller).
If those are false the certificate can pass on an unstable dataset and the release is not
Alg. 1's output. They cannot be enforced cheaply (strong convexity and smoothness are not
checkable from samples; clipping would change f into a non-gradient field with no minimizer),
so on a user's loss (``constants_declared``) a run that may take the certificate path reports
provenance ``declared`` (``theorem`` otherwise), conditional on the constants named in its
notes; ``stability_test="exact"`` gives the unconditional ``theorem``. ``heuristic`` runs stay
``heuristic`` with the same note. The naive baseline: see
:mod:`dpsco_jax.algorithms.output_perturbation.naive`.

**Neighbouring relation and accounting.** Replace-one user (the paper's Def. 1.1), ``n`` and
``m`` public: every sensitivity divides by the public ``n`` and the stability test deletes
users from a dataset of known size, so ``relation`` other than ``replace_one`` is refused.
Each DelOutputPert call is an ``ApproxDpEvent(eps_i, delta_i)`` block on the one
:class:`~dpsco_jax.privacy.PrivacyLedger` (basic composition; disjoint blocks of Phased-SCO in
parallel with ``group=``), every block spent before the first release against the budget
``min(epsilon, epsilon_budget)``. The naive baseline is one Gaussian event calibrated by
:func:`~dpsco_jax.privacy.calibrate_noise_multiplier` (``sigma = z * Delta/2``: the ledger
doubles the add/remove-equivalent ``Delta/2`` under replace-one). Audit hook:
:func:`output_perturbation_releases` returns every privatized release of a driver.

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
# the shared pieces (re-exported: tests and the audits read them here)
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

# ------------------------------------------------------------------------------------------
# Runner entry points: each runs a plan (``plan.detail``: the :class:`OutputPertPlan` or
# ``NaivePlan`` its planner made; ``plan.privacy``: the guarantee charged when it was made).
# ``_hook``: the audit's release hook (:func:`output_perturbation_releases`).


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
  """Audit hook: every privatized release of a paper-001 driver, in order.

  One dict per DelOutputPert call (``{"release": anchor + f + N(0, σ²I)`` or the anchor when
  ⊥, ``"bottom"``, ``"anchor"``, ``"sigma"``, ``"Delta"}``), or for ``naive_output_pert`` the
  one noisy minimizer (``"sigma"``, ``"sensitivity"``). Releases are before the
  post-processing projection; planned by the registered planner and run by the registered
  runner, with the same keys (its output is unchanged). ``add_noise=False`` (tests) sets
  σ = 0 and keeps everything else."""
  runners = {fn.__name__: fn for fn in (
      sc_output_pert, phased_erm_output_pert, phased_sco_output_pert, sc_erm_output_pert,
      sc_sco_output_pert, naive_output_pert)}
  name = check_choice(algorithm, "algorithm", tuple(runners))
  hook = ReleaseHook([], check_bool(add_noise, "add_noise"))
  # the planner's Planned carries the plan's detail and privacy, all a runner reads
  runners[name](registered()[name].planner(problem, cfg), problem, key, _hook=hook)
  return hook.releases
