#!/usr/bin/env bash
# The Hopper grouped expert GEMM (`wgtma128`, kernels/cuda/gemm_moe_sm90.cu) in one device
# call: its bits against the mma.sync grouped kernel, the MoE model tests, then the speed
# side by side with the PyTorch reference. Run ON the GPU machine (nvidia-h100-x1) from
# the repo root, with binaries staged by scripts/gpu/build-device.sh (carry [".device"]):
#
#   scripts/gpu/moe-wg-check.sh
#
# Steps, in order while BUDGET_S (default 530) lasts:
#   1. kernels-gpu grouped_wgmma_gives_the_mma_bits (uneven/empty experts, segment tails,
#      a TP shard, Qwen3-30B-A3B and Mixtral shapes);
#   2. model-gpu gpu_moe_ (every forced ARBOR_MOE_GEMM path gives the default's bits, the
#      MoE decode/prefill/batch invariance tests);
#   3. make-model --preset qwen3-30b-a3b --layers 4, then scripts/bench/moe_reference.py
#      --batch 1,64,256 --prefill 8x2048 (the default path choice: wgtma128 for prefill);
#   4. if time is left, the same bench forcing the path (torch runs again beside it):
#      ARBOR_MOE_GEMM=tree128 at prefill (the mma.sync grouped kernel, the A/B) and
#      ARBOR_MOE_GEMM=wgtma128 at decode batch 256 (whether it beats split16 there).
# Output in $OUT (default ./moe-wg-out): summary.txt, tests.log, bench.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/device-lib.sh

OUT=${OUT:-./moe-wg-out}
BIN=${ARBOR_DEVICE_DIR:-.device}
BUDGET_S=${BUDGET_S:-530}
WORK=${WORK:-/tmp/arbor-moe-wg}
T0=$(date +%s)
mkdir -p "$OUT" "$WORK"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
TESTS_LOG=$OUT/tests.log
BENCH_LOG=$OUT/bench.log
need_binaries moe-wg-check arbor tests/kernels-gpu tests/model-gpu
{
    echo "moe-wg-check on $(hostname) at $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
} 2>&1 | tee -a "$SUMMARY"

step "kernels: grouped_wgmma_gives_the_mma_bits" "$TESTS_LOG" 150 \
    "$BIN/tests/kernels-gpu" --test-threads=1 --nocapture grouped_wgmma_gives_the_mma_bits
step "model tests: gpu_moe_" "$TESTS_LOG" 200 "$BIN/tests/model-gpu" --test-threads=1 --nocapture gpu_moe_
if grep -s -q "skipped:" "$TESTS_LOG"; then
    note "FAIL  GPU tests skipped: $(grep -h -o 'skipped: .*' "$TESTS_LOG" | sort -u | head -n 1)"
fi
grep -s -h "same bits" "$TESTS_LOG" | tee -a "$SUMMARY"

M=$WORK/qwen3-30b-a3b-4l
if [[ ! -f $M/config.json ]]; then
    step "make-model qwen3-30b-a3b --layers 4" "$BENCH_LOG" 120 \
        "$BIN/arbor" make-model --preset qwen3-30b-a3b --layers 4 --out "$M"
fi
bench() {
    local name=$1
    shift
    step "$name" "$BENCH_LOG" 240 python3 scripts/bench/moe_reference.py --model "$M" \
        --arbor "$BIN/arbor" --prompt-len 128 --steps 16 --compile off "$@"
    # The table: from the header line to the end of this step's output.
    awk -v n="=== $name" 'index($0, n) == 1 {on = 1; next} /^=== / {on = 0} on && /torch ms|decode batch|prefill/' \
        "$BENCH_LOG" | tee -a "$SUMMARY"
}
bench "bench: default paths" --batch 1,64,256 --prefill 8x2048
STEP_MIN_LEFT=100 ARBOR_MOE_GEMM=tree128 bench "bench: ARBOR_MOE_GEMM=tree128 prefill" --batch 1 --prefill 8x2048
STEP_MIN_LEFT=60 ARBOR_MOE_GEMM=wgtma128 bench "bench: ARBOR_MOE_GEMM=wgtma128 decode 256" --batch 256 --prefill none
grep -q "^FAIL\|^TIME" "$SUMMARY" && exit 1
exit 0
