#!/usr/bin/env bash
# One device call (carry [".device"]): the paged attention kernels timed (every prefill
# build) and under Nsight Compute's full sections, next to PyTorch's flash kernel.
# Run from the repo root after `bash scripts/gpu/build-device.sh`:
#   bash scripts/bench/profile-attention.sh
# BUILDS (default "64 96 wgmma": ARBOR_ATTN_PREFILL_ROWS values), PREFILL (default
# 8x1024,4x8192), DECODE (default 1x8192,32x8192; the one-stage decode kernel is profiled at
# DECODE_NCU, default 32x8192, and the wide one at DECODE_WIDE_NCU, default 1x1024: what
# bounds a batch-1 split's chain of blocks). The ncu reports and logs go into one archive,
# $OUT/profile-attention.tgz (a call returns at most 8 files); the digest is in
# $OUT/profile-attention-summary.txt.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-500}
source scripts/gpu/device-lib.sh
script_start profile-attention-summary.txt
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
BUILDS=${BUILDS:-64 96 wgmma}
PREFILL=${PREFILL:-8x1024,4x8192}
DECODE=${DECODE:-1x8192,32x8192}
W=$OUT/profile-attention
mkdir -p "$W"
for b in $BUILDS; do
    ARBOR_ATTN_PREFILL_ROWS=$b step "bench attention, prefill build $b" "$W/bench.log" 120 \
        "$ARBOR" bench attention --prefill "$PREFILL" --decode "$DECODE"
    grep -E "^ +(prefill|decode) " "$W/bench.log" | tail -n 4 | sed "s/^/$b /" | tee -a "$SUMMARY"
done
digest() {
    grep -E "^  [A-Za-z_].*\(|Duration|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Waves Per SM|Est. Speedup|One or More Eligible|Issued Warp|No Eligible|Stall|Executed Ipc|Shared Memory Configuration|Bank" \
        "$1" | head -n 60 | tee -a "$SUMMARY"
}
# ncu_kernel NAME REGEX ARGS...: one launch of REGEX under the full sections, the report's
# details and its SASS source view (stall samples and sectors per instruction).
ncu_kernel() {
    local name=$1 regex=$2
    shift 2
    ARBOR_NVRTC_LINEINFO=1 step "ncu $name" "$W/ncu-$name.log" 150 "$NCU" --clock-control none --set full \
        --import-source yes -k "regex:$regex" --launch-skip 2 --launch-count 1 -o "$W/$name" "$@"
    "$NCU" -i "$W/$name.ncu-rep" --page details >"$W/$name.txt" 2>&1
    "$NCU" -i "$W/$name.ncu-rep" --page source --csv --print-source sass >"$W/$name-sass.csv" 2>&1
    digest "$W/$name.txt"
}
if [[ -n $NCU ]]; then
    for b in $BUILDS; do
        case $b in
        64) k=pa_prefill_hd128 ;;
        96) k=pa_prefill96_hd128 ;;
        *) k=pa_prefill_wg_hd128 ;;
        esac
        ARBOR_ATTN_PREFILL_ROWS=$b ncu_kernel "$k" "^$k\$" "$ARBOR" bench attention --prefill 8x1024 --decode "" \
            --warmup 2 --iters 2
    done
    ncu_kernel pa_decode1_hd128 '^pa_decode1_hd128$' "$ARBOR" bench attention --prefill "" \
        --decode "${DECODE_NCU:-32x8192}" --warmup 2 --iters 2
    ARBOR_ATTN_DECODE=wide ncu_kernel pa_decode_wide_hd128 '^pa_decode_wide_hd128$' "$ARBOR" bench attention \
        --prefill "" --decode "${DECODE_WIDE_NCU:-1x1024}" --warmup 2 --iters 2
    step "ncu flash (torch)" "$W/torch.txt" 150 "$NCU" --clock-control none --set full \
        -k "regex:flash" --launch-skip 2 --launch-count 1 \
        python3 scripts/bench/attention-reference.py --prefill 8x1024 --decode "" --iters 3
    digest "$W/torch.txt"
fi
tar czf "$OUT/profile-attention.tgz" -C "$OUT" profile-attention && rm -rf "$W"
echo "==== profile-attention ($(elapsed) s)"
