"""Issue 24.2 for paper 004: the private bilevel methods (``dp_bilevel`` and its minibatch and
population variants) shard their examples over a ``"users"`` axis of 4 forced host devices
(a subprocess: the device count is fixed when JAX starts). 103 examples (one padded row,
masked out of every clipped sum): the outer hypergradient mechanism and both inner DP-Loc-(S)GD
solves run on the mesh, and the whole trajectory (x_0..x_{T-1} and the private inner
solutions), the privacy report and the record equal the one-device run's to float tolerance;
another key moves the trajectory (the equality is not vacuous). Full batch and Poisson
minibatches (the sampled sets are the one-device run's). The runner's ``devices:`` key now
accepts them and refuses the non-private reference with its reason."""

import textwrap

from multidevice_users import on_four_devices

from dpsco_jax.api import MESH_READY, MESH_UNSUPPORTED

SCRIPT = textwrap.dedent("""
    import copy, json, warnings
    warnings.filterwarnings("ignore")
    import jax, jax.numpy as jnp, numpy as np
    from dpsco_jax.algorithms.bilevel import driver as bd
    from dpsco_jax.api import solve
    from dpsco_jax.problems import bilevel as bl
    assert len(jax.devices()) == 4, jax.devices()
    rng = np.random.default_rng(3)
    n = 103
    data = {"z": jnp.asarray(rng.normal(size=(n, 2)), jnp.float32),
            "w": jnp.asarray(rng.uniform(0.5, 1.5, size=(n, 2)), jnp.float32)}
    consts = bl.ProblemConstants(l0f=1.0, l1f=1.0, l0g=1.0, l1g=1.0, l2g=1.0, mu_g=1.0)
    # per-example x-gradients depend on the example: the outer Gaussian mechanism runs too
    prob = bl.BilevelProblem(
        name="sens", f_ex=lambda x, y, ex: 0.5 * jnp.sum(jnp.square(x + y - ex["z"])),
        g_ex=lambda x, y, ex: 0.5 * jnp.sum(jnp.square(y - ex["w"] * x)), data=data,
        x0=jnp.zeros(2), y0=jnp.zeros(2), consts=consts, x_radius=3.0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("users",))
    shard = copy.copy(prob); shard.mesh = mesh
    traj = lambda o: np.concatenate([np.asarray(o.xs).ravel(), np.asarray(o.y_star),
                                     np.asarray(o.y_lam), np.asarray(o.step_norms)])
    out = {}
    for name, extra in (("full", {}),
                        ("minibatch", {"outer_batch_size": 20, "inner_batch_size": 20})):
      cfg = {"epsilon": 8.0, "delta": 1e-5, "lam": 10.0, "learning_rate": 0.5,
             "num_steps": 6, "inner_num_steps": 20, "inner_rounds": 2, **extra}
      one = solve("dp_bilevel", cfg, prob, jax.random.key(7))
      four = solve("dp_bilevel", cfg, shard, jax.random.key(7))
      bcfg, _ = bd.bilevel_config(prob, bd.config_view(cfg))
      # the executables dp_bilevel compiled (cached on the problem per config and mesh)
      a = bd._run_compiled(prob, bcfg, jax.random.key(7))
      b = bd._run_compiled(shard, bcfg, jax.random.key(7), mesh)
      c = bd._run_compiled(shard, bcfg, jax.random.key(8), mesh)
      rec = {k: v for k, v in one.record.items() if four.record[k] != v}
      out[name] = {"diff": float(np.max(np.abs(traj(a) - traj(b)))),
                   "other": float(np.max(np.abs(traj(a) - traj(c)))),
                   "scale": float(np.max(np.abs(traj(a)))),
                   "x_out": float(np.max(np.abs(np.asarray(one.params)
                                                - np.asarray(four.params)))),
                   "same_report": one.privacy == four.privacy,
                   "record_rel": max([abs(four.record[k] - v) / abs(v) for k, v in rec.items()
                                      if isinstance(v, float)] + [0.0]),
                   "record_other": sorted(k for k, v in rec.items()
                                          if not isinstance(v, float)),
                   "outer_noise": one.record["outer_noise_std"]}
    print(json.dumps(out))
""")


def test_private_bilevel_on_four_devices_equals_one_device():
  got = on_four_devices(SCRIPT)
  for name in ("full", "minibatch"):
    r = got[name]
    assert r["outer_noise"] > 0, r          # the outer mechanism is part of the comparison
    assert r["diff"] <= 1e-5 * max(1.0, r["scale"]), r
    assert r["other"] > 100 * max(r["diff"], 1e-6), r
    assert r["x_out"] <= 1e-5 * max(1.0, r["scale"]), r
    assert r["same_report"], r
    assert r["record_other"] == [] and r["record_rel"] <= 1e-5, r


def test_the_registry_marks_the_private_bilevel_methods_mesh_ready():
  assert {"dp_bilevel", "dp_bilevel_minibatch", "dp_bilevel_population"} <= MESH_READY
  assert "nonprivate_penalty" not in MESH_READY
  assert "exactly" in MESH_UNSUPPORTED["nonprivate_penalty"]
