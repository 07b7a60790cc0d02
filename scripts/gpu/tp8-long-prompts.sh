#!/usr/bin/env bash
# One device call (carry [".device"]): TP 1 against TP 8 with the ranks sharing the GPUs
# there are (`--ranks-per-gpu auto`), the llama3-8b shape, PROMPTS (default 24) prompts of
# 200–1500 tokens (half of them sharing a 300-token prefix), BATCH (default 8) per step, 8
# new tokens. On one 80 GB GPU, with 24 prompts, the eight ranks' working memory for
# 8192-row steps leaves the cache no block: the offline command cuts its steps to fit
# (docs/serving.md, KV capacity), and rank 0 logs the cut. `arbor check --rank-logs` lets
# the ranks' logs into the log whether or not they fail. Run from the repo root after
# `bash scripts/gpu/build-device.sh`:
#   bash scripts/gpu/tp8-long-prompts.sh     # writes $OUT/tp8-long-summary.txt, tp8-long.tgz
# Eight ranks on one H100 took 177 s for 12 prompts (collectives staged through the host).
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-590}
source scripts/gpu/device-lib.sh
script_start tp8-long-summary.txt
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$SUMMARY"
l8b_model "$OUT/tp8-long-make.log"
W=$(mktemp -d)
vocab=$(grep -o '"vocab_size": *[0-9]*' "$L8B/config.json" | grep -o '[0-9]*$')
long_prompts "$W/long.jsonl" "${PROMPTS:-24}" "${vocab:-128256}" 200 1500 300
step "check TP 1,8 --ranks-per-gpu auto, ${PROMPTS:-24} prompts, batch ${BATCH:-8}" "$OUT/tp8-long-check.log" \
    $((BUDGET_S - $(elapsed) - 10)) \
    env RUST_LOG=warn,arbor_model::runner=info "$ARBOR" check --model "$L8B" --device cuda --tp 1,8 \
    --ranks-per-gpu auto --batch "${BATCH:-8}" --prompts "$W/long.jsonl" --max-tokens 8 --rank-logs
grep -E "steps cut|KV cache rank=0|ok \(|RESULT|no GPU memory|error" "$OUT/tp8-long-check.log" | tail -n 12 |
    tee -a "$SUMMARY"
(cd "$OUT" && tar czf tp8-long.tgz tp8-long-*.log && rm -f tp8-long-*.log)
echo "==== tp8-long-prompts ($(elapsed) s)"
