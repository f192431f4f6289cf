#!/usr/bin/env bash
# One prepared device check (issue 26 part 3): bench_gpu at full sizes with the jax_privacy
# rows, then the test suite at the GPU's default precision. Run from the repo root on the
# device machine with the wheels of .whl carried (dp-accounting, dm-tree, jax-privacy, pydantic).
# Each stage has its own time limit so a slow stage cannot eat the next one's time. pytest is
# stopped with SIGINT, not killed, so it still prints the failures' tracebacks and summary (the
# first H200 run, cut by SIGTERM at 94%, left 9 failures without a traceback).
set -u
. "$(dirname "$0")/setup.sh"   # wheels, path, $OUT/gpu.txt, TAG
# ONLY: workload names to bench (default all five); the card's name tags the logs.
timeout ${BENCH_S:-270} python3 experiments/bench_gpu.py --budget ${BUDGET:-20} --reps 5 \
  ${ONLY:+--only $ONLY} 2>&1 | tee "$OUT/bench_gpu_$TAG.log"
echo "bench rc=${PIPESTATUS[0]}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout -s INT -k 20 ${TEST_S:-230} python3 -m pytest -n ${WORKERS:-12} -p no:cacheprovider \
  --dist loadgroup --timeout 200 -v --tb=short -rfE --durations=25 tests 2>&1 \
  | tee "$OUT/pytest_$TAG.log" | grep -v PASSED | tail -80
echo "pytest rc=${PIPESTATUS[0]}"
