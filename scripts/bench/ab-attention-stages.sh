#!/usr/bin/env bash
# One device call (carry [".device"]): the decode attention kernel's builds (how many
# warps share a block and how far ahead it loads: ARBOR_ATTN_DECODE 1, 2, wide or the
# automatic choice; bits are the same in all of them) side by side, alone and in the llama3-8b decode step, next to the PyTorch
# long-context reference at ~1k context; `arbor check` of batch 1 against batch 128 (the
# GEMMs' M = 128 paths). STAGES="2 1 wide auto" (attention alone), DECODE_STAGES="2 auto". Run from the repo root after
# `bash scripts/gpu/build-device.sh` (and a copy of long_context_reference.py in .device/):
#   bash scripts/bench/ab-attention-stages.sh     # writes $OUT/stages-summary.txt, stages-raw.tgz
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
source scripts/gpu/device-lib.sh
script_start stages-summary.txt
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1 | tee -a "$SUMMARY"

# The variants give the prefill kernel's bits (every head dim, splits, combine).
step "kernel tests (paged attention, every decode variant)" "$OUT/stages-tests.log" 120 \
    "$BIN/tests/kernels-gpu" paged_attention --test-threads 1
grep -E "test result|panicked" "$OUT/stages-tests.log" | tee -a "$SUMMARY"

DEC=1x1024,8x1024,64x1024,128x1024,256x1024,1x8192,4x8192,32x8192,1x16384,16x16384
for st in ${STAGES:-2 1 wide auto}; do
    env_st=()
    [[ $st != auto ]] && env_st=(env ARBOR_ATTN_DECODE=$st)
    step "attention alone, stages $st" "$OUT/stages-attention.log" 60 "${env_st[@]}" "$BIN/arbor" bench attention \
        --prefill "" --decode "$DEC" --out "$OUT/stages-attention-$st.json"
done
python3 - "$OUT" <<'PY' | tee -a "$SUMMARY"
import json, os, sys
d = sys.argv[1]
runs = {}
for st in ("2", "1", "wide", "auto"):
    try:
        runs[st] = {(x["batch"], x["tokens"]): x["us"] for x in json.load(open(os.path.join(d, f"stages-attention-{st}.json"))) if x["kind"] == "decode"}
    except Exception as e:
        runs[st] = {}
print("\ndecode attention, one layer of llama3-8b, us per call (stages 2: the kernel before)")
print(f"{'batch x context':>16}" + "".join(f"{'stages ' + s:>12}" for s in runs) + f"{'auto/2':>8}")
for key in sorted(runs.get("2") or runs.get("auto") or {}, key=lambda k: (k[1], k[0])):
    row = "".join(f"{runs[s].get(key, float('nan')):>12.1f}" for s in runs)
    a, b = runs.get("auto", {}).get(key), runs.get("2", {}).get(key)
    print(f"{key[0]:>7} x {key[1]:<6}" + row + (f"{a / b:>8.2f}" if a and b else ""))
PY

l8b_model "$OUT/stages-make.log"
vocab=$(grep -o '"vocab_size": *[0-9]*' "$L8B/config.json" | grep -o '[0-9]*$')
prompts "$OUT/stages-prompts.jsonl" 128 "${vocab:-128256}"
step "check l8b TP 1, batch 1 against 128" "$OUT/stages-check.log" 240 "$ARBOR" check --model "$L8B" \
    --device cuda --tp 1 --batch 1,128 --prompts "$OUT/stages-prompts.jsonl" --max-tokens 8
grep -iE "unique|identical|differ|PASS|FAIL" "$OUT/stages-check.log" | tail -n 4 | tee -a "$SUMMARY"
for st in ${DECODE_STAGES:-2 auto}; do
    env_st=()
    [[ $st != auto ]] && env_st=(env ARBOR_ATTN_DECODE=$st)
    for c in "1024 17 1,8,64,128,256" "8192 9 1,4,32"; do
        read -r plen steps batches <<<"$c"
        step "decode ctx $plen stages $st" "$OUT/stages-decode.log" 150 "${env_st[@]}" "$ARBOR" bench decode \
            --model "$L8B" --device cuda --numerics invariant --batch "$batches" --prompt-len "$plen" \
            --steps "$steps" --out "$OUT/stages-decode-$plen-$st.json"
        grep -E "TP 1 invariant" "$OUT/stages-decode.log" | tail -n 5 | sed "s/^/[stages $st] /" | tee -a "$SUMMARY"
    done
done
REF=$BIN/long_context_reference.py
if [[ -f $REF ]]; then
    step "reference ctx1k decode" "$OUT/stages-reference.log" 200 python3 "$REF" --compile --prefill "" \
        --decode 1,8,64,128,256 --ctx 1040 --out "$OUT/stages-reference-1024.json"
    grep -E "^reference" "$OUT/stages-reference.log" | tail -n 6 | tee -a "$SUMMARY"
fi
python3 - "$OUT" <<'PY' | tee -a "$SUMMARY"
import json, os, sys
d = sys.argv[1]
def load(p):
    try:
        return json.load(open(os.path.join(d, p)))
    except Exception:
        return None
print("\nllama3-8b decode step, ms (invariant numerics); reference: PyTorch SDPA + compile + CUDA graph")
print(f"{'context':>8} {'batch':>6} {'stages 2':>9} {'auto':>9} {'auto/2':>7} {'reference':>10} {'auto/ref':>9}")
ref = load("stages-reference-1024.json") or {}
refd = {int(k): v for k, v in (ref.get("decode") or {}).items()}
for plen in ("1024", "8192"):
    a = {r["batch"]: r for r in load(f"stages-decode-{plen}-auto.json") or []}
    b = {r["batch"]: r for r in load(f"stages-decode-{plen}-2.json") or []}
    for bt in sorted(set(a) | set(b)):
        ma = a.get(bt, {}).get("decode_ms_per_step")
        mb = b.get(bt, {}).get("decode_ms_per_step")
        rf = refd.get(bt) if plen == "1024" else None
        f = lambda x: f"{x:.3f}" if x else "-"
        print(f"{plen:>8} {bt:>6} {f(mb):>9} {f(ma):>9} {(ma / mb if ma and mb else float('nan')):>7.2f} {f(rf):>10} {(ma / rf if ma and rf else float('nan')):>9.2f}")
PY
pack_raw stages-raw 'stages-*'
note "==== ab-attention-stages ($(elapsed) s)"
