"""Issue 46: a mesh of ``jax.make_mesh`` (explicit axis types, JAX's default) shards users for
``dp.fit`` / ``fit_model`` and ``DPTrainer``, given as ``mesh=`` or set with ``jax.set_mesh``:
the runs release the params of the same run on ``jax.sharding.Mesh(devices, ("users",))``
(auto axes), and the params come back usable inside the caller's explicit context. Before,
JAX refused the library's sharding constraints on explicit axes from inside the run. One
subprocess with 4 forced host devices (the device count is fixed when JAX starts)."""

import textwrap

import jax
from jax.sharding import AxisType
from multidevice_users import USERS, on_four_devices

from dpsco_jax.algorithms.common import auto_axes

SCRIPT = USERS + textwrap.dedent("""
    import json, optax
    from flax import nnx
    import dpsco_jax as dp
    from dpsco_jax.flax import DPTrainer, fit_model
    explicit = jax.make_mesh((4,), ("users",))
    assert explicit.axis_types == (jax.sharding.AxisType.Explicit,), explicit.axis_types
    auto = jax.sharding.Mesh(np.array(jax.devices()), ("users",))
    cfg = {"epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.5,
           "num_steps": 3, "batch_size": 20, "n_users": n}
    def dist(a, b):   # on the host: the two runs' arrays live on different meshes
      return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in
                 zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    def fit(**kw):
      return dp.fit("dp_sgd_user", cfg, loss, params, data, jax.random.key(0), **kw)
    ref = fit(mesh=auto)
    out = {"fit_mesh": dist(fit(mesh=explicit).params, ref.params)}
    with jax.set_mesh(explicit):
      r = fit()
      out["fit_ctx"] = dist(r.params, ref.params)
      out["usable_in_ctx"] = float(jnp.sum(r.params["w"] * 2.0))   # params enter the context
    class Lin(nnx.Module):
      def __init__(self):
        self.w = nnx.Param(jnp.zeros(5))
      def __call__(self, x):
        return x @ self.w.value
    def mloss(model, ex):
      z = model(ex["x"])
      return jax.nn.softplus(z) - ex["y"] * z
    def model_fit(**kw):
      model = Lin()
      fit_model("dp_sgd_user", cfg, model, mloss, data, jax.random.key(0), **kw)
      return model.w.value
    mref = model_fit(mesh=auto)
    with jax.set_mesh(explicit):
      out["model_ctx"] = dist(model_fit(), mref)
    out["model_mesh"] = dist(model_fit(mesh=explicit), mref)
    def ce(model, ex):
      return optax.sigmoid_binary_cross_entropy(model(ex["x"]), ex["y"])
    def train(**kw):
      tr = DPTrainer(Lin(), ce, optax.sgd(0.5), data=data, clip_norm=1.0, sampling_rate=0.2,
                     delta=1e-5, expected_batch_size=20.0, noise_multiplier=1.0, key=7,
                     accountant="rdp", method="vmap", **kw)
      tr.train(2, report_every=2)
      return tr.params["w"].value
    tref = train(mesh=auto)
    out["trainer_mesh"] = dist(train(mesh=explicit), tref)
    with jax.set_mesh(explicit):
      out["trainer_ctx"] = dist(train(), tref)
    out["moved"] = scale(ref)
    print(json.dumps(out))
""")


def test_auto_axes_twin_in_process():
  """The auto-typed twin has the mesh's devices, names and shape; an auto mesh is itself."""
  explicit = jax.make_mesh((1,), ("users",))
  twin = auto_axes(explicit)
  assert explicit.axis_types == (AxisType.Explicit,)
  assert twin.axis_types == (AxisType.Auto,) and twin.axis_names == ("users",)
  assert list(twin.devices.flat) == list(explicit.devices.flat)
  assert auto_axes(twin) is twin and auto_axes(None) is None


def test_explicit_mesh_runs_like_the_auto_mesh_on_four_devices():
  out = on_four_devices(SCRIPT)
  tol = 1e-6
  for name in ("fit_mesh", "fit_ctx", "model_mesh", "model_ctx", "trainer_mesh",
               "trainer_ctx"):
    assert out[name] <= tol, (name, out)
  assert out["moved"] > 100 * tol   # the runs moved the params: the comparisons have power
