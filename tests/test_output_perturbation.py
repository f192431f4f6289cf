"""DelOutputPert (paper 001 Alg. 1), its certificate (App. C), SCOutputPert and the phased
algorithms (Algs 2–6), and the naive baseline."""

import itertools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpsco_jax.algorithms.output_perturbation import deletion_stability as ds
from dpsco_jax.algorithms.output_perturbation import driver as op
from dpsco_jax.api import solve
from dpsco_jax.algorithms.output_perturbation import solver
from dpsco_jax.privacy import discrete_laplace as tdl
from dpsco_jax.privacy.ledger import PrivacyBudgetExceeded
from dpsco_jax.problems.output_perturbation import l2_regularized_loss
from dpsco_jax.transforms.noise import tree_gaussian_like

# ------------------------------------------------------------------------------------------
# A closed-form f: the mean of the kept users' means (quadratic loss 0.5||θ - z||², μ = 1),
# with f(∅) = 0 (public point).


def mean_f(user_means):
  U = jnp.asarray(user_means, jnp.float32)

  def f(mask):
    w = mask.astype(jnp.float32)
    c = jnp.sum(w)
    # explicit precision: on GPU the default (TF32) would make this f and all_F below differ
    # by ~1e-3, so the fast and exact paths would not be comparable at 1e-5
    return jnp.where(c > 0, jnp.matmul(w, U, precision="highest") / jnp.maximum(c, 1.0),
                     jnp.zeros(U.shape[1]))
  return f


def all_F(user_means):
  """Closed form of ``evaluate_all_subsets(mean_f(U))`` (vectorized, no solver)."""
  U = jnp.asarray(user_means, jnp.float32)
  keep = ds.subset_keep_masks(U.shape[0]).astype(jnp.float32)
  c = jnp.sum(keep, axis=1, keepdims=True)
  return jnp.where(c > 0, jnp.matmul(keep, U, precision="highest") / jnp.maximum(c, 1.0), 0.0)


def brute_force_stable(F, n, Delta, depth):
  """Independent reference straight from Def. 3.2: x_{-S} stable iff
  Δ_{depth-|S|} f(x_{-S}) <= Δ, enumerating the sub-deletions explicitly."""
  F = np.asarray(F)

  def one_step(s):
    return max([np.linalg.norm(F[s] - F[s | (1 << i)]) for i in range(n) if not s >> i & 1],
               default=0.0)

  out = np.zeros(2 ** n, bool)
  for s in range(2 ** n):
    size = bin(s).count("1")
    budget = depth - size
    if budget < 0:
      out[s] = False if one_step(s) > Delta else True
      # sets deeper than the depth are never examined as S (|S| <= R1 <= depth/2)
      continue
    rest = [i for i in range(n) if not s >> i & 1]
    ok = True
    for r in range(budget + 1):
      for extra in itertools.combinations(rest, r):
        t = s
        for i in extra:
          t |= 1 << i
        if one_step(t) > Delta:
          ok = False
          break
      if not ok:
        break
    out[s] = ok
  return out


def outlier_data(n, n_out, key, d=2, good=0.3, far=5.0):
  g = good * jax.random.uniform(key, (n, d), minval=-1.0, maxval=1.0) / math.sqrt(d)
  return g.at[:n_out].set(far)


def test_stability_table_matches_definition():
  n, depth = 6, 3
  U = jax.random.normal(jax.random.key(0), (n, 2))
  F = all_F(U)
  np.testing.assert_allclose(np.asarray(ds.evaluate_all_subsets(mean_f(U), n)),
                             np.asarray(F), atol=1e-6)
  sizes = np.asarray(ds.subset_sizes(n))
  probe = ds.stability_table(F, n, 0.0, depth)
  Delta = float(np.quantile(np.asarray(probe.one_step)[sizes <= depth], 0.8))
  table = ds.stability_table(F, n, Delta, depth)
  ref = brute_force_stable(F, n, Delta, depth)
  small = np.asarray(table.sizes) <= depth
  np.testing.assert_array_equal(np.asarray(table.stable)[small], ref[small])
  assert 0 < ref[small].sum() < small.sum()  # a non-trivial mix of stable / unstable sets


# ---- exact DelOutputPert on n = 12 (full power set) ----------------------------------------

EPS, DELTA = 1.0, 1e-3
P = tdl.del_output_pert_params(EPS, DELTA)
PMF = tdl.tdlap_pmf_from_kappa(P.epsilon_prime, P.kappa)
N12 = 12
DELTA_T = 0.6  # Δ target: good users (norm <= 0.3) are stable, outliers (norm ~7) are not


def _analyse(U):
  F = all_F(U)
  table = ds.stability_table(F, len(U), DELTA_T, P.depth)
  sel = ds.smallest_stable(table, P.max_r1)
  return F, table, int(sel.s_min), int(sel.index)


def _neighbour_pairs():
  key = jax.random.key(11)
  pairs = []
  for b in range(0, 5):
    k1, k2, key = jax.random.split(key, 3)
    U = outlier_data(N12, b, k1)
    V = U.at[N12 - 1].set(jnp.array([-5.0, 4.0]))          # a good user replaced by an outlier
    W = U.at[N12 - 2].set(0.1 * jax.random.normal(k2, (2,)))  # a good user replaced by a good
    pairs += [(U, V), (U, W)]
  return pairs


PAIRS = _neighbour_pairs()
ANALYSES = [(_analyse(U), _analyse(V)) for U, V in PAIRS]


def test_smallest_stable_set_deletes_exactly_the_outliers():
  for b in range(0, 4):
    U = outlier_data(N12, b, jax.random.key(b))
    F, table, s_min, idx = _analyse(U)
    assert s_min == b
    assert idx == (1 << b) - 1  # the outliers are users 0..b-1


def test_no_bottom_and_unperturbed_mean_when_locally_stable():
  # spec §6.2 6(a): Δ_{4κ} f(x) <= Δ -> S = ∅ for every R1, output f(x) + N(0, σ² I)
  U = outlier_data(N12, 0, jax.random.key(5))
  F, table, s_min, idx = _analyse(U)
  assert bool(table.stable[0]) and s_min == 0 and idx == 0
  sigma = 0.7
  rel = jax.jit(jax.vmap(lambda k: ds.exact_release(
      F, k, n_users=N12, Delta=DELTA_T, epsilon=EPS, delta=DELTA, sigma=sigma,
      public_point=jnp.zeros(2))[0]))(jax.random.split(jax.random.key(1), 4000))
  assert not np.any(np.asarray(rel.is_bottom))
  out = np.asarray(rel.params)
  np.testing.assert_allclose(out.mean(0), np.asarray(F[0]), atol=4 * sigma / math.sqrt(4000))
  np.testing.assert_allclose(np.cov(out.T), sigma ** 2 * np.eye(2), rtol=0.1, atol=0.02)


def test_observation_3_5_and_bottom_probability_identity():
  # Obs. 3.5: X^{r1}(x') != ∅ => X^{r1+1}(x) != ∅, i.e. s_min(x) <= s_min(x') + 1 both ways;
  # eq. (2): Pr[⊥|x] <= δ' + e^{ε'} Pr[⊥|x'] with Pr[⊥|x] = Pr[R1 < s_min(x)] (exact).
  slack_used = []
  for (_, _, sx, _), (_, _, sy, _) in ANALYSES:
    assert sx <= sy + 1 and sy <= sx + 1
    for a, b in ((sx, sy), (sy, sx)):
      pa, pb = ds.bottom_probability(a, EPS, DELTA), ds.bottom_probability(b, EPS, DELTA)
      assert pa <= P.delta_prime + math.exp(P.epsilon_prime) * pb + 1e-15
      slack_used.append(pa - math.exp(P.epsilon_prime) * pb)
  # the identity is nearly tight on these pairs, and fails for a TDLap of the wrong scale
  wrong = tdl.tdlap_pmf_from_kappa(2.0 * P.epsilon_prime, P.kappa)
  viol = [np.sum(wrong[:b + 1]) - P.delta_prime - math.exp(P.epsilon_prime) * np.sum(
      wrong[:b]) for b in range(1, P.max_r1)]
  assert max(viol) > 0


def test_chain_bound_for_neighbours():
  # spec §6.2 6(d): for r1 < 2κ with both runs non-⊥ (x at R1 = r1, x' at R1 = r1 + 1), the
  # released means are within 8κΔ; sharper: each walks to the common sub-dataset x* by steps
  # of at most Δ.
  checked = 0
  for ((U, V), ((Fx, tx, sx, ix), (Fy, ty, sy, iy))) in zip(PAIRS, ANALYSES):
    i = next(j for j in range(N12) if not np.allclose(U[j], V[j]))
    union = ix | iy | (1 << i)
    for r1 in range(0, P.max_r1):
      if sx <= r1 and sy <= r1 + 1:
        dist = float(jnp.linalg.norm(Fx[ix] - Fy[iy]))
        assert dist <= 8 * P.kappa * DELTA_T
        # x_{-union} = x'_{-union}; chain lengths |union \ S| and |union \ S'|
        assert np.allclose(Fx[union], Fy[union], atol=1e-6)
        steps_x = bin(union & ~ix).count("1")
        steps_y = bin(union & ~iy).count("1")
        assert float(jnp.linalg.norm(Fx[ix] - Fx[union])) <= steps_x * DELTA_T + 1e-6
        assert float(jnp.linalg.norm(Fy[iy] - Fy[union])) <= steps_y * DELTA_T + 1e-6
        checked += 1
        break
  assert checked == len(PAIRS)


def _gauss_hockey(a, b, mu_dist, sigma, eps):
  """H_{e^eps}(a N(μ, σ²) || b N(μ', σ²)) along the 1-d direction μ - μ' (exact)."""
  if a == 0:
    return 0.0
  if mu_dist == 0:
    return max(0.0, a - math.exp(eps) * b)
  c = math.log(math.exp(eps) * b / a) if b > 0 else -math.inf
  s = mu_dist / sigma
  # region where a φ(y) > e^eps b φ'(y): privacy loss > c; loss ~ N(s²/2, s²) under P
  return (a * stats.norm.sf((c - s * s / 2) / s)
          - math.exp(eps) * b * stats.norm.sf((c + s * s / 2) / s))


@pytest.mark.statistical
def test_hockey_stick_divergence_within_delta_for_adversarial_pair():
  # x: no outlier (always releases), x': one outlier swapped in (Pr[⊥] = Pr[R1 = 0]).
  U = outlier_data(N12, 0, jax.random.key(21))
  V = U.at[0].set(jnp.array([5.0, 5.0]))
  sigma = tdl.sigma(DELTA_T, EPS, DELTA)
  (Fx, _, sx, ix), (Fy, _, sy, iy) = _analyse(U), _analyse(V)
  assert (sx, sy) == (0, 1)
  px, py = ds.bottom_probability(sx, EPS, DELTA), ds.bottom_probability(sy, EPS, DELTA)
  assert px == 0.0 and py > 0
  mu_x, mu_y = np.asarray(Fx[ix]), np.asarray(Fy[iy])
  dist = float(np.linalg.norm(mu_x - mu_y))

  n_mc = 200_000
  keys = jax.random.split(jax.random.key(99), n_mc)
  run = jax.jit(jax.vmap(lambda F, k: ds.exact_release(
      F, k, n_users=N12, Delta=DELTA_T, epsilon=EPS, delta=DELTA, sigma=sigma,
      public_point=jnp.zeros(2))[0], in_axes=(None, 0)))
  for (F, pa, ma, pb, mb) in ((Fy, py, mu_y, px, mu_x), (Fx, px, mu_x, py, mu_y)):
    rel = run(F, keys)
    bot = np.asarray(rel.is_bottom)
    # the implementation follows the exact analysis: ⊥ frequency ~ Pr[R1 < s_min]
    assert abs(bot.mean() - pa) <= 5 * math.sqrt(pa * (1 - pa) / n_mc) + 1e-6
    y = np.asarray(rel.params, np.float64)
    # privacy loss of each draw against the neighbour, then the hockey-stick estimate
    with np.errstate(divide="ignore"):
      logphi = lambda m: -np.sum((y - m) ** 2, axis=1) / (2 * sigma ** 2)
      loss = np.where(bot, np.log(pa) - np.log(pb) if pa > 0 else -np.inf,
                      np.log1p(-pa) - np.log1p(-pb) + logphi(ma) - logphi(mb))
    est = np.mean(np.maximum(0.0, 1.0 - np.exp(EPS - loss)))
    exact = max(0.0, pa - math.exp(EPS) * pb) + _gauss_hockey(1 - pa, 1 - pb, dist, sigma,
                                                               EPS)
    assert exact <= DELTA
    assert est <= DELTA + 5 * math.sqrt(max(exact, 1e-6) / n_mc)
  # power: without the randomized deletion budget (R1 = 0, plain propose-test-release) the
  # neighbour that needs one deletion always returns ⊥ while x never does: divergence 1.
  broken_px, broken_py = float(sx > 0), float(sy > 0)
  assert max(0.0, broken_py - math.exp(EPS) * broken_px) > DELTA
  # and the Gaussian part is what protects the vector outputs: at noise dist/3 it exceeds δ
  assert _gauss_hockey(1 - py, 1 - px, dist, dist / 3, EPS) > DELTA


# ---- certificate (App. C, Lemma C.1) and fast path == exact path -----------------------------

EPS8, DELTA8 = 8.0, 0.05          # kappa = 4: depth 16, so n = 18 > 4κ+1 admits a certificate
P8 = tdl.del_output_pert_params(EPS8, DELTA8)
N18 = 18
GAMMA = 0.1


def _cert_setup(spread, seed):
  U = jnp.array([1.0, 0.5]) + spread * jax.random.normal(jax.random.key(seed), (N18, 2))
  Delta = ds.certified_sensitivity(n_users=N18, depth=P8.depth, gamma=GAMMA, e_max=1e-5,
                                   mu=1.0, tau=0.0)

  def certify(theta):
    grads = theta[None, :] - U  # per-user gradients of 0.5||θ - u_i||²
    return ds.lemma_c1_certificate(grads, jnp.zeros(2), theta, mu=1.0, gamma=GAMMA,
                                   e_max=1e-5, radius=None)
  return U, Delta, certify


def test_kappa_four_setup():
  assert P8.kappa == 4 and P8.depth + 1 == 17


def _EXACT18(F, key, Delta, sigma):
  return ds._exact_release_jit(F, key, n_users=N18, Delta=Delta, epsilon=EPS8, delta=DELTA8,
                               sigma=sigma, public_point=jnp.zeros(2))


@pytest.mark.slow
def test_certificate_sound_and_fast_path_equals_exact():
  sigma = 0.3
  for spread, seed, certified in ((0.01, 0, True), (0.2, 2, False)):
    U, Delta, certify = _cert_setup(spread, seed)
    F = all_F(U)
    table = ds.stability_table(F, N18, Delta, P8.depth)
    cert = certify(F[0])
    assert bool(cert.certified) == certified
    small = np.asarray(table.sizes) <= P8.depth
    if certified:
      # Lemma C.1 soundness: Δ_{4κ} f(x) <= Δ_cert, hence S = ∅ stable
      assert float(jnp.max(jnp.where(small, table.one_step, 0.0))) <= Delta
      assert bool(table.stable[0])
    key = jax.random.key(seed + 100)
    fast, dbg_f, c = ds.del_output_pert(
        key, mean_f(U), n_users=N18, Delta=Delta, epsilon=EPS8, delta=DELTA8, sigma=sigma,
        public_point=jnp.zeros(2), certify=certify)
    exact, dbg_e = _EXACT18(F, key, Delta, sigma)
    # same key -> same R1 and the same Gaussian draw on both paths
    assert int(dbg_f.r1) == int(dbg_e.r1)
    assert bool(fast.is_bottom) == bool(exact.is_bottom)
    np.testing.assert_allclose(np.asarray(fast.params), np.asarray(exact.params), atol=1e-5)
    assert bool(dbg_f.exact_path) == (not certified) and bool(c.certified) == certified
    if certified:
      assert not bool(fast.is_bottom)
      np.testing.assert_allclose(np.asarray(fast.params - F[0]) / sigma,
                                 np.asarray(tree_gaussian_like(ds._keys(key)[1],
                                                               jnp.zeros(2))),
                                 atol=1e-4)
    else:
      with pytest.raises(ds.CertificateFailure):
        ds.del_output_pert(key, mean_f(U), n_users=N18, Delta=Delta, epsilon=EPS8,
                           delta=DELTA8, sigma=sigma, public_point=jnp.zeros(2),
                           certify=certify, on_certificate_failure="raise")


def test_exact_fallback_required_beyond_max_exact_users():
  U, Delta, certify = _cert_setup(0.01, 0)
  with pytest.raises(ValueError, match="max_exact_users"):
    ds.del_output_pert(jax.random.key(0), mean_f(U), n_users=N18, Delta=Delta,
                       epsilon=EPS8, delta=DELTA8, sigma=1.0, public_point=jnp.zeros(2),
                       certify=certify, max_exact_users=10)
  with pytest.raises(ValueError, match="on_certificate_failure"):
    ds.del_output_pert(jax.random.key(0), mean_f(U), n_users=N18, Delta=Delta,
                       epsilon=EPS8, delta=DELTA8, sigma=1.0, public_point=jnp.zeros(2),
                       certify=certify, on_certificate_failure="bottom")


@pytest.mark.statistical
def test_noise_calibration_accepts_sigma_rejects_half_and_one_and_half():
  U = outlier_data(N12, 0, jax.random.key(5))
  F = all_F(U)
  sigma = 0.25
  rel = jax.jit(jax.vmap(lambda k: ds.exact_release(
      F, k, n_users=N12, Delta=DELTA_T, epsilon=EPS, delta=DELTA, sigma=sigma,
      public_point=jnp.zeros(2))[0]))(jax.random.split(jax.random.key(2), 20000))
  z = (np.asarray(rel.params) - np.asarray(F[0])).ravel()
  for scale, ok in ((1.0, True), (0.5, False), (1.5, False)):
    p = stats.kstest(np.asarray(z / (scale * sigma), np.float64), stats.norm(0.0, 1.0).cdf).pvalue
    assert (p > 1e-3) == ok


# ---- the certified solver, masked deletion, deletion sensitivity ----------------------------

def _logit_data(key, n, m, d=2, adversarial=False):
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (n, m, d))
  x = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  y = jax.random.bernoulli(ky, jax.nn.sigmoid(x @ jnp.array([1.0, -0.5][:d]))).astype(
      jnp.float32)
  if adversarial:  # user 0: m identical outlier items
    x = x.at[0].set(jnp.array([1.0, 0.0][:d]))
    y = y.at[0].set(0.0)
  return {"x": x, "y": y}


L2 = 0.5
LOSS = l2_regularized_loss(
    lambda w, ex: jax.nn.softplus(ex["x"] @ w) - ex["y"] * (ex["x"] @ w), L2)
PLAN = op.solver_plan(smoothness=0.25 + L2, strong_convexity=L2, distance=4.0, tau=3e-5)


def _solve(data, mask, init=None):
  d = data["x"].shape[-1]
  anchor = jnp.zeros(d) if init is None else init
  return anchor + solver.solve_masked(data, mask, anchor, -anchor, loss_fn=LOSS, lam=0.0,
                                      plan=PLAN, radius=2.0)


def test_solver_reaches_certified_accuracy_and_masked_equals_removed():
  data = _logit_data(jax.random.key(0), 10, 6)
  full = _solve(data, jnp.ones(10, bool))
  # reference optimum by long gradient descent
  def obj(w):
    return jnp.mean(jax.vmap(jax.vmap(lambda ex: LOSS(w, ex)))(data))
  w = jax.jit(lambda w0: jax.lax.fori_loop(  # Newton's method on the exact objective
      0, 20, lambda _, w: w - jnp.linalg.solve(jax.hessian(obj)(w), jax.grad(obj)(w)),
      w0))(jnp.zeros(2))
  assert float(jnp.linalg.norm(full - w)) <= max(PLAN.tau, 1e-5)
  keep = jnp.array([True] * 10).at[jnp.array([1, 4, 7])].set(False)
  masked = _solve(data, keep)
  removed = _solve(jax.tree.map(lambda a: a[np.asarray(keep)], data), jnp.ones(7, bool))
  np.testing.assert_allclose(np.asarray(masked), np.asarray(removed), atol=1e-5)
  assert float(jnp.linalg.norm(masked - full)) > 1e-3  # the deletion did something


def test_nan_user_contributes_zero():
  data = _logit_data(jax.random.key(1), 10, 6)
  bad = jax.tree.map(lambda a: a.at[3].set(jnp.nan), data)
  out = _solve(bad, jnp.ones(10, bool))
  assert bool(jnp.all(jnp.isfinite(out)))
  # equal to the solve where user 3's gradient is exactly zero but still counted
  zero = jax.tree.map(lambda a: a, data)
  zero["x"] = zero["x"].at[3].set(0.0)
  zero["y"] = zero["y"].at[3].set(0.0)
  # user 3 with x = 0 has loss gradient l2*w only; compare up to that term's effect
  assert float(jnp.linalg.norm(out - _solve(zero, jnp.ones(10, bool)))) < 0.05


def _max_loo_change(data, keep=None, reduce="max"):
  n = data["x"].shape[0]
  keep = jnp.ones(n, bool) if keep is None else keep
  # row 0: the full data; rows 1..n: leave user i out. One vmapped compilation per shape:
  # a cold pass gives the full solution, a second pass is warm-started from it.
  masks = jnp.concatenate([keep[None, :], keep[None, :] & ~jnp.eye(n, dtype=bool)])
  solve = lambda mk, init: _solve(data, mk, init)
  full = ds.leave_users_out(solve, masks, jnp.zeros(2))[0]
  sub = ds.leave_users_out(solve, masks, full)
  change = jnp.linalg.norm(sub[1:] - sub[0], axis=1)
  if reduce == "mean":
    return float(jnp.sum(jnp.where(keep, change, 0.0)) / jnp.sum(keep))
  return float(jnp.max(jnp.where(keep, change, 0.0)))


@pytest.mark.slow
def test_deletion_sensitivity_scales_on_permuted_not_on_adversarial():
  n = 32
  ms = [4, 16, 64]
  perm_vals, adv_vals = [], []
  for m in ms:
    adv = _logit_data(jax.random.key(m), n, m, adversarial=True)
    flat = jax.tree.map(lambda a: a.reshape((n * m,) + a.shape[2:]), adv)
    pi = jax.random.permutation(jax.random.key(1000 + m), n * m)
    perm = jax.tree.map(lambda a: a[pi].reshape((n, m) + a.shape[1:]), flat)
    perm_vals.append(_max_loo_change(perm))
    adv_vals.append(_max_loo_change(adv))
    # Thm 3.6 bound (centred, G_eff = 2G, β = 1e-3) holds on the permuted data
    G = 1.0 + L2 * 2.0
    bound = 5 * 2 * G * math.sqrt(math.log(1e3)) / (L2 * (n - 1) * math.sqrt(m))
    assert perm_vals[-1] <= bound
    if m == 16:  # the same data with 8 of the 32 users kept (masked): ~1/n on average
      small = _max_loo_change(perm, jnp.arange(n) < 8, "mean")
      large = _max_loo_change(perm, None, "mean")
  slope_p = np.polyfit(np.log(ms), np.log(perm_vals), 1)[0]
  slope_a = np.polyfit(np.log(ms), np.log(adv_vals), 1)[0]
  assert -0.8 < slope_p < -0.3, slope_p
  assert abs(slope_a) < 0.15, slope_a
  assert adv_vals[-1] > 3 * perm_vals[-1]
  slope_n = math.log(large / small) / math.log(4)
  assert -1.5 < slope_n < -0.65, slope_n


# ---- SCOutputPert / phased / baseline drivers -----------------------------------------------

@pytest.fixture(scope="module")
def problem():
  return op.l2_logistic({"n_users": 120, "m": 8, "d": 2, "l2": 0.5, "radius": 2.0,
                         "n_eval": 2000}, jax.random.key(0))


def test_l2_logistic_problem(problem):
  assert problem.meta["strong_convexity"] == 0.5
  assert abs(problem.lipschitz - 2.0) < 1e-9 and abs(problem.smoothness - 0.75) < 1e-9
  assert problem.excess_risk(problem.x_opt) <= 1e-6
  assert problem.excess_risk(problem.x_opt + 0.1) > 0


def test_sc_output_pert_certified_run_and_debug_gating(problem):
  cfg = {"epsilon": 4.0, "delta": 1e-5, "on_certificate_failure": "raise"}
  res = solve("sc_output_pert", cfg, problem, jax.random.key(3))
  assert res.debug is None
  assert res.privacy.provenance == "heuristic"  # 'raise' abort is outside the theorem
  assert res.privacy.epsilon == 4.0 and res.privacy.delta == 1e-5
  assert res.privacy.relation == "replace_one"
  assert float(jnp.linalg.norm(res.params)) <= 2.0 + 1e-5
  res2 = solve("sc_output_pert", {**cfg, "debug": True}, problem, jax.random.key(3))
  assert res2.debug["certified"] == [True] and res2.debug["exact_path"] == [False]
  np.testing.assert_allclose(np.asarray(res.params), np.asarray(res2.params))
  # σ is data independent and matches the calculator
  assert abs(res.record["sigma"] - tdl.sigma(res.record["Delta"], 4.0, 1e-5, "analytic")) \
      < 1e-9 * res.record["sigma"]


def test_sc_output_pert_exact_mode_tiny_n_matches_independent_computation():
  prob = op.l2_logistic({"n_users": 6, "m": 3, "d": 2, "l2": 0.5, "n_eval": 2000},
                        jax.random.key(4))
  cfg = {"epsilon": 1.0, "delta": 1e-3, "stability_test": "exact", "Delta": 0.05,
         "debug": True, "max_exact_users": 6}
  res = solve("sc_output_pert", cfg, prob, jax.random.key(5))
  assert res.privacy.provenance == "theorem"
  assert res.debug["exact_path"] == [True]
  info = op.plan_sc_output_pert(n_users=6, m=3, lipschitz=prob.lipschitz,
                                smoothness=prob.smoothness, mu0=0.5, lam=0.0,
                                radius=prob.radius, epsilon=1.0, delta=1e-3, beta=1e-3,
                                settings=op.settings_from_cfg(cfg))
  zero = jnp.zeros(2)
  F = solver.solve_all_subsets(prob.data, zero, zero, loss_fn=prob.loss_fn, lam=0.0,
                               plan=info.plan, radius=float(prob.radius), n_users=6)
  # the table is the masked solver on every sub-dataset (spot check one deletion set)
  keep = ds.subset_keep_masks(6)[37]
  np.testing.assert_allclose(np.asarray(F[37]), np.asarray(solver.solve_masked(
      prob.data, keep, zero, zero, loss_fn=prob.loss_fn, lam=0.0, plan=info.plan,
      radius=float(prob.radius))), atol=1e-6)
  rel, dbg = ds._exact_release_jit(F, jax.random.key(5), n_users=6, Delta=info.Delta,
                                   epsilon=1.0, delta=1e-3, sigma=info.sigma,
                                   public_point=zero)
  assert res.record["is_bottom"] == bool(rel.is_bottom)
  assert res.debug["r1"] == [int(dbg.r1)] and res.debug["s_size"] == [int(dbg.s_size)]
  want = op.project_l2_ball(rel.params, prob.radius)
  np.testing.assert_allclose(np.asarray(res.params), np.asarray(want), atol=1e-5)


def test_theory_preset_uses_paper_formulas(problem):
  # eps = 1, delta = 0.5: kappa = 6, min users 50 <= 120; classic Gaussian, Lemma 3.8 gamma
  cfg = {"epsilon": 1.0, "delta": 0.5, "preset": "theory", "on_certificate_failure": "raise"}
  res = solve("sc_output_pert", cfg, problem, jax.random.key(1))
  p = tdl.del_output_pert_params(1.0, 0.5)
  assert res.record["kappa"] == p.kappa == 6
  want = math.sqrt(2 * math.log(2 / p.delta_prime)) * 8 * 6 * res.record["Delta"] / 0.5
  assert abs(res.record["sigma"] - want) < 1e-9 * want
  gamma = 10 * problem.lipschitz * math.sqrt(math.log(120 / 1e-3) / 8)
  assert abs(res.record["gamma"] - gamma) < 1e-9 * gamma
  r = 4 * 6 + 1
  stat = 2 * r * gamma / (0.5 * (120 - r))
  assert abs(res.record["Delta"] - stat * 1.05) < 1e-9 * stat  # Δ_stat (1 + solver_tol)


def test_validation_errors(problem):
  base = {"epsilon": 1.0, "delta": 1e-5}
  with pytest.raises(ValueError, match="preset"):
    solve("sc_output_pert", {**base, "preset": "fast"}, problem, jax.random.key(0))
  with pytest.raises(ValueError, match="epsilon"):
    solve("sc_output_pert", {**base, "preset": "theory", "epsilon": 2.0}, problem,
          jax.random.key(0))
  with pytest.raises(ValueError, match="n_users"):  # 120 < 2(4κ+1) at eps = 1
    solve("sc_output_pert", {**base, "on_certificate_failure": "raise"}, problem,
          jax.random.key(0))
  with pytest.raises(ValueError, match="max_exact_users"):  # exact fallback infeasible
    solve("sc_output_pert", {**base, "epsilon": 4.0}, problem, jax.random.key(0))
  import dataclasses
  plain = dataclasses.replace(problem, meta={})  # a merely convex problem
  with pytest.raises(ValueError, match="strong_convexity"):
    solve("naive_output_pert", base, plain, jax.random.key(0))
  with pytest.raises(ValueError, match="strong_convexity"):
    solve("sc_erm_output_pert", base, plain, jax.random.key(0))
  with pytest.raises(ValueError, match="solver_tol"):
    op.settings_from_cfg({"epsilon": 1.0, "delta": 1e-5, "solver_tol": -1})
  with pytest.raises(ValueError, match="Delta"):
    op.settings_from_cfg({"epsilon": 1.0, "delta": 1e-5, "preset": "theory", "Delta": 0.1})


def test_budget_exceeded_raises_before_release(problem):
  cfg = {"epsilon": 4.0, "delta": 1e-5, "on_certificate_failure": "raise",
         "epsilon_budget": 2.0}
  with pytest.raises(PrivacyBudgetExceeded):
    solve("sc_output_pert", cfg, problem, jax.random.key(0))
  with pytest.raises(PrivacyBudgetExceeded):
    solve("naive_output_pert", cfg, problem, jax.random.key(0))


def test_naive_baseline_flat_in_m_and_paper_ratio_scaling(problem):
  import dataclasses
  res = solve("naive_output_pert", {"epsilon": 1.0, "delta": 1e-5}, problem,
              jax.random.key(1))
  assert res.privacy.provenance == "accountant"
  assert abs(res.privacy.epsilon - 1.0) < 1e-3
  sens = res.record["sensitivity"]
  assert abs(sens - 2 * problem.lipschitz / (0.5 * 120)) < 0.1 * sens
  settings = op.settings_from_cfg({"epsilon": 1.0, "delta": 1e-5})
  s = [op.naive_sigma(dataclasses.replace(problem, m=m), 1.0, 1e-5, settings)
       for m in (2, 8, 512)]
  assert s[0] == s[1] == s[2]  # sensitivity 2G/(μn): no gain from m
  r = [op.noise_ratio(n_users=10_000, m=m, epsilon=1.0, delta=1e-6) for m in (1e2, 1e4)]
  assert 8 < r[0] / r[1] < 12  # the paper's noise ~ 1/sqrt(m)
  # spec §5: the crossover is far beyond laptop scale
  assert op.crossover_m(n_users=10_000, epsilon=1.0, delta=1e-6, preset="theory",
                        mode="exact") > 1e8


def test_phased_schedules():
  s = op.phased_erm_schedule(n_users=1000, m=100, d=4, lipschitz=1.0, diameter=2.0,
                             epsilon=1.0, delta=1e-6)
  T = math.ceil(math.log2(1e5))
  assert s["T"] == T and abs(s["epsilon"] - 1.0 / T) < 1e-15 and s["delta"] == 1e-6 / T
  lam = 1.0 * 2.0 / (2.0 * 1000 * 10.0)
  np.testing.assert_allclose(s["lams"], [lam * 4 ** i for i in range(1, T + 1)])
  np.testing.assert_allclose(s["radii"], [1.0 / (lam * 4 ** i) for i in range(1, T + 1)])
  assert s["phase_lipschitz"] == 2.0 and abs(s["beta"] - 1e-5 / T) < 1e-18
  q = op.phased_sco_schedule(n_users=4000, m=10, d=4, lipschitz=1.0, diameter=2.0,
                             epsilon=4.0, delta=1e-5)
  n0 = tdl.min_users(4.0, 1e-5)
  assert q["T"] == int(math.floor(math.log2(4000 / n0))) >= 1
  covered = set()
  for b in q["blocks"]:
    assert b.stop - b.start >= n0
    users = set(range(b.start, b.stop))
    assert not users & covered
    covered |= users
  assert abs(q["lam"] - 0.5 * max(2 / (4000 * math.sqrt(10)), 1 / math.sqrt(4e4))) < 1e-15
  with pytest.raises(ValueError, match="n_users"):
    op.phased_sco_schedule(n_users=100, m=10, d=4, lipschitz=1.0, diameter=2.0,
                           epsilon=1.0, delta=1e-5)


def test_composition_of_theorem_blocks_on_the_ledger():
  """(eps, delta) blocks: basic composition, max over disjoint blocks, budget before release."""
  from dpsco_jax.algorithms.output_perturbation.base import OutputPertPlan

  def charge(cfg, epsilon, blocks):
    return OutputPertPlan("blocks", op.settings_from_cfg(cfg), epsilon, 1e-3, 0.0, None, (),
                          tuple(blocks), {}).charge()
  rep = charge({"epsilon": 1.0, "delta": 1e-5}, 10.0, [("phases", 0.2, 1e-6, 5, None)])
  assert np.allclose((rep.epsilon, rep.delta), (1.0, 5e-6))
  cfg = {"epsilon": 1.0, "delta": 1e-5, "epsilon_budget": 1.5}
  blocks = [(f"block {i}", 1.0, 1e-5, 1, f"b{i}") for i in range(3)]   # disjoint: max
  blocks.append(("warm start", 0.5, 1e-5, 1, None))
  rep = charge(cfg, 4.0, blocks)
  assert np.allclose((rep.epsilon, rep.delta), (1.5, 2e-5))
  with pytest.raises(PrivacyBudgetExceeded):
    charge(cfg, 4.0, blocks + [("one more", 0.1, 0.0, 1, None)])
  assert charge(cfg, 4.0, blocks) == rep                  # nothing recorded by the refusal


@pytest.mark.slow
def test_phased_sco_end_to_end_structure():
  prob = op.l2_logistic({"n_users": 160, "m": 4, "d": 2, "l2": 0.5, "n_eval": 2000},
                        jax.random.key(8))
  cfg = {"epsilon": 8.0, "delta": 0.05, "on_certificate_failure": "raise", "debug": True}
  res = solve("phased_sco_output_pert", cfg, prob, jax.random.key(9))
  T = res.record["num_phases"]
  assert T >= 2 and len(res.record["bottoms"]) == T == len(res.debug["certified"])
  assert res.privacy.epsilon == 8.0 and abs(res.privacy.delta - 0.05) < 1e-15  # parallel
  assert float(jnp.linalg.norm(res.params)) <= prob.radius + 1e-5
  blocks = res.record["blocks"]
  assert all(b[1] - b[0] >= tdl.min_users(8.0, 0.05) for b in blocks)
  assert res.record["kappa"] == 4


def test_random_deletion_masks_delete_exactly_k_users():
  masks = ds.random_deletion_masks(jax.random.key(0), 10, 3, 64)
  chex.assert_shape(masks, (64, 10))
  np.testing.assert_array_equal(np.asarray(jnp.sum(~masks, axis=1)), 3)
  assert len({tuple(np.asarray(r)) for r in masks}) > 10
  with pytest.raises(ValueError, match="k="):
    ds.random_deletion_masks(jax.random.key(0), 4, 5, 2)


def test_the_numbers_the_release_is_decided_on_are_computed_at_highest_precision():
  """The deletion-set table, the solver and the certificate ask for Precision.HIGHEST whatever
  the backend default (GPU: TF32, ~1e-3 relative, ran these tests off by that much on an H200):
  a lint of their jaxprs, which a CPU can check. The lint has power: the same user function
  traced outside the library's wrapper shows its default-precision dot."""
  from precision_lint import default_precision_dots  # tests/ is on sys.path under pytest
  U = jnp.asarray(np.random.default_rng(0).normal(size=(5, 2)), jnp.float32)

  def f_default(mask):                      # a user's f, written without any precision
    w = mask.astype(jnp.float32)
    return (w @ U) / jnp.maximum(jnp.sum(w), 1.0)
  bare = jax.make_jaxpr(lambda: jax.lax.map(f_default, ds.subset_keep_masks(5)))()
  assert default_precision_dots(bare)                       # the lint sees it ...
  wrapped = jax.make_jaxpr(lambda: ds.evaluate_all_subsets(f_default, 5))()
  assert default_precision_dots(wrapped) == []              # ... and the library pins it
  prob = op.l2_logistic({"n_users": 5, "m": 3, "d": 2, "l2": 0.5, "n_eval": 10},
                        jax.random.key(4))
  cfg = {"epsilon": 1.0, "delta": 1e-3, "stability_test": "exact", "Delta": 0.05,
         "max_exact_users": 5}
  info = op.plan_sc_output_pert(n_users=5, m=3, lipschitz=prob.lipschitz,
                                smoothness=prob.smoothness, mu0=0.5, lam=0.0,
                                radius=prob.radius, epsilon=1.0, delta=1e-3, beta=1e-3,
                                settings=op.settings_from_cfg(cfg))
  zero = jnp.zeros(2)
  table = jax.make_jaxpr(lambda d: solver.solve_all_subsets(
      d, zero, zero, loss_fn=prob.loss_fn, lam=0.0, plan=info.plan,
      radius=float(prob.radius), n_users=5))(prob.data)
  cert = jax.make_jaxpr(lambda d: solver.certify_solution(
      d, zero, zero, zero, loss_fn=prob.loss_fn, lam=0.0, mu=0.5, gamma=1.0, e_max=1.0,
      radius=float(prob.radius)))(prob.data)
  assert default_precision_dots(table) == [] and default_precision_dots(cert) == []


# ---- replace-one keeps the user's slot: the same sub-dataset is the same computation --------

def test_replaced_user_keeps_its_slot_so_every_shared_sub_dataset_is_bitwise_equal():
  """Thm 3.3's proof evaluates f on the same sub-dataset from two neighbouring datasets. Under
  the library's replace-one (ordered users: the replaced user keeps its id, hence its slot;
  :data:`dpsco_jax.privacy.relations.PUBLIC`) every deletion set containing the replaced slot
  gives bitwise the same f, even for a NaN/huge replacement. The power check: the *same*
  sub-datasets laid out in another user order (what a replacement that changed the user's id,
  and so its sorted slot, would do) are not bitwise equal, so the convention is load-bearing
  (a masked sum reorders its float additions)."""
  n, m, d, i = 6, 3, 2, 2
  data = _logit_data(jax.random.key(11), n, m, d)
  # mixed magnitudes (norms <= 1 keep the planned smoothness) so that the order of the users'
  # float additions shows in the last bits
  data["x"] = data["x"] * jnp.array([1.0, 1e-2, 0.5, 1e-3, 0.3, 0.9])[:, None, None]
  twin = {"x": data["x"].at[i].set(jnp.nan), "y": data["y"].at[i].set(1.0)}
  twin2 = {"x": data["x"].at[i].set(1e30), "y": data["y"]}
  zero = jnp.zeros(d)
  table = lambda dd: np.asarray(solver.solve_all_subsets(dd, zero, zero, loss_fn=LOSS,
                                                         lam=0.0, plan=PLAN, radius=2.0,
                                                         n_users=n))
  F, F_nan, F_big = table(data), table(twin), table(twin2)
  with_i = np.array([(s >> i) & 1 for s in range(2 ** n)], bool)
  assert np.isfinite(F).all()
  np.testing.assert_array_equal(F_nan[with_i], F[with_i])
  np.testing.assert_array_equal(F_big[with_i], F[with_i])
  assert not np.allclose(F_nan[~with_i], F[~with_i], equal_nan=True)  # i's data was read there

  perm = np.array([5, 3, 0, 4, 1, 2])          # new slot j holds old user perm[j]
  F_perm = table(jax.tree.map(lambda a: a[perm], data))
  old_bit = lambda s: sum(((s >> j) & 1) << int(perm[j]) for j in range(n))
  same_sets = F[[old_bit(s) for s in range(2 ** n)]]
  np.testing.assert_allclose(F_perm, same_sets, atol=1e-5)    # the same sub-datasets ...
  assert not np.array_equal(F_perm, same_sets)                # ... not the same bits
