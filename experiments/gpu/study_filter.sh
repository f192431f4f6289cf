#!/usr/bin/env bash
# Issue 28, paper 000 at n >= 1e5 on a GPU: FILTER (Algorithms 1 and 3) against user-level DP-SGD
# with 0/2/5/10% huge-gradient users, m = 64, eps = 1, on the curve's evaluation seeds 300-309
# (experiments/configs_eval/filter_curve_{1e5,3e5}.yaml; the hyper-parameters are the curve's,
# set on seeds 0-2). On 2 CPU cores one Algorithm 3 run at n = 1e5 takes minutes, so these cells
# were out of reach there. Cells run in a fixed priority order, each appending its records to
# $OUT; a deadline stops the run between cells, so a partial run is usable and can be resumed.
# Then, with the time left, bench_gpu's transformer row (not re-run on the H100 before).
#   STUDY_S: seconds for the study (default 300); BENCH_S: seconds for the bench (default 0);
#   FRACTIONS: the corrupted fractions (default "0.05 0.0 0.02 0.1"); ALG1=0 skips Algorithm 1;
#   MS: items per user (default "64"; "16 256" with SIZES=1e5_m: filter_curve_1e5_m.yaml).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
TAG=${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -dc 'A-Za-z0-9' | tr 'A-Z' 'a-z')}
DEADLINE=$((T0 + ${STUDY_S:-300}))
A3=user_level_accelerated_erm; A1=user_level_phased_sgd; SGD=dp_sgd_user
# SIZES: config suffixes, in order (filter_curve_<suffix>.yaml; "1e5_fresh": seeds 600-609;
# "1e5_flip": label-flipping users; "1e5_m": m = 16 and 256, with MS="16 256").
for n in ${SIZES:-1e5 3e5}; do
  N=$(python3 -c "print(int(float('$n'.split('_')[0])))")
  MODE=huge; case $n in *flip*) MODE=flip;; esac
  cells=()
  for m in ${MS:-64}; do
    for f in ${FRACTIONS:-0.05 0.0 0.02 0.1}; do
      cells+=("[\"$A3\", $N, \"$MODE\", $m, $f]" "[\"$SGD\", $N, \"$MODE\", $m, $f]")
    done
  done
  if [ "${ALG1:-1}" = 1 ]; then
    for m in ${MS:-64}; do
      for f in ${FRACTIONS:-0.05 0.0 0.02 0.1}; do cells+=("[\"$A1\", $N, \"$MODE\", $m, $f]"); done
    done
  fi
  timeout $((DEADLINE - $(date +%s) + 120)) python3 experiments/filter_curve.py run \
    --config experiments/configs_eval/filter_curve_$n.yaml --max-seeds 10 \
    --records "$OUT/filter_curve_records_gpu_$TAG.jsonl" --deadline $DEADLINE \
    --cells "${cells[@]}" 2>&1 | grep -v "^WARNING\|^I0000" | tee -a "$OUT/study_filter_$TAG.log"
  [ "$(date +%s)" -ge "$DEADLINE" ] && break
done
echo "study done at $(( $(date +%s) - T0 )) s"
LEFT=${BENCH_S:-0}
if [ "$LEFT" -gt 0 ]; then
  timeout "$LEFT" python3 experiments/bench_gpu.py --budget 20 --reps 5 --only ${ONLY:-transformer} \
    2>&1 | tee "$OUT/bench_gpu_${ONLY:-transformer}_$TAG.log" | tail -15
fi
echo "all done at $(( $(date +%s) - T0 )) s"
