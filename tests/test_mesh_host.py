"""Issue 24 ("what still does not scale", item 2): host streaming on a mesh. With
``data_placement='host'`` each step's Poisson-sampled rows are gathered on the host (O(q n)),
padded with masked slots to a multiple of the devices and placed sharded over the ``users``
axis, so each of 4 forced host devices receives and differentiates only its share; the
released params equal the one-device host-streamed run's to float tolerance (same sampled rows,
same noise key), with the same privacy report, at user level and item level (``U m`` item
slots); another key moves the params (the equality is not vacuous)."""

import textwrap

from multidevice_users import USERS, on_four_devices

SCRIPT = textwrap.dedent("""
    import json, warnings
    warnings.filterwarnings("ignore")
    import jax, jax.numpy as jnp, numpy as np
    import dpsco_jax
    assert len(jax.devices()) == 4, jax.devices()
""") + USERS + textwrap.dedent("""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("users",))
    out = {}
    # item level: every item kept (an item-level guarantee does not cover dropped items)
    m_all = int(np.bincount(ids).max())
    items = UserData.from_arrays({"x": x, "y": y}, ids, max_items_per_user=m_all)
    for alg, rows, d in (("dp_sgd_user", n, data), ("dp_sgd_item", n * m_all, items)):
      cfg = {"epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.5,
             "num_steps": 8, "n_users": rows, "batch_size": 21, "noise_multiplier": 2.0}
      one = dpsco_jax.fit(alg, cfg, loss, params, d, jax.random.key(7), data_placement="host")
      four = dpsco_jax.fit(alg, cfg, loss, params, d, jax.random.key(7), data_placement="host",
                           mesh=mesh)
      other = dpsco_jax.fit(alg, cfg, loss, params, d, jax.random.key(8), data_placement="host",
                            mesh=mesh)
      out[alg] = {"diff": param_dist(one, four), "other": param_dist(one, other),
                  "scale": scale(one), "same_report": one.privacy == four.privacy}
    print(json.dumps(out))
""")


def test_host_streamed_runs_on_four_devices_equal_the_one_device_run():
  got = on_four_devices(SCRIPT)
  for alg in ("dp_sgd_user", "dp_sgd_item"):
    r = got[alg]
    assert r["diff"] <= 1e-6 * max(1.0, r["scale"]), r
    assert r["other"] > 100 * max(r["diff"], 1e-7), r
    assert r["same_report"], r
