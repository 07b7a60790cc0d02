#!/usr/bin/env bash
# One device call (carry [".device"]): one GEMM shape under Nsight Compute's full sections,
# arbor's kernel for each path named and cuBLAS's kernel in the same process, so that the
# two can be read side by side (DRAM throughput, stalls, occupancy, waves).
# Run from the repo root after `bash scripts/gpu/build-device.sh`:
#   SHAPE=4096x28672 M=64 PATHS="wgcluster64x2 wgcluster64x2n256" bash scripts/bench/profile-gemm.sh
# Writes $OUT/profile-gemm-*.txt (ncu's report per kernel) and profile-gemm-summary.txt
# (the lines that say what bounds each kernel). Timings: `arbor bench gemm --path P`
# for every path first (no profiler attached), so the report sits next to wall figures.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
source scripts/gpu/device-lib.sh
script_start profile-gemm-summary.txt
SHAPE=${SHAPE:-4096x28672}
M=${M:-64}
PATHS=${PATHS:-wgcluster64x2 wgcluster64x2n256}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
note "shape $SHAPE (K x N), M $M, paths: $PATHS; ncu: ${NCU:-not found}"

for path in $PATHS; do
    step "bench gemm $path" "$OUT/profile-gemm-bench.log" 90 "$ARBOR" bench gemm --shapes "$SHAPE" \
        --m "$M" --iters 50 --path "$path"
    grep -E "^ +[0-9]+ +[0-9]+ +$M " "$OUT/profile-gemm-bench.log" | tail -n 1 | tee -a "$SUMMARY"
done

# What ncu's full set says bounds a kernel, one block of lines per kernel.
digest() {
    grep -E "^  [A-Za-z_].*\(|Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Waves Per SM|Grid Size|Block Size|Cluster Size|Est. Speedup|One or More Eligible|Issued Warp|Stall" \
        "$1" | head -n 40 | tee -a "$SUMMARY"
}
kernel_of() {
    case $1 in
        wgtma128) echo arbor_gemm_wg_tma_128x128 ;;
        wgcluster64) echo arbor_gemm_wg_cluster_64x128 ;;
        wgcluster64x2) echo arbor_gemm_wg_cluster2_64x128 ;;
        wgcluster64x2n256) echo arbor_gemm_wg_cluster2_64x256 ;;
        wgwhole*) echo "arbor_gemm_wg_whole_64x${1#wgwhole}" ;;
        wgquad128x*) echo "arbor_gemm_wg_quad_128x${1#wgquad128x}" ;;
        wgquad*) echo "arbor_gemm_wg_quad_64x${1#wgquad}" ;;
        wgsplit64) echo arbor_gemm_wg_split_64x128 ;;
        wgtree128) echo arbor_gemm_wg_tree_128x128 ;;
        *) echo "arbor_gemm_$1" ;;
    esac
}
if [[ -n $NCU ]]; then
    for path in $PATHS; do
        # By the kernel's own name: the bench's checks launch every other path too.
        step "ncu $path" "$OUT/profile-gemm-$path.txt" 150 "$NCU" --clock-control none \
            --set full -k "regex:^$(kernel_of "$path")\$" --launch-skip 5 --launch-count 1 \
            "$ARBOR" bench gemm --shapes "$SHAPE" --m "$M" --iters 30 --path "$path"
        digest "$OUT/profile-gemm-$path.txt"
    done
    step "ncu cuBLAS" "$OUT/profile-gemm-cublas.txt" 150 "$NCU" --clock-control none --set full \
        -k "regex:nvjet|xmma|cutlass" --launch-skip 5 --launch-count 1 \
        "$ARBOR" bench gemm --shapes "$SHAPE" --m "$M" --iters 30
    digest "$OUT/profile-gemm-cublas.txt"
fi
echo "==== profile-gemm ($(elapsed) s)"
