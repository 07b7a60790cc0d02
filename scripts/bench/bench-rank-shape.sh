#!/usr/bin/env bash
# One device call (carry [".device"]), one GPU: what one rank of a TP=N group computes in a
# decode step, collectives aside. `arbor make-model --per-rank-of-tp N` writes the
# llama3-8b shape with heads, KV heads, intermediate size and vocabulary divided by N; a
# TP=1 `bench decode` of it runs a rank's GEMMs, attention and LM head (and its host work),
# with decode steps from CUDA graphs and op by op. A TP=N step costs this plus its 2 x
# layers all-reduces and the logits all-gather: measure those with `arbor bench allreduce`
# on a machine of N GPUs. `bench decode --rank-of-tp N` reduces the model's o and down as
# rank 0's shard of TP N (8/N of the segments), the tiles a real rank runs.
#   RANKS="2 4 8" MODES="graphs eager" BATCHES=1,8,32,64 bash scripts/bench/bench-rank-shape.sh
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
source scripts/gpu/device-lib.sh
script_start rank-shape-summary.txt
RANKS=${RANKS:-2 4 8}
MODES=${MODES:-graphs eager}
BATCHES=${BATCHES:-1,8,32,64}
STEPS=${STEPS:-64}
for n in $RANKS; do
    rank_model "$n" "$OUT/rank-shape.log"
    dir=$RANK_MODEL
    for mode in $MODES; do
        graphs=1
        [[ $mode == eager ]] && graphs=0
        log=/tmp/arbor-rank-shape-$n-$mode.log
        rm -f "$log"
        step "rank of TP $n, $mode" "$log" 120 env ARBOR_CUDA_GRAPHS=$graphs \
            "$ARBOR" bench decode --model "$dir" --device cuda --batch "$BATCHES" --steps "$STEPS" \
            --rank-of-tp "$n" --out "$OUT/rank-shape-tp$n-$mode.json"
        cat "$log" >>"$OUT/rank-shape.log"
        grep -E "^TP 1 " "$log" | sed "s/^TP 1/rank of TP $n ($mode):/" | tee -a "$SUMMARY"
    done
done
echo "==== bench-rank-shape ($(elapsed) s)"
cat "$SUMMARY"
