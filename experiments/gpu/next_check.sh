#!/usr/bin/env bash
# The device checks still open after 2026-11-27, in priority order, for one call of the device
# tool (about 8 min of an H100; each step stops at its own deadline, and what finished is under
# $OUT). Run from the repository root with the wheels of dp-accounting, dm-tree, jax-privacy
# and pydantic under .whl/ (carried), e.g.
#   bash experiments/gpu/next_check.sh            # all steps
#   STEPS="flip3e5 m1e5" bash experiments/gpu/next_check.sh
# Done on an H100 on 2026-11-27 (experiments/results/gpu/): the user-level CNN's conv default,
# the transformer's vmap step in 4 chunks, flips at 3e5 5%, m = 256 at 2 and 5%; and, in the
# second session of that day (*_h100_s6.log), probe, tf for the plain transformer (the MHA one
# was cut at its deadline), rest for CNN item and GLM (CNN user cut), and 75 tests of `tests`.
# Still open, in this order (one full-size transformer row compiles for ~150 s there):
#   STEPS="tf rest tests" TF_END=330 REST_END=420 TESTS_END=560: the transformers under the
#   defaults of d8164c8 (the fast path's projections instantiated on a GPU, the vmap path's
#   sum without its barrier: neither timed end to end yet), the user-level CNN, more tests;
#   then e6 / flip3e5 for whatever issue 28 cells the CPU has not finished.
# Steps:
#   flip3e5  issue 28: label-flipping users at n = 3e5, m = 64, 10% (Algorithm 3 and DP-SGD,
#            10 eval seeds; 89 s for Algorithm 3's 10 seeds at 5%, 29 s for DP-SGD's).
#   e6       issue 28: n = 1e6, m = 64: the cells the CPU could not finish (filter_curve
#            skips cells already in the records: carry experiments/results/ as it is).
#   bench    issue 26: bench_gpu's two transformer rows, every path.
#   probe    issue 26: the vmap path's clip-and-sum alone on transformer-shaped per-user
#            gradients, ours against its variants (experiments/gpu/rowsum_probe.py; seconds).
#   tf       issue 26: bench_gpu's two transformer rows with the fast path at ghost="gram" and
#            "direct" too.
#   rest     issue 26: bench_gpu's CNN item, GLM and CNN user rows under today's defaults.
#   tests    the GPU-sensitive test files (fast clipping, clipping, noise, trainer) at the
#            GPU's default precision, stopped with SIGINT at the step's deadline.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
for step in ${STEPS:-e6 flip3e5 bench}; do
  echo "== $step at $(( $(date +%s) - T0 )) s"
  case $step in
    conv) timeout 120 python3 experiments/gpu/conv_budget_default.py --only cnn_user \
            2>&1 | grep -v "^WARNING\|^I0000" | tee "$OUT/conv_budget_default_cnn_user.log" ;;
    flip3e5) SIZES=3e5_flip FRACTIONS="0.1" ALG1=0 STUDY_S=$(left 180) BENCH_S=0 \
            bash experiments/gpu/study_filter.sh ;;
    e6) for cfg in 1e6 1e6_flip; do
          cells=(); for f in 0.05 0.1 0.0 0.02; do for a in user_level_accelerated_erm dp_sgd_user; do
            mode=huge; [ "$cfg" = 1e6_flip ] && mode=flip
            [ "$cfg" = 1e6_flip ] && [ "$f" != 0.05 ] && [ "$f" != 0.1 ] && continue
            cells+=("[\"$a\", 1000000, \"$mode\", 64, $f]"); done; done
          timeout $(left 300) python3 experiments/filter_curve.py run \
            --config experiments/configs_eval/filter_curve_$cfg.yaml --max-seeds 10 \
            --records experiments/results/filter_curve_records_cpu_1e6.jsonl \
            --deadline $(( $(date +%s) + $(left 320) )) --cells "${cells[@]}" 2>&1 \
            | grep -v "^WARNING\|^I0000" | tee -a "$OUT/study_filter_e6.log"
          cp experiments/results/filter_curve_records_cpu_1e6.jsonl "$OUT/" ; done ;;
    bench) t=$(left 480); [ "$t" -gt 30 ] && timeout "$t" python3 experiments/bench_gpu.py \
            --budget 20 --reps 5 --only transformer transformer_mha 2>&1 | grep -v "^WARNING\|^I0000" \
            | tee "$OUT/bench_gpu_transformer.log" | tail -15 ;;
    probe) timeout 120 python3 experiments/gpu/rowsum_probe.py 2>&1 \
            | grep -v "^WARNING\|^I0000" | tee "$OUT/rowsum_probe.log" ;;
    tf) for w in transformer_mha transformer; do t=$(left ${TF_END:-430}); [ "$t" -gt 60 ] && \
          timeout "$t" python3 experiments/bench_gpu.py --budget 10 --reps 5 --ghost-variants gram direct \
            --only $w 2>&1 | grep -v "^WARNING\|^I0000" | tee "$OUT/bench_gpu_$w.log"; done ;;
    rest) t=$(left ${REST_END:-510}); [ "$t" -gt 30 ] && timeout "$t" python3 experiments/bench_gpu.py \
            --budget 10 --reps 5 --only cnn_item logistic_user cnn_user 2>&1 \
            | grep -v "^WARNING\|^I0000" | tee "$OUT/bench_gpu_rest.log" ;;
    tests) t=$(left ${TESTS_END:-570}); [ "$t" -gt 40 ] && XLA_PYTHON_CLIENT_PREALLOCATE=false \
            timeout -s INT -k 15 "$t" python3 -m pytest -n 14 -p no:cacheprovider -q --tb=short \
            -rfE tests/test_flax_fast_clip*.py tests/test_clipping*.py tests/test_noise.py \
            tests/test_flax_trainer.py tests/test_flax_trainer_privacy.py 2>&1 \
            | tee "$OUT/pytest_gpu_subset.log" | tail -30 ;;
    tfchunk) timeout 280 python3 experiments/bench_cost_vmap_chunked.py --only transformer \
            --fast --peers optax --chunks 4 --reps 7 2>&1 \
            | grep -v "^WARNING\|^I0000" | tee "$OUT/bench_tf_chunked.log" | tail -20 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "all done at $(( $(date +%s) - T0 )) s"
