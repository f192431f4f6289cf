"""Accelerated DP-SRGD (paper 003): SRG, clip contract, acceleration, presets, accounting.

Spec 003 §7.5: T5 (clip / zero-out neighbour), T6 (accountant), T7 (SRG telescoping), T9
(deterministic acceleration), T10/T11 (single epoch, end to end), T12 (Lemma 5.9), T13 (JAX).
"""

import math

import chex
import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting.pld import pld_privacy_accountant
from scipy.stats import norm

from dpsco_jax import problems
from dpsco_jax.algorithms.srgd import driver as srgd
from dpsco_jax.api import solve
from dpsco_jax.privacy.ledger import PrivacyBudgetExceeded
from dpsco_jax.transforms import srg
from dpsco_jax.transforms.clipping import aggregate, clip_per_user
from dpsco_jax.transforms.steps import projected_sgd, released_params, tree_l2_norm


def _nonconvex_loss(w, ex):
  z = jnp.dot(ex["x"], w)
  return ex["keep"] * (jnp.sin(3.0 * z) * ex["y"] + 0.25 * z ** 4 - jnp.cos(w[0] * ex["y"]))


def _dataset(key, n, d, m=1):
  kx, ky = jax.random.split(key)
  return {"x": jax.random.normal(kx, (n, m, d)), "y": jax.random.normal(ky, (n, m)),
          "keep": jnp.ones((n, m))}


# ----------------------------------------------------------------------------- T7: SRG
def test_srg_telescopes_to_the_batch_gradient():
  """No clip, no noise, the same batch each step, arbitrary points: the SRG equals grad."""
  d, B, T = 3, 8, 6
  batch = _dataset(jax.random.key(0), B, d)
  points = jax.random.normal(jax.random.key(1), (T, d))
  privatizer = srgd.srgd_privatizer(clip_norm=1e9, batch_size=B, noise_multiplier=0.0,
                                    num_steps=T, key=jax.random.key(2))
  scale = srg.scale_by_srg_weight()
  p_state, s_state = privatizer.init(points[0]), scale.init(points[0])

  @jax.jit
  def step(x, x_prev, t, p_state, s_state):
    rows = srg.srg_differences(_nonconvex_loss, x, x_prev, batch, t)
    chex.assert_shape(rows, (B, d))
    g_hat, p_state = privatizer.update(rows, p_state, x)
    g_tilde, s_state = scale.update(g_hat, s_state, x)
    return g_tilde, p_state, s_state

  full_grad = jax.jit(lambda x: jax.grad(
      lambda w: jnp.mean(jax.vmap(_nonconvex_loss, in_axes=(None, 0))(w, jax.tree.map(
          lambda a: a[:, 0], batch))))(x))
  for t in range(T):
    g_tilde, p_state, s_state = step(points[t], points[max(t - 1, 0)], t, p_state, s_state)
    np.testing.assert_allclose(g_tilde, full_grad(points[t]), rtol=1e-4, atol=1e-5)
  assert int(p_state[-1].count) == int(s_state.count) == T  # stage counters in sync


# ----------------------------------------------------------------------------- T5: clip
_D, _B, _T, _C = 3, 4, 5, 0.7
_POINTS = 0.5 * jax.random.normal(jax.random.key(4), (_T, _D))   # fixed, non-adaptive stream


@jax.jit
def _increments_and_prefix(data):
  """Noiseless Delta_t (clip + fixed-B mean) and the privatizer's prefix sums (sigma = 0)."""
  batches = srgd.single_epoch_batches(data, _T, _B)
  clip_mean = optax.chain(clip_per_user(_C), aggregate("mean", _B))
  tx = srgd.srgd_privatizer(clip_norm=_C, batch_size=_B, noise_multiplier=0.0, num_steps=_T,
                            key=jax.random.key(0))
  def body(state, xs):
    batch, t = xs
    x, x_prev = _POINTS[t], _POINTS[jnp.maximum(t - 1, 0)]
    rows = srg.srg_differences(_nonconvex_loss, x, x_prev, batch, t)
    inc, _ = clip_mean.update(rows, clip_mean.init(x), x)
    out, state = tx.update(rows, state, x)
    return state, (inc, out)
  return jax.lax.scan(body, tx.init(_POINTS[0]), (batches, jnp.arange(_T)))[1]


@pytest.mark.parametrize("replacement", ["zero_out", "adversarial", "nan"])
def test_one_replaced_example_changes_one_increment_by_at_most_c_over_b(replacement):
  data = _dataset(jax.random.key(3), _B * _T, _D)
  victim = 2 * _B + 1                                           # lives in batch t = 2
  other = dict(data)
  if replacement == "zero_out":       # grad f(., d') = 0 everywhere
    other["keep"] = data["keep"].at[victim].set(0.0)
  elif replacement == "adversarial":  # a huge example of a non-convex loss
    other["x"] = data["x"].at[victim].set(1e3)
    other["y"] = data["y"].at[victim].set(-1e4)
  else:
    other["x"] = data["x"].at[victim].set(jnp.nan)
  (inc, prefix), (inc2, prefix2) = _increments_and_prefix(data), _increments_and_prefix(other)
  diff = np.linalg.norm(np.asarray(inc - inc2), axis=1)
  assert np.all(diff[np.arange(_T) != 2] == 0.0)              # exactly one increment moves
  bound = (2 if replacement == "adversarial" else 1) * _C / _B  # zero-out / NaN dropped: C/B
  assert 0 < diff[2] <= bound * (1 + 1e-5)
  pdiff = np.linalg.norm(np.asarray(prefix - prefix2), axis=1)  # so every released prefix
  assert np.all(pdiff[:2] == 0.0) and np.all(pdiff <= bound * (1 + 1e-4))


# ----------------------------------------------------------------------------- T9: acceleration
def _quadratic(key, d=20):
  q, _ = jnp.linalg.qr(jax.random.normal(key, (d, d)))
  spectrum = jnp.logspace(-4, 0, d)
  A = (q * spectrum) @ q.T
  x_dag = 0.5 * jax.random.normal(jax.random.fold_in(key, 1), (d,))
  x_dag = x_dag / jnp.linalg.norm(x_dag) * 0.8                # inside the unit ball
  F = lambda x: 0.5 * (x - x_dag) @ A @ (x - x_dag)
  return F, jax.grad(F)


def _optimize(tx, grad, T, d):
  def run(x0):
    def body(carry, _):
      x, s = carry
      u, s = tx.update(grad(x), s, x)
      x = optax.apply_updates(x, u)
      out = released_params(s, x)
      return (x, s), (out, tree_l2_norm(out))
    return jax.lax.scan(body, (x0, tx.init(x0)), None, length=T)[1]
  return jax.jit(run)(jnp.zeros(d))


@pytest.mark.parametrize("z_scale", [1.0, 0.5])
def test_noise_free_acceleration_has_rate_one_over_t_squared_and_beats_gd(z_scale):
  d, T, M, R = 20, 256, 1.0, 1.0
  F, grad = _quadratic(jax.random.key(5), d)
  f_star = 0.0
  ys, y_norms = _optimize(srg.accelerated_projected_step(M, radius=R, z_scale=z_scale),
                          grad, T, d)
  xs, _ = _optimize(projected_sgd(1.0 / M, radius=R), grad, T, d)
  gap_acc = np.asarray(jax.vmap(F)(ys)) - f_star
  gap_gd = np.asarray(jax.vmap(F)(xs)) - f_star
  assert np.all(np.asarray(y_norms) <= R * (1 + 1e-5))          # iterates stay in C
  ts = np.arange(1, T + 1)
  assert np.all(gap_acc[7:] <= 4 * M * R ** 2 / ts[7:] ** 2)     # O(beta R^2 / T^2)
  sl = np.polyfit(np.log(ts[7:63]), np.log(gap_acc[7:63]), 1)[0]
  assert sl <= -1.8, sl
  assert gap_acc[-1] < 0.1 * gap_gd[-1]                          # GD is O(1/T)


# ----------------------------------------------------------------------------- T10/T11: e2e
@pytest.mark.slow
def test_single_epoch_noise_free_converges_to_the_optimum_faster_than_unaccelerated():
  """Ill-conditioned least squares (feature spectrum 1e-3..1, exact labels, x* = w* inside
  the unit ball, F* = 0), one pass of 64 batches of 64, no clip, no noise."""
  d, n, T, B = 8, 4096, 64, 64
  lam = jnp.logspace(-3, 0, d)
  k1, k2 = jax.random.split(jax.random.key(0))
  w_star = jax.random.normal(k1, (d,))
  w_star = 0.8 * w_star / jnp.linalg.norm(w_star)
  x = jax.random.normal(k2, (n, 1, d)) * jnp.sqrt(lam)
  data = {"x": x, "y": jnp.einsum("nmd,d->nm", x, w_star)}
  F = lambda w: float(0.5 * jnp.sum(lam * (w - w_star) ** 2))
  run = lambda beta, accelerated: F(srgd.run_srgd(
      problems.least_squares_loss, data, jnp.zeros(d), jax.random.key(0), num_steps=T,
      batch_size=B, beta=beta, clip_norm=1e6, noise_multiplier=0.0, radius=1.0,
      accelerated=accelerated)[0])
  acc = run(1.0, True)
  assert acc < 1e-3 * F(jnp.zeros(d))                         # reaches the known optimum
  unacc = [run(beta, False) for beta in (0.7, 1.0, 3.0)]      # its best step on a grid
  assert acc < 0.2 * min(unacc), (acc, unacc)


def test_algorithms_release_records_and_privacy():
  prob = problems.make("least_squares", n_users=400, m=1, d=3, key=jax.random.key(7))
  for name in ("accelerated_dp_srgd", "single_epoch_dp_sgd"):
    res = solve(name, {"epsilon": 1.0, "delta": 1e-6}, prob, jax.random.key(1))
    assert res.record["num_steps"] == 20 and res.record["batch_size"] == 20
    assert res.gradient_evaluations == (2 if name == "accelerated_dp_srgd" else 1) * 400
    assert res.privacy.provenance == "accountant"
    assert res.privacy.epsilon == pytest.approx(1.0, rel=1e-2)
    assert res.privacy.paper_epsilon is not None and res.debug is None
    assert float(tree_l2_norm(res.params)) <= prob.radius * (1 + 1e-5)
  with pytest.raises(PrivacyBudgetExceeded):   # explicit too-small noise: refused up front
    solve("accelerated_dp_srgd", {"epsilon": 1.0, "delta": 1e-6, "noise_multiplier": 0.5},
          prob, jax.random.key(1))


def test_driver_is_vmappable_over_keys_and_noise_changes_with_the_key():
  prob = problems.make("least_squares", n_users=64, m=1, d=3, key=jax.random.key(8))
  kw = dict(num_steps=8, batch_size=8, beta=8.0, clip_norm=1.0, noise_multiplier=1.0,
            radius=prob.radius)
  run = lambda k: srgd.run_srgd(prob.loss_fn, prob.data, prob.init_params(), k, **kw)[0]
  keys = jax.random.split(jax.random.key(0), 3)
  batched = jax.vmap(run)(keys)
  chex.assert_shape(batched, (3, 3))
  np.testing.assert_allclose(batched[1], run(keys[1]), rtol=1e-5, atol=1e-6)
  assert not np.allclose(batched[0], batched[1])


def test_srgd_chain_is_one_jittable_optax_transformation_with_counters_in_sync():
  d, B, T = 2, 4, 3
  data = _dataset(jax.random.key(11), B * T, d)
  tx = srgd.srgd_chain(clip_norm=1.0, batch_size=B, noise_multiplier=1.0, num_steps=T,
                       key=jax.random.key(0), beta=4.0, radius=1.0, z_scale=0.5)

  @jax.jit
  def run(data):
    batches = srgd.single_epoch_batches(data, T, B)
    def body(carry, xs):
      x, x_prev, state = carry
      batch, t = xs
      rows = srg.srg_differences(_nonconvex_loss, x, x_prev, batch, t)
      u, state = tx.update(rows, state, x)
      return (optax.apply_updates(x, u), x, state), None
    x0 = jnp.zeros(d)
    return jax.lax.scan(body, (x0, x0, tx.init(x0)), (batches, jnp.arange(T)))[0]

  x, _, state = run(data)
  (_, _, noise_state), (scale_state, step_state) = state
  counts = [int(noise_state.count), int(scale_state.count), int(step_state.count)]
  assert counts == [T, T, T] and np.all(np.isfinite(np.asarray(x)))
  y = released_params(state, x)
  assert isinstance(state[1][-1], srg.AcceleratedStepState) and y is state[1][-1].released
  assert float(tree_l2_norm(y)) <= 1.0 + 1e-5


@pytest.mark.slow
def test_lemma_5_9_bound_on_srg_differences_holds_unclipped():
  """Variant-B step (beta >= 2MT), unclipped logistic loss, tree noise: every
  ||delta_t(d)|| <= 2(M b_max + 2MR + L) with b_max = max_t ||N_t|| / beta (spec T12)."""
  prob = problems.make("logistic", n_users=1024, m=1, d=4, key=jax.random.key(9))
  T = B = 32
  L, M, R = prob.lipschitz, prob.smoothness, prob.radius
  beta = 2 * M * T
  _, _, diag = srgd.run_srgd(prob.loss_fn, prob.data, prob.init_params(), jax.random.key(1),
                             num_steps=T, batch_size=B, beta=beta, clip_norm=1e6,
                             noise_multiplier=3.0, radius=R, debug=True)
  b_max = float(jnp.max(diag["noise_norm"])) / beta
  assert b_max > 0
  assert float(jnp.max(diag["max_row_norm"])) <= 2 * (M * b_max + 2 * M * R + L)
  assert float(jnp.max(diag["clipped_fraction"])) == 0.0


# ----------------------------------------------------------------------------- T6: accounting
def _gdp_delta(eps, mu):
  return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


@pytest.mark.parametrize("epsilon", [0.5, 4.0])
def test_calibrated_noise_gives_the_target_epsilon(epsilon):
  """The plan calibrates z through the one calibrator: mu = sqrt(levels)/z meets the target
  on the exact GDP curve; the paper's classical conversion is conservative for eps <= 1."""
  delta, T = 1e-6, 100
  plan = srgd.plan_srgd("accelerated_dp_srgd", {"epsilon": epsilon, "delta": delta,
                                                "num_steps": T, "batch_size": 10},
                        n=1000, p=2, lipschitz=1.0, smoothness=1.0, radius=1.0)
  z, levels = plan.params.noise_multiplier, T.bit_length()
  assert plan.levels == levels and isinstance(plan.event, dp_accounting.GaussianDpEvent)
  assert plan.event.noise_multiplier == pytest.approx(z / math.sqrt(levels), rel=1e-12)
  acc = pld_privacy_accountant.PLDAccountant()            # independent dp_accounting run
  acc.compose(dp_accounting.GaussianDpEvent(z / math.sqrt(levels)))
  assert acc.get_epsilon(delta) == pytest.approx(epsilon, rel=1e-2)
  mu = math.sqrt(levels) / z                              # exact GDP curve (Dong et al.)
  assert _gdp_delta(epsilon, mu) == pytest.approx(delta, rel=5e-2)
  assert _gdp_delta(epsilon, 1.1 * mu) > 1.5 * delta      # a wrong scale is rejected
  if epsilon <= 1.0:   # the paper's classical conversion is conservative in its range
    assert srgd.paper_epsilon(plan) >= epsilon


# ----------------------------------------------------------------------------- presets
def test_theory_interior_reproduces_eq19_and_refuses_vacuous_settings():
  assert srgd.interior_c_dp(10 ** 6, 1e-6) == pytest.approx(3.95e4, rel=1e-2)
  assert srgd.interior_c_dp(10 ** 8, 1e-8) == pytest.approx(9.18e4, rel=1e-2)
  for n in (10 ** 4, 10 ** 6):
    with pytest.raises(ValueError, match=r"T = c_DP n\^\(1/4\).*vacuous"):
      srgd.theory_params(n, 5, lipschitz=1.0, smoothness=1.0, radius=1.0, epsilon=1.0,
                         delta=1.0 / n ** 2, variant="interior")
  with pytest.raises(ValueError, match="delta <= 1/n"):
    srgd.theory_params(10 ** 4, 5, lipschitz=1.0, smoothness=1.0, radius=1.0, epsilon=1.0,
                       delta=1e-3, variant="interior")


def test_theory_constrained_reproduces_thm_5_12():
  prm = srgd.theory_params(10 ** 6, 10, lipschitz=1.0, smoothness=1.0, radius=1.0,
                           epsilon=1.0, delta=1e-12, batch_size=1000)
  assert (prm.num_steps, prm.batch_size) == (1000, 1000)
  assert prm.beta == pytest.approx(24000.0) and prm.clip_norm == pytest.approx(12.0)
  want = (16 * math.sqrt(2) + 8 * math.sqrt(2)) * math.sqrt(
      math.log2(1000) * math.log(2.5e12)) / 1000                # Thm 5.12 sigma * beta
  assert prm.paper["sigma_node"] == pytest.approx(want)
  assert prm.noise_multiplier == pytest.approx(want * 1000 / 12.0)
  with pytest.raises(ValueError, match="p <="):
    srgd.theory_params(100, 10 ** 6, lipschitz=1.0, smoothness=1.0, radius=1.0, epsilon=0.1,
                       delta=1e-6)
  with pytest.raises(ValueError, match="batch_size <= sqrt"):
    srgd.theory_params(100, 2, lipschitz=1.0, smoothness=1.0, radius=1.0, epsilon=1.0,
                       delta=1e-6, batch_size=20)


@pytest.mark.slow
def test_theory_preset_runs_with_accountant_epsilon_below_target():
  prob = problems.make("least_squares", n_users=2500, m=1, d=3, key=jax.random.key(10))
  res = solve("accelerated_dp_srgd",
              {"epsilon": 1.0, "delta": 1e-7, "preset": "theory", "variant": "constrained"},
              prob, jax.random.key(0))
  assert res.record["preset"] == "theory" and res.record["num_steps"] == 50
  assert res.privacy.provenance == "accountant" and res.privacy.epsilon < 1.0
  assert res.record["paper_params"]["reference"].startswith("Thm 5.12")
  with pytest.raises(ValueError, match="vacuous"):
    solve("accelerated_dp_srgd",
          {"epsilon": 1.0, "delta": 1e-7, "preset": "theory", "variant": "interior"}, prob,
          jax.random.key(0))


@pytest.mark.parametrize("cfg, name", [
    ({"z_scale": 2.0}, "z_scale"),
    ({"preset": "fast"}, "preset"),
    ({"batch_size": 30, "num_steps": 30}, "exceeds n"),
    ({"noise_mechanism": "laplace"}, "noise_mechanism"),
    ({"relation": "swap"}, "relation"),
    ({"clip_norm": -1.0}, "clip_norm"),
])
def test_bad_configuration_raises_naming_the_parameter(cfg, name):
  prob = problems.make("least_squares", n_users=100, m=1, d=2, key=jax.random.key(0))
  with pytest.raises(ValueError, match=name):
    solve("accelerated_dp_srgd", {"epsilon": 1.0, "delta": 1e-6, **cfg}, prob,
          jax.random.key(0))
  with pytest.raises(ValueError, match="noise='independent'"):
    srgd.srgd_privatizer(clip_norm=1.0, batch_size=2, noise_multiplier=1.0, num_steps=2,
                         key=jax.random.key(0), srg=False, noise="tree")
