"""Correlated (matrix-factorization) noise stages: banded Toeplitz and BLT.

The contract of :func:`~dpsco_jax.transforms.tree_noise.tree_prefix_sum_noise`: increment
``x_t`` in; out the noisy prefix sum ``sum_{i<=t} (x_i + w_i)`` (``output="prefix"``: ``A x +
B Z``) or the noisy increment ``x_t + w_t``, with ``w = C^{-1} Z``, ``Z_t ~ N(0, noise_std^2
I)`` i.i.d. and ``C`` the strategy (:mod:`dpsco_jax.privacy.matrix_factorization`: sensitivity
and event). Both are post-processing of the release ``C x + Z``. ``w`` is streamed by ``C w =
Z``:

* banded: ``w_t = (Z_t - sum_{j=1}^{b-1} c_j w_{t-j}) / c_0``, a ring of the last ``b - 1``
  draws (McKenna et al. 2024; Choquette-Choo et al. 2023, Alg. 9);
* BLT: ``w_t = Z_t - sum_i omega_i S_i``, ``S_i <- theta_i S_i + w_t`` (the map Dvijotham et
  al. 2024 stream through ``C^{-1}``'s own BLT).

``Z_t`` is drawn as :func:`~dpsco_jax.transforms.noise.add_gaussian_noise` draws step ``t``
(``bands=1`` is the independent stage bit for bit), in float32 or wider. The ring/buffers would
strip the noise from later releases: SECRET, like the key. Past ``max_steps``: NaN.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax._checks import check_choice, check_seed_or_key
from dpsco_jax.transforms.noise import (check_stddev, noise_dtype, output_like, redacted_repr,
                                        tree_gaussian_like)
from dpsco_jax.transforms.tree_noise import check_max_steps, wide_zeros

PyTree = Any
OUTPUTS = ("prefix", "increment")
_HI = jax.lax.Precision.HIGHEST  # a TF32 / bf16-pass dot would round the noise to ~10 bits


class BandedNoiseState(NamedTuple):
  """``noisy_prefix``: the released running ``sum (x + w)`` (``()`` for increments);
  ``ring``: the last ``b - 1`` noise vectors per leaf (SECRET); ``key`` (SECRET)."""
  count: jax.Array
  noisy_prefix: PyTree
  ring: PyTree
  key: jax.Array

  def __repr__(self) -> str:
    return redacted_repr(self, ("ring", "key"))

  __str__ = __repr__


class BltNoiseState(NamedTuple):
  """As :class:`BandedNoiseState`; ``buffers``: ``d`` decayed sums of past ``w`` (SECRET)."""
  count: jax.Array
  noisy_prefix: PyTree
  buffers: PyTree
  key: jax.Array

  def __repr__(self) -> str:
    return redacted_repr(self, ("buffers", "key"))

  __str__ = __repr__


def _check_vector(x: Any, name: str) -> np.ndarray:
  v = np.asarray(x, np.float64).reshape(-1)
  if v.size == 0 or not np.all(np.isfinite(v)):
    raise ValueError(f"{name} must be a nonempty vector of finite numbers, got {x!r}")
  return v


def _make_stage(noise_std: float, max_steps: int, key: Any, output: str, depth: int,
                next_noise, state_cls) -> optax.GradientTransformationExtraArgs:
  """Shared driver of both stages: ``next_noise(xi, carry, count) -> (w, carry)``, the carry
  ``depth`` stacked float32+ zeros at init."""
  check_stddev(noise_std, "noise_std")
  max_steps = check_max_steps(max_steps)
  check_choice(output, "output", OUTPUTS)
  key = check_seed_or_key(key, "key")

  def init_fn(params):
    prefix = wide_zeros(params) if output == "prefix" else ()
    carry = jax.tree.map(
        lambda p: jnp.zeros((depth,) + jnp.shape(p), noise_dtype(jnp.result_type(p))), params)
    return state_cls(jnp.zeros((), jnp.int32), prefix, carry, key)

  def update_fn(updates, state, params=None, **extra):
    del extra  # user_mask etc. are the aggregation's business; noise is data-independent
    wide = jax.tree.map(lambda u: u.astype(noise_dtype(jnp.result_type(u))), updates)
    xi = tree_gaussian_like(jax.random.fold_in(state[3], state.count), wide, noise_std)
    w, carry = next_noise(xi, state[2], state.count)
    out = jax.tree.map(lambda u, n: u + n.astype(u.dtype), wide, w)
    prefix = ()
    if output == "prefix":
      out = prefix = jax.tree.map(lambda g, u: g + u.astype(g.dtype), state.noisy_prefix, out)
    over = state.count >= max_steps  # cast as noise.output_like; NaN past the horizon
    out = jax.tree.map(lambda o, r: jnp.where(over, jnp.nan, o).astype(jnp.result_type(r)),
                       out, output_like(updates, params))
    # the state's (public) prefix too: else it keeps a release past the accounted horizon
    prefix = jax.tree.map(lambda g: jnp.where(over, jnp.nan, g), prefix)
    return out, state_cls(state.count + 1, prefix, carry, state[3])

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def banded_noise(noise_std: float, max_steps: int, key: jax.Array | int, *,
                 coefs: Any, output: str = "prefix") -> optax.GradientTransformationExtraArgs:
  """Banded Toeplitz MF noise (module docstring), state ``O(b * params)``; ``noise_std = z *
  s`` for increments of sensitivity ``s`` (event:
  :func:`~dpsco_jax.privacy.matrix_factorization.mf_event`).

  Args:
    noise_std: the std of ``Z``, >= 0.
    max_steps: the most steps, an integer >= 1.
    key: a JAX PRNG key or an int seed.
    coefs: ``c_0..c_{b-1}`` of ``C``, finite, ``c_0 > 0`` (e.g.
      :func:`dpsco_jax.privacy.matrix_factorization.banded_strategy`).
    output: ``"prefix"`` (default) or the other form of :data:`OUTPUTS`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` adding the correlated noise.
  """
  c = _check_vector(coefs, "coefs")
  if not c[0] > 0:
    raise ValueError(f"coefs[0] must be > 0 (C must be invertible), got {c[0]!r}")
  b = min(c.size, check_max_steps(max_steps))
  c0 = float(c[0])
  tail = jnp.asarray(np.concatenate([[0.0], c[1:b]]), jnp.float32)  # tail[j] = c_j, j >= 1
  depth = max(b - 1, 1)

  def next_noise(xi, ring, count):
    if b == 1:
      return jax.tree.map(lambda x: x / jnp.asarray(c0, x.dtype), xi), ring
    slots = jnp.arange(depth, dtype=jnp.int32)
    # slot i holds w_s with s = i (mod b-1), s in [t-b+1, t-1]; its lag t - s in [1, b-1]
    lag = (count - slots - 1) % depth + 1
    weights = tail[lag]

    def one(x, r):
      inner = jnp.tensordot(weights.astype(r.dtype), r, axes=(0, 0), precision=_HI)
      return (x - inner) / jnp.asarray(c0, x.dtype)
    w = jax.tree.map(one, xi, ring)
    ring = jax.tree.map(lambda r, v: r.at[count % depth].set(v.astype(r.dtype)), ring, w)
    return w, ring

  return _make_stage(noise_std, max_steps, key, output, depth, next_noise, BandedNoiseState)


def blt_noise(noise_std: float, max_steps: int, key: jax.Array | int, *, buf_decay: Any,
              output_scale: Any, output: str = "prefix"
              ) -> optax.GradientTransformationExtraArgs:
  """BLT MF noise with ``d = len(buf_decay)`` buffers, state ``O(d * params)``: ``C`` has unit
  diagonal and ``C[t, t-k] = sum_i output_scale_i buf_decay_i^{k-1}`` (jax_privacy's
  ``BufferedToeplitz``; :func:`dpsco_jax.privacy.matrix_factorization.blt_strategy`).

  Args:
    noise_std: the std of ``Z``, >= 0.
    max_steps: the most steps, an integer >= 1.
    key: a JAX PRNG key or an int seed.
    buf_decay: ``theta``, the buffers' decays, each in ``(-1, 1)``.
    output_scale: ``omega``, the buffers' output scales (as many as ``buf_decay``).
    output: ``"prefix"`` (default) or the other form of :data:`OUTPUTS`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` adding the correlated noise.
  """
  th = _check_vector(buf_decay, "buf_decay")
  om = _check_vector(output_scale, "output_scale")
  if th.shape != om.shape:
    raise ValueError(f"buf_decay and output_scale must have the same length, got {th.size} "
                     f"and {om.size}")
  if np.any(np.abs(th) >= 1):
    raise ValueError(f"buf_decay must lie in (-1, 1) (decaying buffers), got {th}")
  theta = jnp.asarray(th, jnp.float32)
  omega = jnp.asarray(om, jnp.float32)
  depth = th.size

  def next_noise(xi, bufs, count):
    del count
    w = jax.tree.map(lambda x, s: x - jnp.tensordot(omega.astype(s.dtype), s, axes=(0, 0),
                                                    precision=_HI), xi, bufs)
    bufs = jax.tree.map(
        lambda s, v: theta.astype(s.dtype).reshape((-1,) + (1,) * v.ndim) * s + v[None],
        bufs, w)
    return w, bufs

  return _make_stage(noise_std, max_steps, key, output, depth, next_noise, BltNoiseState)


def state_floats(state: PyTree) -> int:
  """Array elements held in a stage state (a key counts as one)."""
  return int(sum(np.size(x) if not jax.dtypes.issubdtype(getattr(x, "dtype", np.float32),
                                                         jax.dtypes.prng_key) else 1
                 for x in jax.tree.leaves(state)))
