"""Per-user gradient engine: loop reference, masks, chunks, offsets, two points, sharding."""

import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multidevice_users import on_four_devices

from dpsco_jax import per_example_grads, per_user_grads, per_user_grads_two_points

U, M, D = 6, 3, 4


def loss_fn(params, ex):
  h = jnp.tanh(ex["x"] @ params["w"] + params["b"])
  return jnp.sum(jnp.square(h - ex["y"])) + 0.1 * jnp.sum(params["v"]["c"] ** 2) * ex["y"][0]


@pytest.fixture(scope="module")
def setup():
  k = jax.random.key(0)
  k1, k2, k3, k4 = jax.random.split(k, 4)
  params = {"w": jax.random.normal(k1, (D, 2)), "b": jnp.array([0.1, -0.2]),
            "v": {"c": jnp.arange(3.0)}}
  batch = {"x": jax.random.normal(k2, (U, M, D)), "y": jax.random.normal(k3, (U, M, 2))}
  return params, batch


_item_grad = jax.jit(jax.grad(loss_fn))


def loop_reference(params, batch, offsets=None):
  out = []
  for u in range(U):
    gs = []
    for j in range(M):
      ex = jax.tree.map(lambda a: a[u, j], batch)
      p = params if offsets is None else jax.tree.map(lambda a, o: a + o[u, j], params, offsets)
      gs.append(_item_grad(p, ex))
    out.append(jax.tree.map(lambda *g: sum(g) / M, *gs))
  return jax.tree.map(lambda *g: jnp.stack(g), *out)


def test_matches_python_loop_on_multileaf_pytree(setup):
  params, batch = setup
  got = jax.jit(lambda p, b: per_user_grads(loss_fn, p, b))(params, batch)
  want = loop_reference(params, batch)
  chex.assert_trees_all_equal_shapes(got, want)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  chex.assert_shape(got["w"], (U, D, 2))


def test_mask_zeroes_padded_users_even_when_nan(setup):
  params, batch = setup
  bad = jax.tree.map(lambda a: a.at[2].set(jnp.nan), batch)
  mask = jnp.array([True, True, False, True, False, True])
  got = per_user_grads(loss_fn, params, bad, user_mask=mask)
  want = loop_reference(params, batch)
  for leaf_got, leaf_want in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.all(np.asarray(leaf_got[~np.asarray(mask)]) == 0.0)
    np.testing.assert_allclose(leaf_got[np.asarray(mask)], leaf_want[np.asarray(mask)],
                               rtol=1e-5, atol=1e-6)


def test_mask_does_not_recompile(setup):
  params, batch = setup
  f = jax.jit(lambda p, b, m: per_user_grads(loss_fn, p, b, user_mask=m))
  f(params, batch, jnp.ones(U, bool))
  before = f._cache_size()
  f(params, batch, jnp.arange(U) < 3)
  assert f._cache_size() == before


def test_chunked_equals_vmapped(setup):
  params, batch = setup
  full = per_user_grads(loss_fn, params, batch)
  for chunk in (1, 4, U):
    chex.assert_trees_all_close(per_user_grads(loss_fn, params, batch, chunk_size=chunk), full,
                                rtol=1e-5, atol=1e-6)


def test_offsets_and_per_item(setup):
  params, batch = setup
  offsets = jax.tree.map(lambda p: 0.1 * jax.random.normal(jax.random.key(5), (U, M) + p.shape),
                         params)
  got = per_user_grads(loss_fn, params, batch, offsets=offsets)
  # two float32 computations in different orders: equal to rounding, which depends on code
  # generation (1.4e-6 at one entry of 48 under XLA's unoptimised CPU backend, ~12 ulps of 1)
  chex.assert_trees_all_close(got, loop_reference(params, batch, offsets), rtol=1e-5, atol=4e-6)
  items = per_user_grads(loss_fn, params, batch, reduce_items=False)
  chex.assert_shape(items["w"], (U, M, D, 2))
  chex.assert_trees_all_close(jax.tree.map(lambda g: g.mean(1), items),
                              per_user_grads(loss_fn, params, batch), rtol=1e-5, atol=1e-6)


def test_item_level_is_m_equal_one(setup):
  params, batch = setup
  flat = jax.tree.map(lambda a: a.reshape((U * M,) + a.shape[2:]), batch)
  rows = jax.tree.map(lambda a: a[:, None], flat)
  chex.assert_trees_all_close(per_user_grads(loss_fn, params, rows),
                              per_example_grads(loss_fn, params, flat), rtol=1e-5, atol=1e-6)


def test_two_points(setup):
  params, batch = setup
  other = jax.tree.map(lambda p: p + 0.3, params)
  ga, gb = per_user_grads_two_points(loss_fn, params, other, batch)
  chex.assert_trees_all_close(ga, per_user_grads(loss_fn, params, batch), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(gb, per_user_grads(loss_fn, other, batch), rtol=1e-5, atol=1e-6)


def test_bad_shapes_raise(setup):
  params, batch = setup
  with pytest.raises(ValueError, match="user_mask"):
    per_user_grads(loss_fn, params, batch, user_mask=jnp.ones(U + 1, bool))
  with pytest.raises(ValueError, match="users"):
    per_user_grads(loss_fn, params, {"x": batch["x"], "y": batch["y"][:-1]})
  with pytest.raises(ValueError, match=r"\[users, m"):
    per_user_grads(loss_fn, params, {"x": jnp.ones(U), "y": jnp.ones(U)})


SHARDED_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax
    from dpsco_jax import per_user_grads, shard_users, clip_per_user, aggregate
    assert jax.device_count() == 4, jax.devices()
    loss = lambda w, ex: jnp.log1p(jnp.exp(-ex["y"] * (ex["x"] @ w)))
    k1, k2 = jax.random.split(jax.random.key(0))
    batch = {"x": jax.random.normal(k1, (16, 5, 7)), "y": jnp.sign(jax.random.normal(k2, (16, 5)))}
    w = jnp.linspace(-1, 1, 7)
    tx = optax.chain(clip_per_user(0.5), aggregate("mean", denominator=16.0))
    @jax.jit
    def step(w, b):
        g = per_user_grads(loss, w, b)
        u, _ = tx.update(g, tx.init(w), w)
        return g, u
    g1, u1 = step(w, batch)
    sharded = shard_users(batch)
    assert len(sharded["x"].sharding.device_set) == 4
    g4, u4 = step(w, sharded)
    np.testing.assert_allclose(np.asarray(g4), np.asarray(g1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(u4), np.asarray(u1), rtol=1e-6, atol=1e-7)
    print('"SHARDED-OK"')
""")


def test_four_cpu_devices_match_one_device():
  assert on_four_devices(SHARDED_SCRIPT, timeout=300) == "SHARDED-OK"
