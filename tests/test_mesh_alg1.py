"""Issue 24.2 for paper 000's Algorithm 1 (``user_level_phased_sgd``): each phase's groups run
their one-pass SGD sharded over a ``"users"`` axis of 4 forced host devices (a subprocess: the
device count is fixed when JAX starts). 103 users in C = 6 groups per phase (6 -> 8 slots:
padded groups whose outputs are dropped): the released params, the FILTER trace, the record and
the privacy report equal the one-device run's; another key gives other params (the equality
is not vacuous); the one-device code path is unchanged (same keys per group)."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from multidevice_users import USERS, on_four_devices

from dpsco_jax.algorithms.user_level_filter import driver as ulf

SCRIPT = textwrap.dedent("""
    import json, warnings
    warnings.filterwarnings("ignore")
    import jax, jax.numpy as jnp, numpy as np
    import dpsco_jax
    assert len(jax.devices()) == 4, jax.devices()
""") + USERS + textwrap.dedent("""
    consts = {"lipschitz": 1.0, "smoothness": 1.0, "radius": 4.0}
    # epsilon 50 and typical sensitivity: the Laplace test passes (a halt would release the
    # public fallback point and make the equality vacuous); 2 phases, 6 groups each
    cfg = {"epsilon": 50.0, "delta": 1e-5, "sensitivity": "typical", "debug": True,
           "num_phases": 2, "num_groups": 6, "clip_norm": 1.0}
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("users",))
    one = dpsco_jax.fit("user_level_phased_sgd", cfg, loss, params, data, jax.random.key(3),
                        constants=consts)
    four = dpsco_jax.fit("user_level_phased_sgd", cfg, loss, params, data, jax.random.key(3),
                         constants=consts, mesh=mesh)
    other = dpsco_jax.fit("user_level_phased_sgd", cfg, loss, params, data, jax.random.key(4),
                          constants=consts, mesh=mesh)
    print(json.dumps({"diff": param_dist(one, four), "other": param_dist(one, other),
                      "scale": scale(one),
                      "halted": one.record["halted_phase"], "fallback": one.fallback,
                      "same_report": one.privacy == four.privacy,
                      "same_record": one.record == four.record,
                      "debug_one": one.debug, "debug_four": four.debug}))
""")


def test_algorithm_1_on_four_devices_equals_one_device():
  got = on_four_devices(SCRIPT)
  assert got["halted"] is None and got["fallback"] is None      # a trained model was released
  assert got["scale"] > 1e-3 and got["other"] > 1e-3
  assert got["diff"] <= 1e-5 * max(1.0, got["scale"]), got
  assert got["same_report"] and got["same_record"]
  assert got["debug_one"]["num_kept"] == got["debug_four"]["num_kept"]
  np.testing.assert_allclose(got["debug_one"]["scores"], got["debug_four"]["scores"], rtol=1e-6)


def test_group_keys_given_equal_the_key_split_inside():
  """The mesh path hands each group the key the one-device path splits for it."""
  loss = lambda p, ex: (ex["x"] @ p - ex["y"]) ** 2                       # noqa: E731
  rng = np.random.default_rng(0)
  items = {"x": jnp.asarray(rng.normal(size=(5, 7, 3)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)}
  key = jax.random.key(11)
  a = ulf._sgd_groups(loss, items, jnp.zeros(3), key, eta=0.1, radius=10.0)
  b = ulf._sgd_groups(loss, items, jnp.zeros(3), None, eta=0.1, radius=10.0,
                      keys=jax.random.split(key, 5))
  np.testing.assert_array_equal(a, b)
