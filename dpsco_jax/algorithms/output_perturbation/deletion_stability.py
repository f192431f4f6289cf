"""Local deletion sensitivity: the stability test of DelOutputPert and its certificate.

Paper 001 (Ghazi et al., ICML 2023), Def. 3.2, Alg. 1, Obs. 3.5, App. C / Lemma C.1; spec
``shared/specs/001_ghazi_user_level.md`` §2.2, §2.4, §3.2–3.3.

A deletion set ``S ⊆ [n]`` is the bits of an integer ``s`` (bit ``i`` set = user ``i``
deleted); ``x_{-S}`` is ``x`` with keep-mask ``~bits(s)`` (static shape, masked users
contribute exactly zero), so all sub-datasets are solved at once with ``vmap``/``lax.map``.

    Δf(y)    = max_{i in y} ||f(y) - f(y_{-i})||                (one-step deletion change)
    Δ_r f(y) = max_{|S''| <= r} Δf(y_{-S''})
    x_{-S} is *stable*  <=>  Δ_{4 kappa - |S|} f(x_{-S}) <= Δ
                        <=>  no S' ⊇ S with |S'| <= 4 kappa has Δf(x_{-S'}) > Δ.

DelOutputPert (Alg. 1) draws ``R1 ~ TDLap(eps', delta')`` and releases ``f(x_{-S}) + N(0, σ² I)``
for the smallest stable ``S`` with ``|S| <= R1`` (ties: the smallest bit pattern; any choice is
allowed, spec §2.2), or ⊥. The smallest stable set does not depend on ``R1``, so ``Pr[⊥ | x] =
Pr[R1 < s_min(x)]`` exactly.

Two ways to run the test:
  * **exact**: all ``2^n`` deletion sets (``n <= max_exact_users``; the deletion depth ``4
    kappa + 1 >= 17``, spec §3.3(a), so for ``n <= 16`` the full power set): a gather per user
    and a superset-OR (zeta) transform, ``O(n 2^n)`` after the ``2^n`` solves.
  * **certificate** (App. C, Lemma C.1 with spec §3.3(b)/§3.4's inexact-solver and
    constrained-K extensions): if at ``θ̃ = f(x)`` the centred per-user gradients are ``<= γ``
    and the optimality residual ``<= e_max``, then ``Δ_{4 kappa} f(x) <= Δ_cert``, so ``S = ∅``
    is stable and Alg. 1 outputs ``f(x) + N(0, σ²I)``. On failure the exact test runs
    (REQUIRED: returning ⊥ on failure is not DP).

f must be a deterministic function of the sub-dataset alone (the proof of Thm 3.3 evaluates
the same sub-dataset from two neighbouring datasets): solves inside the test start from a
public point; :func:`leave_users_out` (warm-started) is for diagnostics and tests only.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from dpsco_jax._checks import check_int, check_nonnegative, check_positive
from dpsco_jax.precision import at_guarantee_precision
from dpsco_jax.privacy import discrete_laplace as tdl
from dpsco_jax.transforms.noise import tree_gaussian_like

PyTree = Any
MaskedFn = Callable[[jax.Array], PyTree]   # keep-mask bool[n] -> params

# ------------------------------------------------------------------------------------------
# Certified norms. Both decisions here gate a release whose noise is calibrated to Δ, so a
# norm compared with a threshold is replaced by a certified bound on the exact norm of the
# float arrays it is taken of, on the side that can only refuse: a one-step change that
# rounds just below Δ is still bad, a certificate that holds only by rounding fails (and the
# exact test runs). Each float op errs by at most _UNIT relative (2^-23: twice the float32
# unit roundoff, as in flax/fast_clip_norms.py), so a sum of k terms of one sign errs by at
# most gamma(k) relative whatever the order XLA picks.

_UNIT = 2.0 ** -23
_ABS = 2.0 ** -120  # absolute slack per operation (gradual underflow / flush to zero)


def _gamma(k: int) -> float:
  ku = float(k) * _UNIT
  return ku / (1.0 - ku) if ku < 0.5 else float("inf")


def _norm_upper(x: jax.Array, rounded_terms: bool = False) -> jax.Array:
  """Upper bound on the exact L2 norm over the last axis of ``x``; with ``rounded_terms`` the
  entries are themselves one rounding away from the exact ones (a difference, a sum), which
  the bound then covers too. NaN stays NaN (every comparison with it refuses)."""
  d = x.shape[-1]
  k = d + 4 if rounded_terms else d + 2
  sq = jnp.sum(x * x, axis=-1)
  return jnp.sqrt((sq + d * _ABS) / (1.0 - _gamma(k))) * (1.0 + 2.0 * _UNIT)


# Error-free transformations (Knuth's TwoSum, Dekker's split / TwoProduct) for the one place
# where a relative error of ~d ulp is too much: the slack rho = R - ||θ̃ - c|| of a point on the
# sphere enters the residual as sqrt(t rho / mu), so an ulp-sized error of ||θ̃ - c|| costs
# ~sqrt(ulp R) ~ 1e-3 there. rho is computed instead as (R^2 - ||θ̃ - c||^2) / (R + ||θ̃ - c||)
# with the numerator's cancellation done without rounding (error ~ (log d ulp)^2 R^2).


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def _two_prod(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  def split(x):
    c = 4097.0 * x   # 2^12 + 1: halves of 12 bits for float32's 24
    hi = c - (c - x)
    return hi, x - hi
  p = a * b
  ah, al = split(a)
  bh, bl = split(b)
  return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _cascade_sum(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(hi, lo, err)``: ``|hi + lo - sum(x)| <= err`` (pairwise TwoSum; only the final plain
  sum of the ~len(x) exact error terms rounds)."""
  errs, levels, total = [], 0, jnp.sum(jnp.abs(x))
  while x.shape[0] > 1:
    if x.shape[0] % 2:
      x = jnp.concatenate([x, jnp.zeros((1,), x.dtype)])
    x, e = _two_sum(x[0::2], x[1::2])
    errs.append(e)
    levels += 1
  e = jnp.concatenate(errs) if errs else jnp.zeros((1,), x.dtype)
  bound = 2.0 * _gamma(e.shape[0] + x.shape[0] + 2) * levels * _UNIT * total + 8 * _ABS
  return x[0], jnp.sum(e), bound


def _round_up(x, dtype) -> jax.Array:
  """``x`` in ``dtype`` rounded up (a Python radius is a float64; a traced one is inflated)."""
  if isinstance(x, jax.core.Tracer):
    return jnp.asarray(x, dtype) * (1.0 + 2.0 * _UNIT)
  v = np.asarray(x, dtype)
  if float(v) < float(x):
    v = np.nextafter(v, np.asarray(np.inf, dtype))
  return jnp.asarray(v, dtype)


def _ball_slack_upper(theta: jax.Array, center: jax.Array | None, radius: float
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(rho_up, off, norm)``: ``rho_up >= max(R - ||θ̃ - c||, 0)`` (exact norm), the float
  ``off = fl(θ̃ - c)`` and its norm within a few ulp."""
  if center is None:
    off, off_lo = theta, jnp.zeros_like(theta)
  else:
    off, off_lo = _two_sum(theta, -center)          # θ̃ - c = off + off_lo exactly
  p, pe = _two_prod(off, off)
  r = _round_up(radius, off.dtype)   # the ball's R, never rounded down
  r2, r2e = _two_prod(r, r)
  # ||θ̃ - c||^2 = sum(p + pe + 2 off off_lo + off_lo^2); dropping off_lo^2 >= 0 can only
  # raise rho_up
  cross = 2.0 * off * off_lo                         # rounded: <= ~2 ulp of itself
  hi, lo, err = _cascade_sum(jnp.concatenate([p, pe, cross, -r2[None], -r2e[None]]))
  err = err + 4.0 * _UNIT * jnp.sum(jnp.abs(cross))
  deficit = -(hi + lo)                               # R^2 - ||θ̃ - c||^2
  num = jnp.maximum(deficit * (1.0 + 2.0 * _UNIT) + err, 0.0)
  norm = jnp.sqrt(jnp.maximum((hi + r2) + (lo + r2e), 0.0))
  return num / ((r + norm) * (1.0 - 4.0 * _UNIT)), off, norm


def subset_keep_masks(n_users: int) -> jax.Array:
  """``keep[s, i] = (bit i of s) == 0``: the keep-masks of all ``2^n`` deletion sets."""
  n = check_int(n_users, "n_users", minimum=1)
  idx = jnp.arange(2 ** n, dtype=jnp.int32)
  return ((idx[:, None] >> jnp.arange(n, dtype=jnp.int32)[None, :]) & 1) == 0


def subset_sizes(n_users: int) -> jax.Array:
  """``|S|`` for every subset index ``s``."""
  return jnp.sum(~subset_keep_masks(n_users), axis=1).astype(jnp.int32)


@at_guarantee_precision
def evaluate_all_subsets(f_masked: MaskedFn, n_users: int, *, batch_size: int = 1024
                         ) -> jax.Array:
  """``F[s] = ravel(f(x_{-S_s}))`` for all ``2^n`` deletion sets, ``[2^n, d]`` (``lax.map``
  in chunks of ``batch_size`` masks)."""
  masks = subset_keep_masks(n_users)
  return jax.lax.map(lambda mask: ravel_pytree(f_masked(mask))[0], masks,
                     batch_size=min(int(batch_size), masks.shape[0]))


class StabilityTable(NamedTuple):
  one_step: jax.Array   # [2^n] certified >= Δf(x_{-S}) = max_{i∉S} ||F[S] - F[S ∪ {i}]||
  bad: jax.Array        # [2^n] Δf(x_{-S}) > Δ and |S| <= depth
  stable: jax.Array     # [2^n] no bad superset: Δ_{depth - |S|} f(x_{-S}) <= Δ
  sizes: jax.Array      # [2^n] |S|


@functools.partial(jax.jit, static_argnames=("n_users", "depth"))
def stability_table(F: jax.Array, n_users: int, Delta: float | jax.Array, depth: int
                    ) -> StabilityTable:
  """The exact test of Alg. 1 line 4 from the table ``F`` of all sub-dataset values.

  ``depth`` is ``4 kappa``: a bad set ``S'`` counts only if ``|S'| <= 4 kappa`` (the deepest
  one-step change examined deletes ``4 kappa + 1`` users, spec §2.2).
  """
  n = int(n_users)
  size = 2 ** n
  if F.shape[0] != size:
    raise ValueError(f"F must have 2^n_users = {size} rows, got {F.shape[0]}")
  idx = jnp.arange(size, dtype=jnp.int32)
  sizes = subset_sizes(n)
  one_step = jnp.zeros((size,), F.dtype)
  for i in range(n):  # static: n gathers of the child table
    child = idx | (1 << i)
    valid = ((idx >> i) & 1) == 0
    # difference first (no cancellation whatever F's common offset), then a certified upper
    # bound on the exact norm of the difference; NaN propagates through jnp.maximum
    diff = _norm_upper(F[child] - F, rounded_terms=True)
    one_step = jnp.maximum(one_step, jnp.where(valid, diff, 0.0))
  # "not certainly <= Δ" is bad: rounding (or a NaN) can only make a set unstable
  bad = ~(one_step <= Delta) & (sizes <= depth)
  # superset-OR (zeta) transform, one materialised step per user: unrolled, the n steps
  # x | x[idx | 2^i] form one expression a fusing backend may inline 2^n times (XLA:CPU's
  # legacy emitters wrote 44 MB of IR for n = 12 and never finished compiling)
  any_bad_superset = jax.lax.fori_loop(
      0, n, lambda i, acc: acc | acc[idx | (1 << i)], bad)
  return StabilityTable(one_step, bad, ~any_bad_superset, sizes)


class Selection(NamedTuple):
  s_min: jax.Array    # smallest |S| among stable sets with |S| <= max_r1 (max_r1 + 1 if none)
  index: jax.Array    # subset index of the chosen S (smallest bit pattern of that size)


@functools.partial(jax.jit, static_argnames=("max_r1",))
def smallest_stable(table: StabilityTable, max_r1: int) -> Selection:
  """Alg. 1 line 6: a stable set of smallest size (independent of ``R1``)."""
  big = jnp.int32(max_r1 + 1)
  cand = table.stable & (table.sizes <= max_r1)
  sz = jnp.where(cand, table.sizes, big)
  s_min = jnp.min(sz)
  index = jnp.argmax(cand & (table.sizes == s_min)).astype(jnp.int32)
  return Selection(s_min, index)


def bottom_probability(s_min: int, epsilon: float, delta: float) -> float:
  """``Pr[A(x) = ⊥] = Pr[R1 < s_min]`` (exact, host side; spec §6.2 item 6(c))."""
  p = tdl.del_output_pert_params(epsilon, delta)
  pmf = tdl.tdlap_pmf_from_kappa(p.epsilon_prime, p.kappa)
  return float(np.sum(pmf[: int(s_min)]))


class Certificate(NamedTuple):
  certified: jax.Array     # bool[]
  gamma_hat: jax.Array     # max_i ||g_i - g_bar||   (data dependent: debug only)
  residual: jax.Array      # e0 >= ||θ̃ - θ*(x)||      (data dependent: debug only)


def certified_sensitivity(*, n_users: int, depth: int, gamma: float, e_max: float,
                          mu: float, tau: float) -> float:
  """``Δ_cert = 2 (e_max + r γ / (μ (n - r))) + 2 τ`` with ``r = depth + 1 = 4 kappa + 1``.

  For every ``|S| = s <= r`` and ``y = x_{-S}``:
  ``∇F_y(θ̃) = ∇F_x(θ̃) + Σ_{i∈S}(ḡ - g_i)/(n - s)`` (the regulariser does not change under
  deletion), so with ``v`` the normal-cone vector of the ball at ``θ̃`` and strong monotonicity
  ``||θ̃ - θ*(y)|| <= e0 + s γ/(μ (n - s))`` (Lemma C.1's proof, centred per spec §3.4). A
  one-step change ``||f(y) - f(y_{-i})||`` is then ``<= 2 (e_max + r γ/(μ(n-r))) + 2 τ``, where
  ``τ`` is the solver's a-priori accuracy on every sub-dataset (spec §3.3(b)). The paper's
  cruder form is ``2(4κ+1)γ/(μ(n-4κ-1))`` (spec §2.4, [R]).
  """
  n = check_int(n_users, "n_users", minimum=1)
  r = int(depth) + 1
  if n - r <= 0:
    return float("inf")
  check_positive(mu, "mu")
  return 2.0 * (check_nonnegative(e_max, "e_max")
                + r * check_nonnegative(gamma, "gamma") / (mu * (n - r))) \
      + 2.0 * check_nonnegative(tau, "tau")


def lemma_c1_certificate(user_grads: jax.Array, reg_grad: jax.Array, theta: jax.Array, *,
                         mu: float, gamma: float, e_max: float,
                         radius: float | None, center: jax.Array | None = None
                         ) -> Certificate:
  """Checks the certificate at the computed solution ``theta`` (flat ``[d]``).

  Args:
    user_grads: ``[n, d]`` per-user mean loss gradients at ``theta`` (non-finite rows must be
      already zeroed).
    reg_grad: ``[d]`` gradient of the data-independent regulariser at ``theta``.
    mu: strong convexity of every sub-dataset objective.
    gamma, e_max: the data-independent thresholds.
    radius, center: the ball ``K`` (``None``: unconstrained).

  ``e0 = ||∇F(θ̃) + v||/μ + sqrt(t ρ / μ)``, with ``v = t u`` the normal-cone vector at ``θ̃``
  (``u`` the outward unit normal, ``t = max(0, -<∇F, u>)``) and ``ρ = R - ||θ̃ - c||`` the slack
  of ``θ̃`` inside the ball: from ``μ||e||² <= ||∇F + v|| ||e|| + t ρ`` (strong monotonicity and
  ``<v, θ̃ - θ*> >= -t ρ``). Interior points take ``t = 0``.

  Both ``γ̂`` and ``e0`` are certified upper bounds on the exact values for the given float
  arrays (difference first, the mean's rounding added, norms bounded above, ``ρ`` from an
  error-free evaluation of ``R² - ||θ̃ - c||²``, ``R`` never rounded down): a common component
  of the gradients cannot make the certificate hold by rounding (``gamma_hat`` / ``residual``
  are these bounds). The per-user gradients themselves are taken as given.
  """
  n, d = user_grads.shape
  g_bar = jnp.mean(user_grads, axis=0)
  # |fl(mean) - mean| <= gamma(n + 1) mean_i |g_i| entrywise: with a large common component
  # this is ~ulp of the component, far above the centred norms it is subtracted from
  mean_err = _gamma(n + 2) * _norm_upper(jnp.mean(jnp.abs(user_grads), axis=0))
  grad_f = g_bar + reg_grad
  gamma_hat = jnp.max(_norm_upper(user_grads - g_bar, rounded_terms=True)) + mean_err
  if radius is None:
    e0 = (_norm_upper(grad_f, rounded_terms=True) + mean_err) / mu
  else:
    rho, off, norm = _ball_slack_upper(theta, center, radius)
    u = off / jnp.maximum(norm, 1e-30)
    t = jnp.maximum(0.0, -jnp.dot(grad_f, u))   # any t >= 0 is valid in the inequality
    # the true unit normal u* is within a few ulp of u (off's rounding, norm, division); the
    # rounding of t u inside grad_f + t u errs by ulp(t) too: t * u_err covers both
    u_err = 16.0 * _UNIT
    e0 = ((_norm_upper(grad_f + t * u, rounded_terms=True) + mean_err + t * u_err) / mu
          + jnp.sqrt(t * rho / mu) * (1.0 + 4.0 * _UNIT))
  e0 = e0 * (1.0 + 2.0 * _UNIT)   # the divisions by mu
  ok = (gamma_hat <= gamma) & (e0 <= e_max) & jnp.all(jnp.isfinite(user_grads))
  return Certificate(ok, gamma_hat, e0)


class Release(NamedTuple):
  params: jax.Array       # flat [d]; the public point when ⊥
  is_bottom: jax.Array    # bool[]: ⊥ is a legitimate DP output


class StabilityDebug(NamedTuple):
  """Data-dependent diagnostics: NOT covered by the DP guarantee, never released."""
  r1: jax.Array           # the TDLap draw
  s_size: jax.Array       # |S| of the chosen deletion set (-1 when ⊥)
  s_min: jax.Array        # smallest stable size (max_r1 + 1 if none)
  certified: jax.Array    # the Lemma C.1 certificate held
  exact_path: jax.Array   # the exact test ran


def _keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  k_r1, k_noise = jax.random.split(key)
  return k_r1, k_noise


def exact_release(F: jax.Array, key: jax.Array, *, n_users: int, Delta: float | jax.Array,
                  epsilon: float, delta: float, sigma: float | jax.Array,
                  public_point: jax.Array) -> tuple[Release, StabilityDebug]:
  """Alg. 1 lines 3–7 from the table ``F`` of all sub-dataset values (jittable in ``F``,
  ``key``, ``Delta``, ``sigma``)."""
  p = tdl.del_output_pert_params(epsilon, delta)
  table = stability_table(F, n_users, Delta, p.depth)
  sel = smallest_stable(table, p.max_r1)
  k_r1, k_noise = _keys(key)
  r1 = tdl.tdlap_sample_from_kappa(k_r1, p.epsilon_prime, p.kappa)
  is_bottom = sel.s_min > r1
  # the library's Gaussian sampler (float32+ draws); same derivation as certified_release
  noise = tree_gaussian_like(k_noise, F[sel.index], sigma)
  out = jnp.where(is_bottom, public_point, F[sel.index] + noise)
  dbg = StabilityDebug(r1, jnp.where(is_bottom, -1, sel.s_min), sel.s_min,
                       jnp.zeros((), bool), jnp.ones((), bool))
  return Release(out, is_bottom), dbg


def certified_release(f_full: jax.Array, key: jax.Array, *, epsilon: float, delta: float,
                      sigma: float | jax.Array) -> tuple[Release, StabilityDebug]:
  """The output of Alg. 1 when ``S = ∅`` is stable: ``f(x) + N(0, σ²I)`` with the same key
  derivation as :func:`exact_release` (so both paths agree draw for draw)."""
  p = tdl.del_output_pert_params(epsilon, delta)
  k_r1, k_noise = _keys(key)
  r1 = tdl.tdlap_sample_from_kappa(k_r1, p.epsilon_prime, p.kappa)
  noise = tree_gaussian_like(k_noise, f_full, sigma)
  dbg = StabilityDebug(r1, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
                       jnp.ones((), bool), jnp.zeros((), bool))
  return Release(f_full + noise, jnp.zeros((), bool)), dbg


_exact_release_jit = jax.jit(exact_release, static_argnames=("n_users", "epsilon", "delta"))
_certified_release_jit = jax.jit(certified_release, static_argnames=("epsilon", "delta"))


@at_guarantee_precision
def del_output_pert(key: jax.Array, f_masked: MaskedFn, *, n_users: int, Delta: float,
                    epsilon: float, delta: float, sigma: float, public_point: jax.Array,
                    certify: Callable[[jax.Array], Certificate] | None = None,
                    on_certificate_failure: str = "exact", max_exact_users: int = 20,
                    evaluate_all: Callable[[], jax.Array] | None = None,
                    batch_size: int = 1024
                    ) -> tuple[Release, StabilityDebug, Certificate | None]:
  """DelOutputPert (Alg. 1) for a deterministic masked function ``f`` (flat outputs).

  ``certify(f_full) -> Certificate`` is the fast path: when it holds the output is ``f(x) +
  N(0, σ²I)``; when it fails the exact test runs (``"exact"``, ``n_users <=
  max_exact_users``) or :class:`CertificateFailure` is raised (``"raise"``: a data-dependent
  abort outside the DP guarantee). ``certify=None`` always runs the exact test.
  ``evaluate_all()`` may supply the ``[2^n, d]`` table of ``f`` (default
  :func:`evaluate_all_subsets`). The path is chosen on the host from the computed
  certificate. Returns ``(Release, StabilityDebug, Certificate | None)``; only the Release is
  covered by the DP guarantee.
  """
  if on_certificate_failure not in ("exact", "raise"):
    raise ValueError("on_certificate_failure must be 'exact' or 'raise', got "
                     f"{on_certificate_failure!r}")
  n = check_int(n_users, "n_users", minimum=1)
  exact_ok = n <= int(max_exact_users)
  if (certify is None or on_certificate_failure == "exact") and not exact_ok:
    raise ValueError(
        f"n_users={n} > max_exact_users={max_exact_users}: the exact stability test would "
        f"enumerate 2^{n} deletion sets; use the certificate with "
        "on_certificate_failure='raise' (heuristic provenance) or fewer users")

  def exact():
    F = (evaluate_all() if evaluate_all is not None
         else evaluate_all_subsets(f_masked, n, batch_size=batch_size))
    return _exact_release_jit(F, key, n_users=n, Delta=Delta, epsilon=float(epsilon),
                              delta=float(delta), sigma=sigma, public_point=public_point)

  if certify is None:
    rel, dbg = exact()
    return rel, dbg, None
  f_full = ravel_pytree(f_masked(jnp.ones((n,), bool)))[0]
  cert = certify(f_full)
  if bool(cert.certified):
    rel, dbg = _certified_release_jit(f_full, key, epsilon=float(epsilon),
                                      delta=float(delta), sigma=sigma)
    return rel, dbg, cert
  if on_certificate_failure == "raise":
    raise CertificateFailure(
        "the Lemma C.1 certificate failed and the exact test is not used; nothing was "
        "released (this abort is data dependent and outside the DP guarantee)")
  rel, dbg = exact()
  return rel, dbg, cert


class CertificateFailure(RuntimeError):
  """The certificate failed under ``on_certificate_failure='raise'``; nothing released."""


# Diagnostics (not private).


def leave_users_out(solve: Callable[[jax.Array, PyTree], PyTree], keep_masks: jax.Array,
                    init: PyTree) -> PyTree:
  """``solve(mask, init)`` for every row of ``keep_masks`` (``[B, n]``), vmapped, warm-started
  from ``init`` (the result then depends on the deleted users: measurements and tests only,
  never inside the released decision)."""
  return jax.vmap(solve, in_axes=(0, None))(keep_masks, init)


def random_deletion_masks(key: jax.Array, n_users: int, k: int, num: int) -> jax.Array:
  """``num`` keep-masks each deleting ``k`` distinct uniformly random users."""
  n = check_int(n_users, "n_users", minimum=1)
  check_int(k, "k", minimum=0)
  if k > n:
    raise ValueError(f"k={k} > n_users={n}")
  keys = jax.random.split(key, num)
  perm = jax.vmap(lambda kk: jax.random.permutation(kk, n))(keys)
  return jnp.argsort(perm, axis=1) >= k  # ranks < k are deleted
