#!/usr/bin/env bash
# The device checks still open after 2026-11-26, in priority order, for one call of the device
# tool (about 8 min of an H100; each step stops at its own deadline, and what finished is under
# $OUT). Run from the repository root with the wheels of dp-accounting, dm-tree, jax-privacy
# and pydantic under .whl/ (carried), e.g.
#   bash experiments/gpu/next_check.sh            # all steps
#   STEPS="conv flip3e5" bash experiments/gpu/next_check.sh
# Steps:
#   conv     issue 26: the user-level CNN under the accelerator's conv chunk default (budget 1.0),
#            beside unchunked and the CPU budget (~40 s; the item CNN was measured: 2.39x).
#   flip3e5  issue 28: label-flipping users at n = 3e5, m = 64, 5 and 10% (Algorithm 3 and
#            DP-SGD, 10 eval seeds; ~8 s per Algorithm 3 run, ~30 s per DP-SGD cell).
#   m1e5     issue 28: n = 1e5 at m = 256, 2 and 5% huge users (m = 16 at 0-10% ran on the CPU:
#            experiments/results/filter_curve_records_cpu_m.jsonl).
#   bench    issue 26: bench_gpu's transformer rows under today's defaults (not re-run on the
#            H100 since the cost model).
#   tfchunk  issue 26: the transformers' vmap step in 4 chunks of users beside fast / optax /
#            jax_privacy at full size (on CPU it beat the fast path: 0.97 vs 1.03 of the
#            non-private time, FLOPs 1.012 vs 1.136; on a GPU auto keeps one piece and picks
#            fast, unmeasured against chunks).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
for step in ${STEPS:-conv tfchunk flip3e5 m1e5 bench}; do
  echo "== $step at $(( $(date +%s) - T0 )) s"
  case $step in
    conv) timeout 120 python3 experiments/gpu/conv_budget_default.py --only cnn_user \
            2>&1 | grep -v "^WARNING\|^I0000" | tee "$OUT/conv_budget_default_cnn_user.log" ;;
    flip3e5) SIZES=3e5_flip FRACTIONS="0.05 0.1" ALG1=0 STUDY_S=$(left 330) BENCH_S=0 \
            bash experiments/gpu/study_filter.sh ;;
    m1e5) SIZES=1e5_m MS="256" FRACTIONS="0.05 0.02" ALG1=0 STUDY_S=$(left 420) \
            BENCH_S=0 bash experiments/gpu/study_filter.sh ;;
    bench) t=$(left 480); [ "$t" -gt 30 ] && timeout "$t" python3 experiments/bench_gpu.py \
            --budget 20 --reps 5 --only transformer transformer_mha 2>&1 | grep -v "^WARNING\|^I0000" \
            | tee "$OUT/bench_gpu_transformer.log" | tail -15 ;;
    tfchunk) timeout 150 python3 experiments/bench_cost_vmap_chunked.py --only transformer \
            transformer_mha --fast --peers --chunks 4 --reps 5 2>&1 \
            | grep -v "^WARNING\|^I0000" | tee "$OUT/bench_tf_chunked.log" | tail -20 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "all done at $(( $(date +%s) - T0 )) s"
