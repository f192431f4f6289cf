"""Issue 24 ("what still does not scale", item 1): on a users mesh the device path's Poisson
coins are drawn sharded. Every device used to hash all ``n`` counters every step (the key and
the draw were replicated: 144 ``u32[10000]`` arrays in the compiled 4-device step at
n = 1e4); now each device hashes its own users' counters (partitionable threefry gives the
values of the unsharded draw, so the released params are unchanged, ``tests/test_mesh.py``), and
each device finds its chosen users among its own and places them at its offset (the chosen
count of the devices before it), so the slot vector is the global ``nonzero``'s without any
device holding an ``[n]`` array. Checked on the optimized HLO of the compiled loop (4 forced
host devices, 103 users padded to 104: shards of 26)."""

import textwrap

from multidevice_users import USERS, on_four_devices

SCRIPT = textwrap.dedent("""
    import glob, json, os, sys, tempfile, warnings
    dump = tempfile.mkdtemp()
    os.environ["XLA_FLAGS"] += f" --xla_dump_to={dump}"   # read when the backend starts
    warnings.filterwarnings("ignore")
    import jax, jax.numpy as jnp, numpy as np
    import dpsco_jax
    assert len(jax.devices()) == 4, jax.devices()
""") + USERS + textwrap.dedent("""
    cfg = {"epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.5,
           "num_steps": 5, "n_users": n, "batch_size": 20, "noise_multiplier": 2.4}
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("users",))
    four = dpsco_jax.fit("dp_sgd_user", cfg, loss, params, data, jax.random.key(7), mesh=mesh)
    one = dpsco_jax.fit("dp_sgd_user", cfg, loss, params, data, jax.random.key(7))
    (hlo,) = [open(f).read() for f in glob.glob(f"{dump}/*jit_loop*after_optimizations.txt")
              if "num_partitions=4" in open(f).read()]
    # the slot vector equals the global nonzero's, truncation at capacity included
    from dpsco_jax.algorithms.common import _sharded_slots
    users = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("users"))
    same = []
    for seed, q, cap in ((0, 0.3, 40), (1, 0.3, 10), (2, 0.02, 12), (3, 0.0, 8)):
      c = jax.random.bernoulli(jax.random.key(seed), q, (104,))
      idx, mask = jax.jit(lambda c, cap=cap: _sharded_slots(
          jax.lax.with_sharding_constraint(c, users), users, cap))(c)
      (want,) = jnp.nonzero(c, size=cap, fill_value=0)
      same.append(bool(jnp.all(idx == want))
                  and bool(jnp.all(mask == (jnp.arange(cap) < jnp.sum(c)))))
    print(json.dumps({"same_slots": same, "full": hlo.count("u32[104]"), "shard": hlo.count("u32[26]"),
                      "slots_full": sum(hlo.count(f"{t}[104]") for t in ("s32", "pred")),
                      "diff": param_dist(one, four), "scale": scale(one)}))
""")


def test_poisson_coins_are_drawn_sharded_on_a_mesh():
  got = on_four_devices(SCRIPT, fresh=True)   # XLA_FLAGS set before its backend starts
  assert got["full"] == 0, got          # no device hashes all n counters
  assert got["shard"] > 0, got          # each hashes its own 26
  assert got["slots_full"] == 0, got     # and finds its chosen users among its own 26
  assert got["diff"] <= 1e-6 * max(1.0, got["scale"]), got
  assert got["same_slots"] == [True] * 4, got   # 30 chosen in 40 or 10 slots, 2 in 12, none
