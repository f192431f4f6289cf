"""Projection, projected SGD with averaging, AC-SA against its reference, released iterates."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax import (acsa, add_prox_to_anchor, project_l2_ball, projected_sgd, projection,
                       released_params)
from dpsco_jax.transforms.steps import tree_l2_norm

D = 12
EIG = jnp.logspace(-3, 0, D)  # condition number 1000, L = 1, mu = 0.001
B = jnp.linspace(-0.005, 0.005, D)


def quad(x):
  return 0.5 * jnp.sum(EIG * x * x) - jnp.dot(B, x)


X_STAR = B / EIG
F_STAR = quad(X_STAR)


def run(tx, x0, steps, grad=jax.grad(quad)):
  @jax.jit
  def go(x0):
    def body(carry, _):
      x, s = carry
      u, s = tx.update(grad(x), s, x)
      x = optax.apply_updates(x, u)
      return (x, s), (quad(released_params(s, x)), released_params(s, x))
    (x, s), (vals, iters) = jax.lax.scan(body, (x0, tx.init(x0)), None, length=steps)
    return released_params(s, x), vals, iters
  return go(x0)


def acsa_reference(x0, steps, L, mu, radius=None):
  """EXT spec A.2 written out with numpy, one iteration at a time."""
  x = x_ag = np.asarray(x0, np.float64)
  eig, b = np.asarray(EIG, np.float64), np.asarray(B, np.float64)
  for t in range(1, steps + 1):
    a, g = 2.0 / (t + 1), 4.0 * L / (t * (t + 1))
    c = (1 - a) * (mu + g) / (g + (1 - a * a) * mu)
    x_md = c * x_ag + (1 - c) * x
    G = eig * x_md - b
    w = a * mu / (mu + g)
    v = w * x_md + (1 - w) * x - a / (mu + g) * G
    if radius is not None:
      v = v * min(1.0, radius / np.linalg.norm(v))
    x = v
    x_ag = a * x + (1 - a) * x_ag
  return x_ag


@pytest.mark.parametrize("mu,radius", [(0.0, None), (1e-3, None), (1e-3, 1.0)])
def test_acsa_matches_reference(mu, radius):
  out, _, _ = run(acsa(1.0, strong_convexity=mu, radius=radius), jnp.zeros(D), 40)
  np.testing.assert_allclose(out, acsa_reference(np.zeros(D), 40, 1.0, mu, radius),
                             rtol=2e-4, atol=2e-5)


def test_acsa_needs_far_fewer_iterations_than_projected_gd():
  target = 1e-4 * float(quad(jnp.zeros(D)) - F_STAR)
  def iters_to_target(tx, steps=3000):
    _, vals, _ = run(tx, jnp.zeros(D), steps)
    hit = np.nonzero(np.asarray(vals) - float(F_STAR) <= target)[0]
    return int(hit[0]) + 1 if hit.size else steps + 1
  n_gd = iters_to_target(projected_sgd(1.0), steps=10000)
  n_acsa = iters_to_target(acsa(1.0, strong_convexity=1e-3,
                                stage_length=int(np.ceil(4 * np.sqrt(2 / 1e-3)))), steps=10000)
  assert n_acsa * 3 < n_gd, (n_acsa, n_gd)
  # deterministic AC-SA bound (EXT A.3a): gap <= 4 L V0 / (N (N + 1))
  _, vals, _ = run(acsa(1.0, strong_convexity=1e-3), jnp.zeros(D), 200)
  v0 = 0.5 * float(jnp.sum(X_STAR ** 2))
  for n in (10, 50, 200):
    assert float(vals[n - 1] - F_STAR) <= 4 * v0 / (n * (n + 1)) + 1e-6


def test_acsa_iterates_stay_in_ball():
  radius = 0.5 * float(jnp.linalg.norm(X_STAR))
  center = jnp.full((D,), 0.01)
  _, _, iters = run(acsa(1.0, strong_convexity=1e-3, radius=radius, center=center),
                    jnp.zeros(D), 100)
  norms = np.linalg.norm(np.asarray(iters) - np.asarray(center), axis=1)
  assert np.all(norms <= radius * (1 + 1e-5))


def test_projection_and_projected_sgd_averaging():
  tree = {"a": jnp.full((3,), 3.0), "b": jnp.full((4,), 4.0)}
  p = project_l2_ball(tree, 2.0)
  # on the sphere of radius R (1 - 2^-20) (the rounding margin), never outside R
  assert float(tree_l2_norm(p)) == pytest.approx(2.0 * (1 - 2.0 ** -20), rel=1e-6)
  inside = project_l2_ball(jax.tree.map(lambda x: 0.01 * x, tree), 2.0)
  chex.assert_trees_all_close(inside, jax.tree.map(lambda x: 0.01 * x, tree))
  c = {"a": jnp.ones(3), "b": jnp.ones(4)}
  pc = project_l2_ball(tree, 1.0, center=c)
  assert float(tree_l2_norm(jax.tree.map(jnp.subtract, pc, c))) == pytest.approx(1.0, rel=2e-6)

  tx = projected_sgd(0.5, radius=1.0, averaging="uniform")
  x = jnp.zeros(2)
  s = tx.init(x)
  xs = []
  for g in (jnp.array([-4.0, 0.0]), jnp.array([0.0, -1.0]), jnp.array([1.0, 1.0])):
    u, s = tx.update(g, s, x)
    x = optax.apply_updates(x, u)
    xs.append(x)
    assert float(jnp.linalg.norm(x)) <= 1.0 + 1e-6
  # float32 running mean vs numpy mean: summation orders differ (GPU), so a few ulps x steps
  np.testing.assert_allclose(released_params(s, x), np.mean(xs, axis=0), rtol=1e-5)
  tx = optax.chain(optax.sgd(1.0), projection(1.0))
  u, _ = tx.update(jnp.array([-5.0, 0.0]), tx.init(x), jnp.zeros(2))
  np.testing.assert_allclose(u, [1.0, 0.0], rtol=2e-6)  # on the margin sphere R (1 - 2^-20)


def test_prox_to_anchor_gradient():
  tx = add_prox_to_anchor(0.5, anchor=jnp.ones(3))
  u, _ = tx.update(jnp.zeros(3), tx.init(jnp.zeros(3)), jnp.full(3, 3.0))
  np.testing.assert_allclose(u, np.full(3, 1.0))
  tx = add_prox_to_anchor(2.0)
  s = tx.init(jnp.full(3, 1.0))
  u, _ = tx.update(jnp.zeros(3), s, jnp.full(3, 2.0))
  np.testing.assert_allclose(u, np.full(3, 2.0))


@pytest.mark.parametrize("factory,name", [
    (lambda: acsa(0.0), "smoothness"), (lambda: acsa(1.0, strong_convexity=-1), "strong_convexity"),
    (lambda: acsa(1.0, stage_length=0), "stage_length"), (lambda: projected_sgd(-0.1), "learning_rate"),
    (lambda: projected_sgd(0.1, radius=-1.0), "radius"),
    (lambda: projected_sgd(0.1, averaging="ema"), "averaging"), (lambda: projection(0.0), "radius")])
def test_invalid_step_arguments(factory, name):
  with pytest.raises(ValueError, match=name):
    factory()


@pytest.mark.parametrize("center_scale", [0.0, 1.0, 1e3])
def test_projected_points_are_inside_the_ball_in_exact_arithmetic(center_scale):
  """The float32 projection lands inside ``B(c, R)`` measured in float64, for points far
  outside, just outside, and on a box edge whose centre is large against the radius (the
  bilevel ``omega`` box [1e-3, 5]: centre 2.5005, radius 2.4995). Before the rounding margin,
  ~1/3 of these landed outside by a few ulps."""
  rng = np.random.default_rng(7)
  worst = -np.inf
  for d in (1, 3, 1000):
    for _ in range(40):
      c = center_scale * rng.standard_normal(d).astype(np.float32)
      r = np.float32(rng.uniform(0.1, 3.0))
      v = (c + rng.standard_normal(d) * rng.choice([1.0001, 1.5, 100.0]) * r
           / np.sqrt(d)).astype(np.float32)
      out = np.asarray(project_l2_ball(jnp.asarray(v), float(r), jnp.asarray(c)), np.float64)
      worst = max(worst, np.linalg.norm(out - c.astype(np.float64)) / float(r) - 1.0)
  lo, hi = np.float32(1e-3), np.float32(5.0)
  c1, r1 = (hi + lo) / 2, (hi - lo) / 2
  for v in np.linspace(-3.0, 1e-3, 500, dtype=np.float32):
    out = float(project_l2_ball(jnp.asarray([v]), float(r1), jnp.asarray([c1]))[0])
    assert out >= float(lo), (v, out)         # omega_min is never rounded away
  assert worst <= 0.0, worst
