#!/usr/bin/env bash
# Issue 50's device check: each path's peak device memory beside its time, at both matmul
# precisions, and the largest user batch each path fits in GPU memory for the transformer.
#   stage 1: bench_gpu at --precision default (TF32 on a GPU): times, compiled peaks
#            (peak_mib) and the device's runtime peaks (peak_mib_runtime, peak_rise_mib);
#   stage 2: the same at --precision highest;
#   stage 3: bench_gpu --only transformer --max-batch: per path, the largest user batch whose
#            compiled step fits the device's bytes_limit (compiles only, nothing runs).
# Run from the repo root on the device machine with the wheels of .whl carried:
#   bash experiments/gpu/issue50.sh
# Logs: $OUT/issue50_{default,highest,maxbatch}_$TAG.log (last line: bench_gpu's JSON).
# Each stage has its own time limit (S1_S, S2_S, S3_S seconds; 480 s in all by default) so a
# slow stage cannot eat the next one's time; a stage cut short still leaves the tables of the
# workloads it finished. The transformers' compiles dominate (20-50 s a path on an H100 with
# autotuning, experiments/results/gpu/bench_tf_chunked_h100.log): ONLY narrows stages 1-2's
# workloads (default all five, which may not all fit S1_S), BUDGET their seconds of timing per
# workload. Stage 3 compiles the transformer several times a path, so it compiles without
# XLA's GPU autotuning (SEARCH_XLA_FLAGS; set it empty to keep autotuning): the autotuner picks
# kernels, not buffers, so the step's bytes barely change (a GEMM's workspace at most), and
# MAX_BATCH_BUDGET caps its seconds per path (the bracket so far when spent).
set -u
. "$(dirname "$0")/setup.sh"   # wheels, path, $OUT/gpu.txt, TAG
ONLY=${ONLY:-cnn_item transformer transformer_mha logistic_user cnn_user}

for stage in default highest; do
  limit=$([ "$stage" = default ] && echo "${S1_S:-170}" || echo "${S2_S:-170}")
  timeout "$limit" python3 experiments/bench_gpu.py --precision "$stage" \
    --budget "${BUDGET:-5}" --reps 5 --only $ONLY 2>&1 | tee "$OUT/issue50_${stage}_$TAG.log"
  echo "stage $stage rc=${PIPESTATUS[0]}"
done

XLA_FLAGS="${XLA_FLAGS:-} ${SEARCH_XLA_FLAGS---xla_gpu_autotune_level=0}" \
  timeout "${S3_S:-140}" python3 experiments/bench_gpu.py --only transformer --max-batch \
  --max-batch-budget "${MAX_BATCH_BUDGET:-25}" 2>&1 | tee "$OUT/issue50_maxbatch_$TAG.log"
echo "stage maxbatch rc=${PIPESTATUS[0]}"
