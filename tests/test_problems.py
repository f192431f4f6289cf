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


@pytest.mark.parametrize("name", ["least_squares", "logistic"])
def test_float64_excess_risk_resolves_below_a_float32_ulp(name):
  """``excess_risk_f64`` is the float32 ``excess_risk``'s quantity: the same to float32
  rounding at an ordinary point, 0 at the optimum, and at points 1e-5 from the optimum (excess
  ~1e-11, far below float32's step of 6e-8 at risks ~0.5, where the float32 difference is
  rounding) it is the second-order value ``0.5 dw' H dw`` within 1% (H in float64: the
  logistic risk's ``mean p(1-p) x x'``, least squares' ``I / d``)."""
  p = problems.make(name, n_users=20, m=2, d=5, key=jax.random.key(3), n_eval=20000)
  w = p.x_opt + 0.3
  assert p.excess_risk_f64(w) == pytest.approx(p.excess_risk(w), rel=1e-4, abs=2e-7)
  assert p.excess_risk_f64(p.x_opt) == 0.0
  x64 = np.asarray(p.x_opt, np.float64)
  rng = np.random.default_rng(4)
  for _ in range(5):
    dw = 1e-5 * rng.standard_normal(5)
    got = p.excess_risk_f64(x64 + dw)
    eps = 1e-4  # the Hessian by central differences of the float64 risk, in exact steps
    e = np.eye(5) * eps
    r = p.risk_fn64
    hess = np.array([[(r(x64 + e[i] + e[j]) - r(x64 + e[i] - e[j]) - r(x64 - e[i] + e[j])
                       + r(x64 - e[i] - e[j])) / (4 * eps * eps) for j in range(5)]
                     for i in range(5)])
    want = 0.5 * dw @ hess @ dw
    assert 0 < want < 1e-9 and got == pytest.approx(want, rel=1e-2)


def test_runner_records_carry_the_float64_excess_risk():
  """A run on a synthetic problem records ``excess_risk_f64`` beside the float32
  ``excess_risk`` (which stays what every earlier record holds)."""
  from dpsco_jax import runner  # noqa: PLC0415
  algos, probs = runner.registry()
  record = runner.run_one(
      {"algorithm": "dp_sgd_user", "problem": "logistic", "n_users": 40, "m": 2, "d": 3,
       "epsilon": 1.0, "delta": 1e-5, "num_steps": 3, "batch_size": 8, "seed": 0},
      algorithms=algos, problems=probs)
  assert record["excess_risk_f64"] == pytest.approx(record["excess_risk"], rel=1e-4, abs=2e-7)


def test_seeds_still_batch_and_batched_records_carry_the_float64_excess_risk():
  """``risk_fn64`` is a per-seed evaluation field (``sweep.EVALUATION_FIELDS``): two seeds of a
  synthetic problem still run as one batched program (a new closure per seed had made the
  problems' public facts differ, and the sweep ran seed by seed), and each batched record
  carries its own float64 excess risk."""
  from dpsco_jax import runner  # noqa: PLC0415
  algos, probs = runner.registry()
  runs = runner.expand({"problem": "logistic", "n_users": 40, "m": 2, "d": 3, "seed": [0, 1],
                        "experiments": [{"algorithm": "nonprivate_sgd", "num_steps": 3,
                                         "batch_size": 8},
                                        {"algorithm": "dp_sgd_user", "epsilon": 1.0,
                                         "delta": 1e-5, "num_steps": 3, "batch_size": 8}]})
  runs = [runner._checked(r, algos, probs) for r in runs]
  # the second row reuses the first row's (cached) problems, whose float64 optimum risk the
  # first row's records computed and kept: a per-seed evaluation field too
  records = runner.execute(runs, algorithms=algos, problems=probs, progress=False)[2:]
  assert [r["batched"] for r in records] == [True, True], [r.get("batch_note") for r in records]
  for r in records:
    assert r["excess_risk_f64"] == pytest.approx(r["excess_risk"], rel=1e-4, abs=2e-7)
  assert records[0]["excess_risk_f64"] != records[1]["excess_risk_f64"]
