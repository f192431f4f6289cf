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
