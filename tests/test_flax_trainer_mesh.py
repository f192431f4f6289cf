"""Issue 24.2 for the Flax trainer: ``DPTrainer(mesh=)`` (or a ``jax.set_mesh`` context) shards
each step's users over a ``"users"`` axis of 4 forced host devices (in a subprocess: the device
count is fixed when JAX starts). The released params equal the one-device trainer's to float
tolerance (Poisson with fast clipping, cyclic, vmap clipping of UserData with accumulation and
a driven nnx.Optimizer, a resumed checkpoint), the report and ledger are identical, a
micro-batch of 22 users (not divisible by 4) is padded and masked, the compiled step clips
24 / 4 users per device, a different key moves the params by far more than the tolerance,
and a mesh without the users axis, or fast clipping of a user-chunked convolution, is
refused."""

import textwrap

import jax
import numpy as np
import optax
import pytest
from multidevice_users import on_four_devices
from flax import nnx

from dpsco_jax.flax import DPTrainer

SCRIPT = textwrap.dedent("""
    import json, tempfile, warnings
    warnings.filterwarnings("ignore")
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from dpsco_jax.data import UserData
    from dpsco_jax.flax import DPTrainer
    assert len(jax.devices()) == 4, jax.devices()
    rng = np.random.default_rng(0)
    n, m, d = 30, 3, 4
    x = rng.standard_normal((n, m, d)).astype(np.float32)
    data = (jnp.asarray(x), jnp.asarray((x[..., 0] > 0).astype(np.int32)))
    def ce(model, ex):
      return optax.softmax_cross_entropy_with_integer_labels(model(ex[0]), ex[1])
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("users",))
    def make(key=7, model=None, **kw):
      # D = 9: the default micro-batch is ceil(9 + 4 * 3 + 1) = 22 users, padded to 24
      args = dict(data=data, clip_norm=1.0, sampling_rate=0.3, delta=1e-5,
                  expected_batch_size=9.0, noise_multiplier=1.0, key=key, accountant="rdp")
      args.update(kw)
      return DPTrainer(model or nnx.Linear(d, 2, rngs=nnx.Rngs(0)), ce, optax.sgd(0.5), **args)
    def train(steps=4, **kw):
      tr = make(**kw)
      tr.train(steps, report_every=2)
      return tr
    def diff(a, b):
      return max(float(jnp.max(jnp.abs(u - v))) for u, v in
                 zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))
    def same(a, b):
      return (a.privacy_report() == b.privacy_report() and a.history == b.history
              and a.ledger.state_dict() == b.ledger.state_dict())
    out = {}
    one, four = train(), train(mesh=mesh)
    with jax.set_mesh(mesh):
      ctx = train()
    out["poisson"] = {"diff": diff(one, four), "diff_ctx": diff(one, ctx), "same": same(one, four),
                      "micro": [one.micro_batch, four.micro_batch],
                      "replicated": all(p.sharding.is_fully_replicated
                                        for p in jax.tree.leaves(four.params))}
    st, mb = four.state, four.micro_batch
    hlo = four._clipped_chunk.lower(st.params, four.data, jnp.zeros((mb,), jnp.int32),
                                    jnp.ones((mb,), bool), four._zeros(st.params)
                                    ).compile().as_text()
    out["per_device"] = f"f32[{mb // 4},{m},{d}]" in hlo
    cyc = dict(sampling="cyclic", sampling_rate=None, expected_batch_size=None, batch_size=7,
               num_steps=4, accountant="pld")
    c1, c4 = train(**cyc), train(mesh=mesh, **cyc)
    out["cyclic"] = {"diff": diff(c1, c4), "same": same(c1, c4)}
    out["other_key_diff"] = diff(one, train(key=8, mesh=mesh))
    with tempfile.TemporaryDirectory() as tmp:   # save on the mesh, restore onto it, go on
      train(2, mesh=mesh).save(tmp)
      resumed = make(mesh=mesh).restore(tmp)
      resumed.train(2, report_every=2)
    out["resumed"] = {"diff": diff(four, resumed), "same": same(four, resumed)}
    # vmap clipping, UserData (uneven users), accumulation (micro-batches of 8), a driven
    # nnx.Optimizer
    ids = rng.integers(0, 20, 50); ids[:20] = np.arange(20)
    ud = UserData.from_arrays({"x": rng.normal(size=(50, d)).astype(np.float32),
                               "y": (rng.random(50) < .5).astype(np.int32)}, ids,
                              max_items_per_user=4)
    def ce2(model, ex):
      return optax.softmax_cross_entropy_with_integer_labels(model(ex["x"]), ex["y"])
    def driven(**kw):
      model = nnx.Linear(d, 2, rngs=nnx.Rngs(0))
      opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
      tr = DPTrainer(model, ce2, opt, data=ud, clip_norm=1.0, sampling_rate=0.4, delta=1e-5,
                     expected_batch_size=8.0, noise_multiplier=1.0, key=3, accountant="rdp",
                     accumulation_steps=3, method="vmap", **kw)
      tr.train(3, report_every=3)
      return tr, model
    (t1, m1), (t4, m4) = driven(), driven(mesh=mesh)
    out["userdata"] = {"diff": diff(t1, t4), "same": same(t1, t4),
                       "model_diff": float(jnp.max(jnp.abs(m1.kernel.value - m4.kernel.value))),
                       "moved": float(jnp.max(jnp.abs(
                           m4.kernel.value - nnx.Linear(d, 2, rngs=nnx.Rngs(0)).kernel.value)))}
    class Conv(nnx.Module):
      def __init__(self, rngs):
        self.c = nnx.Conv(d, 2, (1,), rngs=rngs)
      def __call__(self, x):
        return jnp.mean(self.c(x[None]), 0)
    for name, kw in (("bad_mesh", dict(mesh=jax.sharding.Mesh(np.array(jax.devices()),
                                                               ("data",)))),
                     ("conv_fast", dict(model=Conv(nnx.Rngs(0)), method="fast", mesh=mesh))):
      try:
        make(**kw)
        out[name] = "accepted"
      except ValueError as err:
        out[name] = str(err)
    make(model=Conv(nnx.Rngs(0)), method="vmap", mesh=mesh)   # vmap clipping shards
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_trainer_on_four_devices_releases_the_one_device_params():
  out = on_four_devices(SCRIPT)
  tol = 1e-6
  r = out["poisson"]
  assert r["diff"] <= tol and r["diff_ctx"] <= tol and r["same"], r
  assert r["micro"] == [22, 24] and r["replicated"], r   # 22 users: padded to 24, masked
  assert out["per_device"]   # the compiled step holds x for 6 users per device
  for name in ("cyclic", "resumed", "userdata"):
    assert out[name]["diff"] <= tol and out[name]["same"], (name, out[name])
  r = out["userdata"]
  assert r["model_diff"] <= tol < r["moved"], r   # the model was updated in place
  assert out["other_key_diff"] > 100 * tol   # the comparisons have power
  assert "no 'users' axis" in out["bad_mesh"] and "('data',)" in out["bad_mesh"]
  assert "does not shard over a mesh" in out["conv_fast"] and "method='vmap'" in out["conv_fast"]


def test_a_mesh_is_checked_in_process():
  """On this process' devices: not a Mesh, or no users axis (also from a jax.set_mesh
  context: a context is read, never ignored), is refused before anything runs."""
  x = np.random.default_rng(0).standard_normal((8, 2, 3)).astype(np.float32)
  kw = dict(data=(x, (x[..., 0] > 0).astype(np.int32)), clip_norm=1.0, sampling_rate=0.5,
            delta=1e-5, expected_batch_size=4.0, noise_multiplier=1.0, accountant="rdp")

  def ce(model, ex):
    return optax.softmax_cross_entropy_with_integer_labels(model(ex[0]), ex[1])

  def make(**more):
    return DPTrainer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), ce, optax.sgd(0.1), **kw, **more)

  with pytest.raises(TypeError, match="jax.sharding.Mesh"):
    make(mesh="users")
  bad = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
  with pytest.raises(ValueError, match="no 'users' axis"):
    make(mesh=bad)
  with jax.set_mesh(bad), pytest.raises(ValueError, match="no 'users' axis"):
    make()
