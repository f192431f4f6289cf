"""Ball optimization oracles and Monteiro–Svaiter ball acceleration (paper 002, Section 3).

References:
  * Carmon, Jambulapati, Jin, Lee, Liu, Sidford, Tian, "ReSQueing Parallel and Private
    Stochastic Convex Optimization" (2023) [ReSQue]: Alg. 1 (EpochSGD), Alg. 2 (AC-SA),
    Props 1-4, Theorems 1-2.
  * Carmon, Jambulapati, Jin, Sidford, "Thinking Inside the Ball", COLT 2021 [CJJS21],
    Alg. 1 (BROO acceleration with LAMBDA-BISECTION): the outer loop implemented here,
    transcribed in spec EXT_acsa_ball_acceleration.md §B.2.

Problem. Minimize a convex, L-Lipschitz ``F`` (here the Gaussian smoothing ``f^_rho`` of the
loss, handled through ReSQue queries) over ``B_R(x0)``, given a *ball oracle*

    O(y, lam, phi) ~ argmin_{x in B_y(r)} F(x) + lam/2 |x - y|^2        (eq. (8), Def. 4)

with expected objective error ``phi``. A ball oracle here is any callable
``ball_oracle(key, center, lam, phi) -> (x, OracleCost)``; ``OracleCost.rounds`` counts the
sequential batched rounds of gradient queries (query depth) and ``.queries`` the gradients.

Oracles provided:
  * :func:`make_epoch_sgd_oracle` — Alg. 1 (EpochSGD, [HK14]) with ReSQue: ONE batched round
    of ``sum_k (T_k - 1) <= T = ceil(48 L^2 / (lam phi))`` queries at ``center + xi``, then a
    ``lax.scan`` that only reweights (Prop. 3: a ``(phi, lam)`` ball oracle for ``f^_rho`` when
    ``rho = r``).
  * :func:`acsa_ball` — Alg. 2 corrected (spec 002 §3.3: AMBIG-1/2/3), built from the core
    :func:`dpsco_jax.transforms.steps.acsa` chained after ``add_prox_to_anchor`` (the full
    gradient of ``Psi = f^_rho + lam/2 |. - xbar|^2`` enters ``alpha_t``, AMBIG-3). One batched
    round of ``T sum_k N_k`` queries; fresh samples for every ``t`` (AMBIG-2).
  * :func:`make_exact_ball_oracle` — a deterministic validation oracle (accelerated projected
    gradient on a closed-form smooth ``F``); it is what CJJS21 calls an exact BROO and is used
    to validate the reconstructed outer loop (spec T13).

Outer loops:
  * :func:`ball_acceleration` — CJJS21 Alg. 1 lines 1-8 and LAMBDA-BISECTION (lines 10-21)
    with ReSQue Prop. 1/2's oracle parameters; invariants ``A_{t+1} = A_t + a_{t+1}``,
    ``lam_{t+1} a_{t+1}^2 = A_{t+1}`` and ``v in B_R(x0)`` are checked every iteration.
  * :func:`iterated_ball_prox` — plain ``x_{k+1} = O(x_k)`` for comparison (``~R/r``
    iterations vs ``~(R/r)^{2/3}`` for acceleration, [CJJ+20]).

Deviations (documented, see also the class docstrings):
  * Line 7 of CJJS21 uses ``lam (y_t - x_{t+1})`` from the ball-oracle output. ReSQue Prop. 1
    instead feeds an MLMC stochastic-proximal estimate (bias ``eps/(C R)``) into the
    ``v``-update; in the parallel pipeline we use the ball-oracle output at accuracy ``phi``
    (its bias is at most ``sqrt(2 lam phi)``). The private pipeline (``algorithms/resque.py``)
    uses the MLMC estimator (Alg. 6).
  * Exits: CJJS21 line 8 tests 1 (``A >= R^2/eps``) and 2 (small ``lam``) and the iteration
    cap ``ceil(C_ba K log kappa)`` of ReSQue Prop. 1. Tests 3-4 need function values (line 9's
    ``argmin f``), which a stochastic oracle does not have; they are not used. The output is
    the last ``x``.
  * ``lam_min`` defaults to ReSQue's ``lam_star / C_ba`` (Prop. 1: every lam is
    ``>= lam_star/C_ba``) rather than CJJS21's ``eps/(6 r R)``: stochastic oracles cost
    ``~1/lam^2`` queries. ``lam_max = 2 L / r`` (CJJS21, spec EXT §B.2 [AMBIG] resolution).
  * Optional warm start of the bisection from the previous ``lam`` (spec 002 §3.1 [IMPL]).
"""

from __future__ import annotations

import dataclasses
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
from dpsco_jax.transforms.steps import acsa, add_prox_to_anchor, project_l2_ball, tree_l2_norm

PyTree = Any
# grad_oracle(key, anchor, xis) -> gradients at anchor + xis (leaves [B, ...]): ONE round.
GradOracle = Callable[[jax.Array, PyTree, PyTree], PyTree]


class OracleCost(NamedTuple):
  """Sequential batched query rounds (query depth) and total gradient queries of a call."""
  rounds: int
  queries: int


BallOracle = Callable[[jax.Array, PyTree, float, float], tuple[PyTree, OracleCost]]


def dataset_oracle(loss_fn: Callable, items: PyTree) -> GradOracle:
  """Stochastic subgradient oracle of ``f(x) = (1/N) sum_i loss(x, item_i)``.

  Query ``b`` draws an index ``z_b ~ Unif[N]`` (with replacement, so each query is an unbiased
  subgradient, ReSQue §4.2) and differentiates at ``anchor + xis[b]`` with the core engine.
  ``items`` has leaves ``[N, ...]``.
  """
  n = jax.tree.leaves(items)[0].shape[0]

  def oracle(key, anchor, xis):
    b = jax.tree.leaves(xis)[0].shape[0]
    z = jax.random.randint(key, (b,), 0, n)
    batch = jax.tree.map(lambda a: a[z], items)
    return per_example_grads(loss_fn, anchor, batch, offsets=xis)

  return oracle


# ----------------------------------------------------------------------- composite step --

def ball_composite_step(x: PyTree, g: PyTree, center: PyTree, radius: float | jax.Array,
                        lam: float | jax.Array, lr: float | jax.Array) -> PyTree:
  """``argmin_{u in B_c(r)} lr <g, u> + lr lam/2 |u - c|^2 + 1/2 |u - x|^2`` in closed form.

  ``= Pi_{B_c(r)}((x + lr lam c - lr g) / (1 + lr lam))`` (Alg. 1 lines 5/9, Alg. 4 step;
  spec 002 §3.2 [IMPL]). ``lam = 0`` is a projected gradient step.
  """
  denom = 1.0 + lr * lam
  u = jax.tree.map(lambda xi, ci, gi: (xi + lr * lam * ci - lr * gi) / denom, x, center, g)
  return project_l2_ball(u, radius, center)


# ------------------------------------------------------------------------- EpochSGD (Alg. 1) --

def epoch_sgd_plan(lam: float, phi: float, lipschitz: float) -> tuple[int, int, int]:
  """``(T, K, n_queries)`` of Alg. 1: ``T = ceil(48 L^2/(lam phi))``, epochs ``T_k = 16 2^(k-1)``
  while ``sum_{j<=k} T_j <= T`` (``K`` full epochs) and ``sum_k (T_k - 1)`` queries used.

  The paper samples ``2T`` queries and uses at most ``T`` (spec §8 item 4); we draw exactly the
  ones used.
  """
  t_total = int(math.ceil(48.0 * lipschitz ** 2 / (lam * phi)))
  k = int(math.floor(math.log2(t_total / 16.0 + 1.0))) if t_total >= 16 else 0
  n_q = 16 * (2 ** k - 1) - k
  return t_total, k, n_q


def _epoch_sgd_tables(k: int) -> tuple[np.ndarray, ...]:
  """Static per-step tables of Alg. 1 with ``k`` epochs: epoch id, epoch-start flag (the
  ``G = 0`` step that produces ``x_k^1``), epoch-end flag, the query index consumed by the
  step (steps ``t >= 1`` of an epoch consume the next query in order) and ``T_k``."""
  lengths = [16 * 2 ** i for i in range(k)]
  epoch, start, end, qidx, tks = [], [], [], [], []
  q = 0
  for e, tk in enumerate(lengths):
    for t in range(tk):
      epoch.append(e)
      start.append(t == 0)
      end.append(t == tk - 1)
      tks.append(tk)
      if t == 0:
        qidx.append(0)
      else:
        qidx.append(q)
        q += 1
  return (np.asarray(epoch, np.int32), np.asarray(start), np.asarray(end),
          np.asarray(qidx, np.int32), np.asarray(tks, np.float32))


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


def epoch_sgd_ball(grad_oracle: GradOracle, key: jax.Array, center: PyTree, *, lam: float,
                   phi: float, radius: float, rho: float, lipschitz: float
                   ) -> tuple[PyTree, OracleCost]:
  """Alg. 1 (parallel EpochSGD): a ``(phi, lam)`` ball oracle for ``f^_rho`` (Prop. 3, rho = r).

  One batched round of queries ``g(center + xi_i)`` (query depth 1), then a ``lax.scan`` of
  composite ball steps (closed form, :func:`ball_composite_step`) on ReSQue estimates, epoch
  lengths ``16, 32, ...`` with step sizes ``1/(4 lam), 1/(8 lam), ...`` and epoch averaging.
  """
  check_positive(lam, "lam")
  check_positive(phi, "phi")
  _, k, n_q = epoch_sgd_plan(lam, phi, lipschitz)
  if k == 0:  # T < 16: the paper's loop does not run and returns xbar
    return center, OracleCost(0, 0)
  xis, grads = _sample_and_query(grad_oracle, key, center, rho, n_q)
  x = _epoch_sgd_scan(k, center, xis, grads, jnp.asarray(lam, jnp.float32),
                      jnp.asarray(radius, jnp.float32), jnp.asarray(rho, jnp.float32))
  return x, OracleCost(1, n_q)


def make_epoch_sgd_oracle(grad_oracle: GradOracle, *, radius: float, rho: float,
                          lipschitz: float, runs: int = 1) -> BallOracle:
  """``ball_oracle(key, center, lam, phi)`` running Alg. 1; with ``runs > 1`` it runs that many
  independent copies in the SAME batched round and returns their :func:`majority_aggregate` (the
  line-search construction of ReSQue Prop. 2 / Lemma 11, ``Delta = 3 sqrt(2 phi / lam)``)."""
  check_positive(radius, "radius")
  check_positive(rho, "rho")
  check_int(runs, "runs")
  sample = jax.jit(lambda key, center, nq: _sample_and_query(grad_oracle, key, center, rho, nq),
                   static_argnums=2)

  def oracle(key, center, lam, phi):
    _, k, n_q = epoch_sgd_plan(lam, phi, lipschitz)
    if k == 0:
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


def acsa_ball(grad_oracle: GradOracle, key: jax.Array, center: PyTree, *, lam: float,
              phi: float, radius: float, rho: float, lipschitz: float
              ) -> tuple[PyTree, OracleCost]:
  """Alg. 2 corrected (spec 002 §3.3, EXT A.2): a ``(phi, lam)`` ball oracle (Prop. 4).

  Minibatch AC-SA on ``Psi = f^_rho + lam/2 |. - xbar|^2`` over ``B_xbar(r)``: ``mu = lam``,
  smoothness ``L/rho + lam``, ``alpha_t = 2/(t+1)``, ``gamma_t = 4(L/rho + lam)/(t(t+1))``,
  restart from ``x_ag`` every ``T`` iterations (``K`` stages), minibatch ``N_k`` of FRESH
  ReSQue queries per iteration (AMBIG-2), full gradient ``grad^ + lam(x_md - xbar)`` scaled
  by ``alpha_t`` (AMBIG-3), ``x_md`` weights summing to one (AMBIG-1; these are the core
  ``acsa``'s). All ``T sum_k N_k`` queries are made in one batched round before the loop.
  """
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
  def oracle(key, center, lam, phi):
    return acsa_ball(grad_oracle, key, center, lam=lam, phi=phi, radius=radius, rho=rho,
                     lipschitz=lipschitz)
  return oracle


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
  """Deterministic ball-prox oracle for a smooth ``F`` with gradient ``grad_fn`` (validation).

  Solves ``min_{B_y(r)} F + lam/2 |x - y|^2`` by accelerated projected gradient for
  ``n_steps`` steps (``phi`` is ignored; ``n_steps`` sets the accuracy). Each call counts as
  one round with zero stochastic queries.
  """
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

  ``points``: leaves ``[k, ...]``. Promise: some unknown ``y`` has ``>= 0.51 k`` points within
  ``delta/3``. Returns a point with ``>= 0.51 k`` points (itself included) within
  ``2 delta / 3``; any such point is within ``delta`` of ``y`` (it shares a neighbour with a
  good point). O(d k^2). If no point qualifies (promise violated), returns the point with the
  most neighbours (never crashes; the output then carries no guarantee).
  """
  flat = jnp.concatenate([a.reshape(a.shape[0], -1) for a in jax.tree.leaves(points)], axis=1)
  k = flat.shape[0]
  sq = jnp.sum(flat * flat, axis=1)
  d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * flat @ flat.T, 0.0)
  counts = jnp.sum(d2 <= (2.0 * delta / 3.0) ** 2, axis=1)
  ok = counts >= 0.51 * k
  # first qualifying point; else the most-connected one
  idx = jnp.where(jnp.any(ok), jnp.argmax(ok), jnp.argmax(counts))
  return jax.tree.map(lambda a: a[idx], points)


# ------------------------------------------------------------------------ ball acceleration --

@dataclasses.dataclass
class BallAccelResult:
  """Output of :func:`ball_acceleration` / :func:`iterated_ball_prox`.

  ``history``: one dict per outer iteration with ``x`` (the iterate after it), ``lam``, ``A``,
  ``rounds`` (cumulative query depth) and ``queries`` (cumulative). ``exit`` names the stop.
  """
  x: PyTree
  iterations: int
  oracle_calls: int
  rounds: int
  queries: int
  exit: str
  history: list


def resque_accel_params(lipschitz: float, radius_r: float, radius_big: float,
                        eps: float) -> dict:
  """ReSQue Prop. 1: ``kappa = L R/eps``, ``K = (R/r)^(2/3)``,
  ``lam_star = eps K^2 log^2(kappa) / R^2``."""
  kappa = lipschitz * radius_big / eps
  k = (radius_big / radius_r) ** (2.0 / 3.0)
  lam_star = eps * k ** 2 * math.log(max(kappa, math.e)) ** 2 / radius_big ** 2
  return {"kappa": kappa, "K": k, "lam_star": lam_star}


def _alpha_tau(tau: float) -> float:
  return tau / (1.0 + tau + math.sqrt(1.0 + 2.0 * tau))


def ball_acceleration(ball_oracle: BallOracle, x0: PyTree, key: jax.Array, *, R: float,
                      r: float, eps: float, lipschitz: float, lam_min: float | None = None,
                      lam_max: float | None = None, c_ba: float = 1.0,
                      max_iter: int | None = None, ls_accuracy: float | None = None,
                      bo_phi: Callable[[float], float] | None = None,
                      warm_start: bool = True, band: tuple[float, float] = (13 / 16, 15 / 16),
                      max_bisection: int = 40,
                      callback: Callable[[int, PyTree], None] | None = None,
                      ls_oracle: BallOracle | None = None,
                      prox_oracle: Callable[[jax.Array, PyTree, float], PyTree] | None = None,
                      center: PyTree | None = None) -> BallAccelResult:
  """Monteiro–Svaiter ball acceleration (CJJS21 Alg. 1; ReSQue Prop. 1/2 parameters).

  Per outer iteration ``t``:
    1. ``lam_{t+1}`` = LAMBDA-BISECTION: find ``lam`` with ``|O(y_lam, lam) - y_lam|`` in the
       band ``[13r/16, 15r/16]`` (long step), or ``lam`` near ``lam_min`` (short step);
       ``y_lam = alpha_{2 A lam} x + (1 - alpha_{2 A lam}) v``,
       ``alpha_tau = tau / (1 + tau + sqrt(1 + 2 tau))`` (line 11). Each distinct ``lam``
       costs one oracle call at accuracy ``ls_accuracy`` (default ``r/17``, i.e.
       ``phi = lam (r/17)^2 / 2``).
    2. ``a = (1 + sqrt(1 + 4 lam A))/(2 lam)``, ``A' = A + a``, ``y = (A x + a v)/A'`` (lines 4-5).
    3. ``x' = O(y, lam, phi = bo_phi(lam))`` (line 6); default
       ``phi = lam r^2 / (c_ba log^3 kappa)`` (ReSQue Prop. 1 item 2).
    4. ``v' = Pi_{B_R(x0)}(v - a lam (y - x'))`` (line 7).
  ``ls_oracle`` (default ``ball_oracle``) serves step 1 (ReSQue's line-search oracle, e.g.
  Alg. 7); ``prox_oracle(key, y, lam)`` (optional; ReSQue's stochastic proximal oracle, e.g.
  the MLMC Alg. 6) replaces ``x'`` in step 4 by its estimate of ``bprox(y)``. ``center`` is
  the constraint ball's center (default ``x0``).

  Stops when ``A >= R^2/eps`` (line 8, test 1), when ``lam <= eps/(3 r R)`` (test 2), or after
  ``max_iter`` (default ``ceil(c_ba K log kappa)``, ReSQue Prop. 1). Invariants are checked
  every iteration (a ``RuntimeError`` names a violated one).

  Returns a :class:`BallAccelResult`; ``rounds`` is the query depth (each oracle call is one
  batched round).
  """
  check_positive(R, "R")
  check_positive(r, "r")
  check_positive(eps, "eps")
  check_positive(lipschitz, "lipschitz")
  if r > R:
    raise ValueError(f"r must be <= R, got r={r}, R={R}")
  p = resque_accel_params(lipschitz, r, R, eps)
  lam_min = p["lam_star"] / c_ba if lam_min is None else check_positive(lam_min, "lam_min")
  lam_max = 2.0 * lipschitz / r if lam_max is None else check_positive(lam_max, "lam_max")
  if lam_min >= lam_max:
    raise ValueError(f"lam_min ({lam_min:.3g}) must be < lam_max ({lam_max:.3g})")
  if max_iter is None:
    max_iter = int(math.ceil(c_ba * p["K"] * math.log(max(p["kappa"], math.e))))
  check_int(max_iter, "max_iter")
  delta_ls = r / 17.0 if ls_accuracy is None else check_positive(ls_accuracy, "ls_accuracy")
  logk3 = math.log(max(p["kappa"], math.e)) ** 3
  if bo_phi is None:
    bo_phi = lambda lam: lam * r * r / (c_ba * logk3)
  lo, hi = band[0] * r, band[1] * r

  ls_oracle = ball_oracle if ls_oracle is None else ls_oracle
  center = x0 if center is None else center
  x = x0
  v = project_l2_ball(x0, R, center)
  a_cum = 0.0
  lam_prev = None
  calls = rounds = queries = 0
  history = []
  exit_reason = "max_iter"
  key_iter = key

  for t in range(max_iter):
    key_iter, k_ls, k_bo, k_sp = jax.random.split(key_iter, 4)
    cache: dict[float, float] = {}

    def y_of(lam):
      al = _alpha_tau(2.0 * a_cum * lam)
      return jax.tree.map(lambda xi, vi: al * xi + (1.0 - al) * vi, x, v)

    def dist(lam):
      nonlocal calls, rounds, queries
      if lam not in cache:
        y = y_of(lam)
        out, cost = ls_oracle(jax.random.fold_in(k_ls, len(cache)), y, lam,
                                0.5 * lam * delta_ls ** 2)
        calls += 1
        rounds += cost.rounds
        queries += cost.queries
        cache[lam] = float(tree_l2_norm(jax.tree.map(jnp.subtract, out, y)))
      return cache[lam]

    lam = _bisection(dist, lam_prev if warm_start else None, lam_min, lam_max, lo, hi, r, R,
                     lipschitz, max_bisection)
    a = (1.0 + math.sqrt(1.0 + 4.0 * lam * a_cum)) / (2.0 * lam)
    a_new = a_cum + a
    y = jax.tree.map(lambda xi, vi: (a_cum * xi + a * vi) / a_new, x, v)
    x_new, cost = ball_oracle(k_bo, y, lam, bo_phi(lam))
    calls += 1
    rounds += cost.rounds
    queries += cost.queries
    x_prox = x_new if prox_oracle is None else prox_oracle(k_sp, y, lam)
    v_new = project_l2_ball(jax.tree.map(lambda vi, yi, xi: vi - a * lam * (yi - xi), v, y, x_prox),
                            R, center)
    # invariants (CJJS21 Alg. 1 line 4 and line 7)
    if not math.isclose(lam * a * a, a_new, rel_tol=1e-9):
      raise RuntimeError(f"invariant lam a^2 = A violated at t={t}: {lam * a * a} vs {a_new}")
    vdist = float(tree_l2_norm(jax.tree.map(jnp.subtract, v_new, center)))
    if vdist > R * (1.0 + 1e-5):
      raise RuntimeError(f"invariant v in B_R(x0) violated at t={t}: |v - x0| = {vdist}")
    x, v, a_cum, lam_prev = x_new, v_new, a_new, lam
    history.append({"t": t, "lam": lam, "a": a, "A": a_new, "rounds": rounds,
                    "queries": queries, "x": x})
    if callback is not None:
      callback(t, x)
    if a_cum >= R * R / eps:
      exit_reason = "A>=R^2/eps"
      break
    if lam <= eps / (3.0 * r * R):
      exit_reason = "small_lambda"
      break

  return BallAccelResult(x=x, iterations=len(history), oracle_calls=calls, rounds=rounds,
                         queries=queries, exit=exit_reason, history=history)


def _bisection(dist, lam0, lam_min, lam_max, lo, hi, r, R, lipschitz, max_steps):
  """CJJS21 LAMBDA-BISECTION (lines 13-21), optionally warm-started at ``lam0``."""
  steps = 0
  if lam0 is None:
    lam = lam_max
    while lam >= lam_min and dist(lam) <= lo and steps < max_steps:
      lam /= 2.0
      steps += 1
  else:
    lam = min(max(lam0, lam_min), lam_max)
    if dist(lam) <= lo:
      while lam >= lam_min and dist(lam) <= lo and steps < max_steps:
        lam /= 2.0
        steps += 1
    else:
      while 2.0 * lam <= lam_max and dist(2.0 * lam) > lo and steps < max_steps:
        lam *= 2.0
        steps += 1
      if 2.0 * lam > lam_max:
        return lam
  if lam <= lam_min:
    return 2.0 * lam if 2.0 * lam <= lam_max else lam_max  # line 15
  lam_u, lam_l = 2.0 * lam, lam
  if dist(lam_l) <= hi:  # line 17
    return lam_l
  lam_m = math.sqrt(lam_u * lam_l)
  while (not lo <= dist(lam_m) <= hi and
         math.log2(lam_u / lam_l) >= r / (8.0 * (R + lipschitz / lam_l)) and steps < max_steps):
    if dist(lam_m) < lo:
      lam_u = lam_m
    else:
      lam_l = lam_m
    lam_m = math.sqrt(lam_u * lam_l)
    steps += 1
  return lam_m


def iterated_ball_prox(ball_oracle: BallOracle, x0: PyTree, key: jax.Array, *, lam: float,
                       phi: float, n_iter: int,
                       stop: Callable[[PyTree], bool] | None = None) -> BallAccelResult:
  """Plain ``x_{k+1} = O(x_k, lam, phi)`` (no acceleration), for comparison with
  :func:`ball_acceleration`. Stops after ``n_iter`` or when ``stop(x)`` is True."""
  check_positive(lam, "lam")
  check_int(n_iter, "n_iter")
  x = x0
  rounds = queries = 0
  history = []
  exit_reason = "max_iter"
  for t in range(n_iter):
    x, cost = ball_oracle(jax.random.fold_in(key, t), x, lam, phi)
    rounds += cost.rounds
    queries += cost.queries
    history.append({"t": t, "rounds": rounds, "queries": queries, "x": x})
    if stop is not None and stop(x):
      exit_reason = "stop"
      break
  return BallAccelResult(x=x, iterations=len(history), oracle_calls=len(history), rounds=rounds,
                         queries=queries, exit=exit_reason, history=history)
