"""The small user-level logistic problem that the multi-device (tests/test_mesh.py) and
multi-process (tests/test_distributed.py) tests run in subprocesses, as source text, so that a
``python -c`` script can include it: 103 users (divisible by neither 2 nor 4, so shards are
unequal and device batches padded) of up to 8 items of 5 features. Defines ``np``, ``jax``,
``jnp``, ``UserData``, ``n``, ``data``, ``loss`` and ``params``, and the comparisons the
scripts report: ``param_dist(a, b)`` (largest absolute difference of two Results' params) and
``scale(r)`` (largest absolute entry of a Result's params)."""

import os
import textwrap

USERS = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp
    from dpsco_jax.data import UserData
    rng = np.random.default_rng(0)
    n = 103
    ids = rng.integers(0, n, 600); ids[:n] = np.arange(n)
    x = rng.normal(size=(600, 5)).astype(np.float32)
    y = (rng.random(600) < 0.5).astype(np.float32)
    data = UserData.from_arrays({"x": x, "y": y}, ids, max_items_per_user=8)
    def loss(p, ex):
      z = ex["x"] @ p["w"] + p["b"]
      return jax.nn.softplus(z) - ex["y"] * z
    params = {"w": jnp.zeros(5), "b": jnp.zeros(())}
    def param_dist(a, b):
      return max(float(jnp.max(jnp.abs(u - v))) for u, v in
                 zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))
    def scale(r):
      return max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(r.params))
""")


#: XLA:CPU flags of the 4-device subprocesses besides the device count: no backend (LLVM)
#: optimisation and no fusion emitters compile these small programs ~3x faster (46 s -> 14 s
#: for tests/test_mesh_filter.py's script), and one thread per device. Both sides of every
#: comparison (the one-device run and the 4-device run) compile in the same process with the
#: same flags; the HLO passes (SPMD partitioning included) still run, only code generation is
#: unoptimised. XLA aborts on a flag it does not know, and jaxlib 0.11 dropped the fusion
#: emitters switch (its emitters are the only path there; the H100 run of jax 0.11.2 stopped
#: every subprocess on it), so that flag is passed to older jaxlibs only.
def _jaxlib_before(major: int, minor: int) -> bool:
  from importlib.metadata import version
  got = tuple(int(x) for x in version("jaxlib").split(".")[:2])
  return got < (major, minor)


def accelerator_installed() -> bool:
  """Whether a GPU or TPU jaxlib plugin is installed (read from the installed distributions,
  without importing JAX, so conftest can choose XLA flags before any backend starts), unless
  ``JAX_PLATFORMS`` pins the CPU."""
  from importlib.metadata import distributions
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return False
  names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in distributions()}
  return any(n.startswith(("jax-cuda", "jax-rocm", "libtpu")) for n in names)


FAST_COMPILE = " ".join(["--xla_backend_optimization_level=0"]
                        + (["--xla_cpu_use_fusion_emitters=false"]
                           if _jaxlib_before(0, 11) else [])
                        + ["--xla_cpu_multi_thread_eigen=false"])


def on_four_devices(script: str, *args: str, timeout: int = 600) -> dict:
  """Runs ``script`` (``python -c``, with ``args``) in a subprocess with 4 forced CPU devices
  (the device count is fixed when JAX starts; XLA flags: :data:`FAST_COMPILE`) and returns
  its last stdout line, parsed as JSON; a failing script fails the test with the tail of its
  stderr."""
  import json
  import os
  import subprocess
  import sys
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 " + FAST_COMPILE,
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                        text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])
