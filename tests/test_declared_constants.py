"""Issue 23.3: a declared constant of the loss is either enforced by the algorithm or the
guarantee says it is conditional on it.

* declared (provenance ``declared``, the constants named in the notes): ``naive_output_pert``
  (2G/(mu n) is the sensitivity of a mu-strongly convex minimizer), the App. C certificate of
  paper 001's DelOutputPert family (Lemma C.1 reads mu, the solver's tau reads beta and maybe
  L), ``resque_private_sco`` (Lemma 5's drift bound reads L and convexity). A ``heuristic``
  guarantee stays ``heuristic`` and gains the note. Each test uses a user loss whose gradients
  break the declared L.
* enforced (provenance unchanged, sensitivity checked with noise off on a neighbouring dataset
  whose replaced user breaks the declared L by ~100x): DelOutputPert's exact test (Thm 3.3
  holds for any f), ``dp_loc_gd`` (clipping), DP-SGD (clipping), SRGD (clipping), FILTER
  (bounded-diameter kept sets).
* synthetic problems hold their constants by construction and keep their provenance.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax import api
from dpsco_jax.data import DataSpec, UserData, UserDataProblem

L2 = 0.5
L_DECLARED = 0.05   # the true per-item gradient norm of LOSS on _users' data is ~0.3-0.5
CONSTANTS = {"lipschitz": L_DECLARED, "smoothness": 1.0, "radius": 2.0,
             "strong_convexity": L2}
PARAMS = {"w": jnp.zeros(4), "b": jnp.zeros(())}


def loss(p, ex):
  z = ex["x"] @ p["w"] + p["b"]
  return (jax.nn.softplus(z) - ex["y"] * z
          + 0.5 * L2 * (jnp.sum(p["w"] ** 2) + p["b"] ** 2))


def _users(n_users: int, m: int, seed: int = 0) -> UserData:
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n_users * m, 4)).astype(np.float32)
  x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
  y = (rng.random(n_users * m) < 0.5).astype(np.float32)
  return UserData.from_arrays({"x": x, "y": y}, np.repeat(np.arange(n_users), m),
                              max_items_per_user=m)


def _max_item_grad_norm(data: UserData, params=PARAMS) -> float:
  flat = data.items()
  g = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, flat)
  norms = jnp.sqrt(sum(jnp.sum(jnp.reshape(a, (a.shape[0], -1)) ** 2, axis=1)
                       for a in jax.tree.leaves(g)))
  return float(jnp.max(norms))


def _declared(report, *names):
  assert "DECLARED: conditional on" in report.notes, report.notes
  for name in names:
    assert name in report.notes, (name, report.notes)


def _plan(name, cfg, n, m, constants=CONSTANTS):
  return api.plan(name, cfg, DataSpec(n, m), num_params=5, constants=constants)


# ------------------------------------------------------------------------ declared: 001

def test_naive_output_pert_with_a_false_declared_L_reports_declared():
  data = _users(6, 3)
  assert _max_item_grad_norm(data) > 4 * L_DECLARED        # the declaration is false
  cfg = {"epsilon": 1.0, "delta": 1e-3}
  res = dpsco_jax.fit("naive_output_pert", cfg, loss, PARAMS, data, jax.random.key(0),
                      constants=CONSTANTS)                 # run == plan is checked by run()
  assert res.privacy.provenance == "declared"
  _declared(res.privacy, f"lipschitz={L_DECLARED:g}", "strong_convexity=0.5", "smoothness=1",
            "convex loss")
  assert res.privacy.epsilon == pytest.approx(1.0, rel=1e-6)  # the conditional claim itself


def test_naive_output_pert_on_a_synthetic_problem_keeps_accountant():
  from dpsco_jax.algorithms.output_perturbation import driver as op
  problem = op.l2_logistic({"n_users": 12, "m": 2, "d": 2, "l2": 0.5, "radius": 2.0,
                            "n_eval": 20}, jax.random.key(0))
  res = api.solve("naive_output_pert", {"epsilon": 1.0, "delta": 1e-5}, problem,
                  jax.random.key(1))
  assert res.privacy.provenance == "accountant"
  assert "DECLARED" not in res.privacy.notes


# certificate with the exact fallback: n > 4 kappa + 1 = 17 users and n <= max_exact_users
SC_CERT = {"epsilon": 16.0, "delta": 0.1, "max_exact_users": 22}


def test_sc_output_pert_certificate_on_a_user_loss_is_declared():
  p = _plan("sc_output_pert", SC_CERT, 20, 2)
  assert p.privacy.provenance == "declared"      # theorem on a synthetic problem
  _declared(p.privacy, "strong_convexity=0.5", "smoothness=1", "convex loss",
            "stability_test='exact'")
  # the solver's a-priori distance is min(2R, 2L/mu) = 2L/mu here: the certificate reads L
  _declared(p.privacy, f"lipschitz={L_DECLARED:g}")
  # with 2R < 2L/mu the distance is the projection's 2R: L is not part of the condition
  big_l = _plan("sc_output_pert", SC_CERT, 20, 2, constants={**CONSTANTS, "lipschitz": 10.0})
  assert big_l.privacy.provenance == "declared"
  assert "lipschitz" not in big_l.privacy.notes


EXACT = {"epsilon": 1.0, "delta": 1e-3, "stability_test": "exact", "Delta": 0.05,
         "max_exact_users": 4}


@pytest.mark.parametrize("name", ["sc_output_pert", "phased_erm_output_pert",
                                  "sc_erm_output_pert"])
def test_exact_stability_test_needs_no_constant_and_stays_theorem(name):
  p = _plan(name, EXACT, 4, 2)
  assert p.privacy.provenance == "theorem" and "DECLARED" not in p.privacy.notes


@pytest.mark.parametrize("name, n, m, cfg", [
    ("phased_sco_output_pert", 80, 4, {"epsilon": 8.0, "delta": 0.05}),
    ("sc_sco_output_pert", 80, 4, {"epsilon": 16.0, "delta": 0.1}),
    ("phased_erm_output_pert", 200, 1, {"epsilon": 16.0, "delta": 0.1}),
    ("sc_erm_output_pert", 200, 1, {"epsilon": 16.0, "delta": 0.1}),
])
def test_certificate_with_abort_stays_heuristic_and_names_the_constants(name, n, m, cfg):
  p = _plan(name, {**cfg, "on_certificate_failure": "raise"}, n, m)
  assert p.privacy.provenance == "heuristic"
  _declared(p.privacy, "smoothness=1", "convex loss")
  if name.startswith("sc_"):   # the declared mu0 (phased: no mu declared is needed)
    _declared(p.privacy, "strong_convexity=0.5")
    _declared(p.privacy, f"lipschitz={L_DECLARED:g}")   # re-planned after a ⊥ warm start


def test_exact_test_release_on_a_loss_breaking_every_declared_constant():
  """Thm 3.3 is DP for any deterministic f: a canary user whose gradients are ~100x the
  declared L (and whose curvature breaks beta) still gets the theorem, because the release is
  decided by the exact stability test on f's own values, never by the certificate."""
  from dpsco_jax.algorithms.output_perturbation import driver as op
  data = _users(4, 2)
  x = np.asarray(data.examples["x"]).copy()
  x[0] *= 100.0                                            # user 0: norm-100 features
  bad = UserData.from_arrays({"x": x.reshape(-1, 4),
                              "y": np.asarray(data.examples["y"]).reshape(-1)},
                             np.repeat(np.arange(4), 2), max_items_per_user=2)
  assert _max_item_grad_norm(bad) > 100 * L_DECLARED
  problem = UserDataProblem(loss, PARAMS, bad, constants=CONSTANTS)
  cfg = {**EXACT, "debug": True}
  res = api.solve("sc_output_pert", cfg, problem, jax.random.key(0))
  assert res.privacy.provenance == "theorem" and "DECLARED" not in res.privacy.notes
  assert res.debug["exact_path"] == [True] and res.debug["certified"] == [False]
  # the exact test looked at f: deleting the canary moves f far more than Delta, so f(x) is
  # not released as is (a stable S contains the canary, or the output is ⊥)
  assert res.record["is_bottom"] or res.debug["s_size"][0] >= 1


# ------------------------------------------------------------------------ declared: 002

# explicit constants, every Theorem 3 precondition of every planned call holds: theorem
RESQUE_THM = {"epsilon": 0.1, "delta": 1e-5, "constants": "explicit", "rho": 0.05,
              "rho_over_r": 1e9, "max_iter": 10, "max_bisection": 1, "phases": 1,
              "T_frac": 1 / 64}


def test_resque_theorem_on_a_user_loss_is_declared_and_synthetic_keeps_theorem():
  from dpsco_jax.algorithms.resque import plan as rq
  from dpsco_jax.audit.drivers import linear_problem
  p = _plan("resque_private_sco", RESQUE_THM, 512, 1)
  assert p.privacy.provenance == "declared"
  _declared(p.privacy, f"lipschitz={L_DECLARED:g}", "convex loss", "Lemma 5")
  synthetic = linear_problem(np.zeros((512, 1, 5), np.float32), radius=2.0)
  plan = rq.resque_private_plan(synthetic, RESQUE_THM)
  assert not plan.violations and plan.declared == ()
  rep = plan.charge()
  assert rep.provenance == "theorem" and "DECLARED" not in rep.notes


def test_resque_heuristic_on_a_user_loss_names_the_constants():
  cfg = {"epsilon": 2.0, "delta": 1e-5, "constants": "c_priv", "rho": 0.05,
         "rho_over_r": 2.0, "max_iter": 1, "max_bisection": 1, "phases": 1, "T_frac": 1 / 64}
  p = _plan("resque_private_sco", cfg, 128, 2)
  assert p.privacy.provenance == "heuristic"
  _declared(p.privacy, f"lipschitz={L_DECLARED:g}")


# ------------------------------------------------------------------------------ enforced

_BIG = 50.0   # the canary's gradient norm; the declared L is 1


def _linear(p, ex):
  return jnp.dot(ex["x"], p["w"], precision=jax.lax.Precision.HIGHEST)


def _linear_problem(n: int, m: int, dim: int, level: str, constants: dict):
  """Users whose linear-loss gradients (their data ``x``) have norm 0.5 <= L = 1, except the
  canary user 0 with norm ``_BIG``; returns the problem and its neighbour (canary ``-x``)."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(n * m, dim)).astype(np.float32)
  x *= 0.5 / np.linalg.norm(x, axis=1, keepdims=True)
  x[:m] *= 2 * _BIG
  ids = np.repeat(np.arange(n), m)
  data = UserData.from_arrays({"x": x}, ids, max_items_per_user=m)
  params = {"w": jnp.zeros(dim)}
  problem = UserDataProblem(_linear, params, data, level=level, constants=constants)
  other = copy.copy(problem)
  ex = problem.data["example"]
  other.data = {**problem.data, "example": {"x": ex["x"].at[0].multiply(-1.0)}}
  return problem, other


def test_dp_loc_gd_clipping_enforces_the_sensitivity_whatever_L_is():
  from dpsco_jax.algorithms.bilevel import localized_gd as lg
  from dpsco_jax.algorithms.bilevel.localized_gd_plan import loc_gd_plan_for_problem
  consts = {"lipschitz": 1.0, "radius": 2.0, "strong_convexity": 0.5}
  cfg = {"epsilon": 2.0, "delta": 1e-5, "num_steps": 6, "rounds": 2}
  problem, other = _linear_problem(10, 1, 3, "item", consts)
  p = _plan("dp_loc_gd", cfg, 10, 1, constants=consts)
  assert p.privacy.provenance == "accountant" and "DECLARED" not in p.privacy.notes
  lcfg = loc_gd_plan_for_problem(problem, cfg).config
  assert lcfg.clip_norm == 1.0                         # the declared L, as the clip
  quiet = dataclasses_replace(lcfg, noise_multiplier=0.0)
  y0, key = problem.init_params(), jax.random.key(0)
  flat = lambda prob: lg._item_level_data(prob)
  r0 = lg.dp_loc_gd_releases(problem.loss_fn, y0, flat(problem), key, quiet)
  r1 = lg.dp_loc_gd_releases(problem.loss_fn, y0, flat(other), key, quiet, forced=r0)
  diff = np.linalg.norm(np.asarray(r0 - r1).reshape(-1, 3), axis=1)
  bound = 2 * lcfg.clip_norm / 10                      # replace-one: 2C / n
  assert np.all(diff <= bound * (1 + 1e-5)), diff
  np.testing.assert_allclose(diff, bound, rtol=1e-4)  # attained: the canary is clipped


def dataclasses_replace(obj, **kw):
  import dataclasses
  return dataclasses.replace(obj, **kw)


def test_dp_sgd_clipping_enforces_the_sensitivity_whatever_L_is():
  from dpsco_jax.algorithms.dpsgd import driver as baselines
  consts = {"lipschitz": 1.0, "radius": 2.0}
  cfg = {"epsilon": 2.0, "delta": 1e-5, "sampling": "full", "relation": "zero_out",
         "num_steps": 3, "learning_rate": 0.1}
  problem, _ = _linear_problem(8, 2, 3, "user", consts)
  p = _plan("dp_sgd_user", cfg, 8, 2, constants=consts)
  assert p.privacy.provenance == "accountant" and "DECLARED" not in p.privacy.notes
  zeroed = {**problem.data, "example": {"x": problem.data["example"]["x"].at[0].set(0.0)}}
  key = jax.random.key(0)
  r0 = baselines.dp_sgd_releases(problem, cfg, key, data=problem.data, noise=False)
  r1 = baselines.dp_sgd_releases(problem, cfg, key, data=zeroed, noise=False)
  diff = np.linalg.norm(np.asarray(jax.tree.leaves(r0)[0] - jax.tree.leaves(r1)[0]), axis=-1)
  np.testing.assert_allclose(diff, 1.0 / 8, rtol=1e-4)  # C / n with C = the declared L


def test_srgd_clipping_enforces_the_sensitivity_whatever_L_is():
  from dpsco_jax.algorithms.srgd import driver as srgd
  from dpsco_jax.algorithms.srgd.plan import plan_for_problem
  consts = {"lipschitz": 1.0, "smoothness": 1.0}
  cfg = {"epsilon": 2.0, "delta": 1e-5}                 # zero_out, tree noise
  problem, _ = _linear_problem(16, 1, 3, "user", consts)
  p = _plan("accelerated_dp_srgd", cfg, 16, 1, constants=consts)
  assert p.privacy.provenance == "accountant" and "DECLARED" not in p.privacy.notes
  plan = plan_for_problem("accelerated_dp_srgd", problem, cfg)
  assert plan.params.clip_norm == 1.0
  x0, key = problem.init_params(), jax.random.key(0)
  ref = srgd.srgd_releases(plan, problem.loss_fn, problem.data, x0, key, add_noise=False)
  mask = jnp.ones(16, bool).at[0].set(False)           # zero-out the canary user
  nb = srgd.srgd_releases(plan, problem.loss_fn, problem.data, x0, key, user_mask=mask,
                          points=ref["query"], add_noise=False)
  diff = np.linalg.norm(np.asarray(ref["release"] - nb["release"]).reshape(
      ref["release"].shape[0], -1), axis=1)
  assert np.all(diff <= plan.sensitivity * (1 + 1e-4)), (diff, plan.sensitivity)
  assert diff[0] == pytest.approx(plan.sensitivity, rel=1e-3)   # the canary is clipped to C


def test_filter_enforces_the_sensitivity_whatever_L_is():
  """FILTER (paper 000, Alg. 1): a replaced user whose features are -100x (gradients far
  beyond the declared L) moves the noiseless release by at most the planned Delta."""
  from dpsco_jax.algorithms.user_level_filter import driver as ulf
  from dpsco_jax.algorithms.user_level_filter.plan import PublicSpec, plan_phased_sgd
  from dpsco_jax.problems import make
  n, m, d = 300, 4, 3
  syn = make("logistic", n_users=n, m=m, d=d, key=jax.random.key(0))
  consts = {"lipschitz": float(syn.lipschitz), "smoothness": float(syn.smoothness),
            "radius": float(syn.radius)}
  data = UserData.from_arrays(
      {k: np.asarray(v).reshape((n * m,) + v.shape[2:]) for k, v in syn.data.items()},
      np.repeat(np.arange(n), m), max_items_per_user=m)
  problem = UserDataProblem(lambda p, ex: syn.loss_fn(p["w"], ex), {"w": jnp.zeros(d)},
                            data, constants=consts)
  cfg = {"epsilon": 2.0, "delta": 1e-6, "num_phases": 1, "num_groups": 30,
         "learning_rate": 0.05, "sensitivity": "typical"}
  p = _plan("user_level_phased_sgd", cfg, n, m, constants=consts)
  assert p.privacy.provenance == "heuristic" and "DECLARED" not in p.privacy.notes  # typical
  key = jax.random.key(4)
  plan = plan_phased_sgd(PublicSpec.of(problem), cfg)
  u = int(ulf._phase_users(plan, jax.random.split(key)[0], n)[0][0])
  bad = copy.copy(problem)
  ex = problem.data["example"]
  bad.data = {**problem.data, "example": {**ex, "x": ex["x"].at[u].multiply(-100.0)}}
  r0 = ulf.user_level_phased_sgd_releases(problem, cfg, key, add_noise=False)
  r1 = ulf.user_level_phased_sgd_releases(bad, cfg, key, add_noise=False,
                                          anchors=[r["anchor"] for r in r0])
  shift = float(jnp.linalg.norm(r0[0]["release"] - r1[0]["release"]))
  assert shift <= plan.phases[0].sensitivity, (shift, plan.phases[0].sensitivity)
