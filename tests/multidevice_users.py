"""The small user-level logistic problem that the multi-device (tests/test_mesh.py) and
multi-process (tests/test_distributed.py) tests run in subprocesses, as source text, so that a
``python -c`` script can include it: 103 users (divisible by neither 2 nor 4, so shards are
unequal and device batches padded) of up to 8 items of 5 features. Defines ``np``, ``jax``,
``jnp``, ``UserData``, ``n``, ``data``, ``loss`` and ``params``, and the comparisons the
scripts report: ``param_dist(a, b)`` (largest absolute difference of two Results' params) and
``scale(r)`` (largest absolute entry of a Result's params)."""

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import textwrap

_HERE = os.path.dirname(os.path.abspath(__file__))

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


def four_device_env() -> dict:
  """The environment of a 4-device process: this one's, with 4 forced CPU devices and
  :data:`FAST_COMPILE` (the device count is fixed when JAX starts)."""
  return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 " + FAST_COMPILE,
              JAX_PLATFORMS="cpu")


def on_four_devices(script: str, *args: str, timeout: int = 600, fresh: bool = False) -> dict:
  """Runs ``script`` (as ``python -c``, with ``args`` in ``sys.argv[1:]``) on 4 forced CPU
  devices and returns its last stdout line, parsed as JSON; a failing script fails the test
  with the tail of its stderr (its traceback).

  The scripts share one long-lived 4-device process per test process (:class:`FourDevices`):
  each 4-device test used to start its own Python, import jax and dpsco_jax (2.4 s of CPU
  with byte-code cached) and compile the library's common programs again (the 4-device
  files' CPU: 195 s with a process per script, 158 s shared: issue 47.6). Each script runs
  there in a fresh namespace, and what a script may set for the whole process
  (``sys.argv``, ``sys.path`` and the modules imported from a folder it added,
  ``os.environ``, warning filters, ``jax.config``) is put back after it. ``fresh=True`` runs
  it in a process of its own instead, for a script that must set something before the
  backend starts (an XLA flag). If the shared process dies under a script (a crash in XLA),
  the script is run again alone, so a crash is reported with its own stderr, and the next
  script starts a new shared process."""
  env = four_device_env()
  if not fresh:
    reply = FourDevices.shared(env).run(script, args, timeout)
    if reply is not None:
      assert reply["ok"], reply["stderr"][-3000:]
      return json.loads(reply["stdout"].strip().splitlines()[-1])
  proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                        text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


# Variables that differ between tests without changing what a script computes.
_VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)


class FourDevices:
  """A 4-device Python process (:func:`serve`) that runs scripts sent to it one at a time:
  one JSON line per request (``{"script", "args"}``) on its stdin, one per reply
  (``{"ok", "stdout", "stderr"}``) on its stdout. :meth:`shared` keeps one per test process,
  started with the environment of the first request; a request with another environment (a
  module that sets ``JAX_DISABLE_MOST_OPTIMIZATIONS``, say) starts a new one, so a script
  sees the environment it would have had in a process of its own."""

  _shared: "FourDevices | None" = None

  def __init__(self, env: dict):
    self.env = env
    self._log = tempfile.TemporaryFile()   # the process's own stderr (a pipe could fill)
    self.proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {_HERE!r}); "
         "import multidevice_users; multidevice_users.serve()"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)

  @classmethod
  def shared(cls, env: dict) -> "FourDevices":
    same = {k: v for k, v in env.items() if k not in _VOLATILE_ENV}
    worker = cls._shared
    if worker is None or worker.proc.poll() is not None or same != {
        k: v for k, v in worker.env.items() if k not in _VOLATILE_ENV}:
      if worker is not None:
        worker.close()
      worker = cls._shared = cls(env)
    return worker

  def run(self, script: str, args, timeout: float) -> "dict | None":
    """The reply to ``script``, or None if the process died before replying."""
    try:
      self.proc.stdin.write(json.dumps({"script": script, "args": list(args)}) + "\n")
      self.proc.stdin.flush()
    except BrokenPipeError:
      return None
    ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
    if not ready:   # as subprocess.run(timeout=) did: the script's process is killed
      self.close()
      raise subprocess.TimeoutExpired("the shared 4-device process", timeout)
    line = self.proc.stdout.readline()
    if not line:
      self.close()
      return None
    return json.loads(line)

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()
    self._log.close()
    if FourDevices._shared is self:
      FourDevices._shared = None


  @classmethod
  def close_shared(cls) -> None:
    """Stops the shared process, if any (the next script starts a new one)."""
    if cls._shared is not None:
      cls._shared.close()


atexit.register(FourDevices.close_shared)


def serve() -> None:
  """The loop of a :class:`FourDevices` process. Replies go to the process's original stdout;
  fd 1 is pointed at stderr, so nothing a library writes there can corrupt a reply."""
  import jax   # noqa: F401  (imported once for every script)
  replies = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  for n, line in enumerate(sys.stdin):
    request = json.loads(line)
    replies.write(json.dumps(_run_script(request["script"], request["args"], n)) + "\n")
    replies.flush()


def _run_script(script: str, args: list, n: int) -> dict:
  """Runs one script as ``python -c`` would (``__name__ == "__main__"``, ``sys.argv``), in a
  fresh namespace, capturing its output; then puts back what it may have set for the whole
  process."""
  import contextlib
  import io
  import linecache
  import traceback
  import warnings

  import jax
  name = f"<4-device script {n}>"
  linecache.cache[name] = (len(script), None, script.splitlines(True), name)  # tracebacks
  out, err = io.StringIO(), io.StringIO()
  argv, path, environ = sys.argv, list(sys.path), dict(os.environ)
  modules, config = set(sys.modules), dict(jax.config.values)
  ok = True
  try:
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), \
        contextlib.redirect_stderr(err):
      sys.argv = ["-c", *args]
      exec(compile(script, name, "exec"), {"__name__": "__main__"})
  except SystemExit as stop:
    ok = stop.code in (None, 0)
  except BaseException:
    ok = False
    err.write(traceback.format_exc())
  finally:
    added = [p for p in sys.path if p not in path]
    sys.argv, sys.path[:] = argv, path
    _restore_environ(environ)
    for mod in set(sys.modules) - modules:   # a module of a folder the script put on the path
      origin = getattr(sys.modules[mod], "__file__", None) or ""
      if any(p and origin.startswith(p) for p in added):
        del sys.modules[mod]
    for key, value in config.items():
      if jax.config.values.get(key) != value:
        jax.config.update(key, value)
  return {"ok": ok, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _restore_environ(before: dict) -> None:
  for key in set(os.environ) - set(before):
    del os.environ[key]
  for key, value in before.items():
    if os.environ.get(key) != value:
      os.environ[key] = value
