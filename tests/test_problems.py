"""Synthetic problems: the stated optimum is optimal, shapes, constants, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import problems


@pytest.mark.parametrize("name", problems.PROBLEM_NAMES)
@pytest.mark.parametrize("h", [0.0, 0.5])
def test_known_optimum_is_optimal(name, h):
  p = problems.make(name, n_users=50, m=3, d=4, heterogeneity=h, key=jax.random.key(1),
                    n_eval=4000)
  assert p.data["x"].shape == (50, 3, 4) and p.data["y"].shape == (50, 3)
  np.testing.assert_allclose(np.linalg.norm(p.data["x"], axis=-1), 1.0, rtol=1e-5)
  assert abs(p.excess_risk(p.x_opt)) < 1e-6
  assert float(jnp.linalg.norm(p.x_opt)) <= p.radius
  rng = np.random.default_rng(0)
  for _ in range(20):  # no nearby point does better
    w = p.x_opt + 0.05 * rng.standard_normal(4)
    assert p.excess_risk(jnp.asarray(w, jnp.float32)) > -1e-6
  assert p.excess_risk(p.init_params()) > 0


def test_least_squares_closed_form_and_empirical_agreement():
  p = problems.make("least_squares", n_users=4000, m=5, d=3, noise=0.4, key=jax.random.key(2))
  w = jnp.array([0.3, -0.2, 0.1])
  emp = jnp.mean(jax.vmap(jax.vmap(p.loss_fn, (None, 0)), (None, 0))(w, p.data))
  assert float(emp) == pytest.approx(p.population_risk(w), rel=0.03)


@pytest.mark.parametrize("kw,name", [
    (dict(n_users=0), "n_users"), (dict(m=-1), "m"), (dict(d=2.5), "d"),
    (dict(radius=0.0), "radius"), (dict(noise=-1.0), "noise"),
    (dict(heterogeneity=float("nan")), "heterogeneity")])
def test_invalid_problem_arguments(kw, name):
  args = dict(n_users=5, m=2, d=3, key=jax.random.key(0))
  args.update(kw)
  with pytest.raises(ValueError, match=name):
    problems.make("logistic", **args)
  with pytest.raises(ValueError, match="problem"):
    problems.make("hinge2", n_users=5, m=2, d=3, key=jax.random.key(0))
