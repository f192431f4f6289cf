"""Noisy prefix sums of a stream: binary-tree continual counting and independent noise.

A chain stage that receives one increment ``Delta_t`` per step (an aggregated, clipped batch
quantity, params-shaped) and emits ``g_hat_t = sum_{i <= t} Delta_i + N_t``, with ``N_t`` from
one of two mechanisms (``mechanism=``):

``"tree"`` — the binary tree mechanism (Dwork–Naor–Pitassi–Rothblum 2010, Chan–Shi–Song 2011)
  as in paper 003 Lemma 5.6 (index ranges repaired as in spec 003 §3.3 / AMBIG-6). Leaf
  ``t+1`` holds ``Delta_t``; node ``(k, j)`` (odd ``j``, ``j 2^k <= T``) releases the block sum
  over leaves ``((j-1)2^k, j 2^k]`` plus ``xi_{j,k} ~ N(0, sigma^2 I)``, and the prefix ending
  at leaf ``t1`` sums the ``popcount(t1)`` nodes ``s_{t1 >> k, k}`` for the set bits ``k``.
  ``Var(N_t) = popcount(t+1) sigma^2`` per coordinate; a leaf lies in at most
  ``T.bit_length()`` nodes.

``"independent"`` — the DP-SGD comparison: fresh ``N(0, sigma^2 I)`` per increment
  (:func:`~dpsco_jax.transforms.noise.add_gaussian_noise`), summed: ``Var(N_t) = (t+1) sigma^2``.

Memory is ``O(params)``: node noise is regenerated from ``fold_in(fold_in(key, k), j)``. The
state's noiseless running sum and key are **secret**; outputs use complete nodes only.

Privacy (spec 003 §3.3, §4.4). Each increment has L2 sensitivity ``s`` (``C/B`` for a
fixed-denominator mean under zero-out / add-remove, ``2C/B`` replace-one) and changes in one
step only (single epoch). With ``noise_std = z * s``:
  * tree: the encoder has sensitivity ``s * sqrt(levels)``, so the run, adaptive increments
    included, is ``mu``-GDP with ``mu = sqrt(levels) / z``: one Gaussian mechanism of
    multiplier ``z / sqrt(levels)`` (:func:`prefix_noise_event`).
  * independent: one Gaussian mechanism of multiplier ``z`` (``mu = 1/z``).
``levels = T.bit_length()`` is exact; the paper's ``1 + ceil(log2 T)`` is ``levels="paper"``.

Past ``max_steps`` a leaf would fall in a node the accounting did not count, so the stage
emits NaN (a loud, jit-compatible flag).
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
                                        noise_dtype, redacted_repr, tree_gaussian_like)

PyTree = Any
MECHANISMS = ("tree", "independent")
LEVEL_RULES = ("exact", "paper")
#: The stages count steps in int32: past this the counter would wrap and replay noise.
MAX_STEPS = 2 ** 31 - 1


def _check_max_steps(max_steps: Any) -> int:
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
  ``t+1``): states and tests the mechanism; the streaming stage never builds it."""
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
  xi_{leaf >> k, k}``, levels vectorized, absent bits masked."""
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
  """``count`` increments consumed; ``prefix`` (noiseless running sum) and ``key`` are
  SECRET, redacted in repr/str."""
  count: jax.Array
  prefix: PyTree
  key: jax.Array

  def __repr__(self) -> str:
    return redacted_repr(self, ("prefix", "key"))

  __str__ = __repr__


class IndependentPrefixNoiseState(NamedTuple):
  """``noise``: the Gaussian stage's state (redacts its key); ``noisy_prefix``: the running
  sum of released noisy increments (not secret)."""
  count: jax.Array
  noisy_prefix: PyTree
  noise: Any


def _poison_after(count: jax.Array, max_steps: int, tree: PyTree) -> PyTree:
  over = count >= max_steps
  return jax.tree.map(lambda x: jnp.where(over, jnp.full_like(x, jnp.nan), x), tree)


def _wide_zeros(params: PyTree) -> PyTree:
  """Running sums in float32 or wider (a bfloat16 sum's rounding would change the
  increments' sensitivity)."""
  return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), noise_dtype(jnp.result_type(p))),
                      params)


def tree_prefix_sum_noise(noise_std: float, max_steps: int, key: jax.Array | int
                          ) -> optax.GradientTransformationExtraArgs:
  """Binary-tree noisy prefix sums (paper 003, Lemma 5.6; spec 003 §3.3).

  Increments in, ``sum_{i<=t} Delta_i + N_t`` out (``N_t``: the tree noise of leaf ``t+1``).
  Sums and noise are float32 or wider; the output is cast to the params' (else the
  increments') dtype, which is post-processing.

  Args:
    noise_std: the std of each tree node's noise, >= 0.
    max_steps: the most steps, an integer >= 1 (sets the tree's depth).
    key: a JAX PRNG key or an int seed.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: increments in, noisy prefix sums out.

  Raises:
    ValueError: a bad ``noise_std`` or ``max_steps`` (beyond the int32 step counter).
    ArgumentTypeError: ``key`` is neither a PRNG key nor an int seed.
  """
  check_stddev(noise_std, "noise_std")
  max_steps = _check_max_steps(max_steps)
  levels = tree_levels(max_steps)
  key = check_seed_or_key(key, "key")

  def init_fn(params):
    return TreePrefixNoiseState(count=jnp.zeros((), jnp.int32), prefix=_wide_zeros(params),
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
  """State of :func:`tree_increment_noise`: the tree stage's state (secret: its running sum
  and key) and the last emitted noisy prefix (public: it was released)."""
  tree: TreePrefixNoiseState
  last: PyTree


def tree_increment_noise(noise_std: float, max_steps: int, key: jax.Array | int
                         ) -> optax.GradientTransformationExtraArgs:
  """The tree's noisy prefix sums emitted as increments ``g_hat_t - g_hat_{t-1}`` (DP-FTRL
  style, Kairouz et al. 2021): post-processing of :func:`tree_prefix_sum_noise`, with the
  tree's guarantee under its participation schema."""
  inner = tree_prefix_sum_noise(noise_std, max_steps, key)

  def init_fn(params):
    return TreeIncrementNoiseState(inner.init(params), _wide_zeros(params))

  def update_fn(updates, state, params=None, **extra):
    prefix, tree = inner.update(updates, state.tree, params, **extra)
    wide = jax.tree.map(lambda p, l: p.astype(l.dtype), prefix, state.last)
    out = jax.tree.map(lambda w, l, p: (w - l).astype(jnp.result_type(p)), wide, state.last,
                       prefix)
    return out, TreeIncrementNoiseState(tree, wide)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def independent_prefix_sum_noise(noise_std: float, max_steps: int, key: jax.Array | int
                                 ) -> optax.GradientTransformationExtraArgs:
  """Noisy prefix sums with independent per-step noise (the DP-SGD comparison; interface of
  :func:`tree_prefix_sum_noise`): ``N_t = sum_{i<=t} w_i``, ``Var = (t+1) sigma^2``.

  Args:
    noise_std: the std of each step's noise, >= 0.
    max_steps: the most steps, an integer >= 1.
    key: a JAX PRNG key or an int seed.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: increments in, noisy prefix sums out.

  Raises:
    ValueError: a bad ``noise_std`` or ``max_steps``.
    ArgumentTypeError: ``key`` is neither a PRNG key nor an int seed.
  """
  check_stddev(noise_std, "noise_std")
  max_steps = _check_max_steps(max_steps)
  gaussian = add_gaussian_noise(noise_std, check_seed_or_key(key, "key"))

  def init_fn(params):
    return IndependentPrefixNoiseState(
        count=jnp.zeros((), jnp.int32), noisy_prefix=_wide_zeros(params),
        noise=gaussian.init(params))

  def update_fn(updates, state, params=None, **extra):
    # the noise is added in float32+ before any cast: the increment goes in un-rounded
    wide = jax.tree.map(lambda u: u.astype(noise_dtype(u.dtype)), updates)
    noisy, noise_state = gaussian.update(wide, state.noise, None, **extra)
    total = jax.tree.map(lambda g, u: g + u.astype(g.dtype), state.noisy_prefix, noisy)
    same = params is not None and jax.tree.structure(params) == jax.tree.structure(updates)
    out = jax.tree.map(lambda t, r: t.astype(jnp.result_type(r)), total,
                       params if same else updates)
    out = _poison_after(state.count, max_steps, out)
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

  Raises:
    ValueError: an unknown ``mechanism``; as :func:`tree_prefix_sum_noise`.
  """
  check_choice(mechanism, "mechanism", MECHANISMS)
  if mechanism == "tree":
    return tree_prefix_sum_noise(noise_std, max_steps, key)
  return independent_prefix_sum_noise(noise_std, max_steps, key)


# ----------------------------------------------------------------------------- accounting
def prefix_noise_mu(noise_multiplier: float, max_steps: int, *, mechanism: str = "tree",
                    levels: str = "exact") -> float:
  """GDP parameter of a single-epoch run: ``sqrt(levels)/z`` (tree) or ``1/z``
  (independent), with ``noise_std = z * sensitivity`` of one increment.

  Args:
    noise_multiplier: ``z``, > 0.
    max_steps: the run's steps.
    mechanism: ``"tree"`` (default) or ``"independent"``.
    levels: how the tree's levels are counted (default ``"exact"``).

  Returns:
    ``mu``, a float.

  Raises:
    ValueError: ``noise_multiplier`` is not > 0, or an unknown ``mechanism``.
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

  Raises:
    ValueError: as :func:`prefix_noise_mu`.
  """
  return dp_accounting.GaussianDpEvent(
      1.0 / prefix_noise_mu(noise_multiplier, max_steps, mechanism=mechanism, levels=levels))
