#!/usr/bin/env bash
# One device call (carry [".device"]), one GPU: every tensor-core launch path of the tree
# GEMM timed on each layer shape a TP rank computes, to set the default path rules
# (kernels/src/cuda/gemm/select.rs: default_path_for, whole_tile, quad_tile) for shapes that the
# TP 1 benchmarks never saw. All paths give the same bits (bench gemm checks that on every
# call), so the rules only move time.
#   SHAPES="4096x1536 tp4:4096x4096" MS=1,8,32,64 bash scripts/bench/sweep-gemm-paths.sh
# A shape "tpN:KxN" is a row-parallel layer's shard at TP N (`bench gemm --tp N`).
# The band 129 <= M <= 1024 (decode at batch 256, serving's steps with prompt rows):
# MS=256,384,512,768,1024 PATHS="default wgtma128 wgtma128x96 wgtma128x64 wgquad128x128"
# (ARBOR_GEMM_NARROW=0 / ARBOR_GEMM_M256=0 keep "default" off the narrow / quad rules).
# EPILOGUE=silu (or silu-bf16) times arbor's calls with the MLP's SiLU·mul epilogue, as the
# model's gate/up layer runs (cuBLAS times the plain GEMM either way; N must be even).
# X_ROWS=exact gives arbor's calls X of exactly M rows, padded rounds them up to whole
# 128-row boxes; the default, model, reads as the model does (gemm::x_rows_to_read).
# Prints "shape M path arbor_us cublas_us" rows and, per (shape, M), the fastest path.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
source scripts/gpu/device-lib.sh
script_start sweep-summary.txt
# llama3-8b at TP 4: q/k/v, gate/up, LM head (column-parallel: the whole K), o and down
# (row-parallel: a rank's K shard).
SHAPES=${SHAPES:-4096x1536 4096x7168 4096x32064 tp4:4096x4096 tp4:14336x4096}
MS=${MS:-1,8,32,64}
PATHS=${PATHS:-default wgcluster64 wgcluster64x2 wgcluster64x2n256 wgwhole224 wgwhole112 wgwhole64 wgwhole48 wgwhole32 wgquad96 wgquad64 wgquad128x128 wgquad128x64}
ROWS=$OUT/sweep-rows.txt
WORK=/tmp/arbor-sweep
mkdir -p "$WORK"
: >"$ROWS"
for spec in $SHAPES; do
    tp=1
    shape=$spec
    if [[ $spec == tp*:* ]]; then
        tp=${spec%%:*}
        tp=${tp#tp}
        shape=${spec#*:}
    fi
    for p in $PATHS; do
        args=(bench gemm --shapes "$shape" --m "$MS" --tp "$tp" --iters 30 --warmup 5
            --epilogue "${EPILOGUE:-store}" --x-rows "${X_ROWS:-model}")
        [[ $p == default ]] || args+=(--path "$p")
        log=$WORK/sweep-${spec/:/-}-$p.log
        rm -f "$log"
        step "$spec $p" "$log" 60 "$ARBOR" "${args[@]}" >/dev/null
        cat "$log" >>"$OUT/sweep.log"
        # Rows: K N M path arbor_ms cublas_ms ...; a path that cannot take the shape fails.
        awk -v s="$spec" -v p="$p" '
            $1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && NF > 6 {
                printf "%-18s %5d %-17s %9.2f %9.2f %s\n", s, $3, (p == "default" ? "default=" $4 : $4), 1000 * $5, 1000 * $6, ($0 ~ /FAIL/ ? "FAIL" : "")
            }' "$log" >>"$ROWS"
    done
done
{
    echo "shape              M     path              arbor_us cublas_us"
    sort -k1,1 -k2,2n -k4,4n "$ROWS"
    echo
    echo "fastest per (shape, M):"
    awk '$6 != "FAIL" { k = $1 " " $2; if (!(k in best) || $4 < best[k]) { best[k] = $4; bp[k] = $3; cb[k] = $5 } }
         END { for (k in best) printf "%-24s %-20s %8.2f us (cuBLAS %8.2f)\n", k, bp[k], best[k], cb[k] }' "$ROWS" | sort -k1,1 -k2,2n
} | tee -a "$SUMMARY"
echo "==== sweep-gemm-paths ($(elapsed) s)"
