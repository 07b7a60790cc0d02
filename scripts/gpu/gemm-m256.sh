#!/usr/bin/env bash
# One device call (nvidia-h100-x1, carry [".device"], under 8 minutes) after
# `bash scripts/gpu/build-device.sh`: the 128-row quad kernels (`wgquad128x128`,
# `wgquad128x64`) for 129 <= M <= 512 against `wgtma128` and cuBLAS.
#   1. the tree GEMM's GPU bit tests (every path; the llama3-8b layer shapes at M = 129,
#      200, 256, 384, 512 and their TP 2 / 4 / 8 shards);
#   2. `bench gemm` on q/k/v, o, gate/up and down at M = 128, 256, 512, one process per
#      path (each next to cuBLAS in the same process), "default" as today and "m256" with
#      ARBOR_GEMM_M256=1 (the quad128 rule of kernels/src/cuda/gemm/select.rs);
#   3. if time is left, `bench decode` of the llama3-8b shape at batch 256 without and with
#      ARBOR_GEMM_M256=1.
# Writes $OUT/m256-summary.txt (the rows) and one log per step.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
source scripts/gpu/device-lib.sh
script_start m256-summary.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a "$SUMMARY"

step "kernels GPU tests (gemm)" "$OUT/m256-tests.log" 200 .device/tests/kernels-gpu \
    cuda::gemm::gpu_test --skip grouped --test-threads 1
grep -E "^test |test result" "$OUT/m256-tests.log" | tee -a "$SUMMARY"

SHAPES=${SHAPES:-4096x6144,4096x4096,4096x28672,14336x4096}
MS=${MS:-128,256,512}
for p in ${PATHS:-default m256 wgtma128 wgquad128x128 wgquad128x64}; do
    args=(bench gemm --shapes "$SHAPES" --m "$MS" --iters 30 --warmup 5)
    env=()
    case $p in
        default) env=(ARBOR_GEMM_M256=0) ;;
        m256) env=(ARBOR_GEMM_M256=1) ;;
        *) args+=(--path "$p") ;;
    esac
    log=$OUT/m256-gemm-$p.log
    step "bench gemm $p" "$log" 75 env "${env[@]}" "$ARBOR" "${args[@]}"
    # Rows: K N M path arbor_ms cublas_ms ... status.
    awk -v p="$p" '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && NF > 6 {
        printf "%-8s %6d %6d %4d %-15s %8.1f us  cuBLAS %8.1f us  %s\n", p, $1, $2, $3, $4, 1000 * $5, 1000 * $6, ($0 ~ /FAIL/ ? "FAIL" : "ok")
    }' "$log" | tee -a "$SUMMARY"
done

l8b_model "$OUT/m256-make.log"
for v in 0 1; do
    step "bench decode batch 256 ARBOR_GEMM_M256=$v" "$OUT/m256-decode-$v.log" 90 \
        env ARBOR_GEMM_M256=$v "$ARBOR" bench decode --model "$L8B" --device cuda \
        --batch 256 --prompt-len 128 --steps 16
    grep -E "batch +256" "$OUT/m256-decode-$v.log" | sed "s/^/ARBOR_GEMM_M256=$v  /" | tee -a "$SUMMARY"
done
echo "==== gemm-m256 ($(elapsed) s)"
