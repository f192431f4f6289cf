"""AboveThreshold (sparse vector) and the one-shot Laplace test, with their pure-DP events.

Paper 000 (Lowy, Liu, Asi, "Faster Algorithms for User-Level Private SCO"), Algorithm 4 and
Lemma A.9 ([DR14, Thm 3.24]):

  Delta^ = Delta + Lap(b_thr)                 drawn ONCE (spec 000 §7 item 1)
  for t = 1..T:  nu_t ~ Lap(b_q);  if q_t + nu_t >= Delta^: TOP, HALT  else BOT

With queries of l1-sensitivity ``s``, ``b_thr = 2 s / eps`` and ``b_q = 4 s / eps``, the whole
halting pattern is ``(eps, 0)``-DP. Algorithm 2 runs it on the score (``s = 2``) at budget ``eps
/ 2``, continuing while the noisy score clears the threshold (the negated queries: the same
statement). Algorithm 1's per-phase test ``s + Lap(20/eps) >= 4C/5`` is ``eps/10``-DP (the
paper books ``eps/4``, which also holds). Rounding is monotone, so the float32 test cannot
widen the gap between neighbours; the *computed* query must have sensitivity ``<= s`` (FILTER's
score is exact on a dyadic grid). Queries are promoted to float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dpsco_jax._checks import check_int, check_positive, check_probability
from dpsco_jax.privacy.ledger import pure_dp_event
from dpsco_jax.privacy.mechanisms import laplace

__all__ = ["above_threshold_scales", "above_threshold_init", "above_threshold_step",
           "above_threshold_run", "above_threshold_accuracy", "above_threshold_epsilon",
           "above_threshold_dp_event", "laplace_test", "laplace_test_epsilon",
           "laplace_test_dp_event", "laplace_tail"]


def _wide(q) -> jax.Array:
  """The query in float32 or wider."""
  q = jnp.asarray(q)
  return q.astype(jnp.promote_types(q.dtype, jnp.float32)) if jnp.issubdtype(
      q.dtype, jnp.floating) else q.astype(jnp.float32)


def above_threshold_scales(epsilon: float, sensitivity: float = 1.0
                           ) -> tuple[float, float]:
  """Laplace scales ``(b_thr, b_q) = (2 s / eps, 4 s / eps)`` of an ``eps``-DP AboveThreshold
  (Algorithm 2: ``epsilon=eps/2``, ``sensitivity=2``)."""
  epsilon = check_positive(epsilon, "epsilon")
  sensitivity = check_positive(sensitivity, "sensitivity")
  return 2.0 * sensitivity / epsilon, 4.0 * sensitivity / epsilon


def above_threshold_epsilon(threshold_scale: float, query_scale: float,
                            sensitivity: float = 1.0) -> float:
  """Pure-DP epsilon ``s / b_thr + 2 s / b_q`` of AboveThreshold ([DR14, Thm 3.23])."""
  threshold_scale = check_positive(threshold_scale, "threshold_scale")
  query_scale = check_positive(query_scale, "query_scale")
  sensitivity = check_positive(sensitivity, "sensitivity")
  return sensitivity / threshold_scale + 2.0 * sensitivity / query_scale


def above_threshold_dp_event(threshold_scale: float, query_scale: float,
                             sensitivity: float = 1.0):
  """The ``(eps, 0)`` DpEvent of one AboveThreshold run (whatever its length)."""
  return pure_dp_event(above_threshold_epsilon(threshold_scale, query_scale, sensitivity))


def above_threshold_init(key: jax.Array, threshold: float | jax.Array,
                         threshold_scale: float | jax.Array) -> jax.Array:
  """Draws the noisy threshold ``Delta^ = Delta + Lap(b_thr)`` (once per run / phase).

  Args:
    key: a JAX PRNG key used for the threshold only.
    threshold: the public threshold ``Delta``.
    threshold_scale: the threshold's Laplace scale ``b_thr``, > 0.

  Returns:
    The noisy threshold, a float32 scalar: secret state of the run, never to be released.
  """
  return jnp.asarray(threshold, jnp.float32) + laplace(key, (), threshold_scale)


def above_threshold_step(key: jax.Array, query: jax.Array, noisy_threshold: jax.Array,
                         query_scale: float | jax.Array, halted: jax.Array
                         ) -> jax.Array:
  """One step: continues iff ``query + Lap(b_q) >= Delta^``; ``halted`` is sticky.

  Args:
    key: a JAX PRNG key for this step's query noise.
    query: the step's (sensitivity-bounded) query value, a scalar.
    noisy_threshold: the value of :func:`above_threshold_init`.
    query_scale: the query's Laplace scale ``b_q``, > 0.
    halted: the current halted flag (a bool scalar).

  Returns:
    The new halted flag, a bool scalar.
  """
  passed = _wide(query) + laplace(key, (), query_scale) >= noisy_threshold
  return jnp.logical_or(halted, jnp.logical_not(passed))


def above_threshold_run(key: jax.Array, queries: jax.Array, threshold: float,
                        threshold_scale: float, query_scale: float) -> jax.Array:
  """Reference run over queries ``[T]``: ``flags[t]`` is whether it halted by step ``t``."""
  k_thr, k_q = jax.random.split(key)
  noisy = above_threshold_init(k_thr, threshold, threshold_scale)

  def body(halted, xs):
    t, q = xs
    halted = above_threshold_step(jax.random.fold_in(k_q, t), q, noisy, query_scale, halted)
    return halted, halted

  _, flags = jax.lax.scan(body, jnp.asarray(False),
                          (jnp.arange(queries.shape[0]), jnp.asarray(queries, jnp.float32)))
  return flags


def above_threshold_accuracy(num_queries: int, gamma: float, query_scale: float,
                             threshold_scale: float | None = None) -> float:
  """Accuracy ``alpha = 2 b_q log(2T/gamma)`` of Lemma A.9 (needs ``b_thr <= b_q``): w.p. ``>= 1
  - gamma`` a continue implies ``q_t >= Delta - alpha`` and a halt ``q_t <= Delta + alpha``."""
  num_queries = check_int(num_queries, "num_queries")
  gamma = check_probability(gamma, "gamma")
  query_scale = check_positive(query_scale, "query_scale")
  if threshold_scale is not None and check_positive(threshold_scale,
                                                    "threshold_scale") > query_scale:
    raise ValueError("threshold_scale must be <= query_scale for Lemma A.9's alpha")
  return 2.0 * query_scale * math.log(2.0 * num_queries / gamma)


def laplace_test(key: jax.Array, score: jax.Array, threshold: float | jax.Array,
                 scale: float | jax.Array) -> jax.Array:
  """One-shot noisy test ``score + Lap(scale) >= threshold`` (Algorithm 1, line 13).

  Args:
    key: a JAX PRNG key used for this test only.
    score: the (sensitivity-bounded) score, a scalar.
    threshold: the public threshold.
    scale: the Laplace scale ``b`` (sensitivity / epsilon), > 0.

  Returns:
    A bool scalar: whether the noisy score passed (a DP release).
  """
  return _wide(score) + laplace(key, (), scale) >= threshold


def laplace_test_epsilon(scale: float, sensitivity: float) -> float:
  """``eps = s / b`` of the one-shot Laplace test (Lemma A.4)."""
  return check_positive(sensitivity, "sensitivity") / check_positive(scale, "scale")


def laplace_test_dp_event(scale: float, sensitivity: float):
  """The ``(s/b, 0)`` DpEvent of one Laplace test."""
  return pure_dp_event(laplace_test_epsilon(scale, sensitivity))


def laplace_tail(t: float, scale: float) -> float:
  """``P(|Lap(b)| >= t) = exp(-t/b)`` (Lemmas B.2 / C.2's bad events)."""
  return math.exp(-max(float(t), 0.0) / check_positive(scale, "scale"))
