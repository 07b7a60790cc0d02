#!/usr/bin/env bash
# The mixture-of-experts models (Qwen3-MoE, Mixtral) on the CUDA backend, in one device
# call. Run ON the GPU machine from the repo root, with binaries staged by
# scripts/gpu/build-device.sh (device tool: carry [".device"]):
#
#   scripts/gpu/moe-check.sh
#
# Parts ($PARTS, default tests,check,graphs,prefix,shadow, run in that order while the
# budget lasts):
#   tests  = the model tests of tests/gpu_model.rs that run MoE models: CPU vs GPU logits
#            per row, prefill == decode == a row in a batch, `run_step` with recording on
#            equal to op by op (and never replayed while routing reads the host);
#   check  = `arbor check --device cuda --tp $TPS --batch $CHECK_BATCH --ranks-per-gpu auto`
#            on tiny qwen3-moe and mixtral models, greedy and seeded top-p (every TP on the
#            GPUs there are: on one GPU all ranks share it), each with score == generate;
#   graphs = generate at TP 1 with CUDA graphs on (the default) vs ARBOR_CUDA_GRAPHS=0:
#            byte-identical records;
#   prefix = generate at TP 2 with the prefix cache (prompts sharing a prefix) vs
#            --no-prefix-cache: byte-identical records;
#   shadow = generate --shadow-tp1 at TP 4 (every layer's hidden state equal to TP 1's).
# Output in $OUT (default ./moe-check-out): summary.txt, tests.log, moe.log, reports.tar;
# the summary and the check tables print last. Exit 1 if anything failed or timed out.
# Environment: TPS (default 1,2,4,8), CHECK_BATCH (default 1,3,8), ARCHS (default
# "qwen3-moe mixtral"), BUDGET_S (default 570). The four checks at TP 1/2/4/8 on one GPU
# may not fit one call's budget: run PARTS=check once per ARCHS, the rest in another call.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-./moe-check-out}
BIN=${ARBOR_DEVICE_DIR:-.device}
TPS=${TPS:-1,2,4,8}
CHECK_BATCH=${CHECK_BATCH:-1,3,8}
PARTS=${PARTS:-tests,check,graphs,prefix,shadow}
ARCHS=${ARCHS:-qwen3-moe mixtral}
BUDGET_S=${BUDGET_S:-570}
WORK=${WORK:-/tmp/arbor-moe-check}
T0=$(date +%s)
mkdir -p "$OUT" "$WORK"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
part() { [[ ,$PARTS, == *,$1,* ]]; }

source scripts/gpu/device-lib.sh
need_binaries moe-check arbor arbor-launch tests/model-gpu

TESTS_LOG=$OUT/tests.log
LOG=$OUT/moe.log
REPORTS=$WORK/reports
rm -rf "$REPORTS"
mkdir -p "$REPORTS"
{
    echo "moe-check on $(hostname) at $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
} 2>&1 | tee -a "$SUMMARY"

if part tests; then
    # The test names that run MoE models: the MoE tests and the prefill/decode/batch test.
    for t in gpu_moe_ gpu_prefill_decode_and_batch_are_bit_identical; do
        step "model tests: $t" "$TESTS_LOG" 240 "$BIN/tests/model-gpu" --test-threads=1 --nocapture "$t"
    done
    grep -s -h -o "CPU vs GPU logits (.*\|[a-z0-9-]*: [0-9]* decode shapes recorded.*" "$TESTS_LOG" | tee -a "$SUMMARY"
    if grep -s -q "skipped:" "$TESTS_LOG"; then
        note "FAIL  GPU tests skipped: $(grep -h -o 'skipped: .*' "$TESTS_LOG" | sort -u | head -n 1)"
    fi
fi

prompts "$WORK/prompts.jsonl" 8 250
long_prompts "$WORK/shared-prefix.jsonl" 6 250 150 400 130
for arch in $ARCHS; do
    M=$WORK/$arch
    rm -rf "$M"
    step "make tiny $arch" "$LOG" 60 "$ARBOR" make-model --arch "$arch" --out "$M" || continue
    if part check; then
        step "check $arch greedy" "$LOG" 200 "$ARBOR" check --model "$M" --device cuda \
            --ranks-per-gpu auto --tp "$TPS" --batch "$CHECK_BATCH" --prompts "$WORK/prompts.jsonl" \
            --max-tokens 16 --json "$REPORTS/$arch-greedy.json"
        step "check $arch seeded top-p" "$LOG" 200 "$ARBOR" check --model "$M" --device cuda \
            --ranks-per-gpu auto --tp "$TPS" --batch "$CHECK_BATCH" --prompts "$WORK/prompts.jsonl" \
            --max-tokens 16 --temperature 0.8 --top-p 0.9 --seed 1234 --json "$REPORTS/$arch-seeded.json"
    fi
    if part graphs; then
        a=$WORK/$arch-graphs.jsonl b=$WORK/$arch-eager.jsonl
        rm -f "$a" "$b"
        step "$arch generate, CUDA graphs on" "$LOG" 120 "$ARBOR" generate --model "$M" --device cuda \
            --prompts "$WORK/prompts.jsonl" --batch 3 --max-tokens 24 --logprobs 3 --out "$a" &&
            step "$arch generate, ARBOR_CUDA_GRAPHS=0" "$LOG" 120 env ARBOR_CUDA_GRAPHS=0 "$ARBOR" generate \
                --model "$M" --device cuda --prompts "$WORK/prompts.jsonl" --batch 3 --max-tokens 24 \
                --logprobs 3 --out "$b" &&
            if [[ -s $a ]] && cmp -s "$a" "$b"; then
                note "PASS  $arch: records with graphs on byte-identical to op by op ($(wc -l <"$a") records)"
            else
                note "FAIL  $arch: records with graphs on differ from op by op (see $a, $b)"
            fi
    fi
    if part prefix; then
        a=$WORK/$arch-cached.jsonl b=$WORK/$arch-recomputed.jsonl
        rm -f "$a" "$b"
        step "$arch generate TP=2, prefix cache" "$LOG" 150 "$LAUNCH" -n 2 --ranks-per-gpu auto \
            --output rank0 -- "$ARBOR" generate --model "$M" --device cuda \
            --prompts "$WORK/shared-prefix.jsonl" --batch 2 --max-tokens 16 --logprobs 2 \
            --temperature 0.8 --seed 5 --out "$a" &&
            step "$arch generate TP=2, no prefix cache" "$LOG" 150 "$LAUNCH" -n 2 --ranks-per-gpu auto \
                --output rank0 -- "$ARBOR" generate --model "$M" --device cuda \
                --prompts "$WORK/shared-prefix.jsonl" --batch 2 --max-tokens 16 --logprobs 2 \
                --temperature 0.8 --seed 5 --no-prefix-cache --out "$b" &&
            if [[ -s $a ]] && cmp -s "$a" "$b"; then
                note "PASS  $arch: prefix-cached records byte-identical to recomputed ($(wc -l <"$a") records)"
            else
                note "FAIL  $arch: prefix-cached records differ from recomputed (see $a, $b)"
            fi
    fi
    if part shadow; then
        step "$arch generate --shadow-tp1 TP=4" "$LOG" 150 "$LAUNCH" -n 4 --ranks-per-gpu auto -- \
            "$ARBOR" generate --model "$M" --device cuda --shadow-tp1 --prompts "$WORK/prompts.jsonl" \
            --batch 8 --max-tokens 12
    fi
done

tar -C "$WORK" -cf "$OUT/reports.tar" reports 2>/dev/null

echo
echo "==================== moe-check: results (TP $TPS; $(elapsed) s) ===================="
cat "$SUMMARY"
awk '/^=== check /{name=$3 " " $4} /prompts x [0-9]+ configurations/{p=1; print "\n--- " name} p{print} /^RESULT:/{p=0}' "$LOG" |
    grep -v '^unique outputs: \|^top-5 divergence: '
grep -q '^FAIL\|^TIME' "$SUMMARY" && exit 1
exit 0
