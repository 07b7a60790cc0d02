#!/usr/bin/env bash
# One device call (carry [".device"]), one GPU: what one rank of a TP=N group computes in a
# decode step, collectives aside. `arbor make-model --per-rank-of-tp N` writes the
# llama3-8b shape with heads, KV heads, intermediate size and vocabulary divided by N; a
# TP=1 `bench decode` of it runs a rank's GEMMs, attention and LM head (and its host work),
# with decode steps from CUDA graphs and op by op. A TP=N step costs this plus its 2 x
# layers all-reduces and the logits all-gather: measure those with `arbor bench allreduce`
# on a machine of N GPUs. Not quite a rank's work: its row-parallel GEMMs (o, down) reduce
# their K as 8 segments where a real rank's shard is 8/N of them (same bytes, other tiles).
#   RANKS="4" BATCHES=1,8,32,64 bash scripts/bench-rank-shape.sh
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
source scripts/device-lib.sh
script_start rank-shape-summary.txt
RANKS=${RANKS:-4}
BATCHES=${BATCHES:-1,8,32,64}
STEPS=${STEPS:-64}
for n in $RANKS; do
    rank_model "$n" "$OUT/rank-shape-make.log"
    dir=$RANK_MODEL
    for mode in graphs eager; do
        graphs=1
        [[ $mode == eager ]] && graphs=0
        step "rank of TP $n, $mode" "$OUT/rank-shape-$n-$mode.log" 120 env ARBOR_CUDA_GRAPHS=$graphs \
            "$ARBOR" bench decode --model "$dir" --device cuda --batch "$BATCHES" --steps "$STEPS" \
            --out "$OUT/rank-shape-tp$n-$mode.json"
        grep -E "^TP 1 " "$OUT/rank-shape-$n-$mode.log" | sed "s/^TP 1/rank of TP $n ($mode):/" | tee -a "$SUMMARY"
    done
done
echo "==== bench-rank-shape ($(elapsed) s)"
cat "$SUMMARY"
