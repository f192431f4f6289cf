"""Issue 24.3: many hosts under ``jax.distributed``. ``UserData.shard`` (in process), the
distributed path on one process (equals the host-streamed run, user and item level), and two
processes on
127.0.0.1 with CPU (gloo) collectives: both release the one-process params and the same ledger
digest, and a process with another config, another declared ``n_users`` or unsharded data is
refused on both processes before the first step (no hang: every wait has a timeout)."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax.data import UserData
from dpsco_jax.data.user_data import ShardInfo
from dpsco_jax.distributed import privacy_digest
from multidevice_users import USERS

DATA = USERS + textwrap.dedent("""
    # n = 103 users: not divisible by 2, shards of 51 and 52
    # an explicit noise multiplier (its epsilon reported): no calibration in each fit
    cfg = {"epsilon": None, "noise_multiplier": 2.0, "delta": 1e-5, "clip_norm": 1.0,
           "learning_rate": 0.5, "num_steps": 25, "n_users": 110, "batch_size": 20}
    # item level keeps every item (m = the largest user's count, declared)
    data_items = UserData.from_arrays({"x": x, "y": y}, ids,
                                      max_items_per_user=int(np.bincount(ids).max()))
""")
exec(DATA)   # the same data, loss and config in this process (data, loss, params, cfg)

WORKER = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    pid, port = int(sys.argv[1]), int(sys.argv[2])
    import jax
    from jax.experimental import multihost_utils
    import dpsco_jax
    from dpsco_jax import distributed as dist
    try:
      dist.initialize(f"127.0.0.1:{port}", 2, pid, timeout_s=60)
      multihost_utils.sync_global_devices("up")
    except Exception as err:    # no CPU collectives on this platform: the test skips
      print(json.dumps({"skip": f"{type(err).__name__}: {err}"[:400]}), flush=True)
      sys.exit(0)
""") + DATA + textwrap.dedent("""
    def flat(tree):
      return [float(v) for leaf in jax.tree.leaves(tree) for v in jax.numpy.ravel(leaf)]
    out = {"processes": jax.process_count()}
    res = dpsco_jax.fit("dp_sgd_user", cfg, loss, params, data.shard(pid, 2), jax.random.key(7))
    out.update(params=flat(res.params), digest=res.record["ledger_digest"],
               epsilon=res.privacy.epsilon)
    res = dpsco_jax.fit("dp_sgd_user", cfg, loss, params, data.shard(pid, 2, layout="strided"),
                        jax.random.key(7))
    out["strided"] = flat(res.params)
    res = dpsco_jax.fit("dp_sgd_item", cfg, loss, params, data_items.shard(pid, 2),
                        jax.random.key(7))
    out.update(items=flat(res.params), items_digest=res.record["ledger_digest"])
    # refusals: both processes raise before the first step (no progress report is made)
    seen = []
    for case, (c, d) in {
        "config": (dict(cfg, learning_rate=0.5 if pid == 0 else 0.25), data.shard(pid, 2)),
        "unsharded": (cfg, data.shard(pid, 2) if pid == 0 else data),
        "invalid": (dict(cfg, learning_rate=-1.0) if pid == 1 else cfg,
                    data.shard(pid, 2))}.items():
      try:
        dpsco_jax.fit("dp_sgd_user", c, loss, params, d, jax.random.key(7),
                      callback=lambda pr: seen.append(pr.step))
        out[case] = "accepted"
      except ValueError as err:
        out[case] = f"{type(err).__name__}: {err}"
    out["steps_seen"] = seen
    print(json.dumps(out), flush=True)
    # another declared n_users, uncaught: both processes exit with the error
    dpsco_jax.fit("dp_sgd_user", dict(cfg, n_users=110 + pid), loss, params,
                  data.shard(pid, 2), jax.random.key(7))
    print("RAN", flush=True)
""")


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


# ----------------------------------------------------------------------------- in process
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shards_are_disjoint_cover_every_user_and_keep_the_whole_datas_facts(layout, count):
  shards = [data.shard(i, count, layout=layout) for i in range(count)]
  ids = np.concatenate([s.user_ids for s in shards])
  assert sorted(ids.tolist()) == sorted(data.user_ids.tolist())
  assert len(set(ids.tolist())) == data.n_users                   # disjoint
  for i, s in enumerate(shards):
    info = s.shard_info
    assert (info.index, info.count, info.n_users_total) == (i, count, data.n_users)
    assert s.spec == data.spec                                    # the plan's facts: global
    assert s.n_users == info.size() == len(info.positions())     # the arrays: local
    pos = info.positions()
    np.testing.assert_array_equal(s.user_ids, data.user_ids[pos])
    np.testing.assert_array_equal(s.examples["x"], data.examples["x"][pos])
    np.testing.assert_array_equal(s.n_items, data.n_items[pos])
    np.testing.assert_array_equal(info.owner(pos), np.full(pos.size, i))
    np.testing.assert_array_equal(info.local(pos), np.arange(pos.size))
  assert sum(s.n_users for s in shards) == data.n_users
  if layout == "contiguous":   # user order is kept: concatenated shards are the data
    np.testing.assert_array_equal(ids, data.user_ids)


def test_shard_of_a_memory_map_stays_a_memory_map(tmp_path):
  rng = np.random.default_rng(1)
  ids = np.repeat(np.arange(40), 3)
  x = rng.normal(size=(120, 4)).astype(np.float32)
  mapped = UserData.from_arrays({"x": x}, ids, max_items_per_user=3, store=tmp_path / "s")
  part = UserData.open(tmp_path / "s").shard(1, 3)
  assert isinstance(part.examples["x"], np.memmap)   # a view: no page read
  assert part.spec.n_users == 40 and part.n_users == 13
  np.testing.assert_array_equal(part.examples["x"], mapped.examples["x"][13:26])


def test_shard_refusals():
  with pytest.raises(ValueError, match="index must be in"):
    data.shard(2, 2)
  with pytest.raises(ValueError, match="layout"):
    data.shard(0, 2, layout="random")
  with pytest.raises(ValueError, match="at least one user"):
    data.shard(0, data.n_users + 1)
  with pytest.raises(TypeError):
    data.shard(0.0, 2)
  with pytest.raises(ValueError, match="already shard"):
    data.shard(0, 2).shard(0, 2)
  with pytest.raises(ValueError, match="should hold"):     # a forged shard
    UserData(data.examples, data.item_mask, data.user_ids, data.n_items, data.n_dropped,
             m_declared=True, shard_info=ShardInfo(0, 2, data.n_users))
  # the measured/declared flags survive: m declared, n measured
  s = data.shard(0, 2)
  assert s.spec.declared("max_items_per_user") and not s.spec.declared("n_users")
  assert "shard=0/2" in repr(s)


def test_one_process_distributed_path_equals_the_host_streamed_run():
  key = jax.random.key(7)
  host = dpsco_jax.fit("dp_sgd_user", cfg, loss, params, data, key, data_placement="host")
  for d in (data, data.shard(0, 1, layout="strided")):
    dist = dpsco_jax.fit("dp_sgd_user", cfg, loss, params, d, key, distributed=True)
    np.testing.assert_allclose(_flat(dist.params), _flat(host.params), atol=1e-6)
    assert dist.privacy == host.privacy
    assert dist.record["ledger_digest"] == privacy_digest(host.privacy)
    assert dist.record["processes"] == 1
  with pytest.raises(ValueError, match="jax.distributed yet"):
    dpsco_jax.fit("dp_sgd_group", cfg, loss, params, data, key, distributed=True)
  with pytest.raises(ValueError, match="Poisson"):
    fixed = {k: v for k, v in cfg.items() if k != "n_users"}
    dpsco_jax.fit("dp_sgd_user", dict(fixed, sampling="fixed"), loss, params, data, key,
                  distributed=True)
  with pytest.raises(ValueError, match="shard 1 of 2"):     # a shard outside its 2 processes
    dpsco_jax.fit("dp_sgd_user", cfg, loss, params, data.shard(1, 2), key)


def test_item_level_distributed_path_equals_the_host_streamed_run():
  """dp_sgd_item: the global Poisson draw over the U m item slots, each shard keeping its
  users' slots (contiguous and strided layouts), equals the one-process host run."""
  key = jax.random.key(7)
  host = dpsco_jax.fit("dp_sgd_item", cfg, loss, params, data_items, key,
                       data_placement="host")
  for d in (data_items, data_items.shard(0, 1, layout="strided")):
    dist = dpsco_jax.fit("dp_sgd_item", cfg, loss, params, d, key, distributed=True)
    np.testing.assert_allclose(_flat(dist.params), _flat(host.params), atol=1e-6)
    assert dist.privacy == host.privacy and dist.privacy.level == "item"
    assert dist.gradient_evaluations == host.gradient_evaluations


# ----------------------------------------------------------------------------- two processes
def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_release_the_one_process_params_and_refuse_mismatches():
  if "jax_cpu_collectives_implementation" not in jax.config.values:
    pytest.skip("this jax has no CPU collectives option (jax_cpu_collectives_implementation)")
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = []
  try:
    # the one-process references, computed while the workers start
    one = dpsco_jax.fit("dp_sgd_user", cfg, loss, params, data, jax.random.key(7),
                        data_placement="host")
    other = dpsco_jax.fit("dp_sgd_user", cfg, loss, params, data, jax.random.key(8),
                          data_placement="host")
    items = dpsco_jax.fit("dp_sgd_item", cfg, loss, params, data_items, jax.random.key(7),
                          data_placement="host")
    for proc in procs:
      stdout, stderr = proc.communicate(timeout=150)
      outs.append((proc.returncode, stdout, stderr))
  finally:
    for proc in procs:   # a hang is a failure, never a stuck suite
      if proc.poll() is None:
        proc.kill()
  lines = [[json.loads(s) for s in out.splitlines() if s.startswith("{")] for _, out, _ in outs]
  if all(ls and "skip" in ls[-1] for ls in lines):
    pytest.skip(f"2-process CPU collectives unavailable: {lines[0][-1]['skip']}")
  for i, ((rc, out, err), ls) in enumerate(zip(outs, lines)):
    assert ls and "skip" not in ls[-1], (i, rc, out[-1000:], err[-3000:])
  r0, r1 = lines[0][-1], lines[1][-1]
  assert r0["processes"] == r1["processes"] == 2
  # both processes hold the same params, equal to the one-process run's; one ledger
  ref = _flat(one.params)
  for r in (r0, r1):
    np.testing.assert_allclose(r["params"], ref, atol=1e-5)
    np.testing.assert_allclose(r["strided"], ref, atol=1e-5)
    assert r["digest"] == privacy_digest(one.privacy)
    np.testing.assert_allclose(r["items"], _flat(items.params), atol=1e-5)   # item level
    assert r["items_digest"] == privacy_digest(items.privacy)
  np.testing.assert_array_equal(r0["params"], r1["params"])
  np.testing.assert_array_equal(r0["items"], r1["items"])
  # the tolerance has power: another key moves the params by far more
  assert np.max(np.abs(_flat(other.params) - ref)) > 1e-2
  # refusals on both processes, before any step
  for r in (r0, r1):
    assert r["config"].startswith("DistributedMismatch") and "learning_rate" in r["config"], r
    assert r["steps_seen"] == []
  assert "each process must hold only its own users" in r1["unsharded"]
  assert "process(es) [1] refused" in r0["unsharded"]
  # a process that cannot even plan still joins the handshake: the other raises, no hang
  assert "learning_rate must be" in r1["invalid"]
  assert "process(es) [1] refused" in r0["invalid"]
  for rc, out, err in outs:   # another declared n_users: both exit with the error
    assert rc != 0 and "RAN" not in out
    assert "declared n_users: process 0: 110, process 1: 111" in err, err[-2000:]
