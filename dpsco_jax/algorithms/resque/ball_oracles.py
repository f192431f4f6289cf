"""Ball optimization oracles (paper 002, Section 3), the inner solvers of ball acceleration.

References: [ReSQue] Alg. 1 (EpochSGD), Alg. 2 (AC-SA), Props 3-4, Lemma 11; CJJS21 for the
exact BROO. A *ball oracle* ``ball_oracle(key, center, lam, phi) -> (x, OracleCost)``
approximately solves

    O(y, lam, phi) ~ argmin_{x in B_y(r)} F(x) + lam/2 |x - y|^2        (eq. (8), Def. 4)

with expected error ``phi``, ``F = f^_rho``, from ONE batched round of ReSQue queries at
``center + xi`` (``OracleCost.rounds``: the query depth)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax._checks import check_int, check_positive
from dpsco_jax.grads import per_example_grads
from dpsco_jax.transforms.resque import reweight, sample_queries
from dpsco_jax.transforms.steps import acsa, add_prox_to_anchor, project_l2_ball

PyTree = Any
# grad_oracle(key, anchor, xis) -> gradients at anchor + xis (leaves [B, ...]): ONE round.
GradOracle = Callable[[jax.Array, PyTree, PyTree], PyTree]


class OracleCost(NamedTuple):
  """Sequential batched query rounds (query depth) and total gradient queries of a call."""
  rounds: int
  queries: int


BallOracle = Callable[[jax.Array, PyTree, float, float], tuple[PyTree, OracleCost]]


def dataset_oracle(loss_fn: Callable, items: PyTree) -> GradOracle:
  """Stochastic subgradient oracle of ``f(x) = (1/N) sum_i loss(x, item_i)``: query ``b`` draws
  ``z_b ~ Unif[N]`` (with replacement: unbiased, ReSQue §4.2) at ``anchor + xis[b]``."""
  n = jax.tree.leaves(items)[0].shape[0]

  def oracle(key, anchor, xis):
    b = jax.tree.leaves(xis)[0].shape[0]
    z = jax.random.randint(key, (b,), 0, n)
    batch = jax.tree.map(lambda a: a[z], items)
    return per_example_grads(loss_fn, anchor, batch, offsets=xis)

  return oracle


# ----------------------------------------------------------------------- composite step --

def ball_composite_step(x: PyTree, g: PyTree, center: PyTree, radius: float | jax.Array,
                        lam: float | jax.Array, lr: float | jax.Array,
                        ball_center: PyTree | None = None) -> PyTree:
  """``argmin_{u in B_b(r)} lr <g, u> + lr lam/2 |u - c|^2 + 1/2 |u - x|^2`` in closed form,
  ``Pi_{B_b(r)}((x + lr lam c - lr g) / (1 + lr lam))`` (Alg. 1 lines 5/9, Alg. 4 step; spec 002
  §3.2 [IMPL]), ``b = ball_center`` (default ``c = center``); ``lam = 0`` is a projected
  gradient step."""
  denom = 1.0 + lr * lam
  u = jax.tree.map(lambda xi, ci, gi: (xi + lr * lam * ci - lr * gi) / denom, x, center, g)
  return project_l2_ball(u, radius, center if ball_center is None else ball_center)


# ------------------------------------------------------------------------- EpochSGD (Alg. 1) --

def epoch_sgd_plan(lam: float, phi: float, lipschitz: float) -> tuple[int, int, int]:
  """``(T, K, n_queries)`` of Alg. 1: ``T = ceil(48 L^2/(lam phi))``, epochs ``T_k = 16 2^(k-1)``
  while ``sum_{j<=k} T_j <= T``, and the ``sum_k (T_k - 1)`` queries used (the paper samples
  ``2T``, spec §8 item 4; we draw exactly the ones used)."""
  t_total = int(math.ceil(48.0 * lipschitz ** 2 / (lam * phi)))
  k = int(math.floor(math.log2(t_total / 16.0 + 1.0))) if t_total >= 16 else 0
  n_q = 16 * (2 ** k - 1) - k
  return t_total, k, n_q


def _epoch_sgd_tables(k: int) -> tuple[np.ndarray, ...]:
  """Static per-step tables of Alg. 1 with ``k`` epochs: epoch id, epoch-start flag (the
  ``G = 0`` step that produces ``x_k^1``), epoch-end flag, the query index consumed by the
  step (steps ``t >= 1`` of an epoch consume the next query in order) and ``T_k``."""
  lengths = 16 * 2 ** np.arange(k)
  tks = np.repeat(lengths, lengths)
  start = np.arange(tks.size) == np.repeat(np.cumsum(lengths) - lengths, lengths)
  qidx = np.where(start, 0, np.cumsum(~start) - 1).astype(np.int32)
  return (np.repeat(np.arange(k, dtype=np.int32), lengths), start, np.roll(start, -1), qidx,
          tks.astype(np.float32))


@partial(jax.jit, static_argnums=(0,))
def _epoch_sgd_scan(k: int, center: PyTree, xis: PyTree, grads: PyTree, lam: jax.Array,
                    radius: jax.Array, rho: jax.Array) -> PyTree:
  epoch, start, end, qidx, tk = (jnp.asarray(a) for a in _epoch_sgd_tables(k))
  eta1 = 1.0 / (4.0 * lam)

  def body(carry, inp):
    x, x0, acc = carry
    e, s, en, qi, t_k = inp
    eta = eta1 / (2.0 ** e.astype(jnp.float32))
    xi = jax.tree.map(lambda a: a[qi][None], xis)
    gi = jax.tree.map(lambda a: a[qi][None], grads)
    g = reweight(x, center, xi, gi, rho)
    g = jax.tree.map(lambda v: jnp.where(s, 0.0, 1.0).astype(v.dtype) * v, g)
    base = jax.tree.map(lambda a, b: jnp.where(s, b, a), x, x0)
    x_new = ball_composite_step(base, g, center, radius, lam, eta)
    acc = jax.tree.map(lambda a, xn: jnp.where(s, xn, a + xn), acc, x_new)
    x0 = jax.tree.map(lambda a, o: jnp.where(en, a / t_k, o), acc, x0)
    return (x_new, x0, acc), None

  init = (center, center, jax.tree.map(jnp.zeros_like, center))
  (_, x0, _), _ = jax.lax.scan(body, init, (epoch, start, end, qidx, tk))
  return x0


def make_epoch_sgd_oracle(grad_oracle: GradOracle, *, radius: float, rho: float,
                          lipschitz: float, runs: int = 1) -> BallOracle:
  """``ball_oracle(key, center, lam, phi)`` running Alg. 1 (parallel EpochSGD), a ``(phi, lam)``
  ball oracle for ``f^_rho`` (Prop. 3, ``rho = r``): one batched round of queries, then
  composite ball steps on ReSQue estimates, epoch lengths ``16, 32, ...``, steps ``1/(4 lam),
  1/(8 lam), ...`` and epoch averaging. With ``runs > 1`` it runs that many independent copies
  in the SAME batched round and returns their :func:`majority_aggregate` (the line-search
  construction of ReSQue Prop. 2 / Lemma 11, ``Delta = 3 sqrt(2 phi / lam)``)."""
  check_positive(radius, "radius")
  check_positive(rho, "rho")
  check_int(runs, "runs")
  sample = jax.jit(lambda key, center, nq: _sample_and_query(grad_oracle, key, center, rho, nq),
                   static_argnums=2)

  def oracle(key, center, lam, phi):
    check_positive(lam, "lam")
    check_positive(phi, "phi")
    _, k, n_q = epoch_sgd_plan(lam, phi, lipschitz)
    if k == 0:  # T < 16: the paper's loop does not run and returns xbar
      return center, OracleCost(0, 0)
    outs = []
    for j in range(runs):
      xis, grads = sample(jax.random.fold_in(key, j), center, n_q)
      outs.append(_epoch_sgd_scan(k, center, xis, grads, jnp.float32(lam), jnp.float32(radius),
                                  jnp.float32(rho)))
    if runs == 1:
      return outs[0], OracleCost(1, n_q)
    pts = jax.tree.map(lambda *a: jnp.stack(a), *outs)
    x = majority_aggregate(pts, 3.0 * math.sqrt(2.0 * phi / lam))
    return x, OracleCost(1, runs * n_q)

  return oracle


def epoch_sgd_ball(grad_oracle: GradOracle, key: jax.Array, center: PyTree, *, lam: float,
                   phi: float, radius: float, rho: float, lipschitz: float
                   ) -> tuple[PyTree, OracleCost]:
  """One call of :func:`make_epoch_sgd_oracle`'s oracle (one run)."""
  oracle = make_epoch_sgd_oracle(grad_oracle, radius=radius, rho=rho, lipschitz=lipschitz)
  return oracle(key, center, lam, phi)


def _sample_and_query(grad_oracle, key, center, rho, n_q):
  """The ONE batched round of a ball-oracle call: ``n_q`` offsets and the oracle there."""
  kq, kg = jax.random.split(key)
  xis, _ = sample_queries(kq, center, rho, n_q)
  return xis, grad_oracle(kg, center, xis)


# ----------------------------------------------------------------------------- AC-SA (Alg. 2) --

def acsa_plan(lam: float, phi: float, radius: float, rho: float, lipschitz: float
              ) -> tuple[int, int, list[int]]:
  """``(K, T, [N_1..N_K])`` of Alg. 2: ``K = ceil(log2(lam r^2/phi))``,
  ``T = ceil(4 sqrt(L/(rho lam) + 1))``, ``N_k = ceil(48 2^k L^2 / (lam^2 r^2 T))``."""
  k = max(1, int(math.ceil(math.log2(lam * radius ** 2 / phi))))
  t = int(math.ceil(4.0 * math.sqrt(lipschitz / (rho * lam) + 1.0)))
  ns = [int(math.ceil(48.0 * 2 ** j * lipschitz ** 2 / (lam ** 2 * radius ** 2 * t)))
        for j in range(1, k + 1)]
  return k, t, ns


def acsa_ball(grad_oracle: GradOracle, key: jax.Array, center: PyTree, lam: float, phi: float,
              *, radius: float, rho: float, lipschitz: float) -> tuple[PyTree, OracleCost]:
  """Alg. 2 corrected (spec 002 §3.3, EXT A.2): a ``(phi, lam)`` ball oracle (Prop. 4).

  Minibatch AC-SA on ``Psi = f^_rho + lam/2 |. - xbar|^2`` over ``B_xbar(r)`` (``mu = lam``,
  smoothness ``L/rho + lam``), restarted from ``x_ag`` every ``T`` iterations (``K`` stages),
  ``N_k`` FRESH ReSQue queries per iteration (AMBIG-2), the full gradient scaled by
  ``alpha_t`` (AMBIG-3), ``x_md`` weights summing to one (AMBIG-1; the core ``acsa``'s). All
  ``T sum_k N_k`` queries are one batched round."""
  check_positive(lam, "lam")
  check_positive(phi, "phi")
  k, t, ns = acsa_plan(lam, phi, radius, rho, lipschitz)
  total = t * sum(ns)
  xis, grads = _sample_and_query(grad_oracle, key, center, rho, total)
  x_ag = _acsa_run(float(lam), float(radius), float(rho), float(lipschitz), t, tuple(ns),
                   center, xis, grads)
  return x_ag, OracleCost(1, total)


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _acsa_run(lam, radius, rho, lipschitz, t, ns, center, xis, grads):
  opt = optax.chain(add_prox_to_anchor(lam, center),
                    acsa(lipschitz / rho + lam, strong_convexity=lam, radius=radius,
                         center=center, stage_length=t))
  x_md = center
  state = opt.init(center)
  offset = 0
  for n_k in ns:  # stages have different minibatch sizes: one scan each (static shapes)
    buf = jax.tree.map(lambda a: a[offset:offset + t * n_k].reshape((t, n_k) + a.shape[1:]),
                       (xis, grads))

    def body(carry, b):
      x, st = carry
      est = reweight(x, center, b[0], b[1], rho)
      upd, st = opt.update(est, st, x)
      return (optax.apply_updates(x, upd), st), None

    (x_md, state), _ = jax.lax.scan(body, (x_md, state), buf)
    offset += t * n_k
  return state[1].released


def make_acsa_oracle(grad_oracle: GradOracle, *, radius: float, rho: float,
                     lipschitz: float) -> BallOracle:
  """``ball_oracle(key, center, lam, phi)`` running :func:`acsa_ball`."""
  return partial(acsa_ball, grad_oracle, radius=radius, rho=rho, lipschitz=lipschitz)


# ---------------------------------------------------------------- exact (validation) oracle --

@partial(jax.jit, static_argnums=(0, 5))
def _exact_prox(grad_fn, center, lam, radius, smoothness, n_steps):
  # Accelerated projected gradient with constant momentum for the (lam)-strongly convex,
  # (smoothness + lam)-smooth ball subproblem; linear rate 1 - sqrt(lam/(smoothness+lam)).
  big_l = smoothness + lam
  q = jnp.sqrt(big_l / lam)
  mom = (q - 1.0) / (q + 1.0)

  def body(carry, _):
    x, x_prev = carry
    yv = jax.tree.map(lambda a, b: a + mom * (a - b), x, x_prev)
    g = jax.tree.map(lambda gi, yi, ci: gi + lam * (yi - ci), grad_fn(yv), yv, center)
    x_new = project_l2_ball(jax.tree.map(lambda yi, gi: yi - gi / big_l, yv, g), radius, center)
    return (x_new, x), None

  (x, _), _ = jax.lax.scan(body, (center, center), None, length=n_steps)
  return x


def make_exact_ball_oracle(grad_fn: Callable[[PyTree], PyTree], *, radius: float,
                           smoothness: float, n_steps: int = 400) -> BallOracle:
  """Deterministic ball-prox oracle for a smooth ``F`` (validation): accelerated projected
  gradient for ``n_steps`` steps (``phi`` ignored); one round, zero stochastic queries."""
  check_positive(radius, "radius")
  check_positive(smoothness, "smoothness")

  def oracle(key, center, lam, phi):
    del key, phi
    x = _exact_prox(grad_fn, center, jnp.float32(lam), jnp.float32(radius),
                    jnp.float32(smoothness), n_steps)
    return x, OracleCost(1, 0)

  return oracle


# ------------------------------------------------------------------------------- Aggregate --

@jax.jit
def majority_aggregate(points: PyTree, delta: float | jax.Array) -> PyTree:
  """Lemma 11 / [KLL+22] Claim 1 (ReSQue Alg. 7's outlier filter).

  ``points``: leaves ``[k, ...]``. Promise: some ``y`` has ``>= 0.51 k`` points within
  ``delta/3``. Returns a point with ``>= 0.51 k`` points within ``2 delta / 3``, hence within
  ``delta`` of ``y``. O(d k^2). Without such a point (promise violated) it returns the point
  with the most neighbours, with no guarantee."""
  flat = jnp.concatenate([a.reshape(a.shape[0], -1) for a in jax.tree.leaves(points)], axis=1)
  k = flat.shape[0]
  sq = jnp.sum(flat * flat, axis=1)
  d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * flat @ flat.T, 0.0)
  counts = jnp.sum(d2 <= (2.0 * delta / 3.0) ** 2, axis=1)
  ok = counts >= 0.51 * k
  # first qualifying point; else the most-connected one
  idx = jnp.where(jnp.any(ok), jnp.argmax(ok), jnp.argmax(counts))
  return jax.tree.map(lambda a: a[idx], points)
