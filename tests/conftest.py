import os

# Tests run on CPU; keep XLA from grabbing every core of the 2-core CI box per process.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True)
settings.load_profile("ci")
