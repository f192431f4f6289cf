import os

# Tests run on CPU; keep XLA from grabbing every core of the 2-core CI box per process.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True)
settings.load_profile("ci")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def bench_steps_cache(tmp_path_factory):
  """Environment of a JAX persistent compilation cache shared, for this session only, by the
  two smoke runs that compile the same 25 steps (``bench_cost.py --quick`` and ``bench_gpu.py
  --quick``: bench_cost's steps *are* bench_gpu's, at the same sizes and XLA flags; a test
  checks it). ``make test`` runs both tests on one worker (``xdist_group("bench_steps")``,
  ``--dist loadgroup``), so the second loads the first's executables instead of compiling
  them (~25 s -> ~15 s for whichever runs second; bench_cost's cost and memory tables from
  loaded executables are identical). Under other schedulers the cache is merely shared by
  whichever runs later."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):   # the workers' base temps share one parent
    root = root.parent
  path = root / "jax-cache-bench-steps"
  path.mkdir(exist_ok=True)
  return {"JAX_COMPILATION_CACHE_DIR": str(path),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


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


def pytest_xdist_make_scheduler(config, log):
  if config.getvalue("dist") != "loadgroup":
    return None
  from xdist.scheduler import LoadScopeScheduling

  class FileGroupScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      if nodeid.rfind("@") > nodeid.rfind("]"):   # a pytest / xdist where the tag works
        return nodeid.split("@")[-1]
      return _GROUPED.get(nodeid, nodeid.split("::", 1)[0])

  return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
  marked = {}
  for item in items:
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
      marked[item.nodeid.split("@")[0]] = mark.args[0] if mark.args else mark.kwargs["name"]
  listed = {k: v for k, v in _GROUPED.items() if k in {i.nodeid.split("@")[0] for i in items}}
  assert marked == listed, ("conftest._GROUPED and the xdist_group marks disagree", marked,
                            listed)
