"""ReSQue's private solvers (paper 002, Section 4, Algs 3-7), item level.

Alg. 3/4 (:func:`localized_resque_sgd`; audit view :func:`alg4_phase_releases`) is subsampled
(WITH replacement) ReSQue SGD whose phase-end Gaussian output perturbation is the ONLY privacy
noise. Algs 5-7 (:func:`strongly_convex_resque`, :func:`mlmc_prox_estimator`,
:func:`high_probability_solver`) only compose and post-process Alg. 4 calls: each takes
``charge(T, beta, label)``, called before every Alg. 4 call, and ``alg4`` (default
:func:`localized_resque_sgd`), which the audit hook replaces by a recording one. Accounting:
:mod:`.accounting`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from dpsco_jax._checks import check_int
from dpsco_jax.algorithms.resque.ball_oracles import ball_composite_step, majority_aggregate
from dpsco_jax.cache import bounded_cache
from dpsco_jax.grads import per_example_grads
from dpsco_jax.transforms.noise import tree_gaussian_like
from dpsco_jax.transforms.resque import reweight, sample_queries
from dpsco_jax.transforms.steps import project_l2_ball

PyTree = Any
# alg4(loss_fn, items, center, key, *, T, radius, rho, beta, lipschitz, lam, r_prime, x0,
#      reg_center) -> (x, Alg4Plan): one Alg. 3/4 call (see localized_resque_sgd).
Alg4 = Callable[..., tuple[PyTree, "Alg4Plan"]]


def flat_items(data: PyTree) -> PyTree:
  """User-grouped data (leaves ``[users, m, ...]``) as one flat item dataset (leaves
  ``[users * m, ...]``): ReSQue's guarantee is item level."""
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), data)


def problem_items(problem) -> PyTree:
  """The problem's items as one flat dataset (see :func:`flat_items`)."""
  return flat_items(problem.data)


def _dim(tree: PyTree) -> int:
  return sum(int(np.prod(jnp.shape(a))) for a in jax.tree.leaves(tree))


# ============================================================ Alg. 3 / 4 (localized SGD) ==

@dataclasses.dataclass(frozen=True)
class Alg4Plan:
  """Static schedule of one Alg. 3/4 call: ``T^ = 2^floor(log2 T)``, phase lengths
  ``T^/2^i`` (i = 1..log2 T^), ``eta = (r'/L) min(1/sqrt(T), beta/sqrt(d))``,
  ``eta_i = 4^-i eta``, ``sigma_i = L eta_i / beta``."""
  t_hat: int
  lengths: tuple[int, ...]
  etas: tuple[float, ...]
  sigmas: tuple[float, ...]


def alg4_plan(T: int, *, r_prime: float, lipschitz: float, beta: float, d: int) -> Alg4Plan:
  check_int(T, "T", minimum=2)
  t_hat = 2 ** int(math.floor(math.log2(T)))
  k = int(math.log2(t_hat))
  eta = (r_prime / lipschitz) * min(1.0 / math.sqrt(T), beta / math.sqrt(d))
  lengths = tuple(t_hat // 2 ** i for i in range(1, k + 1))
  etas = tuple(eta / 4 ** i for i in range(1, k + 1))
  sigmas = tuple(lipschitz * e / beta for e in etas)
  return Alg4Plan(t_hat, lengths, etas, sigmas)


def phase_average(y0: PyTree, center: PyTree, reg_center: PyTree, xis: PyTree, grads: PyTree,
                  *, eta: float | jax.Array, lam: float | jax.Array, radius: float | jax.Array,
                  rho: float | jax.Array) -> tuple[PyTree, PyTree]:
  """One phase of Alg. 3/4: ``y_j = argmin_{B_xbar(r)} eta <w(y_{j-1}) g_j, y>
  + 1/2 |y - y_{j-1}|^2 + eta lam/2 |y - c|^2`` over the given queries; returns
  ``(ybar, y_last)`` (``ybar`` = mean of ``y_1..y_T``, the released quantity before noise).

  ``grads`` must be taken at ``center + xis`` (ReSQue contract). ``c = reg_center`` (the
  regularization center; Alg. 4 has ``c = xbar``; localization adds a second quadratic).
  """
  def body(carry, q):
    y, acc = carry
    xi, g = q
    est = reweight(y, center, jax.tree.map(lambda a: a[None], xi),
                   jax.tree.map(lambda a: a[None], g), rho)
    y = ball_composite_step(y, est, reg_center, radius, lam, eta, ball_center=center)
    return (y, jax.tree.map(jnp.add, acc, y)), None

  steps = jax.tree.leaves(xis)[0].shape[0]
  (y, acc), _ = jax.lax.scan(body, (y0, jax.tree.map(jnp.zeros_like, y0)), (xis, grads))
  return jax.tree.map(lambda a: a / steps, acc), y


def draw_queries(key: jax.Array, loss_fn: Callable, items: PyTree, center: PyTree,
                 rho: float | jax.Array, num: int, users: NamedSharding | None = None
                 ) -> tuple[jax.Array, PyTree, PyTree]:
  """``num`` indices ``z ~ Unif[n]`` WITH replacement, offsets ``xi ~ N(0, rho^2 I)`` and the
  gradients ``grad f^{z}(center + xi)``: one batched round (spec 002 §3.5 [IMPL]). ``users`` (a
  mesh's users-axis sharding) splits the calls over the devices with the same ``z`` and ``xi``
  (padded with copies of query 0, sliced off)."""
  n = jax.tree.leaves(items)[0].shape[0]
  kz, kx = jax.random.split(key)
  z = jax.random.randint(kz, (num,), 0, n)
  xis, _ = sample_queries(kx, center, rho, num)
  if users is None:
    batch = jax.tree.map(lambda a: a[z], items)
    return z, xis, per_example_grads(loss_fn, center, batch, offsets=xis)
  pad = -num % users.mesh.shape[users.spec[0]]
  zp, xp = jax.tree.map(lambda a: jnp.concatenate([a, jnp.repeat(a[:1], pad, 0)]), (z, xis))
  zp, xp = jax.lax.with_sharding_constraint((zp, xp), users)
  batch = jax.lax.with_sharding_constraint(jax.tree.map(lambda a: a[zp], items), users)
  grads = per_example_grads(loss_fn, center, batch, offsets=xp)
  return z, xis, jax.tree.map(lambda g: g[:num], grads)


def _alg4_phases(loss_fn: Callable, lengths: tuple[int, ...], items, center, reg_center, lam,
                 x0, key, etas, sigmas, radius, rho, *, add_noise: bool = True,
                 forced: PyTree | None = None, users: NamedSharding | None = None
                 ) -> tuple[PyTree, list, jax.Array]:
  """Traced body of one Alg. 3/4 call: ``(projected output, [release_i], item indices)``.

  ``release_i = ybar_i + zeta_i`` is phase ``i``'s noisy output (Alg. 3 line 11), the only
  quantity that depends on the data and leaves a phase. ``add_noise=False`` (audit only)
  drops ``zeta_i``; ``forced`` (audit only, leaves ``[k, ...]``) starts phase ``i > 0`` from
  ``forced[i-1]`` instead of this run's own release (re-coupling, spec 002 §4 item 2)."""
  kq, kn = jax.random.split(key)
  z, xis, grads = draw_queries(kq, loss_fn, items, center, rho, sum(lengths), users)
  x, off, releases = x0, 0, []
  for i, t_i in enumerate(lengths):  # static: the phase lengths are part of the plan
    if forced is not None and i > 0:
      x = jax.tree.map(lambda a: a[i - 1], forced)
    sl = jax.tree.map(lambda a: a[off:off + t_i], (xis, grads))
    ybar, _ = phase_average(x, center, reg_center, sl[0], sl[1], eta=etas[i], lam=lam,
                            radius=radius, rho=rho)
    x = ybar
    if add_noise:  # Gaussian output perturbation (Alg. 3 line 11)
      noise = tree_gaussian_like(jax.random.fold_in(kn, i), ybar, sigmas[i])
      x = jax.tree.map(jnp.add, ybar, noise)
    releases.append(x)
    off += t_i
  return project_l2_ball(x, radius, center), releases, z  # projection: spec §3.5 [AMBIG]


@bounded_cache()
def _alg4_compiled(loss_fn: Callable, lengths: tuple[int, ...],
                   users: NamedSharding | None = None, audit: tuple[bool, bool] | None = None):
  """One jitted Alg. 3/4 call: its projected output, or with ``audit = (add_noise, replay)``
  (the audit view) ``(output, releases stacked, indices)``."""
  @jax.jit
  def run(items, center, reg_center, lam, x0, key, etas, sigmas, radius, rho, forced=None):
    args = (loss_fn, lengths, items, center, reg_center, lam, x0, key, etas, sigmas, radius,
            rho)
    if audit is None:
      return _alg4_phases(*args, users=users)[0]
    out, rel, z = _alg4_phases(*args, add_noise=audit[0], forced=forced if audit[1] else None)
    return out, jax.tree.map(lambda *a: jnp.stack(a), *rel), z
  return run


def _alg4_args(items, center, key, *, T, radius, rho, beta, lipschitz, lam, r_prime, x0,
               reg_center) -> tuple[Alg4Plan, tuple]:
  """The static plan and the traced arguments shared by the driver and the audit view."""
  r_prime = radius if r_prime is None else r_prime
  plan = alg4_plan(T, r_prime=r_prime, lipschitz=lipschitz, beta=beta, d=_dim(center))
  args = (items, center, center if reg_center is None else reg_center, jnp.float32(lam),
          center if x0 is None else x0, key, jnp.asarray(plan.etas, jnp.float32),
          jnp.asarray(plan.sigmas, jnp.float32), jnp.float32(radius), jnp.float32(rho))
  return plan, args


def localized_resque_sgd(loss_fn: Callable, items: PyTree, center: PyTree, key: jax.Array, *,
                         T: int, radius: float, rho: float, beta: float, lipschitz: float,
                         lam: float = 0.0, r_prime: float | None = None,
                         x0: PyTree | None = None, reg_center: PyTree | None = None,
                         users: NamedSharding | None = None) -> tuple[PyTree, Alg4Plan]:
  """Alg. 3 (``lam = 0``) / Alg. 4: private localized ReSQue SGD in ``B_center(radius)``, using
  ``T^ - 1 <= T`` gradients; the caller charges :func:`~.accounting.alg4_rdp` BEFORE calling.
  ``r_prime`` (default ``radius``): Alg. 4's bound ``E|x0 - x*|^2 <= r'^2``; ``reg_center``
  defaults to ``center``; ``users``: a mesh's sharding for the round's oracle calls."""
  plan, args = _alg4_args(items, center, key, T=T, radius=radius, rho=rho, beta=beta,
                          lipschitz=lipschitz, lam=lam, r_prime=r_prime, x0=x0,
                          reg_center=reg_center)
  return _alg4_compiled(loss_fn, plan.lengths, users)(*args), plan


def alg4_phase_releases(loss_fn: Callable, items: PyTree, center: PyTree, key: jax.Array, *,
                        T: int, radius: float, rho: float, beta: float, lipschitz: float,
                        lam: float = 0.0, r_prime: float | None = None,
                        x0: PyTree | None = None, reg_center: PyTree | None = None,
                        add_noise: bool = True, forced: PyTree | None = None
                        ) -> tuple[PyTree, PyTree, jax.Array, Alg4Plan]:
  """Audit view of one :func:`localized_resque_sgd` call (same arguments, keys and
  computation): ``(output, releases, indices, plan)``. ``releases`` (leaves ``[k, ...]``) are
  the phases' noisy outputs ``ybar_i + zeta_i``, ``output`` the projected last one, ``indices``
  the items queried (phase ``i`` takes the next ``plan.lengths[i]``; ``b_i`` of Lemma 5 counts
  the replaced item). TEST HOOKS, never releases: ``add_noise=False`` drops the noise;
  ``forced`` (another run's releases) starts phase ``i > 0`` from ``forced[i-1]``, the coupling
  under which Lemma 5 bounds ``|release_i - release'_i| <= sqrt(1500) b_i eta_i L``. Jitted;
  vmappable over ``key``, ``items`` and the points."""
  plan, args = _alg4_args(items, center, key, T=T, radius=radius, rho=rho, beta=beta,
                          lipschitz=lipschitz, lam=lam, r_prime=r_prime, x0=x0,
                          reg_center=reg_center)
  run = _alg4_compiled(loss_fn, plan.lengths, None, (bool(add_noise), forced is not None))
  out, releases, z = run(*args, forced)
  return out, releases, z, plan


# ================================================================ Alg. 5 (strongly convex) ==

def alg5_schedule(T: int, *, beta: float, lam: float, lipschitz: float, radius: float, d: int,
                  c_cvx: float = 16.0) -> list[dict]:
  """Eq. (28): ``k = ceil(log2 log2 T)``; call ``i`` (0-based) uses
  ``beta_i = 2^((k-i)/2) beta``, ``T_i = 2^(i-k) T`` (floored, >= 2) and
  ``r_i = min(2r, sqrt(2 D_i / lam))`` with ``E_i = (2 C_cvx^2 L^2/lam)(sqrt(d)/(beta_i T_i)
  + 1/sqrt(T_i))^2``, ``D_0 = 2L^2/lam``, ``D_i = 4 E_i (2L^2/(lam 4 E_0))^(1/2^i)``."""
  check_int(T, "T", minimum=4)
  k = max(1, int(math.ceil(math.log2(math.log2(T)))))
  out = []
  e0 = None
  for i in range(k):
    b_i = 2 ** ((k - i) / 2) * beta
    t_i = max(2, int(T * 2.0 ** (i - k)))
    e_i = (2 * c_cvx ** 2 * lipschitz ** 2 / lam) * (math.sqrt(d) / (b_i * t_i)
                                                     + 1 / math.sqrt(t_i)) ** 2
    e0 = e_i if e0 is None else e0
    d_i = 2 * lipschitz ** 2 / lam if i == 0 else \
        4 * e_i * (2 * lipschitz ** 2 / (lam * 4 * e0)) ** (1 / 2 ** i)
    out.append({"beta": b_i, "T": t_i, "r_prime": min(2 * radius, math.sqrt(2 * d_i / lam))})
  return out


def strongly_convex_resque(loss_fn: Callable, items: PyTree, center: PyTree, key: jax.Array, *,
                           T: int, radius: float, rho: float, beta: float, lam: float,
                           lipschitz: float, reg_center: PyTree | None = None,
                           charge: Callable[[int, float, str], None] | None = None,
                           c_cvx: float = 16.0, alg4: Alg4 | None = None) -> PyTree:
  """Alg. 5: ``k`` warm-started calls of Alg. 4 (returns ``x_k``; spec §8 item 8).

  ``charge(T_i, beta_i, label)`` is called before each Alg. 4 call (ledger). Its total privacy
  cost is a geometric sum in ``beta_i^2 T_i^2`` ending at ``beta^2 T^2 / 2`` (Prop. 8)."""
  alg4 = localized_resque_sgd if alg4 is None else alg4
  d = _dim(center)
  x = center
  for i, call in enumerate(alg5_schedule(T, beta=beta, lam=lam, lipschitz=lipschitz,
                                         radius=radius, d=d, c_cvx=c_cvx)):
    if charge is not None:
      charge(call["T"], call["beta"], f"alg5[{i}]")
    x, _ = alg4(loss_fn, items, center, jax.random.fold_in(key, i), T=call["T"], radius=radius,
                rho=rho, beta=call["beta"], lipschitz=lipschitz, lam=lam,
                r_prime=call["r_prime"], x0=x, reg_center=reg_center)
  return x


# ===================================================================== Alg. 6 (MLMC) ==

def mlmc_prox_estimator(loss_fn: Callable, items: PyTree, center: PyTree, key: jax.Array, *,
                        T: int, j_max: int, copies: int, radius: float, rho: float, beta: float,
                        lam: float, lipschitz: float, reg_center: PyTree | None = None,
                        charge: Callable | None = None, level_beta_scaling: str = "paper",
                        js: list[int] | None = None, alg4: Alg4 | None = None) -> PyTree:
  """Alg. 6: ``xhat = mean_k [x_0 + 2^J (x_J - x_{J-1})]``, ``J ~ Geom(1/2)`` per copy,
  level ``j`` = Alg. 5 with ``(2^(-j/2) beta, 2^j T)`` (``level_beta_scaling="paper"``) or
  ``(beta, 2^j T)`` (``"none"``, the §3.8 bias question). Telescoping gives
  ``E xhat = E x_{j_max}``. ``js`` may pre-draw the J's (they are data independent)."""
  check_int(j_max, "j_max")
  check_int(copies, "copies")
  scale = (lambda j: 2 ** (-j / 2)) if level_beta_scaling == "paper" else (lambda j: 1.0)
  if js is None:
    js = [int(v) for v in jax.random.geometric(jax.random.fold_in(key, 10_000), 0.5, (copies,))]
  acc = None
  kw = dict(radius=radius, rho=rho, lam=lam, lipschitz=lipschitz, reg_center=reg_center,
            charge=charge, alg4=alg4)
  for kc, j in zip(jax.random.split(key, len(js)), js):
    x0 = strongly_convex_resque(loss_fn, items, center, jax.random.fold_in(kc, 0), T=T,
                                beta=beta, **kw)
    est = x0
    if j <= j_max:
      xj = strongly_convex_resque(loss_fn, items, center, jax.random.fold_in(kc, 1),
                                  T=2 ** j * T, beta=scale(j) * beta, **kw)
      xj1 = strongly_convex_resque(loss_fn, items, center, jax.random.fold_in(kc, 2),
                                   T=2 ** (j - 1) * T, beta=scale(j - 1) * beta, **kw)
      est = jax.tree.map(lambda a, b, e: e + 2 ** j * (a - b), xj, xj1, x0)
    acc = est if acc is None else jax.tree.map(jnp.add, acc, est)
  return jax.tree.map(lambda a: a / len(js), acc)


# ============================================================== Alg. 7 (high probability) ==

def high_probability_solver(loss_fn: Callable, items: PyTree, center: PyTree, key: jax.Array,
                            *, runs: int, T: int, radius: float, rho: float, beta: float,
                            lam: float, lipschitz: float, reg_center: PyTree | None = None,
                            charge: Callable | None = None, c_sc: float = 8192.0,
                            delta_agg: float | None = None, alg4: Alg4 | None = None) -> PyTree:
  """Alg. 7: ``runs`` (paper ``ceil(20 log(1/zeta))``) independent Alg. 5 runs, then
  Aggregate with ``Delta = 9 sqrt(2 C_sc) (L/lam) (d/(beta^2 T^2) + 1/T)^(1/2)`` (or
  ``delta_agg``). Lemma 11: the output is within ``Delta`` of ``x*`` when >= 51% of the runs
  are within ``Delta/3`` (Markov + Chernoff, Prop. 10)."""
  check_int(runs, "runs")
  d = _dim(center)
  pts = [strongly_convex_resque(loss_fn, items, center, jax.random.fold_in(key, i), T=T,
                                radius=radius, rho=rho, beta=beta, lam=lam, lipschitz=lipschitz,
                                reg_center=reg_center, charge=charge, alg4=alg4)
         for i in range(runs)]
  if runs == 1:
    return pts[0]
  if delta_agg is None:
    delta_agg = 9 * math.sqrt(2 * c_sc) * (lipschitz / lam) * math.sqrt(d / (beta * T) ** 2 + 1 / T)
  return majority_aggregate(jax.tree.map(lambda *a: jnp.stack(a), *pts), delta_agg)
