"""Issue 24.2 for paper 002's private ReSQue (``resque_private_sco``): each round's oracle calls
(gradients at Gaussian-perturbed points of items drawn with replacement) are split over a
``"users"`` axis of 4 forced host devices (a subprocess: the device count is fixed when JAX
starts), with the items replicated. The draws are the one-device run's, padded to a multiple of
the devices and sliced off, so the released params equal the one-device run's to float
tolerance and the privacy report and record are the same; another key moves the params (the
equality is not vacuous). In-process: the padded, sharded round returns the very queries and
gradients of the unsharded one."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from multidevice_users import USERS, on_four_devices

from dpsco_jax.algorithms.resque import solvers

SCRIPT = textwrap.dedent("""
    import json, warnings
    warnings.filterwarnings("ignore")
    import jax, jax.numpy as jnp, numpy as np
    import dpsco_jax
    assert len(jax.devices()) == 4, jax.devices()
""") + USERS + textwrap.dedent("""
    # item level: every item must be kept (m = the largest user's count, declared)
    data = UserData.from_arrays({"x": x, "y": y}, ids,
                                max_items_per_user=int(np.bincount(ids).max()))
    consts = {"lipschitz": 4.0, "radius": 2.0}
    cfg = {"epsilon": 4.0, "delta": 1e-5, "constants": "c_priv", "rho": 0.05,
           "rho_over_r": 2.0, "max_iter": 1, "max_bisection": 1, "phases": 1, "T_frac": 1 / 16}
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("users",))
    fit = lambda k, **kw: dpsco_jax.fit("resque_private_sco", cfg, loss, params, data,
                                        jax.random.key(k), constants=consts, **kw)
    one, four, other = fit(5), fit(5, mesh=mesh), fit(6, mesh=mesh)
    print(json.dumps({"diff": param_dist(one, four), "other": param_dist(one, other),
                      "scale": scale(one),
                      "same_report": one.privacy == four.privacy,
                      "same_record": one.record == four.record}))
""")


def test_resque_private_on_four_devices_equals_one_device():
  got = on_four_devices(SCRIPT)
  assert got["scale"] > 1e-3 and got["other"] > 1e-3, got
  assert got["diff"] <= 1e-5 * max(1.0, got["scale"]), got
  assert got["same_report"] and got["same_record"]


def test_a_sharded_round_draws_the_one_device_queries():
  """On this process's devices (1 here: the pad and the slicing are the identity; the
  4-device run above exercises both)."""
  loss = lambda p, ex: (ex["x"] @ p - ex["y"]) ** 2                      # noqa: E731
  rng = np.random.default_rng(1)
  items = {"x": jnp.asarray(rng.normal(size=(9, 3)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(9,)), jnp.float32)}
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("users",))
  users = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("users"))
  key, center = jax.random.key(2), jnp.ones(3)
  z, xis, g = solvers.draw_queries(key, loss, items, center, 0.1, 7)
  z2, xis2, g2 = jax.jit(lambda k: solvers.draw_queries(k, loss, items, center, 0.1, 7,
                                                         users))(key)
  np.testing.assert_array_equal(z, z2)
  np.testing.assert_allclose(xis, xis2, rtol=1e-6, atol=1e-7)   # jit may fuse rho * normal
  np.testing.assert_allclose(g, g2, rtol=1e-6, atol=1e-7)
