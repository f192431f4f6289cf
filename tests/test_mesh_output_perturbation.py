"""Issue 24.2 for paper 001: the six output-perturbation drivers shard their users over a
``"users"`` axis of 4 forced host devices (a subprocess: the device count is fixed when JAX
starts). 641 users (padded to 644: the padded users are in no kept set and are dropped before
Lemma C.1's certificate): every solve of a release (the full solve, the certificate, the
deletion sets) differentiates each device's own users, and the released params, the ⊥ flags
and the privacy report equal the one-device run's to float tolerance; another key moves the
params (the equality is not vacuous). The exact stability test (every deletion set of a tiny
dataset) on the padded data gives the one-device release too."""

import textwrap

from multidevice_users import on_four_devices

from dpsco_jax.api import MESH_READY

SIX = ("sc_output_pert", "phased_erm_output_pert", "phased_sco_output_pert",
       "sc_erm_output_pert", "sc_sco_output_pert", "naive_output_pert")

SCRIPT = textwrap.dedent("""
    import copy, json, warnings
    warnings.filterwarnings("ignore")
    import jax, jax.numpy as jnp, numpy as np
    from dpsco_jax.api import solve
    from dpsco_jax.problems import output_perturbation as op
    assert len(jax.devices()) == 4, jax.devices()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("users",))

    def on(p):
      shard = copy.copy(p); shard.mesh = mesh
      return shard

    def dist(a, b):
      return float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))))
    prob = op.l2_logistic({"n_users": 641, "m": 4, "d": 2, "l2": 0.5, "n_eval": 500},
                          jax.random.key(8))
    cfg = {"epsilon": 8.0, "delta": 0.05, "on_certificate_failure": "raise"}
    out = {}
    for name in %r:
      run = lambda p, c, k, name=name: solve(name, c, p, k)
      one = run(prob, cfg, jax.random.key(9))
      four = run(on(prob), cfg, jax.random.key(9))
      # another key (one driver: the check that the equality is not vacuous)
      other = run(on(prob), cfg, jax.random.key(10)) if name == "sc_output_pert" else four
      flags = lambda r: [r.record.get(k) for k in ("is_bottom", "bottoms", "bottom0")]
      out[name] = {"diff": dist(one.params, four.params), "other": dist(one.params, other.params),
                   "scale": float(jnp.max(jnp.abs(one.params))),
                   "same_report": one.privacy == four.privacy,
                   "same_flags": flags(one) == flags(four)}
    tiny = op.l2_logistic({"n_users": 7, "m": 3, "d": 2, "l2": 0.5, "n_eval": 10},
                          jax.random.key(1))
    exact = {"epsilon": 1.0, "delta": 1e-3, "stability_test": "exact", "Delta": 0.05,
             "max_exact_users": 8}
    run = lambda p, c, k: solve("sc_output_pert", c, p, k)
    one, four = run(tiny, exact, jax.random.key(2)), run(on(tiny), exact, jax.random.key(2))
    out["exact"] = {"diff": dist(one.params, four.params),
                    "scale": float(jnp.max(jnp.abs(one.params))),
                    "same_flags": one.record["is_bottom"] == four.record["is_bottom"]}
    print(json.dumps(out))
""" % (SIX,))


def test_output_perturbation_on_four_devices_equals_one_device():
  got = on_four_devices(SCRIPT)
  for name in SIX:
    r = got[name]
    assert r["same_flags"] and r["same_report"], (name, r)
    assert r["diff"] <= 1e-5 * max(1.0, r["scale"]), (name, r)
  r = got["sc_output_pert"]
  assert r["other"] > 100 * max(r["diff"], 1e-7), r
  assert got["exact"]["same_flags"], got["exact"]
  assert got["exact"]["diff"] <= 1e-5 * max(1.0, got["exact"]["scale"]), got["exact"]


def test_every_paper_001_driver_is_mesh_ready():
  assert set(SIX) <= MESH_READY
