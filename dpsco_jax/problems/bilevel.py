"""Paper 004's bilevel problems (Kornowski, "Differentially Private Bilevel Optimization"):
specification, penalty hypergradients, non-private oracles, the §7 ridge-tuning instances.

(BO): ``min_{x in X} F(x) = f(x, y*(x))``, ``y*(x) = argmin_y g(x, y)``, ``g(x, .)``
``mu_g``-strongly convex, both levels ERMs over one dataset (footnote 1: per-level membership
through weights inside each example); ``x`` and ``y`` are flat vectors. Nothing here is a
privacy mechanism: the driver clips and noises the per-example penalty hypergradient (Eq. 3);
the exact solvers are NON-PRIVATE evaluation oracles (Example 3.1: releasing anything computed
at the exact ``y*(x)`` leaks).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax._checks import check_positive
from dpsco_jax.grads import per_example_grads
from dpsco_jax.transforms.steps import project_l2_ball

PyTree = object

@dataclasses.dataclass(frozen=True)
class ProblemConstants:
  """Assumption 2.5/2.6 constants (public). ``ell = max(L0f, L1f, L0g, L1g, L2g)``,
  ``kappa = ell / mu_g``."""
  l0f: float
  l1f: float
  l0g: float
  l1g: float
  l2g: float
  mu_g: float
  delta_f: float = 1.0

  def __post_init__(self):
    for name in ("l0f", "l1f", "l0g", "l1g", "l2g", "mu_g", "delta_f"):
      check_positive(getattr(self, name), name)

  @property
  def ell(self) -> float:
    return max(self.l0f, self.l1f, self.l0g, self.l1g, self.l2g)

  @property
  def kappa(self) -> float:
    return self.ell / self.mu_g


@dataclasses.dataclass
class BilevelProblem:
  """A bilevel ERM instance: ``f(x, y) = (1/n) sum_i f_ex(x, y, xi_i) + f_reg(x, y)``, likewise
  ``g``. ``f_reg``, ``g_reg`` are data-independent (added after the noise); ``X = B(x_center,
  x_radius)`` (``None``: ``R^{d_x}``). ``population_fn`` is a NON-PRIVATE evaluation oracle."""
  name: str
  f_ex: Callable[[jax.Array, jax.Array, PyTree], jax.Array]
  g_ex: Callable[[jax.Array, jax.Array, PyTree], jax.Array]
  data: PyTree
  x0: jax.Array
  y0: jax.Array
  consts: ProblemConstants
  f_reg: Callable[[jax.Array, jax.Array], jax.Array] | None = None
  g_reg: Callable[[jax.Array, jax.Array], jax.Array] | None = None
  x_radius: float | None = None
  x_center: jax.Array | None = None
  y_radius: float | None = None      # R_0 of the inner solves (default 2 L0g / mu_g)
  x_opt: jax.Array | None = None     # argmin_X F_S (evaluation only)
  opt_risk: float | None = None      # min_X F_S  (evaluation only)
  population_fn: Callable[[jax.Array], float] | None = None
  population_opt: float | None = None
  meta: dict = dataclasses.field(default_factory=dict)

  @property
  def n(self) -> int:
    return int(jax.tree.leaves(self.data)[0].shape[0])

  @property
  def n_users(self) -> int:  # runner interface: item-level, one example = one user
    return self.n

  m = 1

  @property
  def d(self) -> int:
    return int(self.x0.shape[0])

  @property
  def d_y(self) -> int:
    return int(self.y0.shape[0])

  def init_params(self) -> jax.Array:
    return self.x0

  def hyperobjective(self, x) -> float:
    closed = self.meta.get("_closed_form")
    if closed is not None:  # (theta, F, F') in float64 (ridge)
      return float(closed[1](float(np.asarray(x).reshape(-1)[0])))
    return float(hyperobjective(self, jnp.asarray(x)))

  def excess_risk(self, x) -> float:
    """``F_S(x) - min_X F_S`` (the validation-loss gap for ridge tuning)."""
    opt = self.opt_risk if self.opt_risk is not None else 0.0
    return self.hyperobjective(x) - opt

  def population_risk(self, x) -> float:
    if self.population_fn is None:
      return self.hyperobjective(x)
    return float(self.population_fn(jnp.asarray(x)))

  def gradient_mapping_norm(self, x, eta: float) -> float:
    """``||G_{F_S, eta}(x)||`` with the exact (non-private) hypergradient: the quantity the
    theorems bound."""
    closed = self.meta.get("_closed_form")
    if closed is not None:
      xv = np.asarray(x, np.float64).reshape(-1)
      g = np.array([closed[2](float(xv[0]))])
      xp = np.asarray(project_x(self, jnp.asarray(xv - eta * g, self.x0.dtype)), np.float64)
      return float(np.linalg.norm((xv - xp) / eta))
    return float(jnp.linalg.norm(gradient_mapping(self, jnp.asarray(x), eta)))

  def metrics(self, x, eta: float | None = None) -> dict:
    """Evaluation metrics (non-private oracles; for the experimenter, never released)."""
    out = {"hyperobjective": self.hyperobjective(x), "excess_risk": self.excess_risk(x)}
    if self.population_fn is not None:
      out["population_risk"] = self.population_risk(x)
      if self.population_opt is not None:
        out["population_excess_risk"] = out["population_risk"] - self.population_opt
    if self.x_opt is not None:
      out["dist_to_opt"] = float(jnp.linalg.norm(jnp.asarray(x) - self.x_opt))
    if eta is not None:
      out["gradient_mapping_norm"] = self.gradient_mapping_norm(x, eta)
    return out

  def describe(self) -> dict:
    public_meta = {k: v for k, v in self.meta.items() if not k.startswith("_")}
    return {"problem": self.name, "n": self.n, "d_x": self.d, "d_y": self.d_y,
            "x_radius": self.x_radius, **public_meta}


def _full(ex_fn, reg, data, x, y):
  out = jnp.mean(jax.vmap(ex_fn, in_axes=(None, None, 0))(x, y, data))
  return out if reg is None else out + reg(x, y)


def full_f(problem: BilevelProblem, x, y):
  return _full(problem.f_ex, problem.f_reg, problem.data, x, y)


def full_g(problem: BilevelProblem, x, y):
  return _full(problem.g_ex, problem.g_reg, problem.data, x, y)


def project_x(problem: BilevelProblem, x):
  """``x`` projected onto the upper level's ball ``B(x_center, x_radius)``."""
  return project_l2_ball(x, problem.x_radius, problem.x_center)


# -------------------------------------------------------------------------------- hypergradients

def penalty_hypergrad_per_example(problem: BilevelProblem, lam: float):
  """The data part of Eq. (3) (Alg 1/3 line 4), ``fn(x, y_lam, y_star, batch) -> [B, d_x]``:
  ``v_i = grad_x f_i(x, y_lam) + lam (grad_x g_i(x, y_lam) - grad_x g_i(x, y_star))``."""
  def loss(x, ex, y_lam, y_star):
    return (problem.f_ex(x, y_lam, ex)
            + lam * (problem.g_ex(x, y_lam, ex) - problem.g_ex(x, y_star, ex)))

  def fn(x, y_lam, y_star, batch):
    return per_example_grads(lambda xx, ex: loss(xx, ex, y_lam, y_star), x, batch)
  return fn


def penalty_hypergrad_public(problem: BilevelProblem, lam: float):
  """The data-independent part of Eq. (3) (zero without regularizers)."""
  def fn(x, y_lam, y_star):
    def reg(xx):
      out = jnp.zeros((), x.dtype)
      if problem.f_reg is not None:
        out = out + problem.f_reg(xx, y_lam)
      if problem.g_reg is not None:
        out = out + lam * (problem.g_reg(xx, y_lam) - problem.g_reg(xx, y_star))
      return out
    return jax.grad(reg)(x)
  return fn


def exact_lower_solve(problem: BilevelProblem, x, lam: float | None = None, *,
                      newton_steps: int = 30):
  """NON-PRIVATE Newton minimizer of ``g(x, .)`` (``lam=None``) or ``f/lam + g`` (evaluation
  only: releasing anything computed from it leaks, §3)."""
  def obj(y):
    out = full_g(problem, x, y)
    return out if lam is None else out + full_f(problem, x, y) / lam

  def body(y, _):
    grad = jax.grad(obj)(y)
    hess = jax.hessian(obj)(y)
    return y - jnp.linalg.solve(hess, grad), None

  y, _ = jax.lax.scan(body, problem.y0.astype(jnp.result_type(x)), None, length=newton_steps)
  return y


def exact_penalty_hypergrad(problem: BilevelProblem, lam: float, x, *, newton_steps: int = 30):
  """NON-PRIVATE ``grad L*_lam(x)`` (Eq. 3) with exact ``y*``, ``y^lam`` (tests/baselines)."""
  y_star = exact_lower_solve(problem, x, newton_steps=newton_steps)
  y_lam = exact_lower_solve(problem, x, lam, newton_steps=newton_steps)
  data_part = jnp.mean(penalty_hypergrad_per_example(problem, lam)(x, y_lam, y_star,
                                                                    problem.data), axis=0)
  return data_part + penalty_hypergrad_public(problem, lam)(x, y_lam, y_star)


def implicit_hypergrad(problem: BilevelProblem, x, y_star=None):
  """NON-PRIVATE ground truth, Eq. (1), at ``y*(x)`` (what Example 3.1 shows to leak)."""
  if y_star is None:
    y_star = exact_lower_solve(problem, x)
  gx_f = jax.grad(full_f, argnums=1)(problem, x, y_star)
  gy_f = jax.grad(full_f, argnums=2)(problem, x, y_star)
  hyy = jax.hessian(full_g, argnums=2)(problem, x, y_star)
  hxy = jax.jacfwd(jax.grad(full_g, argnums=1), argnums=2)(problem, x, y_star)  # [d_x, d_y]
  return gx_f - hxy @ jnp.linalg.solve(hyy, gy_f)


def hyperobjective(problem: BilevelProblem, x):
  """NON-PRIVATE ``F_S(x) = f(x, y*(x))`` (evaluation only)."""
  return full_f(problem, x, exact_lower_solve(problem, x))


def gradient_mapping(problem: BilevelProblem, x, eta: float):
  """``(x - Pi_X(x - eta grad F(x))) / eta`` with the exact hypergradient (evaluation only)."""
  g = implicit_hypergrad(problem, x)
  return (x - project_x(problem, x - eta * g)) / eta


# -------------------------------------------------------------------------------------------- §7

def _sq(ex, theta):
  return 0.5 * jnp.square(jnp.dot(ex["a"], theta) - ex["b"])


def ridge_tuning_problem(a_tr, b_tr, a_val, b_val, *, omega_bounds=(1e-3, 5.0),
                         omega0: float = 1.0, clip: float | None = None,
                         clip_val: float | None = None,
                         curvature_bounds: tuple[float, float] = (0.0, 4.0),
                         theta_radius: float = 5.0, name: str = "ridge_tuning",
                         population_fn=None, meta: dict | None = None) -> BilevelProblem:
  """§7 (Eq. 4): ``g = (1/2n_tr)||A_tr theta - b_tr||^2 + (omega/2)||theta||^2``,
  ``f = (1/2n_val)||A_val theta - b_val||^2``, ``X = [omega_min, omega_max]``, ``omega_min > 0``.

  Footnote 1's split: each example carries ``val`` in {0, 1}, ``f_ex`` weights validation rows
  by ``n/n_val``, ``g_ex`` training rows by ``n/n_tr``. The ridge term is data-independent, so
  the outer "gradient" is post-processing of the two private solves (no outer noise needed).
  Public constants, never read from the data: ``clip`` (default ``n/n_tr * 3 sqrt(d)``),
  ``clip_val`` (``L0f``; default ``clip n_tr / n_val``), ``curvature_bounds`` on the
  second-moment eigenvalues (``mu_g = omega_min + h_min``), ``theta_radius`` (``R_0``).
  """
  a_tr, b_tr, a_val, b_val = map(jnp.asarray, (a_tr, b_tr, a_val, b_val))
  n_tr, d = a_tr.shape
  n_val = a_val.shape[0]
  n = n_tr + n_val
  lo, hi = map(float, omega_bounds)
  if not 0 < lo < hi:
    raise ValueError(f"omega_bounds must satisfy 0 < omega_min < omega_max, got {omega_bounds}")
  data = {"a": jnp.concatenate([a_tr, a_val]), "b": jnp.concatenate([b_tr, b_val]),
          "val": jnp.concatenate([jnp.zeros(n_tr), jnp.ones(n_val)]).astype(a_tr.dtype)}
  w_val, w_tr = n / n_val, n / n_tr

  def f_ex(x, theta, ex):
    del x
    return ex["val"] * w_val * _sq(ex, theta)

  def g_ex(x, theta, ex):
    del x
    return (1.0 - ex["val"]) * w_tr * _sq(ex, theta)

  def g_reg(x, theta):
    return 0.5 * x[0] * jnp.sum(jnp.square(theta))

  h_min, h_max = curvature_bounds
  clip = float(clip) if clip is not None else w_tr * 3.0 * math.sqrt(d)
  l0f = float(clip_val) if clip_val is not None else clip * w_val / w_tr
  consts = ProblemConstants(l0f=l0f, l1f=h_max, l0g=clip, l1g=h_max + hi,
                            l2g=1e-12 + 1.0, mu_g=lo + h_min, delta_f=1.0)
  prob = BilevelProblem(name=name, f_ex=f_ex, g_ex=g_ex, data=data,
                        x0=jnp.asarray([omega0], a_tr.dtype), y0=jnp.zeros(d, a_tr.dtype),
                        consts=consts, g_reg=g_reg, x_radius=(hi - lo) / 2,
                        x_center=jnp.asarray([(hi + lo) / 2], a_tr.dtype),
                        y_radius=theta_radius, population_fn=population_fn,
                        meta=dict(meta or {}, n_train=n_tr, n_val=n_val, omega_bounds=[lo, hi]))
  _attach_ridge_optimum(prob, *(np.asarray(v, np.float64) for v in (a_tr, b_tr, a_val, b_val)),
                        lo, hi)
  return prob


def _attach_ridge_optimum(prob, a_tr, b_tr, a_val, b_val, lo, hi):
  """NON-PRIVATE float64 closed forms ``theta*(omega)``, ``F(omega)``, ``F'(omega)`` and the
  optimal penalty (a grid, then bisection on ``F'``), set on ``prob``."""
  n_tr, d = a_tr.shape
  h = a_tr.T @ a_tr / n_tr
  c = a_tr.T @ b_tr / n_tr
  hv = a_val.T @ a_val / a_val.shape[0]
  cv = a_val.T @ b_val / a_val.shape[0]
  bb = float(b_val @ b_val) / a_val.shape[0]

  def theta(om):
    return np.linalg.solve(h + om * np.eye(d), c)

  def big_f(om):
    th = theta(om)
    return 0.5 * (th @ hv @ th) - cv @ th + 0.5 * bb

  def d_f(om):
    th = theta(om)
    grad_f = hv @ th - cv
    return -grad_f @ np.linalg.solve(h + om * np.eye(d), th)

  grid = np.geomspace(lo, hi, 400)
  vals = np.array([big_f(g) for g in grid])
  i = int(np.argmin(vals))
  best = grid[i]
  if 0 < i < len(grid) - 1:  # interior: refine by bisection on F'
    a, b = grid[i - 1], grid[i + 1]
    for _ in range(100):
      mid = 0.5 * (a + b)
      if d_f(mid) > 0:
        b = mid
      else:
        a = mid
    best = 0.5 * (a + b)
  prob.x_opt = jnp.asarray([best], prob.x0.dtype)
  prob.opt_risk = float(big_f(best))
  prob.meta["omega_star"] = float(best)
  prob.meta["omega_star_interior"] = bool(0 < i < len(grid) - 1)
  prob.meta["_closed_form"] = (theta, big_f, d_f)


def attach_population(prob: BilevelProblem, risk: Callable) -> BilevelProblem:
  """Sets ``population_fn(x) = risk(theta*(x))`` and its minimum over a grid of ``X``."""
  theta = prob.meta["_closed_form"][0]
  prob.population_fn = lambda x: risk(theta(float(np.asarray(x).reshape(-1)[0])))
  grid = np.geomspace(*prob.meta["omega_bounds"], 400)
  prob.population_opt = float(min(prob.population_fn(np.array([g])) for g in grid))
  return prob


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _synthetic_ridge_data(key, d, n_train, n_val, label_noise):
  k_w, k_tr, k_val, k_e1, k_e2 = jax.random.split(key, 5)
  w = jax.random.normal(k_w, (d,)) / math.sqrt(d)
  a_tr = jax.random.normal(k_tr, (n_train, d))
  a_val = jax.random.normal(k_val, (n_val, d))
  b_tr = a_tr @ w + label_noise * jax.random.normal(k_e1, (n_train,))
  b_val = a_val @ w + label_noise * jax.random.normal(k_e2, (n_val,))
  return w, a_tr, b_tr, a_val, b_val


def synthetic_ridge_problem(key: jax.Array, *, d: int = 10, n_train: int = 2000,
                            n_val: int = 2000, label_noise: float = 3.0,
                            omega_bounds=(1e-3, 5.0), omega0: float = 1.0,
                            clip: float | None = None) -> BilevelProblem:
  """Synthetic ridge tuning: ``w ~ N(0, I/d)``, ``a ~ N(0, I)``, ``b = a.w + N(0, s^2)``;
  population risk ``1/2 ||theta*(omega) - w||^2 + s^2/2``; curvature bounds
  ``(1 -+ sqrt(d/n))^2`` with slack."""
  w, a_tr, b_tr, a_val, b_val = _synthetic_ridge_data(key, d, n_train, n_val, label_noise)
  r = math.sqrt(d / min(n_train, n_val))
  h_min, h_max = 0.8 * max(0.0, 1 - r) ** 2, 1.25 * (1 + r) ** 2
  n = n_train + n_val
  if clip is None:
    clip = n / n_train * 2.0 * label_noise * math.sqrt(d)
  w_np = np.asarray(w, np.float64)
  prob = ridge_tuning_problem(a_tr, b_tr, a_val, b_val, omega_bounds=omega_bounds,
                              omega0=omega0, clip=clip, curvature_bounds=(h_min, h_max),
                              theta_radius=2.0 + 2.0 * label_noise * math.sqrt(d / n_train),
                              name="ridge_synthetic",
                              meta={"d": d, "label_noise": label_noise})
  return attach_population(
      prob, lambda th: 0.5 * float(np.sum((th - w_np) ** 2)) + 0.5 * label_noise ** 2)


def diabetes_ridge_problem(key: jax.Array, *, omega_bounds=(1e-2, 5.0), omega0: float = 1.0,
                           val_fraction: float = 0.5, clip: float | None = None
                           ) -> BilevelProblem:
  """scikit-learn's diabetes data (442 x 10): features times ``sqrt(442)``, target mapped by
  the PUBLIC affine map of its documented range [25, 346]; a random split by ``key``."""
  try:
    from sklearn.datasets import load_diabetes
  except ImportError as e:  # sklearn is a dev extra
    raise ImportError("the diabetes problem needs scikit-learn (pip install "
                      "dpsco_jax[dev])") from e
  a, b = load_diabetes(return_X_y=True)
  a = np.asarray(a, np.float64) * math.sqrt(442.0)
  b = (np.asarray(b, np.float64) - 185.5) / 160.5
  perm = np.asarray(jax.random.permutation(key, a.shape[0]))
  n_val = int(round(val_fraction * a.shape[0]))
  iv, it = perm[:n_val], perm[n_val:]
  d = a.shape[1]
  n = a.shape[0]
  if clip is None:
    clip = n / len(it) * 1.0 * math.sqrt(d)
  dt = jnp.zeros(()).dtype
  return ridge_tuning_problem(a[it].astype(dt), b[it].astype(dt), a[iv].astype(dt),
                              b[iv].astype(dt), omega_bounds=omega_bounds, omega0=omega0,
                              clip=clip, curvature_bounds=(0.0, 4.0 * d), theta_radius=2.0,
                              name="ridge_diabetes", meta={"d": d})
