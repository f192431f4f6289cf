"""Contracts of the low-level stages (issues 12 §2, 14 §1, 16 §3): strict argument types,
checked masks and keys, float32+ norms/noise, explicit matmul precision, degenerate inputs and
secrets kept out of reprs. Every test here failed on the code before the hardening."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from dpsco_jax import (add_gaussian_noise, aggregate, aggregation_sensitivity, clip_and_aggregate,
                       clip_per_user, per_user_grads)
from dpsco_jax._checks import (check_bool, check_epsilon, check_int, check_key, check_positive,
                               check_user_mask)
from dpsco_jax.privacy.mechanisms import gaussian_sigma_analytic, laplace
from dpsco_jax.transforms import tree_noise as tn
from dpsco_jax.transforms.clipping import _round_toward_zero
from dpsco_jax.transforms.filtering import filter_points, outlier_filter
from dpsco_jax.transforms.noise import tree_gaussian_like

U, D = 6, 300


def _f64_norms(stacked):
  rows = [np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in jax.tree.leaves(stacked)]
  return np.linalg.norm(np.concatenate(rows, axis=1), axis=1)


# ------------------------------------------------------------------------- argument types

@pytest.mark.parametrize("make,name", [
    (lambda v: clip_per_user(v), "max_norm"),
    (lambda v: clip_and_aggregate(v, "sum"), "clip_norm"),
    (lambda v: aggregate("mean", v), "denominator"),
    (lambda v: add_gaussian_noise(v, 0), "stddev"),
    (lambda v: tn.tree_prefix_sum_noise(v, 8, 0), "noise_std"),
    (lambda v: check_epsilon(v), "epsilon"),
    (lambda v: outlier_filter(5, v, key=0, epsilon=1.0), "radius"),
])
@pytest.mark.parametrize("bad", [True, "1.0", None])
def test_bools_strings_none_are_not_numbers(make, name, bad):
  # None for aggregate's denominator has its own message ("required"); a ValueError as before
  err = ValueError if bad is None else TypeError
  with pytest.raises(err, match=name):
    make(bad)


def test_numbers_of_every_kind_are_accepted_and_ranges_still_valueerror():
  assert check_positive(np.float32(2.0), "x") == 2.0
  assert check_positive(jnp.asarray(2.0), "x") == 2.0
  assert check_int(np.int64(3), "n") == 3 and check_int(3.0, "n") == 3
  clip_per_user(np.float64(1.0))
  with pytest.raises(TypeError, match="n"):
    check_int("3", "n")
  with pytest.raises(TypeError, match="n"):
    check_int(False, "n", minimum=0)
  with pytest.raises(ValueError, match="max_norm"):
    clip_per_user(-1.0)
  # traced hyper-parameters pass through (validated by the caller while concrete)
  assert float(jax.jit(lambda c: check_positive(c, "c") * 2)(1.5)) == 3.0


@pytest.mark.parametrize("make", [
    lambda d: clip_per_user(1.0, debug=d),
    lambda d: clip_and_aggregate(1.0, "sum", debug=d),
    lambda d: outlier_filter(5, 1.0, key=0, epsilon=1.0, debug=d),
])
@pytest.mark.parametrize("bad", ["false", "true", 0, 1, None])
def test_only_a_real_bool_switches_debug(make, bad):
  with pytest.raises(TypeError, match="debug"):
    make(bad)
  make(False)
  make(np.bool_(True))
  assert check_bool(True, "debug") is True


def test_keys_are_validated():
  good_typed, good_raw = jax.random.key(0), jax.random.PRNGKey(0)
  assert check_key(good_typed) is good_typed and check_key(good_raw) is good_raw
  for bad in ("seed", 1.5, True, jnp.zeros(3, jnp.uint32), jnp.zeros(2, jnp.float32)):
    with pytest.raises(TypeError, match="key"):
      add_gaussian_noise(1.0, bad)
  with pytest.raises(ValueError, match="key"):
    check_key(jax.random.split(good_typed, 2))
  with pytest.raises(TypeError, match="key"):
    laplace("k", (3,))
  with pytest.raises(TypeError, match="key"):
    outlier_filter(5, 1.0, key="k", epsilon=1.0)
  add_gaussian_noise(1.0, np.int64(3))  # an int seed is fine


# ------------------------------------------------------------------------------ user_mask

def _grads():
  return {"w": jax.random.normal(jax.random.key(0), (U, 4)), "b": jnp.ones((U,))}


def _mask_consumers():
  g = _grads()
  clip, agg = clip_per_user(1.0), aggregate("mean", 4.0)
  fused, filt = clip_and_aggregate(1.0, "mean", 4.0), outlier_filter(U, 1.0, key=0, epsilon=1.0)
  batch = {"x": jnp.ones((U, 3, 4)), "y": jnp.ones((U, 3))}
  loss = lambda w, ex: jnp.sum(ex["x"] * w) * ex["y"]
  return {
      "clip_per_user": lambda m: clip.update(g, clip.init(None), None, user_mask=m),
      "aggregate": lambda m: agg.update(g, agg.init(None), None, user_mask=m),
      "clip_and_aggregate": lambda m: fused.update(g, fused.init(None), None, user_mask=m),
      "outlier_filter": lambda m: filt.update(g, filt.init(None), None, user_mask=m),
      "filter_points": lambda m: filter_points(g, jax.random.key(1), score_radius=1.0,
                                               user_mask=m),
      "per_user_grads": lambda m: per_user_grads(loss, jnp.zeros(4), batch, user_mask=m),
  }


@pytest.mark.parametrize("stage", sorted(_mask_consumers()))
def test_user_mask_must_be_bool_of_shape_u(stage):
  run = _mask_consumers()[stage]
  for shape in ((1,), (), (U + 1,), (U, 1)):
    with pytest.raises(ValueError, match="user_mask"):
      run(jnp.ones(shape, bool))
    with pytest.raises(ValueError, match="user_mask"):  # static check, also under jit
      jax.jit(run)(jnp.ones(shape, bool))
  for dtype in (jnp.int32, jnp.float32):
    with pytest.raises(TypeError, match="user_mask"):
      run(jnp.ones((U,), dtype))
  jax.jit(run)(jnp.arange(U) < 4)


def test_broadcast_mask_no_longer_breaks_replace_one_sensitivity():
  """The fuzzed failure: a (1,) mask counted padded duplicates of one user (moved 10 vs a
  bound of 2). Now it raises, and the correct [U] mask keeps the bound."""
  g = jnp.zeros((U, 2)).at[:].set(jnp.array([5.0, 0.0]))  # padded slots copy user 0
  tx = clip_and_aggregate(1.0, "sum")
  with pytest.raises(ValueError, match="user_mask"):
    tx.update(g, tx.init(None), None, user_mask=jnp.ones((1,), bool))
  mask = jnp.arange(U) < 1
  a, _ = tx.update(g, tx.init(None), None, user_mask=mask)
  b, _ = tx.update(-g, tx.init(None), None, user_mask=mask)
  assert np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)) <= 2.0


# ------------------------------------------------------------------- dtypes and precision

def _low_precision_grads(dtype, scale=20.0, users=U):
  # |g| ~ 20 over 300 entries: a float16 squared norm overflows (~1.2e5 > 65504)
  return (scale * jax.random.normal(jax.random.key(3), (users, D))).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("clip", [1.0, 0.37, 3e-3])
def test_low_precision_rows_clip_to_at_most_c_in_float64(dtype, clip):
  g = _low_precision_grads(dtype, users=256)
  for per_layer in (False, True):
    tx = clip_per_user(clip, per_layer=per_layer)
    # jitted: XLA:GPU folds f32->bf16->f32 round trips, which broke a compare-based rounding
    out, _ = jax.jit(tx.update)({"a": g, "b": g[:, :7]}, tx.init(None))
    assert out["a"].dtype == dtype
    norms = _f64_norms(out)
    assert np.all(norms <= clip), (norms.max() / clip - 1)
    assert np.all(norms >= 0.98 * clip)  # clipped, not dropped (float16 overflow)
  # fused: one user's contribution (sum over a single real user) has norm <= C
  g = g[:U]
  fused = clip_and_aggregate(clip, "sum")
  for u in range(U):
    out, _ = fused.update(g, fused.init(None), None, user_mask=jnp.arange(U) == u)
    assert out.dtype == jnp.promote_types(dtype, jnp.float32)
    assert 0.98 * clip <= np.linalg.norm(np.asarray(out, np.float64)) <= clip


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_round_toward_zero_never_increases_a_magnitude(dtype):
  y = jax.random.normal(jax.random.key(0), (50_000,)) * jnp.logspace(-9, 4, 50_000)
  r = jax.jit(lambda v: _round_toward_zero(v, dtype))(y)
  a, b = np.abs(np.asarray(r, np.float64)), np.abs(np.asarray(y, np.float64))
  assert r.dtype == dtype and np.all(a <= b)
  normal = b > 1e-4
  assert np.all(a[normal] >= b[normal] * (1 - 2.0 ** -(jnp.finfo(dtype).nmant - 1)))


def test_integer_gradients_are_promoted_not_zeroed():
  g = jnp.arange(U * 5, dtype=jnp.int32).reshape(U, 5) + 3
  tx = clip_per_user(1.0)
  out, _ = tx.update(g, tx.init(None))
  assert out.dtype == jnp.float32
  norms = _f64_norms(out)
  assert np.all((norms > 0.99) & (norms <= 1.0))
  fused = clip_and_aggregate(1.0, "sum")
  agg, _ = fused.update(g, fused.init(None))
  np.testing.assert_allclose(agg, out.sum(0), rtol=1e-5)


def test_low_precision_replace_one_within_sensitivity():
  g = _low_precision_grads(jnp.bfloat16)
  chain = optax.chain(clip_per_user(0.5), aggregate("mean", 3.0))
  clean, _ = chain.update(g, chain.init(None))
  bad = g.at[2].set(jnp.asarray(-7e3, jnp.bfloat16))
  dirty, _ = chain.update(bad, chain.init(None))
  assert clean.dtype == jnp.float32  # the aggregate is not rounded before the noise
  moved = np.linalg.norm(np.asarray(dirty, np.float64) - np.asarray(clean, np.float64))
  bound = aggregation_sensitivity(0.5, mode="mean", denominator=3.0, relation="replace_one")
  assert 0.5 * bound < moved <= bound


def _dot_precisions(fn, *args):
  chunks = str(jax.make_jaxpr(fn)(*args)).split("dot_general[")[1:]
  assert chunks, "expected a dot_general"
  return [re.search(r"precision=([^\n]*)", c).group(1) for c in chunks]


def test_guarantee_matmuls_run_at_highest_precision():
  g = jnp.ones((U, 5))
  fused = clip_and_aggregate(1.0, "sum")
  agg = aggregate("sum")
  for fn in (lambda x: fused.update(x, fused.init(None))[0],
             lambda x: agg.update(x, agg.init(None))[0],
             lambda x: filter_points(x, jax.random.key(0), score_radius=1.0).degrees):
    for p in _dot_precisions(fn, g):
      assert p.count("HIGHEST") == 2, p
  like = jnp.ones(5)
  for p in _dot_precisions(lambda k: tn.tree_prefix_noise(k, 5, like, 1.0, 3),
                           jax.random.key(0)):
    assert p.count("HIGHEST") == 2, p


# ----------------------------------------------------------------------------------- noise

def test_noise_for_bfloat16_is_drawn_and_added_in_float32():
  like = jnp.zeros((20_000,), jnp.bfloat16)
  draws = tree_gaussian_like(jax.random.key(0), like, 0.7)
  assert draws.dtype == jnp.float32
  # the chain on bf16 grads: aggregate (float32) + float32 noise, no rounding in between
  grads = jnp.zeros((4, 20_000), jnp.bfloat16)
  tx = optax.chain(clip_and_aggregate(1.0, "sum"), add_gaussian_noise(0.7, jax.random.key(5)))
  out, _ = tx.update(grads, tx.init(None))
  assert out.dtype == jnp.float32
  flat = np.asarray(out, np.float64)
  assert len(np.unique(flat)) > 19_900  # a bfloat16 draw had ~2e3 distinct values
  assert stats.kstest(flat, stats.norm(0.0, 0.7).cdf).pvalue > 1e-3
  assert stats.kstest(flat, stats.norm(0.0, 0.8).cdf).pvalue < 1e-6
  # with bf16 params the noisy sum is rounded once, after the addition (post-processing)
  params = jnp.zeros((20_000,), jnp.bfloat16)
  agg = jnp.full((20_000,), 1.0 + 2.0 ** -9, jnp.float32)  # between two bf16 values
  noise = add_gaussian_noise(1e-3, jax.random.key(6))
  got, _ = noise.update(agg, noise.init(params), params)
  assert got.dtype == jnp.bfloat16
  step_key = jax.random.fold_in(jax.random.key(6), 0)
  want = (agg + tree_gaussian_like(step_key, agg, 1e-3)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_laplace_is_float32_even_when_bfloat16_is_asked():
  x = laplace(jax.random.key(0), (20_000,), 2.0, dtype=jnp.bfloat16)
  assert x.dtype == jnp.float32 and len(np.unique(np.asarray(x))) > 19_900


def test_tree_prefix_sum_is_float32_for_bfloat16_params():
  params = jnp.zeros((3,), jnp.bfloat16)
  tx = tn.tree_prefix_sum_noise(0.0, 300, 0)
  inc = jnp.full((3,), 1e-3, jnp.float32)

  @jax.jit
  def run(state):
    return jax.lax.scan(lambda st, _: tx.update(inc, st, params)[::-1], state, None,
                        length=300)

  state, outs = run(tx.init(params))
  out = outs[-1]
  assert out.dtype == jnp.bfloat16 and state.prefix.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(state.prefix), 0.3, rtol=1e-5)  # bf16 sum: 0.25


# ------------------------------------------------------------------------ degenerate inputs

def test_empty_batches_and_bad_chunks_raise_clear_errors():
  for tx in (clip_per_user(1.0), clip_and_aggregate(1.0, "sum"), aggregate("sum")):
    with pytest.raises(ValueError, match="empty"):
      tx.update(jnp.zeros((0, 5)), tx.init(None))
    with pytest.raises(ValueError, match="empty"):
      tx.update({}, tx.init(None))
  with pytest.raises(ValueError, match="empty"):
    filter_points(jnp.zeros((0, 3)), jax.random.key(0), score_radius=1.0)
  loss = lambda w, ex: jnp.sum(ex * w)
  with pytest.raises(ValueError, match="m = 0"):
    per_user_grads(loss, jnp.zeros(3), jnp.zeros((4, 0, 3)))
  with pytest.raises(ValueError, match="empty"):
    per_user_grads(loss, jnp.zeros(3), jnp.zeros((0, 2, 3)))
  batch = jnp.ones((4, 2, 3))
  for bad in (0, -1, 2.5):
    with pytest.raises(ValueError, match="chunk_size"):
      per_user_grads(loss, jnp.zeros(3), batch, chunk_size=bad)
  for bad in (True, "2"):
    with pytest.raises(TypeError, match="chunk_size"):
      per_user_grads(loss, jnp.zeros(3), batch, chunk_size=bad)
  np.testing.assert_allclose(per_user_grads(loss, jnp.zeros(3), batch, chunk_size=3),
                             np.ones((4, 3)))


def test_extreme_values_work_or_raise_never_silent_inf():
  for make in (lambda: aggregate("mean", 1e-310), lambda: clip_and_aggregate(1.0, "mean", 1e-310)):
    with pytest.raises(ValueError, match="denominator"):
      make()
  with pytest.raises(ValueError, match="denominator"):
    aggregation_sensitivity(1.0, mode="mean", denominator=1e-310)
  with pytest.raises(ValueError, match="stddev"):
    add_gaussian_noise(1e300, 0)
  with pytest.raises(ValueError, match="noise_std"):
    tn.prefix_sum_noise(1e300, 4, 0, mechanism="independent")
  # a large but representable stddev stays finite
  tx = add_gaussian_noise(1e30, 0)
  out, _ = tx.update(jnp.zeros(100), tx.init(None))
  assert np.all(np.isfinite(np.asarray(out)))
  # delta = 1e-300: a finite sigma that grows as delta shrinks (log-space profile)
  s = [gaussian_sigma_analytic(1.0, 1.0, d) for d in (1e-10, 1e-100, 1e-300)]
  assert all(np.isfinite(s)) and s[0] < s[1] < s[2]
  # norms of huge finite rows: float32 norm overflow drops the row (bounded), no NaN leaks
  tx = clip_and_aggregate(1.0, "sum")
  out, _ = tx.update(jnp.full((2, 4), 3e38, jnp.float32), tx.init(None))
  assert np.all(np.isfinite(np.asarray(out)))


# --------------------------------------------------------------------------- secrets in repr

def _key_words(key):
  return [str(int(v)) for v in np.asarray(jax.random.key_data(key)).ravel() if int(v) > 999]


def test_states_redact_keys_noiseless_sums_and_noisy_thresholds():
  key = jax.random.key(1234)
  params = jnp.zeros(3)
  g = add_gaussian_noise(1.0, key)
  gs = g.init(params)
  t = tn.tree_prefix_sum_noise(1.0, 8, key)
  _, ts = t.update(jnp.full(3, 12345.678), t.init(params), params)
  f = outlier_filter(U, 1.0, key=key, epsilon=1.0)
  fs = f.init(None)
  thr = f"{float(fs.noisy_threshold):.4f}"[:6]
  for state, secrets in ((gs, _key_words(gs.key)),
                         (ts, ["12345", *_key_words(ts.key)]),
                         (fs, [thr, *_key_words(fs.key)])):
    assert secrets
    for text in (repr(state), str(state), repr([state]), f"{state}"):
      assert "redacted" in text
      for s in secrets:
        assert s not in text, (type(state).__name__, s)
    # still a pytree with the secrets accessible as attributes, usable under jit
    assert len(jax.tree.leaves(state)) >= 2
    jax.jit(lambda s: s)(state)
  assert float(ts.prefix[0]) == pytest.approx(12345.678)
  assert "count=" in repr(gs)
