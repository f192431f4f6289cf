"""Binary-tree and independent noisy prefix sums (paper 003 Lemma 5.6; spec 003 §7.5 T1–T4)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax.transforms import tree_noise as tn


def _scan(tx, increments, params_like):
  state = tx.init(params_like)
  def body(st, x):
    out, st = tx.update(x, st)
    return st, out
  return jax.lax.scan(body, state, increments)[1]


@functools.partial(jax.jit, static_argnames=("sigma", "T", "mechanism"))
def _stream(key, increments, params_like, *, sigma, T, mechanism="tree"):
  """Outputs [T, ...] of the stage fed with ``increments`` under jit + lax.scan (compiled once
  per (sigma, T, mechanism, shapes); the key is traced)."""
  return _scan(tn.prefix_sum_noise(sigma, T, key, mechanism=mechanism), increments,
               params_like)


@functools.lru_cache(maxsize=None)
def _noise_sampler(T: int, mechanism: str):
  """vmap over keys of the prefix noise of a zero stream, sigma = 1, p = 1: [keys, T, 1]."""
  def one(key):
    return _scan(tn.prefix_sum_noise(1.0, T, key, mechanism=mechanism), jnp.zeros((T, 1)),
                 jnp.zeros(1))
  return jax.jit(jax.vmap(one))


_node_noise = jax.jit(tn.node_noise, static_argnames=("stddev",))


def _shared_nodes(s: int, t: int) -> int:
  return len(set(tn.prefix_nodes(s + 1)) & set(tn.prefix_nodes(t + 1)))


@pytest.mark.parametrize("T", [1, 2, 7, 8, 100])
@pytest.mark.parametrize("mechanism", tn.MECHANISMS)
def test_zero_noise_gives_exact_prefix_sums(T, mechanism):
  incs = jax.random.normal(jax.random.key(T), (T, 3), jnp.float32)
  out = _stream(jax.random.key(0), incs, jnp.zeros(3), sigma=0.0, T=T, mechanism=mechanism)
  chex.assert_shape(out, (T, 3))
  np.testing.assert_array_equal(np.asarray(out), np.cumsum(np.asarray(incs), axis=0))


def test_zero_noise_multi_leaf_pytree():
  T = 7
  params = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(3)}
  incs = {"w": jnp.arange(T * 4, dtype=jnp.float32).reshape(T, 2, 2),
          "b": -jnp.ones((T, 3))}
  out = _stream(jax.random.key(1), incs, params, sigma=0.0, T=T)
  chex.assert_trees_all_close(out, jax.tree.map(lambda x: jnp.cumsum(x, axis=0), incs))


@pytest.mark.slow
def test_prefix_variance_is_popcount_and_covariance_is_shared_nodes():
  T, n_keys = 13, 20000
  keys = jax.random.split(jax.random.key(7), n_keys)
  samples = np.asarray(_noise_sampler(T, "tree")(keys))[..., 0]          # [keys, T]
  var = samples.var(axis=0)
  expected = np.array([tn.prefix_noise_variance(t, "tree") for t in range(T)])
  np.testing.assert_array_equal(expected, [bin(t + 1).count("1") for t in range(T)])
  # +-5% accepts the right scale and rejects 0.5x / 1.5x of the node std (0.25x / 2.25x var)
  np.testing.assert_allclose(var, expected, rtol=0.05)
  assert var.max() <= T.bit_length() * 1.05
  assert np.all(np.abs(samples.mean(axis=0)) < 5 * np.sqrt(expected / n_keys))
  cov = np.cov(samples, rowvar=False)
  shared = np.array([[_shared_nodes(s, t) for t in range(T)] for s in range(T)])
  tol = 5 * np.sqrt((np.outer(expected, expected) + shared ** 2) / n_keys)
  assert np.all(np.abs(cov - shared) <= tol), np.abs(cov - shared).max()
  # leaf 8 shares nothing with leaf 7; leaves 6 and 7 share s_{1,2} and s_{3,1}
  assert shared[6, 7] == 0 and shared[5, 6] == 2


@pytest.mark.slow
def test_independent_prefix_variance_is_linear():
  T, n_keys = 13, 20000
  keys = jax.random.split(jax.random.key(8), n_keys)
  samples = np.asarray(_noise_sampler(T, "independent")(keys))[..., 0]
  np.testing.assert_allclose(samples.var(axis=0), np.arange(1, T + 1), rtol=0.05)
  cov = np.cov(samples, rowvar=False)
  np.testing.assert_allclose(cov[3, 9], 4.0, atol=5 * np.sqrt(4 * 10 / n_keys) + 0.1)


def test_tree_beats_independent_at_fixed_mu_for_long_streams():
  # At a fixed mu, z_tree = sqrt(levels) z_ind; the worst prefix variance is
  # max popcount * levels * s^2 = O(log^2 T) for the tree vs T s^2 for independent noise.
  T = 1024
  levels = tn.tree_levels(T)
  z_ind = 1.0
  z_tree = z_ind * np.sqrt(levels)
  assert tn.prefix_noise_mu(z_tree, T) == pytest.approx(
      tn.prefix_noise_mu(z_ind, T, mechanism="independent"))
  worst_tree = max(tn.prefix_noise_variance(t, "tree") for t in range(T)) * z_tree ** 2
  worst_ind = tn.prefix_noise_variance(T - 1, "independent") * z_ind ** 2
  assert worst_tree == 10 * 11 and worst_ind == 1024
  assert worst_ind / worst_tree > 9


@pytest.mark.parametrize("T", [7, 8, 16, 100, 1000])
def test_unit_impulse_touches_bit_length_nodes(T):
  nodes = tn.tree_nodes(T)
  assert len(nodes) == T                       # one node ends at every leaf
  touched = []
  for i in range(T):
    impulse = np.zeros(T)
    impulse[i] = 1.0
    enc = tn.tree_encode(impulse)
    hit = [(k, j) for (k, j), v in enc.items() if v != 0.0]
    assert len({k for k, _ in hit}) == len(hit)  # at most one node per level
    touched.append(len(hit))
  assert max(touched) == T.bit_length() == tn.tree_levels(T)
  assert tn.tree_levels(T, "paper") >= tn.tree_levels(T)


def test_decoder_reproduces_prefix_sums_and_paper_example():
  assert sorted(tn.prefix_nodes(7)) == [(0, 7), (1, 3), (2, 1)]  # s_{7,0} + s_{3,1} + s_{1,2}
  x = np.random.default_rng(0).normal(size=100)
  enc = tn.tree_encode(x)
  dec = np.array([sum(enc[node] for node in tn.prefix_nodes(t + 1)) for t in range(100)])
  np.testing.assert_allclose(dec, np.cumsum(x), rtol=1e-12, atol=1e-12)


def test_streaming_noise_equals_explicit_noisy_encoder():
  T, sigma = 11, 0.7
  key = jax.random.key(3)
  incs = jax.random.normal(jax.random.key(4), (T, 2))
  out = np.asarray(_stream(key, incs, jnp.zeros(2), sigma=sigma, T=T))
  enc = tn.tree_encode(np.asarray(incs, np.float64))
  like = jnp.zeros(2)
  noisy = {(k, j): v + np.asarray(_node_noise(key, k, j, like, stddev=sigma))
           for (k, j), v in enc.items()}
  expect = np.array([sum(noisy[nd] for nd in tn.prefix_nodes(t + 1)) for t in range(T)])
  np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5)
  # determinism: the same key regenerates the same stream; another key does not
  again = _stream(key, incs, jnp.zeros(2), sigma=sigma, T=T)
  np.testing.assert_array_equal(out, np.asarray(again))
  other = _stream(jax.random.key(5), incs, jnp.zeros(2), sigma=sigma, T=T)
  assert not np.allclose(out, np.asarray(other))


def test_node_noises_are_all_distinct():
  T = 64
  key = jax.random.key(0)
  ks, js = (jnp.array(v, jnp.uint32) for v in zip(*[(k, j) for k, j, _, _ in tn.tree_nodes(T)]))
  draws = np.asarray(jax.jit(jax.vmap(lambda k, j: tn.node_noise(key, k, j, jnp.zeros(4), 1.0)))(
      ks, js))
  assert len({tuple(np.round(d, 6)) for d in draws}) == T


@pytest.mark.parametrize("mechanism", tn.MECHANISMS)
def test_stepping_past_max_steps_is_flagged(mechanism):
  out = _stream(jax.random.key(0), jnp.ones((5, 2)), jnp.zeros(2), sigma=0.1, T=4,
                mechanism=mechanism)
  assert np.all(np.isfinite(np.asarray(out[:4])))
  assert np.all(np.isnan(np.asarray(out[4])))


def test_state_is_a_jittable_pytree_and_keeps_the_secret_sum():
  tx = tn.tree_prefix_sum_noise(1.0, 8, jax.random.key(0))
  params = {"a": jnp.zeros(3)}
  state = tx.init(params)
  assert isinstance(state, tn.TreePrefixNoiseState)
  inc = {"a": jnp.ones(3)}
  out, state = jax.jit(tx.update)(inc, state)
  out, state = jax.jit(tx.update)(inc, state)
  chex.assert_trees_all_close(state.prefix, {"a": 2 * jnp.ones(3)})
  assert int(state.count) == 2
  assert not np.allclose(np.asarray(out["a"]), 2.0)        # the emitted sum is noisy
  restored = jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(state))
  assert isinstance(restored, tn.TreePrefixNoiseState)


def test_memory_is_order_params():
  params = jnp.zeros(1000)
  state = tn.tree_prefix_sum_noise(1.0, 1 << 20, jax.random.key(0)).init(params)
  n_floats = sum(np.size(x) for x in jax.tree.leaves(state)
                 if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))
  assert n_floats <= 1001   # the secret running sum and the counter; no per-node storage


def test_accounting_mu_and_event():
  assert tn.prefix_noise_mu(2.0, 8) == pytest.approx(np.sqrt(4) / 2.0)
  assert tn.prefix_noise_mu(2.0, 8, mechanism="independent") == pytest.approx(0.5)
  assert tn.prefix_noise_mu(2.0, 8, levels="paper") == pytest.approx(np.sqrt(4) / 2.0)
  assert tn.prefix_noise_mu(2.0, 9, levels="paper") == pytest.approx(np.sqrt(5) / 2.0)
  ev = tn.prefix_noise_event(3.0, 100)
  assert ev.noise_multiplier == pytest.approx(3.0 / np.sqrt(7))


@pytest.mark.parametrize("kwargs, name", [
    (dict(noise_std=-1.0, max_steps=4), "noise_std"),
    (dict(noise_std=1.0, max_steps=0), "max_steps"),
    (dict(noise_std=1.0, max_steps=4, mechanism="laplace"), "mechanism"),
])
def test_bad_arguments_raise_naming_the_parameter(kwargs, name):
  with pytest.raises(ValueError, match=name):
    tn.prefix_sum_noise(key=jax.random.key(0), **kwargs)
  with pytest.raises(ValueError, match="noise_multiplier"):
    tn.prefix_noise_mu(0.0, 4)
