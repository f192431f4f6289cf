"""ReSQue (Reweighted Stochastic Query) estimators on pytrees.

Carmon, Jambulapati, Jin, Lee, Liu, Sidford, Tian, "ReSQueing Parallel and Private Stochastic
Convex Optimization" (2023), Definition 2, eq. (2); Lemmas 1-2. Around an anchor ``xbar``, draw
``xi ~ N(0, rho^2 I)``, query the subgradient oracle at ``xbar + xi`` and reweight:

    grad~(x) = w(x; xi) * g(xbar + xi),
    w(x; xi) = exp( (<v, xi> - |v|^2 / 2) / rho^2 ),     v = x - xbar.

``E grad~(x) = grad f^_rho(x)`` (Lemma 1.1; ``f^_rho = f * N(0, rho^2 I)``); for ``|x - xbar|
<= rho`` the second moment is ``<= E|g|^2 exp(|v|^2/rho^2) <= 3 L^2`` (Lemma 1.2; eq. (7)'s
exponent ``2|v|^2/rho^2`` is a slip, spec 002 §8 item 3), so solvers keep ``|x - xbar| <= rho``.

Contract: the raw gradients MUST be taken at ``anchor + xi`` (``per_example_grads(loss_fn,
anchor, batch, offsets=xis)``), NOT at ``params``, with ``xi`` drawn independently of the
iterate (:func:`sample_queries`); the arithmetic cannot detect the mistake. The ``xi`` are
smoothing randomness, not privacy noise.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpsco_jax._checks import check_int, check_key, check_positive
from dpsco_jax.transforms.noise import tree_gaussian_like

PyTree = Any


def sample_queries(key: jax.Array, anchor: PyTree, rho: float | jax.Array,
                   num: int) -> tuple[PyTree, PyTree]:
  """Draws ``num`` Gaussian query offsets around ``anchor`` (Definition 2); pass ``xis`` as
  ``offsets=`` to the gradient engine to evaluate the oracle at ``points``.

  Args:
    key: a JAX PRNG key.
    anchor: the center of the queries (a params pytree).
    rho: the smoothing radius (the offsets' std).
    num: the number of queries, an integer >= 1.

  Returns:
    ``(xis, points)``: ``xis`` with leaves ``[num, *leaf.shape]`` of i.i.d. ``N(0, rho^2)``
    entries, and ``points = anchor + xis``.
  """
  num = check_int(num, "num")
  check_key(key, "key")   # JAX's own refusal names no argument
  template = jax.tree.map(
      lambda a: jnp.zeros((num,) + jnp.shape(a), jnp.result_type(a, jnp.float32)), anchor)
  xis = tree_gaussian_like(key, template, rho)
  points = jax.tree.map(lambda a, x: a[None] + x, anchor, xis)
  return xis, points


def log_weight(x: PyTree, anchor: PyTree, xi: PyTree, rho: float | jax.Array) -> jax.Array:
  """``log w(x; xi) = (<v, xi> - |v|^2/2) / rho^2``, ``v = x - anchor`` (one query)."""
  v = jax.tree.map(jnp.subtract, x, anchor)
  return (optax.tree.vdot(v, xi) - 0.5 * optax.tree.vdot(v, v)) / jnp.square(rho)


def log_weights(x: PyTree, anchor: PyTree, xis: PyTree, rho: float | jax.Array) -> jax.Array:
  """``[B]`` log-weights of ``x`` against a batch of offsets ``xis`` (leading axis ``B``)."""
  v = jax.tree.map(jnp.subtract, x, anchor)
  parts = jax.tree.leaves(jax.tree.map(   # [B] inner products of each offset with v
      lambda xb, y: jnp.sum((xb * y[None]).reshape(xb.shape[0], -1), axis=1), xis, v))
  return (sum(parts[1:], parts[0]) - 0.5 * optax.tree.vdot(v, v)) / jnp.square(rho)


def reweight(x: PyTree, anchor: PyTree, xis: PyTree, grads: PyTree,
             rho: float | jax.Array, *, reduce: str = "mean") -> PyTree:
  """The ReSQue estimate at ``x`` from a batch of queries (eq. (2), minibatch mean).

  Args:
    x: the point at which the smoothed gradient is wanted.
    anchor: the center the queries were drawn around.
    xis: offsets, leaves ``[B, ...]``.
    grads: oracle gradients AT ``anchor + xis`` (leaves ``[B, ...]``).
    rho: smoothing radius.
    reduce: ``"mean"`` (``(1/B) sum_b w_b g_b``) or ``"none"`` (the ``[B, ...]`` terms).

  Returns:
    The ReSQue estimate (params-shaped), or the ``[B, ...]`` terms with ``reduce="none"``.
  """
  w = jnp.exp(log_weights(x, anchor, xis, rho))
  def leaf(g):
    wb = w.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)
    terms = wb * g
    return terms if reduce == "none" else jnp.mean(terms, axis=0)
  return jax.tree.map(leaf, grads)


class ResqueState(NamedTuple):
  """``anchor``: the query center ``xbar``; ``count``: number of updates made."""
  anchor: PyTree
  count: jax.Array


def resque(rho: float) -> optax.GradientTransformationExtraArgs:
  """Reweights raw gradients taken at ``state.anchor + xi`` (module docstring) into ReSQue
  estimates at ``params``: ``w(params; xi) raw_grads`` (eq. (2)), or the minibatch mean when
  ``xi`` has a leading batch axis. The anchor is ``params`` at ``init`` (:func:`reset_anchor`).

  Args:
    rho: the Gaussian smoothing radius (> 0).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``params`` and the extra
    argument ``xi``.
  """
  rho = check_positive(rho, "rho")

  def init_fn(params):
    return ResqueState(anchor=jax.tree.map(jnp.asarray, params), count=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, *, xi=None, **extra):
    del extra
    if params is None:
      raise ValueError("resque needs params (the point at which the estimate is wanted)")
    if xi is None:
      raise ValueError("resque needs the keyword xi: the offsets at which updates were taken")
    p0 = jax.tree.leaves(params)[0]
    x0 = jax.tree.leaves(xi)[0]
    if x0.ndim == p0.ndim + 1:  # a batch of queries: minibatch mean
      out = reweight(params, state.anchor, xi, updates, rho)
    else:
      w = jnp.exp(log_weight(params, state.anchor, xi, rho))
      out = jax.tree.map(lambda g: (w * g).astype(g.dtype), updates)
    return out, ResqueState(anchor=state.anchor, count=state.count + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def reset_anchor(state: ResqueState, new_anchor: PyTree) -> ResqueState:
  """Moves the query center (the outer loop calls this when it moves the ball)."""
  return state._replace(anchor=jax.tree.map(jnp.asarray, new_anchor))


# Closed-form smoothed losses (spec 002 §7.5): ground truth for tests and exact oracles.

def smoothed_abs(x: jax.Array, a: jax.Array, b: jax.Array, rho: float | jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """Value and gradient of ``E_xi |<a, x + xi> - b|``, ``xi ~ N(0, rho^2 I)``, per row of ``a``.

  With ``m = <a,x> - b`` and ``s = rho |a|``: value ``m erf(m/(sqrt2 s)) + s sqrt(2/pi)
  exp(-m^2/(2 s^2))`` and gradient ``erf(m/(sqrt2 s)) a``. ``a``: ``[n, d]``, ``b``: ``[n]``.
  """
  m = a @ x - b
  s = rho * jnp.linalg.norm(a, axis=-1)
  z = m / (jnp.sqrt(2.0) * s)
  val = m * jax.scipy.special.erf(z) + s * jnp.sqrt(2.0 / jnp.pi) * jnp.exp(-jnp.square(z))
  grad = jax.scipy.special.erf(z)[:, None] * a
  return val, grad


def smoothed_hinge(x: jax.Array, a: jax.Array, y: jax.Array, rho: float | jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """Value and gradient of ``E_xi max(0, 1 - y <a, x + xi>)`` per row of ``a``.

  With ``u = 1 - y<a,x>`` and ``s = rho |a|``: value ``u Phi(u/s) + s phi(u/s)`` and gradient
  ``-y Phi(u/s) a``.
  """
  u = 1.0 - y * (a @ x)
  s = rho * jnp.linalg.norm(a, axis=-1)
  t = u / s
  val = u * jax.scipy.stats.norm.cdf(t) + s * jax.scipy.stats.norm.pdf(t)
  grad = (-y * jax.scipy.stats.norm.cdf(t))[:, None] * a
  return val, grad
