#!/usr/bin/env bash
# One device call (carry [".device"]): TP 1 against TP 8 with the ranks sharing the GPUs
# there are (`--ranks-per-gpu auto`), the llama3-8b shape, 24 prompts of 200–1500 tokens
# (half of them sharing a 300-token prefix), BATCH (default 8) per step, 8 new tokens. On
# one 80 GB GPU the eight ranks' step working memory leaves the cache no block at 8192-row
# steps: the offline command cuts its steps to fit (docs/serving.md, KV capacity), and
# rank 0 logs the cut. Run from the repo root after `bash scripts/gpu/build-device.sh`:
#   bash scripts/gpu/tp8-long-prompts.sh     # writes $OUT/tp8-long-summary.txt, tp8-long.tgz
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
source scripts/gpu/device-lib.sh
script_start tp8-long-summary.txt
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$SUMMARY"
l8b_model "$OUT/tp8-long-make.log"
W=$(mktemp -d)
vocab=$(grep -o '"vocab_size": *[0-9]*' "$L8B/config.json" | grep -o '[0-9]*$')
long_prompts "$W/long.jsonl" 24 "${vocab:-128256}" 200 1500 300
step "check TP 1,8 --ranks-per-gpu auto, batch ${BATCH:-8}" "$OUT/tp8-long-check.log" $((BUDGET_S - $(elapsed) - 10)) \
    env RUST_LOG=warn "$ARBOR" check --model "$L8B" --device cuda --tp 1,8 --ranks-per-gpu auto \
    --batch "${BATCH:-8}" --prompts "$W/long.jsonl" --max-tokens 8
grep -E "steps cut|identical|differ|RESULT|no GPU memory" "$OUT/tp8-long-check.log" | tail -n 8 | tee -a "$SUMMARY"
(cd "$OUT" && tar czf tp8-long.tgz tp8-long-*.log && rm -f tp8-long-*.log)
echo "==== tp8-long-prompts ($(elapsed) s)"
