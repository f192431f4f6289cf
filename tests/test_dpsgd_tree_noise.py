"""Issue 27: user-level DP-SGD and DPTrainer take ``noise_mechanism: tree`` (paper 003's binary
tree, its prefix sums emitted as SGD increments) under fixed-order multi-epoch schedules, priced
by the tree's exact sensitivity for the schedule's participation pattern."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from scipy import stats

import dpsco_jax
from dpsco_jax.algorithms.dpsgd import plan as P
from dpsco_jax.config.types import ConfigError
from dpsco_jax.data import UserData
from dpsco_jax.flax import DPTrainer
from dpsco_jax.transforms.tree_noise import (tree_increment_noise, tree_nodes,
                                             tree_prefix_sum_noise)


def _tree_matrix(T: int) -> np.ndarray:
  """The encoder: one row per node, 1 on the leaves (steps) it sums."""
  nodes = tree_nodes(T)
  C = np.zeros((len(nodes), T))
  for r, (_, _, first, last) in enumerate(nodes):
    C[r, first - 1:last] = 1.0
  return C


def _brute_sensitivity(T: int, period: int, k: int) -> float:
  C = _tree_matrix(T)
  worst = 0.0
  for p in range(period):
    steps = [p + i * period for i in range(k) if p + i * period < T]
    worst = max(worst, float(np.linalg.norm(C[:, steps].sum(axis=1))))
  return worst


def _plan(**kw):
  cfg = dict(epsilon=2.0, delta=1e-5, sampling="cyclic", noise_mechanism="tree",
             clip_norm=1.0, learning_rate=0.1, batch_size=10)
  cfg.update(kw)
  return P.plan_dp_sgd(P.config_view(cfg), level="user", realized_rows=cfg.pop("n", 60),
                       rows_per_user=1, default_clip=1.0, radius=float("inf"))


@pytest.mark.parametrize("n,batch,steps", [(60, 10, 18), (40, 10, 13), (30, 10, 2),
                                           (12, 12, 7)])
def test_the_plan_prices_the_tree_by_its_exact_participation_sensitivity(n, batch, steps):
  p = _plan(n=n, batch_size=batch, num_steps=steps)
  period = -(-n // batch)
  k = -(-steps // period)
  assert p.mf.kind == "tree" and p.participations == k
  want = _brute_sensitivity(steps, min(period, steps), k)
  assert p.mf.sensitivity == pytest.approx(want, rel=1e-12)
  # a twin priced as one participation under-counts whenever a user takes part twice
  one = _brute_sensitivity(steps, steps, 1)
  assert (p.mf.sensitivity > one * 1.01) == (k > 1)
  assert p.event.noise_multiplier == pytest.approx(p.noise_multiplier / want)
  # the progress event of a prefix of the run prices the prefix's own participations
  half = steps // 2 or 1
  k_half = -(-half // min(period, half))
  assert p.event_after(half).noise_multiplier == pytest.approx(
      p.noise_multiplier / _brute_sensitivity(half, min(period, half), min(k, k_half)))


def test_increments_sum_to_the_trees_prefixes_with_the_right_noise_scale():
  T, sigma, trials = 8, 0.7, 4000
  keys = jax.random.split(jax.random.key(3), trials)
  deltas = jnp.arange(1.0, T + 1.0)[:, None] * jnp.ones((T, 1))

  def run(stage, key):
    st = stage(sigma, T, key)
    state = st.init(jnp.zeros(1))
    outs = []
    for t in range(T):
      o, state = st.update(deltas[t], state, jnp.zeros(1))
      outs.append(o)
    return jnp.stack(outs)[:, 0]

  inc = jax.jit(jax.vmap(lambda k: run(tree_increment_noise, k)))(keys)
  pre = jax.jit(jax.vmap(lambda k: run(tree_prefix_sum_noise, k)))(keys)
  np.testing.assert_allclose(np.cumsum(np.asarray(inc), axis=1), np.asarray(pre), atol=1e-4)
  # the iterate after t + 1 steps holds the tree's prefix noise: Var = popcount(t+1) sigma^2
  noise = np.cumsum(np.asarray(inc), axis=1) - np.cumsum(np.asarray(deltas[:, 0]))
  for t in (0, 2, 6):
    scale = sigma * np.sqrt(bin(t + 1).count("1"))
    # a frozen cdf, not ("norm", args=...): the GPU image's scipy passed those args to ndtr
    assert stats.kstest(noise[:, t], stats.norm(0, scale).cdf).pvalue > 1e-3
    assert stats.kstest(noise[:, t], stats.norm(0, 1.3 * scale).cdf).pvalue < 1e-3


def test_refusals_and_the_config_vocabulary():
  with pytest.raises(ValueError, match="bounded-participation schedule"):
    _plan(sampling="poisson", batch_size=10, num_steps=5, relation="add_remove", n_users=60)
  with pytest.raises(ValueError, match="banded_poisson"):
    _plan(sampling="banded_poisson", min_separation=3, num_steps=5)
  with pytest.raises(ConfigError, match="trie"):
    dpsco_jax.algorithm_config("dp_sgd_user", {"epsilon": 1.0, "delta": 1e-5,
                                               "noise_mechanism": "trie"})
  assert dpsco_jax.algorithm_config("dp_sgd_user", {
      "epsilon": 1.0, "delta": 1e-5, "noise_mechanism": "tree", "sampling": "cyclic"})


def _data(n=24, m=2, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n * m, 3)).astype(np.float32)
  y = (rng.random(n * m) < 0.5).astype(np.float32)
  return UserData.from_arrays({"x": x, "y": y}, np.repeat(np.arange(n), m),
                              max_items_per_user=m)


def test_fit_and_dptrainer_run_with_tree_noise_under_cyclic_epochs():
  data = _data()

  def loss(p, ex):
    z = ex["x"] @ p
    return jax.nn.softplus(z) - ex["y"] * z

  cfg = dict(epsilon=2.0, delta=1e-5, sampling="cyclic", batch_size=8, epochs=3,
             noise_mechanism="tree", clip_norm=1.0, learning_rate=0.3)
  res = dpsco_jax.fit("dp_sgd_user", cfg, loss, jnp.zeros(3), data, jax.random.key(0))
  assert res.privacy.epsilon <= 2.0 + 1e-9 and res.record["tree_levels"] == 4
  assert res.record["mf_sensitivity"] == pytest.approx(_brute_sensitivity(9, 3, 3))
  assert np.all(np.isfinite(np.asarray(res.params)))

  class Lin(nnx.Module):
    def __init__(self, rngs):
      self.l = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
      return self.l(x)

  def nnx_loss(model, ex):
    return optax.softmax_cross_entropy_with_integer_labels(model(ex["x"]),
                                                           ex["y"].astype(jnp.int32))

  trainer = DPTrainer(Lin(nnx.Rngs(0)), nnx_loss, optax.sgd(0.1), data=data, clip_norm=1.0,
                      delta=1e-5, sampling="cyclic", batch_size=8, num_steps=9,
                      target_epsilon=2.0, noise_mechanism="tree", key=jax.random.key(1))
  trainer.train(9)
  assert trainer.step_count == 9 and trainer.epsilon() <= 2.0 + 1e-9
  assert all(np.all(np.isfinite(np.asarray(v)))
             for v in jax.tree.leaves(nnx.state(trainer.model, nnx.Param)))
  # the tree's secrets (noiseless running sum, node key) are redacted in the state's repr
  state = tree_increment_noise(1.0, 4, jax.random.key(0)).init(jnp.zeros(2))
  assert repr(state).count("<redacted>") == 2 and "last=" in repr(state)
