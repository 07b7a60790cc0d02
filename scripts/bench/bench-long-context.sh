#!/usr/bin/env bash
# One device call (carry [".device"]): arbor at long contexts next to the PyTorch
# long-context reference (SDPA flash, cuBLAS, CUDA graph; `.device/long_context_reference.py`,
# not part of this repository: copy it into .device/ with the binaries), llama3-8b shape,
# random bf16 weights, one GPU. Run from the repo root after `bash scripts/gpu/build-device.sh`:
#   bash scripts/bench/bench-long-context.sh            # PART=short|long|all (default all)
# short: prefill 8 x 1024 and 64 x 1024, decode at ~1040 context, batch 1/64/128/256;
# long:  prefill 4 x 8192, decode at ~8200 context, batch 1/32, and at ~16400, batch 1/16.
# Each of arbor invariant, arbor fast and the reference runs the same shapes; the last
# table prints ms and the ratios invariant / reference and invariant / fast.
# Writes $OUT/long-summary.txt and long-raw.tgz (the runs' long-*.json and long-*.log,
# packed: the device tool brings back at most 8 files from $OUT).
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
source scripts/gpu/device-lib.sh
script_start long-summary.txt
PART=${PART:-all}
REF=$BIN/long_context_reference.py
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1 | tee -a "$SUMMARY"
l8b_model "$OUT/long-make.log"

# name, prompt tokens, new tokens, batches, the reference's prefill shapes. arbor's prefill
# figure of a shape B x T is the prefill of its decode run at batch B (prompts of T).
cases=()
[[ $PART == short || $PART == all ]] && cases+=("ctx1k 1024 17 1,8,64,128,256 8x1024,64x1024")
[[ $PART == long || $PART == all ]] && cases+=("ctx8k 8192 9 1,4,32 4x8192" "ctx16k 16384 9 1,16 -")

for c in "${cases[@]}"; do
    read -r name plen steps batches prefills <<<"$c"
    for num in invariant fast; do
        step "arbor $num decode $name" "$OUT/long-arbor.log" 200 "$ARBOR" bench decode --model "$L8B" \
            --device cuda --numerics "$num" --batch "$batches" --prompt-len "$plen" --steps "$steps" \
            --out "$OUT/long-decode-$name-$num.json"
        # This run's lines: one a batch (the log holds the earlier cases' too).
        grep -E "TP 1 $num" "$OUT/long-arbor.log" | tail -n "$(tr ',' '\n' <<<"$batches" | grep -c .)" |
            tee -a "$SUMMARY"
    done
    if [[ -f $REF ]]; then
        ctx=$((plen + steps - 1))
        pre=$prefills
        [[ $pre == - ]] && pre=""
        step "reference $name" "$OUT/long-reference.log" 300 python3 "$REF" --compile --prefill "$pre" \
            --decode "$batches" --ctx "$ctx" --out "$OUT/long-reference-$name.json"
        # This run's lines: its prefills and decode batches.
        n_ref=$(tr ',' '\n' <<<"$batches,$pre" | grep -c .)
        grep -E "^reference" "$OUT/long-reference.log" | tail -n "$n_ref" | tee -a "$SUMMARY"
    else
        note "SKIP  reference ($REF missing: copy long_context_reference.py into .device/)"
    fi
done

python3 - "$OUT" <<'PY' | tee -a "$SUMMARY"
import glob, json, os, sys
d = sys.argv[1]
def load(p):
    try:
        return json.load(open(p))
    except Exception:
        return None
print("\nllama3-8b shape, one GPU; ms (decode: per step; prefill: whole batch)")
print(f"{'work':>26} {'invariant':>10} {'fast':>9} {'reference':>10} {'inv/ref':>8} {'inv/fast':>9}")
for name in ("ctx1k", "ctx8k", "ctx16k"):
    ref = load(os.path.join(d, f"long-reference-{name}.json")) or {}
    inv = {r["batch"]: r for r in load(os.path.join(d, f"long-decode-{name}-invariant.json")) or []}
    fast = {r["batch"]: r for r in load(os.path.join(d, f"long-decode-{name}-fast.json")) or []}
    for b in sorted(set(inv) | set(fast)):
        i = inv.get(b, {}).get("decode_ms_per_step"); f = fast.get(b, {}).get("decode_ms_per_step")
        ctx = (inv.get(b) or fast.get(b))["prompt_len"]
        r = ref.get("decode", {}).get(str(b))
        row = lambda x: "—" if x is None else f"{x:.2f}"
        ratio = lambda a, c: "—" if a is None or not c else f"{a / c:.2f}"
        print(f"{f'decode ctx~{ctx} batch {b}':>26} {row(i):>10} {row(f):>9} {row(r):>10} {ratio(i, r):>8} {ratio(i, f):>9}")
    for p, r in sorted((ref.get("prefill") or {}).items()):
        b = int(p.split("x")[0])
        i = inv.get(b, {}).get("prefill_ms"); f = fast.get(b, {}).get("prefill_ms")
        row = lambda x: "—" if x is None else f"{x:.1f}"
        ratio = lambda a, c: "—" if a is None or not c else f"{a / c:.2f}"
        print(f"{'prefill ' + p:>26} {row(i):>10} {row(f):>9} {row(r):>10} {ratio(i, r):>8} {ratio(i, f):>9}")
PY
pack_raw long-raw 'long-*'
echo "==== bench-long-context ($(elapsed) s)"
