#!/usr/bin/env bash
# One device call (carry [".device"]): the paged attention kernels timed (both prefill
# forms) and under Nsight Compute's full sections, next to PyTorch's flash kernel.
# Run from the repo root after `bash scripts/gpu/build-device.sh`:
#   bash scripts/bench/profile-attention.sh
# Writes $OUT/profile-attention-*.txt and profile-attention-summary.txt.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-500}
source scripts/gpu/device-lib.sh
script_start profile-attention-summary.txt
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
PREFILL=${PREFILL:-8x1024,4x8192}
DECODE=${DECODE:-1x8192,32x8192}
for form in a b; do
    ARBOR_PA_PREFILL=$form step "bench attention, prefill form $form" "$OUT/profile-attention-bench.log" 120 \
        "$ARBOR" bench attention --prefill "$PREFILL" --decode "$DECODE"
    grep -E "^ +(prefill|decode) " "$OUT/profile-attention-bench.log" | tail -n 4 | sed "s/^/$form /" | tee -a "$SUMMARY"
done
digest() {
    grep -E "^  [A-Za-z_].*\(|Duration|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Waves Per SM|Est. Speedup|One or More Eligible|Issued Warp|No Eligible|Stall|Executed Ipc|Shared Memory Configuration|Bank" \
        "$1" | head -n 60 | tee -a "$SUMMARY"
}
if [[ -n $NCU ]]; then
    for form in a b; do
        k=pa_prefill_hd128
        [[ $form == b ]] && k=pa_prefill_b_hd128
        ARBOR_NVRTC_LINEINFO=1 ARBOR_PA_PREFILL=$form step "ncu $k" "$OUT/profile-attention-$form.txt" 150 \
            "$NCU" --clock-control none --set full --import-source yes -k "regex:^$k\$" --launch-skip 2 --launch-count 1 \
            -o "$OUT/pa-$form" "$ARBOR" bench attention --prefill 8x1024 --decode "" --warmup 2 --iters 2
        "$NCU" -i "$OUT/pa-$form.ncu-rep" --page details >"$OUT/profile-attention-$form.txt" 2>&1
        "$NCU" -i "$OUT/pa-$form.ncu-rep" --page source --csv --print-source sass >"$OUT/profile-attention-$form-sass.csv" 2>&1
        digest "$OUT/profile-attention-$form.txt"
    done
    step "ncu flash (torch)" "$OUT/profile-attention-torch.txt" 150 "$NCU" --clock-control none --set full \
        -k "regex:flash" --launch-skip 2 --launch-count 1 \
        python3 scripts/bench/attention-reference.py --prefill 8x1024 --decode "" --iters 3
    digest "$OUT/profile-attention-torch.txt"
fi
echo "==== profile-attention ($(elapsed) s)"
