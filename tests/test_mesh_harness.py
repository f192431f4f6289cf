"""The 4-device harness (tests/multidevice_users.py, issue 47.6): the 4-device tests' scripts
share one long-lived 4-device process per test process instead of one process each, a script
leaves nothing behind for the next, a failure is reported with its traceback, a process that
dies under a script is replaced (the script reruns alone), and a test with another environment
gets a process of that environment. Tiny scripts: no program is compiled."""

import subprocess
import textwrap

import pytest
from multidevice_users import FourDevices, on_four_devices

import conftest

# Which process a script ran in (no jax import: a new process costs only Python's start).
PID = textwrap.dedent("""
    import json, os, sys
    print("noise before the reply")
    print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:],
                      "codegen": os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS")}))
""")


def test_scripts_share_one_four_device_process():
  devices = "import json, jax\nprint(json.dumps(len(jax.devices())))\n"
  assert on_four_devices(devices) == 4
  first = on_four_devices(PID, "a", "b")
  second = on_four_devices(PID)
  assert first["argv"] == ["a", "b"] and second["argv"] == []
  assert first["pid"] == second["pid"] == FourDevices._shared.proc.pid


def test_a_script_leaves_nothing_behind_for_the_next(tmp_path):
  (tmp_path / "leftover_mod.py").write_text("X = 1\n")
  setter = textwrap.dedent("""
      import json, os, sys, warnings
      import jax
      sys.path.insert(0, sys.argv[1])
      import leftover_mod
      os.environ["LEFTOVER"] = "1"
      os.environ.pop("JAX_PLATFORMS")
      jax.config.update("jax_enable_x64", True)
      warnings.simplefilter("error")
      value = 1
      print(json.dumps({"x64": jax.numpy.zeros(()).dtype.name}))
  """)
  reader = textwrap.dedent("""
      import json, os, sys, warnings
      import jax
      print(json.dumps({"pid": os.getpid(), "path": sys.argv[1] in sys.path,
                        "module": "leftover_mod" in sys.modules,
                        "env": [os.environ.get("LEFTOVER"), os.environ.get("JAX_PLATFORMS")],
                        "x64": jax.numpy.zeros(()).dtype.name,
                        "error_filter": warnings.filters[0][0] == "error",
                        "namespace": "value" in globals()}))
  """)
  assert on_four_devices(setter, str(tmp_path)) == {"x64": "float64"}
  got = on_four_devices(reader, str(tmp_path))
  assert got.pop("pid") == FourDevices._shared.proc.pid
  assert got == {"path": False, "module": False, "env": [None, "cpu"], "x64": "float32",
                 "error_filter": False, "namespace": False}


def test_a_failing_script_reports_its_traceback_and_the_process_goes_on():
  pid = on_four_devices(PID)["pid"]
  with pytest.raises(AssertionError) as err:
    on_four_devices("import sys\nprint('x', file=sys.stderr)\nraise ValueError('boom 47')\n")
  assert "ValueError: boom 47" in str(err.value)
  assert "raise ValueError('boom 47')" in str(err.value)   # the script's line, in its traceback
  assert on_four_devices(PID)["pid"] == pid


def test_a_process_that_dies_under_a_script_is_replaced_and_the_script_reruns_alone():
  old = on_four_devices(PID)["pid"]
  crash = textwrap.dedent("""
      import json, os, sys
      if "multidevice_users" in sys.modules:   # in the shared process: die as XLA might
        os._exit(3)
      print(json.dumps({"pid": os.getpid()}))
  """)
  alone = on_four_devices(crash)["pid"]
  new = on_four_devices(PID)["pid"]
  assert len({old, alone, new}) == 3 and new == FourDevices._shared.proc.pid


def test_a_script_that_runs_too_long_is_stopped_and_the_next_gets_a_new_process():
  old = on_four_devices(PID)["pid"]
  with pytest.raises(subprocess.TimeoutExpired):
    on_four_devices("import time\ntime.sleep(30)\n", timeout=1)
  assert on_four_devices(PID)["pid"] != old


def test_another_environment_gets_a_process_of_its_own(monkeypatch):
  before = on_four_devices(PID)
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")   # as optimized_codegen does
  got = on_four_devices(PID)
  assert got["codegen"] == "0" and got["pid"] != before["pid"]


def test_the_four_device_files_share_one_worker_under_make_test():
  """conftest's scheduler sends every file that calls on_four_devices to one worker (one
  shared process for all of them); a file that calls it must be listed (the collection hook
  checks the files it collects)."""
  import pathlib
  here = pathlib.Path(__file__).parent
  users = {f"tests/{p.name}" for p in here.glob("test_*.py")
           if "on_four_devices(" in p.read_text()}
  assert users <= set(conftest.FOUR_DEVICE_FILES), users - set(conftest.FOUR_DEVICE_FILES)
  scopes = {conftest.scope_of(f + "::test_x") for f in users}
  assert scopes == {"four_devices"}
  assert conftest.scope_of("tests/test_api.py::test_x") == "tests/test_api.py"
  assert conftest.scope_of("tests/test_bench_cost.py::test_bench_cost_quick_prints_json_table"
                           ) == "bench_steps"


def test_the_shared_process_stops_after_the_last_four_device_test(monkeypatch):
  """conftest's teardown hook: not between two 4-device tests, but before a test of another
  file (or at the end), so its memory does not stay with the worker for the rest of the run."""
  closed = []

  class Fake:
    def close(self):
      closed.append(True)
      FourDevices._shared = None

  class Item:
    def __init__(self, nodeid):
      self.nodeid = nodeid
  monkeypatch.setattr(FourDevices, "_shared", Fake())
  conftest.pytest_runtest_teardown(Item("tests/test_mesh.py::a"), Item("tests/test_grads.py::b"))
  assert closed == []
  conftest.pytest_runtest_teardown(Item("tests/test_mesh.py::a"), Item("tests/test_api.py::b"))
  assert closed == [True] and FourDevices._shared is None
  monkeypatch.setattr(FourDevices, "_shared", Fake())
  conftest.pytest_runtest_teardown(Item("tests/test_mesh.py::a"), None)
  assert closed == [True, True]


def test_the_run_compiles_into_one_shared_cache_and_unoptimised_on_a_cpu_install():
  """conftest's speed-ups are on (issue 47.6): every program this worker compiles is written to
  the run's compilation cache, the directory its processes inherit; on a CPU-only jaxlib <
  0.11, compiles while ``jax_disable_most_optimizations`` is on add the legacy emitters' flag,
  and compiles under ``optimized_codegen`` (the flag off) do not."""
  import os
  import pathlib

  import jax
  import jax.numpy as jnp
  from jax._src import compiler
  from multidevice_users import _jaxlib_before, accelerator_installed

  path = pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
  assert jax.config.jax_compilation_cache_dir == str(path) and path.is_dir()
  before = set(path.iterdir())
  jax.jit(lambda x: jnp.cos(x) * 1.2345678)(jnp.arange(3.0)).block_until_ready()
  assert set(path.iterdir()) - before, "the program was not written to the run's cache"

  legacy = ("xla_cpu_use_fusion_emitters", False)
  def overrides():
    return compiler.get_compile_options(num_replicas=1, num_partitions=1).env_option_overrides
  if accelerator_installed() or not _jaxlib_before(0, 11):
    assert legacy not in overrides()
    return
  before = jax.config.read("jax_disable_most_optimizations")
  try:
    jax.config.update("jax_disable_most_optimizations", True)
    assert legacy in overrides()
    jax.config.update("jax_disable_most_optimizations", False)
    assert legacy not in overrides()
  finally:
    jax.config.update("jax_disable_most_optimizations", before)
