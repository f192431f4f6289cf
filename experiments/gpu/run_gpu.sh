#!/usr/bin/env bash
# One prepared device check (issue 26 part 3): bench_gpu at full sizes with the jax_privacy
# rows, then the test suite at the GPU's default precision. Run from the repo root on the
# device machine with the wheels of .whl carried (dp-accounting, dm-tree, jax-privacy, pydantic).
# Each stage has its own time limit so a slow stage cannot eat the next one's time. pytest is
# stopped with SIGINT, not killed, so it still prints the failures' tracebacks and summary (the
# first H200 run, cut by SIGTERM at 94%, left 9 failures without a traceback).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax, jaxlib, flax, optax, chex, dp_accounting, jax_privacy; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'optax', optax.__version__, 'chex', chex.__version__, 'jax_privacy', jax_privacy.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
TAG=${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -dc 'A-Za-z0-9' | tr 'A-Z' 'a-z')}
# ONLY: workload names to bench (default all five); the card's name tags the logs.
timeout ${BENCH_S:-270} python3 experiments/bench_gpu.py --budget ${BUDGET:-20} --reps 5 \
  ${ONLY:+--only $ONLY} 2>&1 | tee "$OUT/bench_gpu_$TAG.log"
echo "bench rc=${PIPESTATUS[0]}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout -s INT -k 20 ${TEST_S:-230} python3 -m pytest -n ${WORKERS:-12} -p no:cacheprovider \
  --dist loadgroup --timeout 200 -v --tb=short -rfE --durations=25 tests 2>&1 \
  | tee "$OUT/pytest_$TAG.log" | grep -v PASSED | tail -80
echo "pytest rc=${PIPESTATUS[0]}"
