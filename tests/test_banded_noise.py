"""Banded / BLT matrix-factorization noise stages (issue #27): streaming = dense, covariance,
memory, sensitivity under participation schemas, events, canary audits with broken twins."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from dpsco_jax.audit import matrix_factorization as mfa
from dpsco_jax.audit.harness import run_audit
from dpsco_jax.privacy import calibrate_noise_multiplier
from dpsco_jax.privacy import matrix_factorization as mf
from dpsco_jax.transforms.clipping import clip_and_aggregate
from dpsco_jax.transforms.matrix_factorization import (banded_noise, blt_noise, state_floats)
from dpsco_jax.transforms.tree_noise import independent_prefix_sum_noise

HAVE_JP = mf.jax_privacy_version() is not None
_SQRT4 = mf.banded_strategy(16, 4, strategy="sqrt").coefs
_BLT = mf.blt_strategy(16, 3, strategy="sqrt")


def _stage(kind, std, T, key, output="prefix", coefs=_SQRT4):
  if kind == "banded":
    return banded_noise(std, T, key, coefs=coefs, output=output)
  return blt_noise(std, T, key, buf_decay=_BLT.buf_decay, output_scale=_BLT.output_scale,
                   output=output)


def _toeplitz(kind, T, coefs=_SQRT4):
  c = coefs if kind == "banded" else mf.blt_coefs(_BLT.buf_decay, _BLT.output_scale, T)
  return mf.toeplitz_matrix(c, T)


def _scan(tx, xs, like):
  def body(st, x):
    out, st = tx.update(x, st, like)
    return st, out
  return jax.lax.scan(body, tx.init(like), xs)[1]


def _draws(key, T, d, std):
  """The ``Z_t`` the stages draw: ``fold_in(key, t)``, as add_gaussian_noise does."""
  from dpsco_jax.transforms.noise import tree_gaussian_like
  return np.stack([np.asarray(tree_gaussian_like(jax.random.fold_in(key, t),
                                                 jnp.zeros(d), std)) for t in range(T)])


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind", ["banded", "blt"])
@pytest.mark.parametrize("output", ["prefix", "increment"])
def test_streaming_equals_dense_computation(kind, output):
  T, d, std = 16, 3, 0.7
  key = jax.random.key(3)
  x = np.asarray(jax.random.normal(jax.random.key(5), (T, d)))
  y = np.asarray(_scan(_stage(kind, std, T, key, output), jnp.asarray(x), jnp.zeros(d)))
  w = np.linalg.solve(_toeplitz(kind, T), _draws(key, T, d, std))   # C^{-1} Z
  ref = x + w if output == "increment" else np.cumsum(x + w, axis=0)
  np.testing.assert_allclose(y, ref, atol=2e-6, rtol=1e-5)


def test_bands_one_is_independent_noise():
  T, d = 12, 4
  key = jax.random.key(9)
  x = jax.random.normal(jax.random.key(1), (T, d))
  a = _scan(banded_noise(0.9, T, key, coefs=[1.0]), x, jnp.zeros(d))
  b = _scan(independent_prefix_sum_noise(0.9, T, key), x, jnp.zeros(d))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # and the single-participation event is the independent one (unit-norm strategy)
  assert mf.participation_sensitivity([1.0], T) == 1.0
  assert mf.banded_strategy(T, 1).source.startswith("identity")


@functools.lru_cache(maxsize=None)
def _noise_sampler(kind, T, d, scale):
  def one(key):
    return _scan(_stage(kind, scale, T, key), jnp.zeros((T, d)), jnp.zeros(d))
  return jax.jit(jax.vmap(one))


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_prefix_noise_covariance_ks(kind):
  """Prefix noise whitened by the claimed covariance ``sigma^2 B B^T`` (``B = A C^{-1}``) is
  i.i.d. N(0, 1): accepted at the right scale, rejected at half the std and for independent
  noise of the same sigma."""
  T, d, sigma = 16, 16, 1.3
  A = np.tril(np.ones((T, T)))
  B = A @ np.linalg.inv(_toeplitz(kind, T))
  L = np.linalg.cholesky(sigma ** 2 * B @ B.T)
  keys = jax.random.split(jax.random.key(7), 300)

  def pvalue(noise):   # noise [keys, T, d]; Bonferroni over the T whitened rows + pooled
    u = np.linalg.solve(L, np.moveaxis(np.asarray(noise, np.float64), 1, 0).reshape(T, -1))
    ps = [stats.kstest(row, "norm").pvalue for row in u] + [stats.kstest(u.ravel(), "norm").pvalue]
    return min(1.0, (T + 1) * min(ps))

  assert pvalue(_noise_sampler(kind, T, d, sigma)(keys)) > 1e-3
  assert pvalue(_noise_sampler(kind, T, d, sigma / 2)(keys)) < 1e-8
  indep = jax.vmap(lambda k: _scan(independent_prefix_sum_noise(sigma, T, k),
                                   jnp.zeros((T, d)), jnp.zeros(d)))(keys)
  assert pvalue(indep) < 1e-8


# ----------------------------------------------------------------------------- memory, contract
@pytest.mark.parametrize("bands", [1, 4, 32])
def test_state_is_o_bands_params_not_o_steps(bands):
  p = {"w": jnp.zeros((100, 10)), "b": jnp.zeros(7)}
  n = 1007
  for T in (64, 100_000):
    st = banded_noise(1.0, T, 0, coefs=np.ones(bands)).init(p)
    assert state_floats(st) <= (max(bands - 1, 1) + 1) * n + 2
    inc = banded_noise(1.0, T, 0, coefs=np.ones(bands), output="increment").init(p)
    assert state_floats(inc) <= max(bands - 1, 1) * n + 2
  st = blt_noise(1.0, 100_000, 0, buf_decay=[0.9, 0.5, 0.1], output_scale=[.1, .1, .1]).init(p)
  assert state_floats(st) <= 4 * n + 2


def test_repr_redacts_secrets_and_nan_past_horizon():
  tx = banded_noise(1.0, 2, jax.random.key(0), coefs=_SQRT4)
  st = tx.init(jnp.zeros(3))
  for _ in range(2):
    out, st = tx.update(jnp.ones(3), st)
    assert np.all(np.isfinite(out))
  out, _ = tx.update(jnp.ones(3), st)
  assert np.all(np.isnan(out))
  assert "<redacted>" in repr(st) and "ring=<redacted>" in str(st) and "key=<redacted>" in repr(st)
  b = blt_noise(1.0, 3, 0, buf_decay=[0.5], output_scale=[0.2]).init(jnp.zeros(2))
  assert "buffers=<redacted>" in repr(b)


def test_chain_forwards_user_mask_and_casts_to_params_dtype():
  tx = optax.chain(clip_and_aggregate(1.0, "sum"), banded_noise(0.0, 4, 0, coefs=_SQRT4))
  g = jnp.array([[3.0, 0.0], [0.0, 0.5], [100.0, 0.0]])
  out, _ = tx.update(g, tx.init(jnp.zeros(2, jnp.bfloat16)), jnp.zeros(2, jnp.bfloat16),
                     user_mask=jnp.array([True, True, False]))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), [1.0, 0.5])


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="coefs"):
    banded_noise(1.0, 4, 0, coefs=[0.0, 1.0])
  with pytest.raises(ValueError, match="buf_decay"):
    blt_noise(1.0, 4, 0, buf_decay=[1.0], output_scale=[0.1])
  with pytest.raises(ValueError, match="output"):
    banded_noise(1.0, 4, 0, coefs=[1.0], output="sum")


# ----------------------------------------------------------------------------- sensitivity
def _patterns(T, k, sep):
  for size in range(1, k + 1):
    for p in itertools.combinations(range(T), size):
      if all(b - a >= sep for a, b in zip(p, p[1:])):
        yield list(p)


def _brute_force(coefs, T, k, sep):
  """max over participation patterns of ||C 1_P|| (the sensitivity when C^T C >= 0)."""
  C = mf.toeplitz_matrix(coefs, T)
  return max(np.linalg.norm(C[:, p].sum(axis=1)) for p in _patterns(T, k, sep))


def _strategies():
  out = [("sqrt3", mf.banded_strategy(10, 3, strategy="sqrt").coefs),
         ("sqrt5", mf.banded_strategy(10, 5, strategy="sqrt").coefs),
         ("blt", mf.blt_coefs(_BLT.buf_decay, _BLT.output_scale, 10))]
  if HAVE_JP:
    out.append(("optimized4", mf.banded_strategy(10, 4, strategy="optimized").coefs))
  return out


@pytest.mark.parametrize("name,coefs", _strategies())
def test_sensitivity_formula_matches_brute_force(name, coefs):
  T = 10
  for k, sep in itertools.product((1, 2, 3), (1, 2, 3, 5)):
    got = mf.participation_sensitivity(coefs, T, participations=k, min_sep=sep)
    assert got == pytest.approx(_brute_force(coefs, T, k, sep), rel=1e-12), (k, sep)
  # k participations >= b apart: disjoint column supports, sens^2 = k ||c||^2
  b = int(np.count_nonzero(coefs))
  if b < T // 2:
    assert mf.participation_sensitivity(coefs, T, participations=2, min_sep=b) == \
        pytest.approx(np.sqrt(2) * np.linalg.norm(coefs))


def test_vector_valued_worst_case_is_equal_gradients():
  """With nonnegative C^T C, no choice of unit g_j beats equal ones: ||sum C_pj g_j^T||_F <=
  ||C 1_P|| (the reduction the scalar brute force relies on)."""
  rng = np.random.default_rng(0)
  C = mf.toeplitz_matrix(_SQRT4, 10)
  for _ in range(200):
    p = sorted(rng.choice(10, size=3, replace=False))
    g = rng.normal(size=(3, 4))
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    assert np.linalg.norm(C[:, p] @ g) <= np.linalg.norm(C[:, p].sum(axis=1)) + 1e-12


def test_disjoint_supports_any_sign_and_refusal_on_overlap():
  coefs = np.array([1.0, -0.6, 0.3])   # not nonnegative: only disjoint patterns are priced
  T = 9
  C = mf.toeplitz_matrix(coefs, T)
  for k in (2, 3):
    want = max(np.sqrt(sum(np.linalg.norm(C[:, j]) ** 2 for j in p))
               for p in _patterns(T, k, 3))
    assert mf.participation_sensitivity(coefs, T, participations=k, min_sep=3) == \
        pytest.approx(want)
  with pytest.raises(ValueError, match="overlap"):
    mf.participation_sensitivity(coefs, T, participations=2, min_sep=2)


@pytest.mark.skipif(not HAVE_JP, reason="jax_privacy not installed")
def test_sensitivity_and_errors_match_jax_privacy():
  from jax_privacy.matrix_factorization import buffered_toeplitz as bt
  from jax_privacy.matrix_factorization import toeplitz
  T = 64
  c = mf.banded_strategy(T, 8, strategy="sqrt").coefs
  with jax.enable_x64():
    for k, sep in ((1, 1), (4, 16), (8, 8), (3, 5)):
      jp = float(toeplitz.minsep_sensitivity_squared(jnp.asarray(c), sep, k, n=T))
      assert mf.participation_sensitivity(c, T, participations=k, min_sep=sep) ** 2 == \
          pytest.approx(jp, rel=1e-10)
    jp_err = np.asarray(toeplitz.per_query_error(strategy_coef=jnp.asarray(c), n=T))
    np.testing.assert_allclose(mf.prefix_errors(mf.toeplitz_inverse_coefs(c, T)), jp_err,
                               rtol=1e-10)
    blt = bt.BufferedToeplitz.build(_BLT.buf_decay, _BLT.output_scale)
    jp_max = float(bt.max_error(blt.inverse(), T))
    jp_sens = float(bt.sensitivity_squared(blt, T))
  ours = mf.prefix_errors(mf.blt_inverse_coefs(_BLT.buf_decay, _BLT.output_scale, T))
  assert ours[-1] == pytest.approx(jp_max, rel=1e-8)
  assert mf.participation_sensitivity(
      mf.blt_coefs(_BLT.buf_decay, _BLT.output_scale, T), T) ** 2 == pytest.approx(jp_sens)


def test_event_calibrates_through_the_one_calibrator():
  """k participations cost exactly a sensitivity factor in z (one Gaussian event)."""
  T, c = 64, mf.banded_strategy(64, 8, strategy="sqrt").coefs
  s1 = mf.participation_sensitivity(c, T)
  s4 = mf.participation_sensitivity(c, T, participations=4, min_sep=16)
  assert s1 == pytest.approx(1.0) and s4 == pytest.approx(2.0)
  z1 = calibrate_noise_multiplier(lambda z: mf.mf_event(z, s1), epsilon=1.0, delta=1e-5)
  z4 = calibrate_noise_multiplier(lambda z: mf.mf_event(z, s4), epsilon=1.0, delta=1e-5)
  assert z4 / z1 == pytest.approx(2.0, rel=1e-4)


def test_sqrt_strategy_beats_independent_and_tree_error():
  """Sanity of the strategy: at T = 256, unit sensitivity, the 32-band sqrt strategy's max
  prefix variance is below the independent noise's T and the tree's levels * popcount."""
  T = 256
  c = mf.banded_strategy(T, 32, strategy="sqrt").coefs
  err = mf.prefix_errors(mf.toeplitz_inverse_coefs(c, T))
  assert err.max() < 0.1 * T
  tree = T.bit_length() * max(bin(t + 1).count("1") for t in range(T))
  assert err.max() < tree


# ----------------------------------------------------------------------------- audits
@pytest.mark.parametrize("name", ["banded_noise", "blt_noise"])
@pytest.mark.parametrize("relation", ["zero_out", "add_remove"])
def test_canary_audit_honest_below_claim_twin_flagged(name, relation):
  honest = run_audit(mfa.build(name, relation), trials=50_000, key=11)
  twin = run_audit(mfa.build(name, relation, "single_participation_accounting"),
                   trials=50_000, key=12)
  assert 0.5 <= honest.claimed_epsilon <= 4.5
  assert not honest.violated, honest
  assert twin.violated, twin
  assert twin.claimed_epsilon < honest.claimed_epsilon
