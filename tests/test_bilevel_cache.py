"""Issue 25 ("compiled code is cached one way"): paper 004's driver compiles through the
library's one bounded cache (:mod:`dpsco_jax.cache`), keyed by the problem's functions and
scalars, with the data an argument. It used to keep its own unbounded dict on ``problem.meta``.
A neighbouring dataset (one example replaced, same functions) reuses the executable (a cache
hit, no new compile) and gets its own release; ``dpsco_jax.cache.clear()`` empties it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax import cache
from dpsco_jax.algorithms.bilevel import driver as bd
from dpsco_jax.api import solve
from dpsco_jax.problems import bilevel as bl

NAME = "dpsco_jax.algorithms.bilevel.driver._compiled_run"
CFG = {"epsilon": 2.0, "delta": 1e-6, "lam": 10.0, "learning_rate": 0.5, "num_steps": 3,
       "inner_num_steps": 10, "inner_rounds": 1}


def _stats() -> dict:
  return cache.stats()[NAME]


def test_a_neighbouring_dataset_reuses_the_program_with_its_own_data():
  prob = bl.synthetic_ridge_problem(jax.random.key(0), d=3, n_train=40, n_val=40)
  cache.clear()
  first = solve("dp_bilevel", CFG, prob, jax.random.key(1))
  assert _stats()["misses"] == 1 and _stats()["size"] == 1
  # replace one example (a huge one: the inner solves' clipped sums move)
  data = jax.tree.map(lambda v: v.at[0].set(50.0 * jnp.ones_like(v[0])), prob.data)
  neighbour = dataclasses.replace(prob, data=data)
  solve("dp_bilevel", CFG, neighbour, jax.random.key(1))
  assert _stats()["misses"] == 1 and _stats()["hits"] >= 1   # reused, not recompiled
  bcfg, _ = bd.bilevel_config(prob, bd.config_view(CFG))
  a = bd._run_compiled(prob, bcfg, jax.random.key(1))
  b = bd._run_compiled(neighbour, bcfg, jax.random.key(1))
  assert not np.allclose(np.asarray(a.y_star), np.asarray(b.y_star))   # its own data
  np.testing.assert_array_equal(np.asarray(a.x_out), np.asarray(first.params))
  assert "_jit_cache" not in prob.meta
  cache.clear()
  assert _stats()["size"] == 0
