"""Ridge tuning whose optimal penalty stays interior as n grows (study 004).

On :func:`~dpsco_jax.problems.bilevel.synthetic_ridge_problem` the optimal penalty
``~ sigma^2 d / (n ||w||^2)`` runs into the box's lower edge as ``n`` grows. Here the model is
trained on clean inputs and validated on noisy ones, ``a~ = a + xi``, ``E xi xi^T = tau^2 I``:
the best predictor is the ridge solution at penalty ``tau^2`` (Bishop 1995), so
``omega* -> tau^2`` for every ``n``.

Every quantity is bounded (features and input noise on spheres, ``||w|| = 1``, Rademacher label
noise), so the declared Lipschitz constants are worst-case bounds; the curvature bounds and the
radius of ``Y`` are concentration bounds (checked by ``tests/test_bilevel_interior.py``).
Privacy never depends on them: the driver clips every per-example gradient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax._checks import check_nonnegative, check_positive
from dpsco_jax.problems.bilevel import (BilevelProblem, attach_population,
                                        ridge_tuning_problem)

#: n_train, n_val must be at least this many times d (the curvature bounds are vacuous below)
MIN_N_OVER_D = 4


def _sphere(rng, n, d):
  u = rng.standard_normal((n, d))
  return u * (math.sqrt(d) / np.linalg.norm(u, axis=1, keepdims=True))


def _noisy_inputs_data(key, d, n_train, n_val, label_noise, input_noise):
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  # numpy seeded by the key's bits: JAX would compile per (n, d)
  rng = np.random.default_rng(np.asarray(key, np.uint32).ravel().tolist())
  w = rng.standard_normal(d)
  w = w / np.linalg.norm(w)                       # ||w|| = 1: public signal size
  a_tr = _sphere(rng, n_train, d)                 # E a a^T = I, ||a|| = sqrt(d)
  a_val = _sphere(rng, n_val, d)
  xi = input_noise * _sphere(rng, n_val, d)       # E xi xi^T = tau^2 I, ||xi|| = tau sqrt(d)
  b_tr = a_tr @ w + label_noise * rng.choice([-1.0, 1.0], n_train)
  b_val = a_val @ w + label_noise * rng.choice([-1.0, 1.0], n_val)  # labels of clean inputs
  dt = jnp.zeros(()).dtype
  return (w, *(jnp.asarray(v, dt) for v in (a_tr, b_tr, a_val + xi, b_val)))  # noisy inputs


def noisy_inputs_constants(*, d: int, n_train: int, n_val: int, label_noise: float,
                           input_noise: float) -> dict:
  """The family's public constants, from the sizes and ``sigma, tau`` only (never the data).

  ``h_min, h_max``: high-probability bounds ``(1 -+ sqrt(d/n))^2`` (slack 0.8, 1.25) on the
  second-moment eigenvalues; ``theta_radius``: ``||theta_OLS|| ~ ||w|| + sigma sqrt(d/n_tr) /
  h_min`` with a factor 3 and 0.25 of slack; ``l0g, l0f``: worst-case per-example gradient
  norms on ``||theta|| <= R``, weights included."""
  if min(n_train, n_val) < MIN_N_OVER_D * d:
    raise ValueError(f"noisy_inputs ridge tuning needs n_train, n_val >= {MIN_N_OVER_D} d = "
                     f"{MIN_N_OVER_D * d} (its curvature bounds are vacuous below), got "
                     f"n_train={n_train}, n_val={n_val}")
  r = math.sqrt(d / min(n_train, n_val))
  h_min = 0.8 * (1 - r) ** 2
  h_max = 1.25 * (1 + input_noise ** 2) * (1 + r) ** 2
  radius = 1.25 + 3.0 * label_noise * math.sqrt(d / n_train) / h_min
  n = n_train + n_val
  sd = math.sqrt(d)
  l0g = n / n_train * sd * (sd * radius + sd + label_noise)
  l0f = n / n_val * (1 + input_noise) * sd * ((1 + input_noise) * sd * radius + sd + label_noise)
  return {"h_min": h_min, "h_max": h_max, "theta_radius": radius, "l0g": l0g, "l0f": l0f}


def noisy_inputs_ridge_problem(key: jax.Array, *, d: int = 10, n_train: int = 2000,
                               n_val: int = 2000, label_noise: float = 1.0,
                               input_noise: float = math.sqrt(0.5),
                               omega_bounds=(1e-3, 5.0), omega0: float = 1.0,
                               clip: float | None = None) -> BilevelProblem:
  """Ridge tuning with noisy validation inputs. ``clip`` defaults to the worst-case bounds
  of :func:`noisy_inputs_constants` (clipping inactive); population risk
  ``1/2 [(1 + tau^2) ||theta||^2 - 2 theta.w + ||w||^2 + sigma^2]``."""
  check_positive(label_noise, "label_noise")
  check_nonnegative(input_noise, "input_noise")
  c = noisy_inputs_constants(d=d, n_train=n_train, n_val=n_val, label_noise=label_noise,
                             input_noise=input_noise)
  w, a_tr, b_tr, a_val, b_val = _noisy_inputs_data(key, d, n_train, n_val, float(label_noise),
                                                   float(input_noise))
  if clip is None:
    clip, clip_val = c["l0g"], c["l0f"]
  else:
    clip, clip_val = check_positive(clip, "clip_norm"), None
  prob = ridge_tuning_problem(a_tr, b_tr, a_val, b_val, omega_bounds=omega_bounds,
                              omega0=omega0, clip=clip, clip_val=clip_val,
                              curvature_bounds=(c["h_min"], c["h_max"]),
                              theta_radius=c["theta_radius"], name="ridge_noisy_inputs",
                              meta={"d": d, "label_noise": label_noise,
                                    "input_noise": input_noise,
                                    "omega_star_population": input_noise ** 2})
  w_np = np.asarray(w, np.float64)
  s2 = (1.0 + input_noise ** 2)
  return attach_population(prob, lambda th: 0.5 * float(
      s2 * th @ th - 2 * th @ w_np + w_np @ w_np + label_noise ** 2))
