"""Noisy prefix sums of a stream: binary-tree continual counting and independent noise.

One increment ``Delta_t`` (aggregated, clipped, params-shaped) in per step, ``g_hat_t =
sum_{i <= t} Delta_i + N_t`` out, with ``N_t`` from ``mechanism=``:

``"tree"``: the binary tree mechanism (Dwork et al. 2010, Chan et al. 2011) as in paper 003
  Lemma 5.6 (index ranges repaired, spec 003 §3.3 / AMBIG-6). Leaf ``t+1`` holds ``Delta_t``;
  node ``(k, j)`` (odd ``j``, ``j 2^k <= T``) releases the sum over leaves ``((j-1)2^k, j 2^k]``
  plus ``xi_{j,k} ~ N(0, sigma^2 I)`` (regenerated from ``fold_in(fold_in(key, k), j)``: memory
  ``O(params)``); the prefix ending at leaf ``t1`` sums the nodes of ``t1``'s set bits.
``"independent"``: the DP-SGD comparison, fresh noise per increment, summed.

Privacy (spec 003 §3.3, §4.4): increments of L2 sensitivity ``s``, each changed in one step
(single epoch), ``noise_std = z * s``. A leaf lies in at most ``levels = T.bit_length()`` nodes
(the paper's ``1 + ceil(log2 T)``: ``levels="paper"``), so the tree run, adaptive increments
included, is one Gaussian mechanism of multiplier ``z / sqrt(levels)``; independent noise is one
of multiplier ``z`` (:func:`prefix_noise_event`). The noiseless running sum and key are secret.
Past ``max_steps`` the stage emits NaN (a leaf there lies in nodes nobody accounted).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax._checks import check_choice, check_int, check_seed_or_key
from dpsco_jax.transforms.noise import (add_gaussian_noise, add_noise_tree, check_stddev,
                                        noise_dtype, output_like, redacted_repr,
                                        tree_gaussian_like)

PyTree = Any
MECHANISMS = ("tree", "independent")
LEVEL_RULES = ("exact", "paper")
#: The stages count steps in int32: past this the counter would wrap and replay noise.
MAX_STEPS = 2 ** 31 - 1


def check_max_steps(max_steps: Any) -> int:
  """``max_steps``, an int in ``[1, MAX_STEPS]`` (the stages' int32 step counter)."""
  v = check_int(max_steps, "max_steps", minimum=1)
  if v > MAX_STEPS:
    raise ValueError(f"max_steps must be <= {MAX_STEPS} (the step counter is int32; a "
                     f"wrapped counter would reuse noise), got {max_steps!r}")
  return v


# ----------------------------------------------------------------------------- tree geometry
def tree_levels(max_steps: int, rule: str = "exact") -> int:
  """Levels a leaf can touch: ``T.bit_length()`` (exact) or ``1 + ceil(log2 T)`` (paper)."""
  max_steps = check_int(max_steps, "max_steps", minimum=1)
  check_choice(rule, "levels", LEVEL_RULES)
  if rule == "exact":
    return max_steps.bit_length()
  return 1 + math.ceil(math.log2(max_steps))


def tree_nodes(max_steps: int) -> list[tuple[int, int, int, int]]:
  """All ``T`` nodes ``(level k, index j, first leaf, last leaf)`` of the tree over leaves
  ``1..T`` (odd ``j``, ``j 2^k <= T``)."""
  max_steps = check_int(max_steps, "max_steps", minimum=1)
  nodes = []
  for k in range(max_steps.bit_length()):
    for j in range(1, max_steps // (1 << k) + 1, 2):
      nodes.append((k, j, (j - 1) * (1 << k) + 1, j * (1 << k)))
  return nodes


def prefix_nodes(leaf: int) -> list[tuple[int, int]]:
  """Nodes ``(k, j)`` whose sum is the prefix ending at ``leaf`` (1-indexed)."""
  leaf = check_int(leaf, "leaf", minimum=1)
  return [(k, leaf >> k) for k in range(leaf.bit_length()) if (leaf >> k) & 1]


def tree_encode(increments: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
  """The explicit noiseless encoder ``{(k, j): node sum}`` of ``increments[t]`` (leaf
  ``t+1``), for tests; the streaming stage never builds it."""
  increments = np.asarray(increments)
  csum = np.concatenate([np.zeros_like(increments[:1]), np.cumsum(increments, axis=0)])
  return {(k, j): csum[hi] - csum[lo - 1] for k, j, lo, hi in tree_nodes(len(increments))}


def prefix_noise_variance(step: int, mechanism: str = "tree") -> int:
  """Per-coordinate variance of ``N_step`` in units of ``noise_std^2``: ``popcount(step+1)``
  for the tree, ``step+1`` for independent noise."""
  check_choice(mechanism, "mechanism", MECHANISMS)
  step = check_int(step, "step", minimum=0)
  return bin(step + 1).count("1") if mechanism == "tree" else step + 1


def node_noise(key: jax.Array, level: int | jax.Array, index: int | jax.Array, like: PyTree,
               stddev: float | jax.Array) -> PyTree:
  """``xi_{index, level}``: the noise of node ``(level, index)``, regenerated from the key."""
  node_key = jax.random.fold_in(jax.random.fold_in(key, level), index)
  return tree_gaussian_like(node_key, like, stddev)


def tree_prefix_noise(key: jax.Array, leaf: jax.Array, like: PyTree,
                      stddev: float | jax.Array, levels: int) -> PyTree:
  """``N`` for the prefix ending at ``leaf`` (1-indexed, traced): ``sum_{k: bit k of leaf}
  xi_{leaf >> k, k}``."""
  ks = jnp.arange(levels, dtype=jnp.uint32)
  leaf = jnp.asarray(leaf, jnp.uint32)
  idx = leaf >> ks
  bits = (idx & 1).astype(jnp.float32)
  per_level = jax.vmap(lambda k, j: node_noise(key, k, j, like, stddev))(ks, idx)
  # HIGHEST: a TF32 / bf16-pass dot would round the noise itself to ~10 bits
  return jax.tree.map(
      lambda n: jnp.tensordot(bits.astype(n.dtype), n, axes=(0, 0),
                              precision=jax.lax.Precision.HIGHEST), per_level)


# ----------------------------------------------------------------------------- the stages
class TreePrefixNoiseState(NamedTuple):
  """``prefix`` (noiseless running sum) and ``key`` are SECRET (redacted in repr)."""
  count: jax.Array
  prefix: PyTree
  key: jax.Array

  def __repr__(self) -> str:
    return redacted_repr(self, ("prefix", "key"))

  __str__ = __repr__


class IndependentPrefixNoiseState(NamedTuple):
  """``noise``: the Gaussian stage's state; ``noisy_prefix``: released, not secret."""
  count: jax.Array
  noisy_prefix: PyTree
  noise: Any


def _poison_after(count: jax.Array, max_steps: int, tree: PyTree) -> PyTree:
  over = count >= max_steps
  return jax.tree.map(lambda x: jnp.where(over, jnp.full_like(x, jnp.nan), x), tree)


def wide_zeros(params: PyTree) -> PyTree:
  """Zero running sums in float32 or wider (a bfloat16 sum would round the increments)."""
  return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), noise_dtype(jnp.result_type(p))),
                      params)


def tree_prefix_sum_noise(noise_std: float, max_steps: int, key: jax.Array | int
                          ) -> optax.GradientTransformationExtraArgs:
  """Binary-tree noisy prefix sums (paper 003, Lemma 5.6; module docstring), float32+ sums
  and noise, output cast to the params' (else the increments') dtype.

  Args:
    noise_std: the std of each tree node's noise, >= 0.
    max_steps: the most steps, an integer >= 1 (sets the tree's depth).
    key: a JAX PRNG key or an int seed.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: increments in, noisy prefix sums out.
  """
  check_stddev(noise_std, "noise_std")
  max_steps = check_max_steps(max_steps)
  levels = tree_levels(max_steps)
  key = check_seed_or_key(key, "key")

  def init_fn(params):
    return TreePrefixNoiseState(count=jnp.zeros((), jnp.int32), prefix=wide_zeros(params),
                                key=key)

  def update_fn(updates, state, params=None, **extra):
    del extra
    prefix = jax.tree.map(lambda g, u: g + u.astype(g.dtype), state.prefix, updates)
    noise = tree_prefix_noise(state.key, state.count + 1, prefix, noise_std, levels)
    out = add_noise_tree(prefix, noise, updates if params is None else params)
    out = _poison_after(state.count, max_steps, out)
    return out, TreePrefixNoiseState(count=state.count + 1, prefix=prefix, key=state.key)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class TreeIncrementNoiseState(NamedTuple):
  """The tree stage's state (secret) and the last released noisy prefix (public)."""
  tree: TreePrefixNoiseState
  last: PyTree


def tree_increment_noise(noise_std: float, max_steps: int, key: jax.Array | int
                         ) -> optax.GradientTransformationExtraArgs:
  """The tree's noisy prefix sums emitted as increments ``g_hat_t - g_hat_{t-1}`` (DP-FTRL
  style, Kairouz et al. 2021): post-processing of :func:`tree_prefix_sum_noise`, with the
  tree's guarantee under its participation schema."""
  inner = tree_prefix_sum_noise(noise_std, max_steps, key)

  def init_fn(params):
    return TreeIncrementNoiseState(inner.init(params), wide_zeros(params))

  def update_fn(updates, state, params=None, **extra):
    prefix, tree = inner.update(updates, state.tree, params, **extra)
    wide = jax.tree.map(lambda p, l: p.astype(l.dtype), prefix, state.last)
    out = jax.tree.map(lambda w, l, p: (w - l).astype(jnp.result_type(p)), wide, state.last,
                       prefix)
    return out, TreeIncrementNoiseState(tree, wide)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def independent_prefix_sum_noise(noise_std: float, max_steps: int, key: jax.Array | int
                                 ) -> optax.GradientTransformationExtraArgs:
  """Noisy prefix sums with independent per-step noise ``N_t = sum_{i<=t} w_i`` (the DP-SGD
  comparison; interface of :func:`tree_prefix_sum_noise`).

  Args:
    noise_std: the std of each step's noise, >= 0.
    max_steps: the most steps, an integer >= 1.
    key: a JAX PRNG key or an int seed.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: increments in, noisy prefix sums out.
  """
  check_stddev(noise_std, "noise_std")
  max_steps = check_max_steps(max_steps)
  gaussian = add_gaussian_noise(noise_std, check_seed_or_key(key, "key"))

  def init_fn(params):
    return IndependentPrefixNoiseState(
        count=jnp.zeros((), jnp.int32), noisy_prefix=wide_zeros(params),
        noise=gaussian.init(params))

  def update_fn(updates, state, params=None, **extra):
    # the noise is added in float32+ before any cast: the increment goes in un-rounded
    wide = jax.tree.map(lambda u: u.astype(noise_dtype(u.dtype)), updates)
    noisy, noise_state = gaussian.update(wide, state.noise, None, **extra)
    total = jax.tree.map(lambda g, u: g + u.astype(g.dtype), state.noisy_prefix, noisy)
    out = jax.tree.map(lambda t, r: t.astype(jnp.result_type(r)), total,
                       output_like(updates, params))
    out = _poison_after(state.count, max_steps, out)
    # the state's (public) prefix too: else it keeps a release past the accounted horizon
    total = _poison_after(state.count, max_steps, total)
    return out, IndependentPrefixNoiseState(count=state.count + 1, noisy_prefix=total,
                                            noise=noise_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def prefix_sum_noise(noise_std: float, max_steps: int, key: jax.Array | int, *,
                     mechanism: str = "tree") -> optax.GradientTransformationExtraArgs:
  """Noisy prefix sums of the increment stream, by ``mechanism`` (module docstring).

  Args:
    noise_std: the node (tree) or step (independent) noise std, >= 0.
    max_steps: the most steps the stage will take, an integer >= 1.
    key: a JAX PRNG key or an int seed.
    mechanism: ``"tree"`` (default) or ``"independent"``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: increments in, noisy prefix sums out.
  """
  check_choice(mechanism, "mechanism", MECHANISMS)
  if mechanism == "tree":
    return tree_prefix_sum_noise(noise_std, max_steps, key)
  return independent_prefix_sum_noise(noise_std, max_steps, key)


# ----------------------------------------------------------------------------- accounting
def prefix_noise_mu(noise_multiplier: float, max_steps: int, *, mechanism: str = "tree",
                    levels: str = "exact") -> float:
  """GDP parameter of a single-epoch run: ``sqrt(levels)/z`` (tree) or ``1/z`` (independent).

  Args:
    noise_multiplier: ``z``, > 0.
    max_steps: the run's steps.
    mechanism: ``"tree"`` (default) or ``"independent"``.
    levels: how the tree's levels are counted (default ``"exact"``).

  Returns:
    ``mu``, a float.
  """
  check_choice(mechanism, "mechanism", MECHANISMS)
  z = float(noise_multiplier)
  if not z > 0:
    raise ValueError(f"noise_multiplier must be > 0 for a finite mu, got {noise_multiplier!r}")
  lv = tree_levels(max_steps, levels) if mechanism == "tree" else 1
  return math.sqrt(lv) / z


def prefix_noise_event(noise_multiplier: float, max_steps: int, *, mechanism: str = "tree",
                       levels: str = "exact") -> dp_accounting.DpEvent:
  """The single-epoch run as one event: mu-GDP is exactly ``GaussianDpEvent(1/mu)``
  (sensitivity 1; the ledger's relation handles replace-one).

  Args:
    noise_multiplier: ``z``, > 0.
    max_steps: the run's steps.
    mechanism: ``"tree"`` (default) or ``"independent"``.
    levels: how the tree's levels are counted (default ``"exact"``).

  Returns:
    A ``dp_accounting.GaussianDpEvent``.
  """
  return dp_accounting.GaussianDpEvent(
      1.0 / prefix_noise_mu(noise_multiplier, max_steps, mechanism=mechanism, levels=levels))
