import os

from multidevice_users import accelerator_installed

# Tests run on CPU; keep XLA from grabbing every core of the 2-core CI box per process.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

# Unoptimised code generation for every test process on a CPU-only install (CI's box), set
# in the environment so that the subprocesses (CLI, benchmark smokes) inherit it; a module
# whose time is running Monte-Carlo programs rather than compiling them opts back in
# (``optimized_codegen`` below). Measured with a per-test CPU account (2026-11-27, this box,
# the whole suite): XLA's backend compile was 1794 s of the 2334 s of CPU the test processes
# spent in-process (77%); ``jax_disable_most_optimizations`` (backend optimisation level 0,
# no expensive LLVM passes) halves a compile-bound file's backend compile
# (tests/test_srgd.py: 35.8 -> 18.5 s). Only code generation changes: the HLO passes (fusion,
# buffer assignment, SPMD partitioning) still run, so the programs, their cost and memory
# analyses and the numbers the tests compare are those of the same HLO, and both sides of
# every comparison compile in one process under the same options. Not with a GPU/TPU jaxlib
# installed (there it would unoptimise the device's code too), and a value the caller set is
# kept.
if not accelerator_installed():
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# One JAX persistent compilation cache for the whole run, shared by the xdist workers and every
# process they start (CLI, benchmark smokes, the 4-device process): a program compiled once is
# loaded, not compiled again, by the other worker, a subprocess, or this worker after a
# fresh closure of the same HLO missed jit's in-memory cache (XLA's backend compile is most
# of the suite's CPU: see above). The cache key is the HLO with its compile options (the
# optimisation level of ``optimized_codegen`` included), the devices and the XLA flags, so a
# loaded executable is the one the same compile would give; programs with host callbacks are
# never cached. A new empty directory per run (made by the controller, inherited by the
# workers through the environment, removed at the end), so nothing crosses runs; a
# directory the caller set is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
  import tempfile
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE = tempfile.mkdtemp(prefix="dpsco-jax-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

  def pytest_unconfigure(config):
    import shutil
    shutil.rmtree(_RUN_CACHE, ignore_errors=True)


def _legacy_emitters_when_unoptimised() -> None:
  """On jaxlib < 0.11 (CPU only), unoptimised code generation also means XLA:CPU's legacy
  fusion emitters (``xla_cpu_use_fusion_emitters=false``, added to each compile's options
  while ``jax_disable_most_optimizations`` is on), so ``optimized_codegen``'s modules still
  compile what users run. The backend compile of a compile-bound file drops again by about a
  third (tests/test_srgd.py + test_bilevel.py: 46 -> 31 s of CPU, 2026-12-02). The 4-device
  subprocesses get the same through ``multidevice_users.FAST_COMPILE``; jaxlib 0.11 dropped
  the flag (and aborts on it)."""
  from multidevice_users import _jaxlib_before
  if accelerator_installed() or not _jaxlib_before(0, 11):
    return
  import jax
  from jax._src import compiler
  compile_options = compiler.get_compile_options

  def get_compile_options(*args, **kwargs):
    options = compile_options(*args, **kwargs)
    if jax.config.read("jax_disable_most_optimizations"):
      options.env_option_overrides = [*options.env_option_overrides,
                                      ("xla_cpu_use_fusion_emitters", False)]
    return options
  compiler.get_compile_options = get_compile_options


_legacy_emitters_when_unoptimised()

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True)
settings.load_profile("ci")


import pytest  # noqa: E402


@pytest.fixture
def dpsco(capfd):
  """``dpsco ARGS...`` (``python -m dpsco_jax``) run in this process through the command
  line's own entry (``dpsco_jax.__main__.main``, argument parsing included): a
  ``subprocess.CompletedProcess`` with its exit code and what it wrote to stdout / stderr
  (file descriptors captured, so native code's output counts too; a warning it raises is
  written to its stderr as a fresh process shows it: categories Python hides by default
  excepted). For tests of what the command does, not of the process boundary: a new process
  costs an import of jax and dpsco_jax and compiles from scratch (2.5-10 s of CPU each);
  ``python -m dpsco_jax`` itself is run by test_runner_user_code's
  test_the_cli_process_exits_2_on_an_import_error and test_algorithm_interface."""
  import subprocess
  import sys
  import warnings

  from dpsco_jax.__main__ import main
  hidden = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)

  def run(*args: str) -> subprocess.CompletedProcess:
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("default")
      try:
        code = main([str(a) for a in args])
      except SystemExit as stop:   # argparse's usage errors
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    for w in caught:
      if not issubclass(w.category, hidden):
        sys.stderr.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["dpsco", *args], code, out, err)
  return run


@pytest.fixture(scope="module")
def optimized_codegen():
  """XLA's full optimisation, as a user's programs get, instead of the suite's unoptimised
  code generation (see the top of this file), for a module (``pytestmark =
  pytest.mark.usefixtures("optimized_codegen")``) that either checks rounding soundness on
  adversarial inputs (tests/test_numerics_adversarial.py, test_audit_numerics.py: the
  optimised backend may contract a multiply-add the unoptimised one rounds twice, and the
  guarantee is for the code users run) or spends its time running Monte-Carlo programs
  rather than compiling them (tests/test_claims_fresh_seeds.py: 99 s of CPU optimised, 155 s
  unoptimised; the driver audits, whose CLI subprocess inherits the setting through the
  environment). The jit caches are cleared on the way in and out, so no executable crosses
  the boundary."""
  import jax
  before = jax.config.read("jax_disable_most_optimizations")
  env_before = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS")
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"   # the module's subprocesses too
  jax.clear_caches()
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", before)
  jax.clear_caches()
  if env_before is None:
    os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
  else:
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = env_before


# Which worker runs what under ``make test`` (``-n 2 --dist loadgroup``). With pytest >= 9
# xdist's loadgroup no longer groups anything: it tags a grouped test by rewriting
# ``item._nodeid``, which pytest 9 no longer reads (``nodeid`` comes from ``item._id``), so
# every test was scheduled alone, the ``xdist_group`` marks included. The scheduler below
# groups instead by file: a file's tests share one worker (scopes as in --dist loadfile), and
# a test marked ``xdist_group(name)`` shares the worker of the others with that mark (listed
# in _GROUPED: the controller sees node ids only, not marks; the collection hook below checks
# that the list and the marks agree). Sending a file's tests to both workers one by one made
# each worker pay again for what they share: module-scoped fixtures (a 4-device subprocess
# sweep, the ReSQue neighbour runs, the FILTER runs) and the compilation of every program the
# file's tests have in common (one driver at the same shapes across parametrized cases). The
# ~90 files balance well over two workers (xdist hands out the scopes with most tests first).
_GROUPED = {
    "tests/test_bench_cost.py::test_bench_cost_quick_prints_json_table": "bench_steps",
    "tests/test_bench_smoke.py::test_bench_gpu_quick_prints_json_summary": "bench_steps",
}

# Files whose tests run scripts on 4 forced CPU devices (multidevice_users.on_four_devices):
# one scope, so one worker runs them all and they share its one 4-device process (issue 47.6:
# each of these tests used to start its own Python, import jax and dpsco_jax and compile from
# scratch). The collection hook checks that every collected file calling on_four_devices is
# listed.
FOUR_DEVICE_FILES = (
    "tests/test_flax_trainer_mesh.py", "tests/test_grads.py", "tests/test_mesh.py",
    "tests/test_mesh_alg1.py", "tests/test_mesh_bilevel.py", "tests/test_mesh_explicit_axes.py",
    "tests/test_mesh_filter.py", "tests/test_mesh_harness.py", "tests/test_mesh_host.py",
    "tests/test_mesh_output_perturbation.py", "tests/test_mesh_resque.py",
    "tests/test_mesh_sampling.py", "tests/test_runner_mesh.py")


def pytest_runtest_teardown(item, nextitem):
  """Stops the shared 4-device process after the last 4-device test of a run of them: it
  holds their compiled programs (1.5 GB after a few files) while the worker goes on."""
  def four(it):
    return it is not None and it.nodeid.split("::", 1)[0] in FOUR_DEVICE_FILES
  if four(item) and not four(nextitem):
    from multidevice_users import FourDevices
    FourDevices.close_shared()


def scope_of(nodeid: str) -> str:
  """The scope (what one worker runs together) of a test under ``make test``: its
  xdist_group, the 4-device group, or its file."""
  if nodeid.rfind("@") > nodeid.rfind("]"):   # a pytest / xdist where the tag works
    return nodeid.split("@")[-1]
  path = nodeid.split("::", 1)[0]
  return _GROUPED.get(nodeid, "four_devices" if path in FOUR_DEVICE_FILES else path)


def pytest_xdist_make_scheduler(config, log):
  if config.getvalue("dist") != "loadgroup":
    return None
  from xdist.scheduler import LoadScopeScheduling

  class FileGroupScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      return scope_of(nodeid)

    def _assign_work_unit(self, node) -> None:
      if not getattr(self, "_ordered", False):   # once, before the first unit goes out
        self._ordered = True
        costs = _scope_costs(self.workqueue)
        for scope in sorted(self.workqueue, key=lambda s: -costs[s]):
          self.workqueue.move_to_end(scope)
      super()._assign_work_unit(node)

  return FileGroupScheduling(config, log)


# Longest scope first (LPT): xdist hands out the scopes with the most *tests* first, which sent
# the slowest files last, since they are the ones with few tests (the 4-device subprocesses,
# the benchmark smokes, the fresh-seed claims: 1-5 tests of 15-90 s each), so one worker was
# still in a 30-90 s file while the other had nothing left. Seconds of each file's tests under
# ``make test`` on the 2-core CPU box (rounded; from --durations and per-file runs); a test in
# _TEST_SECONDS counts its own, a file not listed _SECONDS_PER_TEST per test. A worker takes
# its next scope when it has 2 tests left (at once for a 1-2 test file), so with the slow small
# files last each worker held one or two of them when the queue ran dry. Only the order depends
# on these numbers, so they need only be roughly right; the tail is now the quick small files.
_FILE_SECONDS = {
    "tests/test_claims_fresh_seeds.py": 64,
    "tests/test_flax_fast_clip_chunks.py": 30,
    "tests/test_flax_fast_clip_vmap.py": 17,   # 5 tests, two chunked-sum cases of 5 + 4 s
    "tests/test_plan_invariance.py": 21,
    "tests/test_runner_user_code.py": 38,
    "tests/test_bench_smoke.py": 19,   # without bench_gpu --quick (_TEST_SECONDS)
    "tests/test_mesh_output_perturbation.py": 37,
    "tests/test_bench_cost.py": 5,     # without bench_cost --quick (_TEST_SECONDS)
    "tests/test_bench_scale.py": 28,
    "tests/test_runner_mesh.py": 23,
    "tests/test_flax_trainer_mesh.py": 23,
    "tests/test_distributed.py": 20,
    "tests/test_mesh.py": 20,
    "tests/test_mesh_resque.py": 18,
    "tests/test_mesh_filter.py": 13,
    "tests/test_mesh_sampling.py": 12,
    "tests/test_mesh_alg1.py": 11,
    "tests/test_mesh_bilevel.py": 10,
    "tests/test_mesh_host.py": 8,
    "tests/test_mesh_harness.py": 8,
    "tests/test_grads.py": 30,
    "tests/test_flax_user_data.py": 15,
    "tests/test_host_placement.py": 10,
    "tests/test_flax_fast_clip_cost.py": 9,
    "tests/test_readme.py": 7,
    "tests/test_audit_numerics.py": 7,
    "tests/test_noise.py": 5,
    "tests/test_package_graph.py": 5,
    "tests/test_result_fallback.py": 5,
    "tests/test_problem_defaults.py": 4,
    "tests/test_algorithm_interface.py": 10,
    "tests/test_audit_declared_constants.py": 7,
    "tests/test_audit_declared_facts.py": 7,
    "tests/test_srgd_mf.py": 8,
    "tests/test_filter_bands.py": 30,
    "tests/test_study_000_host_sgd.py": 20,
    "tests/test_study_quick.py": 80,     # every configs/study config through --quick
    "tests/test_study_scripts.py": 34,   # study_002_devices --quick (the analysis scripts run
    # in-process)
}
_TEST_SECONDS = {   # the two tests of the bench_steps group
    "tests/test_bench_cost.py::test_bench_cost_quick_prints_json_table": 30,
    "tests/test_bench_smoke.py::test_bench_gpu_quick_prints_json_summary": 14,
}
_SECONDS_PER_TEST = 0.8


def _scope_costs(workqueue) -> dict:
  """Estimated seconds of each scope of ``workqueue``: its tests' shares of _FILE_SECONDS."""
  per_file: dict = {}
  for nodeids in workqueue.values():
    for nodeid in nodeids:
      if nodeid not in _TEST_SECONDS:
        f = nodeid.split("::", 1)[0]
        per_file[f] = per_file.get(f, 0) + 1
  def test_cost(nodeid):
    if nodeid in _TEST_SECONDS:
      return _TEST_SECONDS[nodeid]
    f = nodeid.split("::", 1)[0]
    return _FILE_SECONDS[f] / per_file[f] if f in _FILE_SECONDS else _SECONDS_PER_TEST
  return {scope: sum(test_cost(n) for n in nodeids) for scope, nodeids in workqueue.items()}


def pytest_collection_modifyitems(config, items):
  marked = {}
  for item in items:
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
      marked[item.nodeid.split("@")[0]] = mark.args[0] if mark.args else mark.kwargs["name"]
  listed = {k: v for k, v in _GROUPED.items() if k in {i.nodeid.split("@")[0] for i in items}}
  assert marked == listed, ("conftest._GROUPED and the xdist_group marks disagree", marked,
                            listed)
  unlisted = {item.nodeid.split("::", 1)[0] for item in items
              if hasattr(getattr(item, "module", None), "on_four_devices")} - set(
                  FOUR_DEVICE_FILES)
  assert not unlisted, ("conftest.FOUR_DEVICE_FILES lacks files that run 4-device scripts",
                        sorted(unlisted))
