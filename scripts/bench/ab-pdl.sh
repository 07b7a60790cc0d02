#!/usr/bin/env bash
# One device call (carry [".device"]): programmatic dependent launch per step. The same
# binary's `bench decode` (llama3-8b shape, one GPU, 1024-token prompts, batch 8 and 256)
# with ARBOR_PDL=auto (the default: steps run op by op with 1024 rows or more launch
# without PDL), 1 (every step with it) and 0 (none), one after the other, then the table of
# prefill ms and decode ms per step. Bits are the same in all three (the kernels wait for
# their predecessor either way); only time moves.
# Run from the repo root after `bash scripts/gpu/build-device.sh`:
#   bash scripts/bench/ab-pdl.sh          # BATCHES (default 8,256), PROMPT (1024), STEPS (32)
# Writes $OUT/pdl-*.json|log and pdl-summary.txt.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
source scripts/gpu/device-lib.sh
script_start pdl-summary.txt
need_binaries ab-pdl.sh arbor
BATCHES=${BATCHES:-8,256}
PROMPT=${PROMPT:-1024}
STEPS=${STEPS:-32}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1 | tee -a "$SUMMARY"
l8b_model "$OUT/pdl-make.log"
for v in auto 1 0; do
    step "bench decode ARBOR_PDL=$v" "$OUT/pdl-$v.log" 170 env ARBOR_PDL=$v "$ARBOR" bench decode \
        --model "$L8B" --device cuda --batch "$BATCHES" --prompt-len "$PROMPT" --steps "$STEPS" \
        --out "$OUT/pdl-$v.json"
    grep -E "^TP 1" "$OUT/pdl-$v.log" | sed "s/^/ARBOR_PDL=$v  /" | tee -a "$SUMMARY"
done
python3 - "$OUT" <<'PY' | tee -a "$SUMMARY"
import json, os, sys
d = sys.argv[1]
runs = {}
for v in ("auto", "1", "0"):
    try:
        with open(os.path.join(d, f"pdl-{v}.json")) as f:
            runs[v] = {r["batch"]: r for r in json.load(f)}
    except (OSError, ValueError) as e:
        print(f"(pdl-{v}.json: {e})")
print(f"\n{'batch':>6} {'what':>8} {'auto':>10} {'PDL=1':>10} {'PDL=0':>10} {'auto/1':>8} {'auto/0':>8}")
for b in sorted({b for r in runs.values() for b in r}):
    for key, label in (("prefill_ms", "prefill"), ("decode_ms_per_step", "decode")):
        x = {v: runs[v][b][key] for v in runs if b in runs[v]}
        def cell(v):
            return f"{x[v]:>10.2f}" if v in x else f"{'-':>10}"
        def ratio(v):
            return f"{x['auto'] / x[v]:>8.3f}" if "auto" in x and v in x and x[v] else f"{'-':>8}"
        print(f"{b:>6} {label:>8} {cell('auto')} {cell('1')} {cell('0')} {ratio('1')} {ratio('0')}")
PY
note "==== ab-pdl ($(elapsed) s)"
