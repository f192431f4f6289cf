"""ReSQue primitives (paper 002 §2, spec 002 §7.5 T1-T3, T15) and the private pieces (T7-T12).

Closed forms (spec 002 §7.5): abs ``grad f^_rho = erf(m/(sqrt2 s)) a``, hinge
``grad f^_rho = -y Phi(u/s) a``, norm loss ``E|grad~|^2 = L^2 exp(|v|^2/rho^2)`` exactly.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax.grads import per_example_grads
from dpsco_jax.transforms import resque as rq

D = 5
M_FUN = 20


def _functions(key):
  ka, kb = jax.random.split(key)
  a = jax.random.normal(ka, (M_FUN, D))
  a = a / jnp.linalg.norm(a, axis=1, keepdims=True)
  b = 0.3 * jax.random.normal(kb, (M_FUN,))
  return a, b


def _direction(key, norm):
  u = jax.random.normal(key, (D,))
  return norm * u / jnp.linalg.norm(u)


@jax.jit
def _abs_draws(key, x, anchor, a, b, rho):
  # g(anchor + xi) = mean_i sign(<a_i, anchor + xi> - b_i) a_i, reweighted to x.
  xis, pts = rq.sample_queries(key, anchor, rho, 100_000)
  g = jnp.sign(pts @ a.T - b) @ a / a.shape[0]
  naive = jnp.sign((x + xis) @ a.T - b) @ a / a.shape[0]
  return rq.reweight(x, anchor, xis, g, rho, reduce="none"), naive


@jax.jit
def _hinge_draws(key, x, anchor, a, y, rho):
  xis, pts = rq.sample_queries(key, anchor, rho, 100_000)
  active = (1.0 - y * (pts @ a.T) > 0).astype(jnp.float32)
  g = -(active * y) @ a / a.shape[0]
  return rq.reweight(x, anchor, xis, g, rho, reduce="none")


def _zscores(draws, target):
  draws = np.asarray(draws, np.float64)
  mean = draws.mean(0)
  se = draws.std(0) / math.sqrt(draws.shape[0])
  return (mean - np.asarray(target)) / se


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0, 2.0])
def test_unbiased_abs_against_closed_form(ratio):
  """T1: mean of ReSQue draws = grad f^_rho(x) (|z| < 5), for |x - xbar|/rho up to 2; the
  naive estimator E g(x + xi) agrees; the smoothing of a 1.5x larger rho is rejected."""
  rho = 0.3
  a, b = _functions(jax.random.key(0))
  anchor = jnp.full((D,), 0.05)
  x = anchor + _direction(jax.random.key(1), ratio * rho)
  draws, naive = _abs_draws(jax.random.key(2), x, anchor, a, b, rho)
  chex.assert_shape(draws, (100_000, D))
  target = jnp.mean(rq.smoothed_abs(x, a, b, rho)[1], axis=0)
  assert np.max(np.abs(_zscores(draws, target))) < 5.0
  assert np.max(np.abs(_zscores(naive, target))) < 5.0
  wrong = jnp.mean(rq.smoothed_abs(x, a, b, 1.5 * rho)[1], axis=0)
  if ratio <= 1.0:  # at 2 rho the variance is e^4 times larger; the power test is at <= rho
    assert np.max(np.abs(_zscores(draws, wrong))) > 5.0


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_unbiased_hinge_against_closed_form(ratio):
  rho = 0.4
  a, _ = _functions(jax.random.key(3))
  y = jnp.where(jnp.arange(M_FUN) % 2 == 0, 1.0, -1.0)
  anchor = 0.5 * a[0]
  x = anchor + _direction(jax.random.key(4), ratio * rho)
  draws = _hinge_draws(jax.random.key(5), x, anchor, a, y, rho)
  target = jnp.mean(rq.smoothed_hinge(x, a, y, rho)[1], axis=0)
  assert np.max(np.abs(_zscores(draws, target))) < 5.0
  wrong = jnp.mean(rq.smoothed_hinge(x, a, y, 1.5 * rho)[1], axis=0)
  assert np.max(np.abs(_zscores(draws, wrong))) > 5.0


@jax.jit
def _weights(key, v, rho):
  xis, _ = rq.sample_queries(key, jnp.zeros(D), rho, 400_000)
  return jnp.exp(rq.log_weights(v, jnp.zeros(D), xis, rho))


@pytest.mark.parametrize("ratio,p", [(0.0, 1), (0.5, 1), (1.0, 1), (0.5, 2), (1.0, 2),
                                     (0.5, 3), (0.4, 4)])
def test_weight_moments(ratio, p):
  """T2: E w^p = exp(p(p-1)|v|^2/(2 rho^2)) (proof of Lemma 2): E w = 1, E w^2 = e^{|v|^2/rho^2}
  (so the paper's eq. (7) exponent 2|v|^2/rho^2 is rejected at |v| = rho)."""
  rho = 0.7
  v = _direction(jax.random.key(6), ratio * rho)
  w = np.asarray(_weights(jax.random.key(7), v, rho), np.float64) ** p
  exact = math.exp(p * (p - 1) * ratio ** 2 / 2.0)
  se = w.std() / math.sqrt(w.size) + 1e-12
  assert abs(w.mean() - exact) < 4 * se + 1e-9
  if p == 2 and ratio == 1.0:
    printed = math.exp(2.0)  # eq. (7) as printed
    assert abs(w.mean() - printed) > 10 * se
    assert w.mean() < 3.0  # Lemma 1.2's constant still holds


def test_lemma2_local_moment_bound():
  """Lemma 2: E w^p <= 2 for |v| <= rho/p, and E|w(x) - w(x')|^p <= (24 p |x-x'|/rho)^p."""
  rho = 1.0
  key = jax.random.key(8)
  xis, _ = rq.sample_queries(key, jnp.zeros(D), rho, 200_000)
  for p in (2, 3, 4):
    x = _direction(jax.random.key(10 + p), rho / p)
    x2 = _direction(jax.random.key(20 + p), rho / p)
    w = jnp.exp(rq.log_weights(x, jnp.zeros(D), xis, rho))
    w2 = jnp.exp(rq.log_weights(x2, jnp.zeros(D), xis, rho))
    assert float(jnp.mean(w ** p)) <= 2.0
    bound = (24 * p * float(jnp.linalg.norm(x - x2)) / rho) ** p
    assert float(jnp.mean(jnp.abs(w - w2) ** p)) <= bound


@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_norm_loss_exact_second_moment(ratio):
  """T2: f = L|x - c| has |g| = L a.e., so E|grad~|^2 = L^2 exp(|v|^2/rho^2) exactly; a 1.5x
  wrong variance is rejected. Gradients come from the core engine with offsets=xis."""
  lip, rho = 2.0, 0.5
  c = jnp.array([1.0, -2.0, 0.5, 0.0, 3.0])
  anchor = jnp.zeros(D)
  x = _direction(jax.random.key(30), ratio * rho)
  loss = lambda p, ex: lip * jnp.linalg.norm(p - ex)
  n = 200_000
  xis, _ = rq.sample_queries(jax.random.key(31), anchor, rho, n)
  grads = per_example_grads(loss, anchor, jnp.broadcast_to(c, (n, D)), offsets=xis)
  est = rq.reweight(x, anchor, xis, grads, rho, reduce="none")
  sq = np.asarray(jnp.sum(est ** 2, axis=1), np.float64)
  exact = lip ** 2 * math.exp(ratio ** 2)
  se = sq.std() / math.sqrt(n)
  assert abs(sq.mean() - exact) < 4 * se
  assert abs(sq.mean() - 1.5 * exact) > 10 * se
  assert sq.mean() <= 3 * lip ** 2  # Lemma 1.2


def test_smoothing_facts():
  """T3: |f^_rho - f| <= L rho sqrt(d) (and in fact <= L rho sqrt(2/pi) |a| for abs);
  |grad f^_rho| <= L; closed-form value matches a Monte Carlo of E f(x + xi)."""
  rho = 0.2
  a, b = _functions(jax.random.key(40))
  xs = jax.random.normal(jax.random.key(41), (50, D))
  val, grad = jax.vmap(lambda x: rq.smoothed_abs(x, a, b, rho))(xs)
  f = jnp.abs(jnp.einsum("nd,md->nm", xs, a) - b)
  assert float(jnp.max(jnp.abs(val - f))) <= rho * math.sqrt(D)
  assert float(jnp.max(jnp.linalg.norm(grad, axis=-1))) <= 1.0 + 1e-6
  xis, _ = rq.sample_queries(jax.random.key(42), xs[0], rho, 200_000)
  mc = jnp.mean(jnp.abs((xs[0] + xis) @ a[0] - b[0]))
  assert abs(float(mc) - float(val[0, 0])) < 5e-3


def test_transformation_pytree_and_jit():
  """T15: the ``resque`` transformation on a pytree ({'w','b'}) equals the flat computation,
  works under jit, is deterministic under a fixed key, and has no NaN at |v| = 3 rho."""
  rho = 0.3
  anchor = {"w": jnp.arange(4.0) / 10, "b": jnp.array(0.2)}
  flat_anchor = jnp.concatenate([anchor["w"], anchor["b"][None]])
  loss = lambda p, ex: jnp.abs(jnp.dot(p["w"], ex["x"]) + p["b"] - ex["y"])
  flat_loss = lambda p, ex: jnp.abs(jnp.dot(p[:4], ex["x"]) + p[4] - ex["y"])
  n = 64
  batch = {"x": jax.random.normal(jax.random.key(50), (n, 4)),
           "y": jax.random.normal(jax.random.key(51), (n,))}
  xis, _ = rq.sample_queries(jax.random.key(52), anchor, rho, n)
  chex.assert_shape(xis["w"], (n, 4))
  chex.assert_shape(xis["b"], (n,))
  flat_xis = jnp.concatenate([xis["w"], xis["b"][:, None]], axis=1)
  grads = per_example_grads(loss, anchor, batch, offsets=xis)
  flat_grads = per_example_grads(flat_loss, flat_anchor, batch, offsets=flat_xis)

  tx = rq.resque(rho)
  state = tx.init(anchor)
  params = {"w": anchor["w"] + 0.1, "b": anchor["b"] - 0.05}
  flat_params = jnp.concatenate([params["w"], params["b"][None]])
  out, state2 = jax.jit(lambda g, s, p, xi: tx.update(g, s, p, xi=xi))(grads, state, params, xis)
  flat_out = rq.reweight(flat_params, flat_anchor, flat_xis, flat_grads, rho)
  np.testing.assert_allclose(np.concatenate([out["w"], out["b"][None]]), flat_out, rtol=1e-5,
                             atol=1e-6)
  assert int(state2.count) == 1
  # single (unbatched) query form
  one, _ = tx.update(jax.tree.map(lambda g: g[0], grads), state, params,
                     xi=jax.tree.map(lambda g: g[0], xis))
  w0 = math.exp(float(rq.log_weight(params, anchor, jax.tree.map(lambda g: g[0], xis), rho)))
  np.testing.assert_allclose(one["w"], w0 * grads["w"][0], rtol=1e-5)
  # determinism and far-from-anchor stability
  xis_b, _ = rq.sample_queries(jax.random.key(52), anchor, rho, n)
  np.testing.assert_array_equal(xis["w"], xis_b["w"])
  far = jax.tree.map(lambda a: a + 3 * rho / math.sqrt(5), anchor)
  est = rq.reweight(far, anchor, xis, grads, rho)
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(est))
  moved = rq.reset_anchor(state, params)
  np.testing.assert_array_equal(moved.anchor["w"], params["w"])
  with pytest.raises(ValueError, match="rho"):
    rq.resque(0.0)
  with pytest.raises(ValueError, match="xi"):
    tx.update(grads, state, params)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)


# ------------------------------------------------------------------ private pieces (§4) --

from dpsco_jax.algorithms.resque import ball_acceleration as ba  # noqa: E402
from dpsco_jax.algorithms.resque import driver as alg  # noqa: E402
from dpsco_jax.api import solve  # noqa: E402
from dpsco_jax.privacy.ledger import PrivacyBudgetExceeded  # noqa: E402

N_ITEMS = 200


def _abs_items(seed=0):
  ka, kx = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (N_ITEMS, D))
  a = a / jnp.linalg.norm(a, axis=1, keepdims=True)
  x_true = 0.5 * jax.random.normal(kx, (D,)) / math.sqrt(D)
  return {"a": a, "b": a @ x_true}


def _abs_item_loss(x, ex):
  return jnp.abs(jnp.dot(ex["a"], x) - ex["b"])


ITEMS_D = _abs_items()
# neighbour: item 0 replaced adversarially (flipped feature, shifted label)
ITEMS_DP = {"a": ITEMS_D["a"].at[0].set(-ITEMS_D["a"][0]),
            "b": ITEMS_D["b"].at[0].set(ITEMS_D["b"][0] + 3.0)}
DRIFT_T = 256
DRIFT_LENGTHS = alg.alg4_plan(DRIFT_T, r_prime=1.0, lipschitz=1.0, beta=1.0, d=D).lengths


@jax.jit
def _coupled_drift(key, rho, r, lam, eta0):
  """Per phase: same (z, xi), same start y0 on D and D' (re-coupled every phase, Lemma 5
  setup); returns (|ybar - ybar'|, b_i, eta_i). Phases with even index get the differing
  index forced in once, odd phases never see it."""
  center = jnp.zeros(D)
  kz, kx = jax.random.split(key)
  nq = sum(DRIFT_LENGTHS)
  z = jax.random.randint(kz, (nq,), 1, N_ITEMS)  # never 0 ...
  xis, _ = rq.sample_queries(kx, center, rho, nq)
  off, starts = 0, []
  for i, t_i in enumerate(DRIFT_LENGTHS):
    if i % 2 == 0:
      z = z.at[off + t_i // 2].set(0)  # ... except once in even phases
    starts.append(off)
    off += t_i
  bd = jax.tree.map(lambda v: v[z], ITEMS_D)
  bdp = jax.tree.map(lambda v: v[z], ITEMS_DP)
  g = per_example_grads(_abs_item_loss, center, bd, offsets=xis)
  gp = per_example_grads(_abs_item_loss, center, bdp, offsets=xis)
  drifts, counts, etas = [], [], []
  y0 = center + 0.3 * r * jnp.ones(D) / math.sqrt(D)
  for i, t_i in enumerate(DRIFT_LENGTHS):
    s = slice(starts[i], starts[i] + t_i)
    eta = eta0 / 4 ** (i + 1)
    yb, _ = alg.phase_average(y0, center, center, xis[s], g[s], eta=eta, lam=lam, radius=r,
                              rho=rho)
    ybp, _ = alg.phase_average(y0, center, center, xis[s], gp[s], eta=eta, lam=lam, radius=r,
                               rho=rho)
    drifts.append(jnp.linalg.norm(yb - ybp))
    counts.append(jnp.sum(z[s] == 0))
    etas.append(eta)
  return jnp.stack(drifts), jnp.stack(counts), jnp.stack(etas)


@pytest.mark.slow
@pytest.mark.parametrize("ratio,lam", [(2.0, 0.0), (10.0, 0.0), (2.0, 1.0)])
def test_coupled_privacy_drift_within_lemma5_bound(ratio, lam):
  """T8 (Lemma 5, eq. (25)): with (z, xi) coupled and each phase restarted from the same point,
  |ybar_i - ybar'_i| <= sqrt(1500) b_i eta_i L in >= 99% of runs (Alg. 3 lam=0, Alg. 4 lam>0),
  and the drift is EXACTLY zero in phases that never draw the differing sample."""
  r = 0.05
  rho = ratio * r
  eta0 = r * min(1 / math.sqrt(DRIFT_T), 1.0 / math.sqrt(D))  # beta = 1, L = 1
  keys = jax.random.split(jax.random.key(11), 24)
  drift, b, eta = jax.vmap(lambda k: _coupled_drift(k, rho, r, lam, eta0))(keys)
  drift, b, eta = np.asarray(drift), np.asarray(b), np.asarray(eta)
  hit = b > 0
  ratio_obs = drift[hit] / (b[hit] * eta[hit])
  assert np.mean(ratio_obs <= math.sqrt(1500)) >= 0.99
  assert np.max(ratio_obs) > 0.05  # the differing sample really moves the iterate
  np.testing.assert_array_equal(drift[~hit], 0.0)


@pytest.mark.slow
def test_alg4_utility_without_noise():
  """T7 / Corollary 2: with beta huge (no effective noise) Alg. 4's F^lam gap is below
  C_cvx L r (sqrt(d)/(beta T) + 1/sqrt(T)) and shrinks with T; output stays in B_xbar(r)."""
  r = rho = 0.1
  lam = 1.0
  center = jnp.zeros(D)
  a, b = ITEMS_D["a"], ITEMS_D["b"]
  value = jax.jit(lambda x: jnp.mean(rq.smoothed_abs(x, a, b, rho)[0]))
  grad = jax.jit(lambda x: jnp.mean(rq.smoothed_abs(x, a, b, rho)[1], axis=0))
  exact = ba.make_exact_ball_oracle(grad, radius=r, smoothness=1 / rho, n_steps=800)
  xs, _ = exact(None, center, lam, 0.0)
  obj = lambda x: float(value(x)) + 0.5 * lam * float(jnp.sum((x - center) ** 2))
  gaps = {}
  for T in (32, 512):
    g = []
    for s in range(3):
      x, plan = alg.localized_resque_sgd(_abs_item_loss, ITEMS_D, center, jax.random.key(s),
                                         T=T, radius=r, rho=rho, beta=1e6, lipschitz=1.0,
                                         lam=lam)
      assert float(jnp.linalg.norm(x - center)) <= r + 1e-6
      assert sum(plan.lengths) == plan.t_hat - 1
      g.append(obj(x) - obj(xs))
    gaps[T] = float(np.mean(g))
    assert gaps[T] <= 16 * r * (math.sqrt(D) / (1e6 * T) + 1 / math.sqrt(T))
  assert gaps[512] < gaps[32]


def test_alg5_schedule_geometry():
  """T9 / eq. (28): beta_i^2 T_i^2 doubles (privacy costs form a geometric sequence),
  sum T_i <= T, the last call has beta^2 T^2 / 2, and
  r_i <= 2r."""
  T, beta = 2 ** 12, 0.3
  sched = alg.alg5_schedule(T, beta=beta, lam=2.0, lipschitz=1.0, radius=0.1, d=D)
  assert len(sched) == math.ceil(math.log2(math.log2(T)))
  prod = [c["beta"] * c["T"] for c in sched]
  for p0, p1 in zip(prod, prod[1:]):
    assert math.isclose(p1 ** 2, 2 * p0 ** 2, rel_tol=1e-9)
  assert sum(c["T"] for c in sched) <= T
  assert math.isclose(prod[-1] ** 2, (beta * T) ** 2 / 2, rel_tol=1e-9)
  assert all(c["r_prime"] <= 0.2 + 1e-12 for c in sched)


def test_approx_rdp_accounting():
  """T12: the explicit Lemma 7 charge by hand, additive composition, Corollary 1 conversion,
  violated preconditions flagged, and the budget enforced BEFORE recording."""
  T, n, beta, delta, alpha = 16, 2000, 1e-4, 1e-6, 40.0
  e, cond = alg.alg4_rdp(T=T, n=n, beta=beta, delta=delta, alpha=alpha, rho_over_r=1e9)
  hand = alpha * 13 * (1.2 * T / n) ** 2 * 6000 * beta ** 2 * math.log(2 / delta) ** 2
  assert math.isclose(e, hand, rel_tol=1e-12)
  assert all(cond.values())
  _, bad = alg.alg4_rdp(T=T, n=n, beta=beta, delta=delta, alpha=alpha, rho_over_r=4.0)
  assert not bad["rho/r >= 1728 log^2(log2 T/delta) (Lemma 5)"]
  _, bad = alg.alg4_rdp(T=400, n=n, beta=beta, delta=delta, alpha=alpha, rho_over_r=1e9)
  assert not bad["T/n <= 1/60 (Lemma 6)"]
  # Lemma 3 + Corollary 1 now live in the one PrivacyLedger (ApproxRdpEvent entries).
  from dpsco_jax.privacy import ApproxRdpEvent, PrivacyLedger
  led = PrivacyLedger(delta=1e-9, epsilon_budget=3.0, relation="replace_one")
  led.spend(ApproxRdpEvent(alpha, 0.1, 1e-8, 1e-6), label="a")
  led.spend(ApproxRdpEvent(alpha, 0.2, 2e-8, 1e-6), label="b")
  eps = 0.3 + math.log(1e6) / 39.0
  assert math.isclose(led.epsilon(exact=True), eps, rel_tol=1e-12)
  assert math.isclose(led.extra_delta(), 1e-6 + (1 + math.exp(eps)) * 3e-8, rel_tol=1e-12)
  with pytest.raises(PrivacyBudgetExceeded):
    led.spend(ApproxRdpEvent(alpha, 5.0, 0.0, 1e-6), label="too much")
  assert math.isclose(led.epsilon(exact=True), eps, rel_tol=1e-12)  # nothing recorded
  with pytest.raises(ValueError, match="constants"):
    alg.alg4_rdp(T=T, n=n, beta=beta, delta=delta, alpha=alpha, rho_over_r=1.0,
                 constants="bogus")
  with pytest.raises(ValueError, match="beta"):
    alg.alg4_rdp(T=T, n=n, beta=0.0, delta=delta, alpha=alpha, rho_over_r=1.0)


def test_theory_preset_checks_preconditions():
  """The theory preset computes eq. (30)-(34) and raises a PrivacyPreconditionError (a
  ValueError) naming the violated condition; at small n the T <= n/C_priv caps fail."""
  p = alg.theorem3_params(n=10_000, d=5, epsilon=0.5, delta=1e-6)
  assert p["r"] < p["rho"] and p["alpha"] > 1
  with pytest.raises(alg.PrivacyPreconditionError, match="precondition violated"):
    alg.check_theorem3_preconditions(p, n=10_000, epsilon=0.5, delta=1e-6)
  with pytest.raises(alg.PrivacyPreconditionError, match="epsilon < 1"):
    alg.check_theorem3_preconditions(p, n=10_000, epsilon=2.0, delta=1e-6)
  with pytest.raises(ValueError, match="delta"):
    alg.theorem3_params(n=100, d=5, epsilon=0.5, delta=1.5)


def test_mlmc_telescopes_to_deepest_level(monkeypatch):
  """T10: with a mock Alg. 5 whose output is x* + c/T (bias shrinking with the level), the
  MLMC estimator's mean equals the level-j_max output x* + c/(2^j_max T) (telescoping), far
  below a single level-0 run's bias c/T; level j is called with 2^(-j/2) beta."""
  calls = []

  def mock(loss_fn, items, center, key, *, T, beta, **kw):
    calls.append((T, beta))
    return center + 1.0 / T

  # Alg. 6 looks Alg. 5 up in the module that defines both (the facade only re-exports)
  from dpsco_jax.algorithms.resque import solvers as resque_solvers
  monkeypatch.setattr(resque_solvers, "strongly_convex_resque", mock)
  T, j_max, beta = 8, 3, 0.5
  copies = 400
  est = alg.mlmc_prox_estimator(None, None, np.zeros(2), jax.random.key(0), T=T, j_max=j_max,
                                copies=copies, radius=1.0, rho=1.0, beta=beta, lam=1.0,
                                lipschitz=1.0)
  target = 1.0 / (2 ** j_max * T)
  # per-copy values are 1/T or 2^{-j_max}... exactly: 1/T - [J <= j_max]/T; sd <= 1/T
  assert abs(float(est[0]) - target) < 5 * (1.0 / T) / math.sqrt(copies)
  assert abs(float(est[0]) - target) < 0.2 * (1.0 / T - target)
  for t_call, b_call in calls:
    j = int(round(math.log2(t_call / T)))
    assert math.isclose(b_call, 2 ** (-j / 2) * beta, rel_tol=1e-12)


@pytest.mark.slow
def test_private_sco_practical_end_to_end():
  """Runner contract: the practical preset runs, stays within the requested (eps, delta), is
  labelled heuristic (C_priv form: not a proof constant) with the violated conditions named,
  releases no data-dependent diagnostics unless debug, and the theory preset raises."""
  from dpsco_jax import problems
  prob = problems.absolute(n_users=512, m=1, d=3, key=jax.random.key(0), radius=1.0,
                           noise=0.0)
  cfg = {"epsilon": 1.0, "delta": 1e-5, "constants": "c_priv", "rho": 0.05,
         "rho_over_r": 2.0, "max_iter": 1, "max_bisection": 1, "phases": 1, "T_frac": 1 / 64}
  res = solve("resque_private_sco", cfg, prob, jax.random.key(1))
  assert res.privacy.provenance == "heuristic"
  assert res.privacy.epsilon <= 1.0 + 1e-9 and res.privacy.delta <= 1e-5 * (1 + 1e-9)
  assert "rho/r" in res.privacy.notes and res.privacy.level == "item"
  assert res.debug is None
  assert float(jnp.linalg.norm(res.params)) <= 1.0 + 1e-6
  assert res.gradient_evaluations > 0
  with pytest.raises(alg.PrivacyPreconditionError):
    solve("resque_private_sco", {**cfg, "preset": "theory"}, prob, jax.random.key(1))
  with pytest.raises(ValueError, match="preset"):
    solve("resque_private_sco", {**cfg, "preset": "fast"}, prob, jax.random.key(1))
