#!/usr/bin/env bash
# One device call (single GPU, carry [".device"]): where a decode step's time goes, and the
# reference loop on the same GPU. Run from the repo root after scripts/build-device.sh and
# `cp ../shared/anchors/decode_baseline.py .device/`:
#   bash scripts/profile-decode.sh            # writes $OUT/profile-*.txt
# Steps: llama3-8b-shape random model; `arbor generate` timing at batch 1/8/32/64 (TP 1);
# nsys of batch 1 and 8 (CUDA API + kernel + memcpy summaries); the PyTorch reference loop.
# With HF_COMPARE=1 it first runs scripts/hf-compare.py (issue 12's transformers check).
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
OUT=${OUT:-/tmp/arbor-out}
mkdir -p "$OUT"
SUMMARY=$OUT/profile-summary.txt
: >"$SUMMARY"
source scripts/device-lib.sh
BIN=${ARBOR_DEVICE_DIR:-.device}
ARBOR=$BIN/arbor
WORK=/tmp/arbor-profile
mkdir -p "$WORK"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$SUMMARY"

if [[ ${HF_COMPARE:-0} == 1 ]]; then
    step "hf-compare" "$OUT/hf-compare.log" 240 python3 scripts/hf-compare.py --arbor "$ARBOR" \
        --out "$OUT/hf-compare.json"
    grep -E '^(ok|FAIL) |configurations agree|^transformers' "$OUT/hf-compare.log" | tee -a "$SUMMARY"
fi

L8B=$WORK/l8b
step "make llama3-8b" "$WORK/make.log" 150 "$ARBOR" make-model --preset llama3-8b --out "$L8B" --force
prompts "$WORK/p64.jsonl" 64 128256
# 128-token prompts, as the reference loop uses.
awk 'BEGIN{for(i=0;i<64;i++){s="";for(j=0;j<128;j++)s=s (j?",":"") ((i*7919+j*104729+13)%128255)+1; printf "{\"id\":%d,\"tokens\":[%s]}\n",i,s}}' >"$WORK/p128.jsonl"
for b in 1 8 32 64; do
    head -n "$b" "$WORK/p128.jsonl" >"$WORK/b$b.jsonl"
    step "arbor TP1 batch $b" "$OUT/profile-timing.log" 120 "$ARBOR" generate --model "$L8B" \
        --device cuda --prompts "$WORK/b$b.jsonl" --batch "$b" --max-tokens 64 --max-seq-len 256 --out "$WORK/o$b.jsonl"
    grep '^timing' "$OUT/profile-timing.log" | tail -n 1 | sed "s/^/batch $b: /" | tee -a "$SUMMARY"
done
if command -v nsys >/dev/null; then
    for b in 1 8; do
        step "nsys batch $b" "$OUT/profile-nsys.log" 150 nsys profile -o "$WORK/nsys-b$b" --force-overwrite true \
            --trace=cuda,osrt "$ARBOR" generate --model "$L8B" --device cuda --prompts "$WORK/b$b.jsonl" \
            --batch "$b" --max-tokens 32 --max-seq-len 256 --out "$WORK/n$b.jsonl"
        nsys stats --report cuda_api_sum --report cuda_gpu_kern_sum --report cuda_gpu_mem_time_sum \
            --report osrt_sum --format table "$WORK/nsys-b$b.nsys-rep" >"$OUT/profile-nsys-b$b.txt" 2>&1
        head -c 20000 "$OUT/profile-nsys-b$b.txt" >/dev/null
    done
else
    note "SKIP  nsys (not installed)"
fi
if [[ -f $BIN/decode_baseline.py ]]; then
    step "reference loop TP1" "$OUT/profile-reference.log" 240 python3 "$BIN/decode_baseline.py" \
        --compile --batch 1,8,32,64 --out "$OUT/reference-tp1.json"
    tail -n 6 "$OUT/profile-reference.log" | tee -a "$SUMMARY"
fi
echo "==== profile-decode ($(elapsed) s)"
cat "$SUMMARY"
