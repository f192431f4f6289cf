"""DPTrainer on UserData: users with uneven item counts, padding weighted out (issue 13/16)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpsco_jax.data import UserData
from dpsco_jax.flax import DPTrainer


class Lin(nnx.Module):
  def __init__(self, rngs):
    self.l = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    return self.l(x)


def loss_fn(model, ex):
  return jnp.sum((model(ex["x"]) - ex["y"]) ** 2)


@pytest.mark.parametrize("method", ["fast", "vmap"])
def test_clipped_sum_is_the_sum_of_each_users_mean_over_real_items(method):
  rng = np.random.default_rng(0)
  ids = np.array([0] * 5 + [1] * 1 + [2] * 3 + [3] * 2)
  x = rng.normal(size=(ids.size, 3)).astype(np.float32)
  y = rng.normal(size=(ids.size, 2)).astype(np.float32)
  data = UserData.from_arrays({"x": x, "y": y}, ids)
  model = Lin(nnx.Rngs(0))
  tr = DPTrainer(model, loss_fn, optax.sgd(0.1), data=data, clip_norm=1e6, sampling_rate=0.5,
                 delta=1e-5, relation="zero_out", noise_multiplier=1.0, method=method)
  summed, info = tr.clipper.clipped_sum(tr.clipper.params, tr.data, jnp.ones(4, bool))
  graphdef, params = nnx.split(model, nnx.Param)
  def item_grad(i):
    g = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p), {"x": x[i], "y": y[i]}))(params)
    return np.concatenate([np.ravel(v) for v in jax.tree.leaves(g)])
  want = sum(np.mean([item_grad(i) for i in np.flatnonzero(ids == u)], axis=0)
             for u in range(4))
  got = np.concatenate([np.ravel(v) for v in jax.tree.leaves(summed)])
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-5)


def test_trainer_trains_on_user_data_and_item_level_reads_real_items():
  rng = np.random.default_rng(1)
  ids = rng.integers(0, 30, 200)
  x = rng.normal(size=(200, 3)).astype(np.float32)
  y = (x @ np.ones((3, 2), np.float32)).astype(np.float32)
  data = UserData.from_arrays({"x": x, "y": y}, ids, max_items_per_user=6)
  model = Lin(nnx.Rngs(0))
  tr = DPTrainer(model, loss_fn, optax.sgd(0.05), data=data, clip_norm=5.0, sampling_rate=0.5,
                 delta=1e-5, relation="zero_out", noise_multiplier=0.5, key=3)
  before = float(np.mean([loss_fn(model, {"x": x[i], "y": y[i]}) for i in range(20)]))
  tr.train(40)
  after = float(np.mean([loss_fn(model, {"x": x[i], "y": y[i]}) for i in range(20)]))
  assert after < 0.5 * before
  item_args = dict(clip_norm=5.0, sampling_rate=0.1, delta=1e-5, relation="zero_out",
                   noise_multiplier=0.5, level="item")
  assert data.n_dropped.any()   # the bound of 6 dropped items: no item-level guarantee
  with pytest.raises(ValueError, match="item-level guarantee"):
    DPTrainer(Lin(nnx.Rngs(0)), loss_fn, optax.sgd(0.05), data=data, **item_args)
  full = UserData.from_arrays({"x": x, "y": y}, ids)
  item = DPTrainer(Lin(nnx.Rngs(0)), loss_fn, optax.sgd(0.05), data=full, **item_args)
  assert item.n == 200 == int(full.n_items.sum())   # real items only, no padding rows
