#!/usr/bin/env bash
# One device call (carry [".device"]): one GEMM shape under Nsight Compute's full sections,
# arbor's kernel for each path named and cuBLAS's kernel in the same process, so that the
# two can be read side by side (DRAM throughput, stalls, occupancy, waves).
# Run from the repo root after `bash scripts/gpu/build-device.sh`:
#   SHAPE=4096x28672 M=64 PATHS="wgcluster64x2 wgcluster64x2n256" bash scripts/bench/profile-gemm.sh
# Writes $OUT/profile-gemm-*.ncu-rep and .txt (ncu's report per kernel) and
# profile-gemm-summary.txt (the lines that say what bounds each kernel, then its largest
# stall reasons). STALLS=1 adds source-level PC sampling to the reports and their samples
# by SASS instruction to the summary (scripts/bench/ncu_source_top.py), e.g. for the
# large-M kernel against cuBLAS's:
#   SHAPE=4096x4096 M=4096 PATHS=wgtma128 STALLS=1 bash scripts/bench/profile-gemm.sh
# CUBLAS=0 leaves cuBLAS's kernel out (when comparing arbor's settings, e.g. under two
# values of ARBOR_GEMM_TAIL_SPLIT, each run with its own OUT). Timings: `arbor bench gemm
# --path P` for every path first (no profiler attached), so the report sits next to wall
# figures.
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
    grep -E "^  [A-Za-z_].*\(|Duration|Memory Throughput|DRAM Throughput|L2 Hit Rate|L1/TEX Cache Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Shared Memory|Achieved Occupancy|Registers Per|Waves Per SM|Grid Size|Block Size|Cluster Size|Est. Speedup|One or More Eligible|Issued Warp|Stall" \
        "$1" | head -n 48 | tee -a "$SUMMARY"
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
        wgswap*s*) local f=${1#wgswap}; echo "arbor_gemm_wg_swap_${f%s*}x8_s${f#*s}" ;;
        *) echo "arbor_gemm_$1" ;;
    esac
}
# Where the warps of a report wait: every collected metric whose name says "issue_stalled"
# (the warp-state averages, and the PC-sampling counts with STALLS=1), largest first; then
# the shared-memory and tensor pipes' use against their peaks.
stalls() {
    "$NCU" --import "$1" --page raw --csv 2>/dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
if len(rows) < 3:
    sys.exit("no raw metrics in the report")
names, values = rows[0], rows[-1]
def num(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None
got = [(num(v), n) for n, v in zip(names, values) if "issue_stalled" in n and num(v)]
for v, n in sorted(got, reverse=True)[:14]:
    print(f"  stall {n}: {v:g}")
# How busy the shared-memory and tensor pipes were (the large-M kernel is predicted to be
# bound by shared-memory bandwidth: docs/gemm.md).
pipes = [(n, num(v)) for n, v in zip(names, values)
         if "pct_of_peak" in n and any(w in n for w in ("shared", "tensor", "gmma", "lsu"))]
for n, v in pipes:
    # The averages that are not zero: the min / max / sum variants and the idle pipes
    # (fp64, int8, sparsity, ...) only bury them.
    if v and not any(x in n for x in (".min.", ".max.", ".sum.")):
        print(f"  pipe {n}: {v:g} %")
' | tee -a "$SUMMARY"
}
# With STALLS=1: the PC samples by SASS instruction and by opcode (what a warp waits on:
# its wgmma group, an mbarrier, a named barrier).
sass_stalls() {
    [[ ${STALLS:-0} == 1 ]] || return 0
    python3 scripts/bench/ncu_source_top.py --ncu "$NCU" --top 20 "$1" | tee -a "$SUMMARY"
}
# STALLS=1: also the source-level PC sampling (which instruction each stall sits at), kept
# in the .ncu-rep files for `ncu --import F --page source`.
SOURCE=()
[[ ${STALLS:-0} == 1 ]] && SOURCE=(--import-source yes --section SourceCounters)
if [[ -n $NCU ]]; then
    for path in $PATHS; do
        # By the kernel's own name: the bench's checks launch every other path too.
        step "ncu $path" "$OUT/profile-gemm-$path.log" 150 "$NCU" --clock-control none \
            --set full "${SOURCE[@]}" -o "$OUT/profile-gemm-$path" -f \
            -k "regex:^$(kernel_of "$path")\$" --launch-skip 5 --launch-count 1 \
            "$ARBOR" bench gemm --shapes "$SHAPE" --m "$M" --iters 30 --path "$path"
        "$NCU" --import "$OUT/profile-gemm-$path.ncu-rep" > "$OUT/profile-gemm-$path.txt" 2>&1
        digest "$OUT/profile-gemm-$path.txt"
        stalls "$OUT/profile-gemm-$path.ncu-rep"
        sass_stalls "$OUT/profile-gemm-$path.ncu-rep"
    done
    if [[ ${CUBLAS:-1} == 1 ]]; then
        step "ncu cuBLAS" "$OUT/profile-gemm-cublas.log" 150 "$NCU" --clock-control none --set full \
            "${SOURCE[@]}" -o "$OUT/profile-gemm-cublas" -f \
            -k "regex:nvjet|xmma|cutlass" --launch-skip 5 --launch-count 1 \
            "$ARBOR" bench gemm --shapes "$SHAPE" --m "$M" --iters 30
        "$NCU" --import "$OUT/profile-gemm-cublas.ncu-rep" > "$OUT/profile-gemm-cublas.txt" 2>&1
        digest "$OUT/profile-gemm-cublas.txt"
        stalls "$OUT/profile-gemm-cublas.ncu-rep"
        sass_stalls "$OUT/profile-gemm-cublas.ncu-rep"
    fi
fi
echo "==== profile-gemm ($(elapsed) s)"
