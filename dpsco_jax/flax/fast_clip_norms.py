"""Certified per-user norm bounds and the matching releases for tapped layers.

For a tapped kernel the per-user gradient is ``G = sum_t a_t g_t^T``. Float32 cannot evaluate
``||G||`` exactly, and a crafted input makes the Gram form ``sum_{s,t} (a_s.a_t)(g_s.g_t)``
cancel catastrophically, so each kernel returns a **certified upper bound** ``B >= max(||G||,
||R|| / w)``, ``R`` being what the release actually adds for this user with weight ``w``.

Error model (Higham ch. 3): at ``Precision.HIGHEST`` every product and addition rounds with
relative error at most ``UNIT = 2^-23`` (twice float32's unit roundoff: headroom for TPUs'
bf16x6 emulation) in any summation order, so a length-``k`` dot errs by at most ``gamma(k)
sum_i |x_i y_i|``, ``gamma(k) = k UNIT / (1 - k UNIT)``. With ``S = sum_t ||a_t|| ||g_t||``:

* direct form ``M = fl(sum_t a_t g_t^T)``: ``||M - G|| <= gamma(n) S``, and ``M`` itself is
  released, so ``B = ||M||_upper + gamma(n) S``;
* Gram form: ``|fl(Gram) - ||G||^2| <= gamma(p + q + 2n + 2) S^2``, and the release ``R =
  fl(sum_t a_t fl(w g_t)^T)`` has ``||R - w G|| <= w gamma(n + 1) S``, so ``B = ||G||_upper
  + gamma(n + 1) S``.

The slack is about ``n UNIT S / ||G||``: ~1e-6 on ordinary inputs, large exactly under
cancellation (over-clipping, never under-clipping). Underflow is covered by an absolute ``n
2^-120``. The Gram form is used only where its ``gamma`` stays below ``1e-3``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import _conv_dimension_numbers, canonicalize_padding
from jax import lax

HI = lax.Precision.HIGHEST
UNIT = 2.0 ** -23
_ABS = 2.0 ** -120  # per-term absolute slack for gradual underflow
_GRAM_MAX_GAMMA = 1e-3


def gamma(k: int) -> float:
  ku = float(k) * UNIT
  return ku / (1.0 - ku) if ku < 0.5 else float("inf")


def sqsum_upper(x: jax.Array) -> jax.Array:
  """Certified upper bound on ``sum x^2`` over all but the leading (user) axis."""
  u = x.shape[0]
  if x.size == 0:   # a zero-size leaf: no coordinates (a -1 reshape of it is undefined)
    return jnp.zeros((u,), jnp.float32)
  x = jnp.reshape(x.astype(jnp.float32), (u, -1, x.shape[-1] if x.ndim > 1 else 1))
  rows = jnp.einsum("urk,urk->ur", x, x, precision=HI)
  k = x.shape[1] + x.shape[2] + 1
  return jnp.sum(rows, axis=1) / (1.0 - gamma(k))


def _row_norms(x: jax.Array) -> jax.Array:
  return jnp.sqrt(jnp.einsum("unk,unk->un", x, x, precision=HI))


def _s_upper(a_norms: jax.Array, g_norms: jax.Array, p: int, q: int) -> jax.Array:
  """Upper bound on ``S = sum_t ||a_t|| ||g_t||`` from float32 row norms."""
  n = a_norms.shape[1]
  s = jnp.sum(a_norms * g_norms, axis=1)
  return s * (1.0 + gamma(p + q + n + 4)) + n * _ABS


def use_gram(n: int, p: int, q: int, ghost: str) -> bool:
  """Gram when asked (or cheaper for ``auto``) and its certified error stays small."""
  if gamma(p + q + 2 * n + 2) > _GRAM_MAX_GAMMA:
    return False
  return ghost == "gram" or (ghost == "auto" and n * (p + q) <= p * q)


def kernel_bound(a: jax.Array, g: jax.Array, ghost: str, recomputed: bool = False):
  """``(B, M)`` for ``a [U, N, p]``, ``g [U, N, q]`` (per group of a grouped conv). Gram
  form: ``M`` is None, ``B`` covers :func:`kernel_release`. Direct form: ``M [U, p, q]`` is
  released as is and ``B >= max(||G||, ||M||)``; with ``recomputed`` the release is
  :func:`kernel_release`'s instead, covered by ``||M|| + (gamma(n) + gamma(n+1)) S``."""
  n, p, q = a.shape[1], a.shape[2], g.shape[2]
  s = _s_upper(_row_norms(a), _row_norms(g), p, q)
  if use_gram(n, p, q, ghost):
    aa = jnp.einsum("unk,uvk->unv", a, a, precision=HI)
    gg = jnp.einsum("unk,uvk->unv", g, g, precision=HI)
    sq = jnp.sum(jnp.einsum("unv,unv->un", aa, gg, precision=HI), axis=1)
    g_up = jnp.sqrt(jnp.maximum(sq, 0.0) + gamma(p + q + 2 * n + 2) * jnp.square(s))
    return g_up + gamma(n + 1) * s, None
  m = jnp.einsum("unp,unq->upq", a, g, precision=HI)
  slack = gamma(n) + (gamma(n + 1) if recomputed else 0.0)
  return jnp.sqrt(sqsum_upper(m)) + slack * s, m


def kernel_release(a: jax.Array, wg: jax.Array) -> jax.Array:
  """``sum_{u,t} a_{ut} (w_u g_{ut})^T`` at HIGHEST precision: ``[p, q]``."""
  return jnp.einsum("unp,unq->pq", a, wg, precision=HI)


def embed_bound(idx: jax.Array, g: jax.Array) -> jax.Array:
  """Same bound for an embedding table: ``a_s . a_t = [idx_s == idx_t]``."""
  n, q = g.shape[1], g.shape[2]
  gn = _row_norms(g)
  s = jnp.sum(gn, axis=1) * (1.0 + gamma(q + n + 2)) + n * _ABS
  # always the Gram form (a one-hot direct form costs n * vocab per user)
  gg = jnp.einsum("unk,uvk->unv", g, g, precision=HI)
  same = (idx[:, :, None] == idx[:, None, :]).astype(jnp.float32)
  sq = jnp.sum(jnp.einsum("unv,unv->un", gg, same, precision=HI), axis=1)
  g_up = jnp.sqrt(jnp.maximum(sq, 0.0) + gamma(q + 2 * n + 2) * jnp.square(s))
  return g_up + gamma(n + 1) * s


def embed_release(idx: jax.Array, wg: jax.Array, num_embeddings: int) -> jax.Array:
  flat_idx = jnp.reshape(idx, (-1,))
  flat_g = jnp.reshape(wg, (-1, wg.shape[-1]))
  return jnp.zeros((num_embeddings, wg.shape[-1]), wg.dtype).at[flat_idx].add(flat_g)


def _bc(v, nd):
  v = 1 if v is None else v
  return (v,) * nd if isinstance(v, int) else tuple(v)


def conv_patches(conv: nnx.Conv, x: jax.Array) -> jax.Array:
  """Receptive-field patches of ``x`` exactly as ``nnx.Conv`` pads, strides and dilates:
  ``[N, *spatial_out, in_features * kernel_volume]``, channel-major, exact copies."""
  ks = tuple(conv.kernel_size)
  nd = len(ks)
  x = jnp.reshape(x, (-1,) + x.shape[x.ndim - nd - 1:])
  strides, in_dil, k_dil = _bc(conv.strides, nd), _bc(conv.input_dilation, nd), _bc(
      conv.kernel_dilation, nd)
  padding = canonicalize_padding(conv.padding, nd)
  if padding in ("CIRCULAR", "REFLECT"):
    kd = [(k - 1) * d + 1 for k, d in zip(ks, k_dil)]
    pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in kd] + [(0, 0)]
    x = jnp.pad(x, pads, mode={"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding])
    padding = "VALID"
  elif padding == "CAUSAL":
    x = jnp.pad(x, [(0, 0), (k_dil[0] * (ks[0] - 1), 0), (0, 0)])
    padding = "VALID"
  return _patches(x, ks, strides, padding, in_dil, k_dil, _conv_dimension_numbers(x.shape))


def _patches(x, ks, strides, padding, in_dil, k_dil, dn) -> jax.Array:
  """``lax.conv_general_dilated_patches`` with *both* operands at ``HIGHEST`` (jax's passes
  DEFAULT for the filter, which a backend may read as TF32 for the whole convolution)."""
  dn = lax.conv_dimension_numbers(x.shape, (1, 1) + tuple(ks), dn)
  lhs_spec, rhs_spec, _ = dn
  vol, channels = prod(ks), x.shape[lhs_spec[1]]
  rhs = jnp.broadcast_to(jnp.eye(vol, dtype=x.dtype), (channels, vol, vol))
  rhs = jnp.reshape(rhs, (channels * vol, 1) + tuple(ks))
  rhs = jnp.moveaxis(rhs, (0, 1), (rhs_spec[0], rhs_spec[1]))
  return lax.conv_general_dilated(x, rhs, strides, padding, lhs_dilation=in_dil,
                                  rhs_dilation=k_dil, dimension_numbers=dn,
                                  feature_group_count=channels, precision=(HI, HI))


def conv_layout(conv: nnx.Conv, flat: jax.Array) -> jax.Array:
  """``[..., G, (in/G) * kvol, out/G]`` (channel-major patches) to the kernel's layout
  ``[..., *kernel_size, in/G, out]``."""
  ks = tuple(conv.kernel_size)
  lead, (groups, k, og) = flat.shape[:-3], flat.shape[-3:]
  cg = k // max(1, prod(ks))
  w = jnp.reshape(flat, lead + (groups, cg) + ks + (og,))
  nl, nd = len(lead), len(ks)
  w = jnp.moveaxis(w, (nl, nl + 1), (nl + nd + 1, nl + nd))   # [..., *ks, cg, G, og]
  return jnp.reshape(w, lead + ks + (cg, groups * og))


def prod(xs) -> int:
  return math.prod(int(x) for x in xs)


def bcast(v: jax.Array, x: jax.Array) -> jax.Array:
  """``v`` (leading axes of ``x``) reshaped to broadcast against ``x``."""
  return jnp.reshape(v, v.shape + (1,) * (x.ndim - v.ndim))
