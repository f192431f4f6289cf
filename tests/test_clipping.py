"""Clipping and aggregation: norms, adversarial replacement, NaN/Inf users, sensitivity."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as st

from dpsco_jax import (aggregate, aggregation_sensitivity, clip_and_aggregate, clip_per_user,
                       tree_global_norms)
from dpsco_jax.transforms.steps import tree_l2_norm

U = 8


def stacked(key, scale=3.0):
  k1, k2 = jax.random.split(key)
  return {"a": scale * jax.random.normal(k1, (U, 3, 2)), "b": scale * jax.random.normal(k2, (U, 5))}


def test_every_norm_at_most_clip():
  g = stacked(jax.random.key(0))
  for per_layer in (False, True):
    tx = clip_per_user(1.5, per_layer=per_layer)
    out, _ = tx.update(g, tx.init(None))
    norms = tree_global_norms(out)
    chex.assert_shape(norms, (U,))
    assert np.all(np.asarray(norms) <= 1.5 * (1 + 1e-5))
  # small rows are untouched
  small = jax.tree.map(lambda x: 1e-3 * x, g)
  tx = clip_per_user(1.5)
  out, _ = tx.update(small, tx.init(None))
  chex.assert_trees_all_close(out, small)


ADVERSARIES = {
    "huge": lambda row: jax.tree.map(lambda x: 1e30 * jnp.ones_like(x), row),
    "nan": lambda row: jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), row),
    "inf": lambda row: jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), row),
    "opposite": lambda row: jax.tree.map(lambda x: -1e3 * x, row),
    "zero": lambda row: jax.tree.map(jnp.zeros_like, row),
}


@pytest.mark.parametrize("mode,denominator", [("sum", None), ("mean", 8.0), ("mean", 32.0)])
@given(seed=st.integers(0, 10_000), victim=st.integers(0, U - 1),
       adversary=st.sampled_from(sorted(ADVERSARIES)), clip=st.floats(0.1, 10.0))
def test_replacing_one_user_moves_aggregate_within_sensitivity(mode, denominator, seed, victim,
                                                               adversary, clip):
  g = stacked(jax.random.key(seed))
  tx = clip_and_aggregate(clip, mode, denominator)
  clean, _ = tx.update(g, tx.init(None))
  row = jax.tree.map(lambda x: x[victim], g)
  bad_row = ADVERSARIES[adversary](row)
  g_bad = jax.tree.map(lambda x, r: x.at[victim].set(r), g, bad_row)
  dirty, _ = tx.update(g_bad, tx.init(None))
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(dirty))
  moved = float(tree_l2_norm(jax.tree.map(jnp.subtract, dirty, clean)))
  bound = aggregation_sensitivity(clip, mode=mode, denominator=denominator,
                                  relation="replace_one")
  assert moved <= bound * (1 + 1e-5)
  # add/remove: dropping the user entirely moves it by at most half of that
  g_removed = jax.tree.map(lambda x: x.at[victim].set(0.0), g)
  removed, _ = tx.update(g_removed, tx.init(None))
  moved = float(tree_l2_norm(jax.tree.map(jnp.subtract, removed, clean)))
  assert moved <= aggregation_sensitivity(clip, mode=mode, denominator=denominator,
                                          relation="add_remove") * (1 + 1e-5)


def test_nan_and_inf_users_are_dropped_and_counted_only_in_debug():
  g = stacked(jax.random.key(1))
  g = jax.tree.map(lambda x: x.at[2].set(jnp.nan).at[5].set(jnp.inf), g)
  for debug, expected in ((True, 2), (False, 0)):
    tx = clip_per_user(1.0, debug=debug)
    out, state = jax.jit(tx.update)(g, tx.init(None))
    assert int(state.dropped) == expected
    for leaf in jax.tree.leaves(out):
      assert np.all(np.isfinite(np.asarray(leaf)))
      assert np.all(np.asarray(leaf[2]) == 0) and np.all(np.asarray(leaf[5]) == 0)


def test_mask_through_chain_and_fixed_denominator():
  g = stacked(jax.random.key(2), scale=0.01)
  mask = jnp.arange(U) < 5
  tx = clip_and_aggregate(1.0, "mean", 10.0)
  out, _ = tx.update(g, tx.init(None), None, user_mask=mask)
  want = jax.tree.map(lambda x: x[:5].sum(0) / 10.0, g)
  # float32 sums in a backend-dependent order (GPU: tree reduction): rtol ~ a few ulps x U
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-7)
  tx = clip_per_user(1.0, debug=True)
  _, state = tx.update(jax.tree.map(lambda x: x.at[6].set(jnp.nan), g), tx.init(None), None,
                       user_mask=mask)
  assert int(state.dropped) == 0  # a padded slot is not a dropped user


def test_sensitivity_formulas_and_validation():
  assert aggregation_sensitivity(2.0, mode="sum", relation="add_remove") == 2.0
  assert aggregation_sensitivity(2.0, mode="sum", relation="replace_one") == 4.0
  assert aggregation_sensitivity(2.0, mode="mean", denominator=4, relation="replace_one") == 1.0
  with pytest.raises(ValueError, match="max_norm"):
    clip_per_user(-1.0)
  with pytest.raises(ValueError, match="denominator"):
    aggregate("mean")
  with pytest.raises(ValueError, match="mode"):
    aggregate("median", 3.0)
  with pytest.raises(ValueError, match="relation"):
    aggregation_sensitivity(1.0, mode="sum", relation="swap")


@pytest.mark.parametrize("mode,denominator", [("sum", None), ("mean", 5.0)])
def test_fused_clip_and_aggregate_equals_the_chain(mode, denominator):
  g = stacked(jax.random.key(7))
  g = jax.tree.map(lambda x: x.at[1].set(jnp.nan).at[3].set(jnp.inf).at[4].multiply(1e-3), g)
  mask = jnp.array([True, True, True, True, True, False, True, False])
  g = jax.tree.map(lambda x: x.at[7].set(jnp.nan), g)  # NaN in a padded slot
  fused = clip_and_aggregate(1.0, mode, denominator, debug=True)
  chain = optax.chain(clip_per_user(1.0, debug=True), aggregate(mode, denominator))
  out_f, st_f = jax.jit(lambda u, s: fused.update(u, s, None, user_mask=mask))(g, fused.init(None))
  out_c, st_c = chain.update(g, chain.init(None), None, user_mask=mask)
  chex.assert_trees_all_close(out_f, out_c, rtol=1e-5, atol=1e-6)
  assert int(st_f.dropped) == int(st_c[0].dropped) == 2
  wrong = clip_and_aggregate(2.0, mode, denominator)
  out_w, _ = wrong.update(g, wrong.init(None), None, user_mask=mask)
  assert not np.allclose(np.asarray(out_w["b"]), np.asarray(out_c["b"]))
