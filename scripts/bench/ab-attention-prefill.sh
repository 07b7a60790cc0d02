#!/usr/bin/env bash
# One device call (carry [".device"]): the prefill attention kernel's builds side by side
# (ARBOR_ATTN_PREFILL_ROWS=64: 4 warps × 16 rows; 96: 3 warps × 32 rows, two m16 tiles per
# warp; wgmma: 64 rows on one warpgroup's wgmma, sm_90a; bits are the same in all), next to
# PyTorch's flash attention (scripts/bench/attention-reference.py) on the same shapes.
# First the kernels' GPU attention tests (every build bit for bit against the decode kernel).
# Run from the repo root after `bash scripts/gpu/build-device.sh`:
#   bash scripts/bench/ab-attention-prefill.sh   # $OUT/prefill-*.json|log, prefill-summary.txt
# PREFILL (default 8x1024,64x1024,4x8192,2x16384) and DECODE (64x1024) set the shapes,
# BUILDS (default "64 96 wgmma") the builds.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-290}
cd "$(dirname "$0")/../.."
source scripts/gpu/device-lib.sh
script_start prefill-summary.txt
need_binaries ab-attention-prefill.sh arbor tests/kernels-gpu
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1 | tee -a "$SUMMARY"

PREFILL=${PREFILL:-8x1024,64x1024,4x8192,2x16384}
DECODE=${DECODE:-64x1024}
BUILDS=${BUILDS:-64 96 wgmma}

step "kernel tests (paged attention, every prefill build)" "$OUT/prefill-tests.log" 150 \
    "$BIN/tests/kernels-gpu" paged_attention --test-threads 1
grep -E "^test |test result|panicked" "$OUT/prefill-tests.log" | tee -a "$SUMMARY"

# A value other than 64, 96 or wgmma is an error that names the variable (no silent fallback).
if ARBOR_ATTN_PREFILL_ROWS=80 timeout 30 "$ARBOR" bench attention --prefill 1x64 --decode "" --iters 1 \
    >"$OUT/prefill-badenv.log" 2>&1; then
    note "FAIL  ARBOR_ATTN_PREFILL_ROWS=80 was accepted"
elif grep -q "ARBOR_ATTN_PREFILL_ROWS" "$OUT/prefill-badenv.log"; then
    note "PASS  ARBOR_ATTN_PREFILL_ROWS=80 refused: $(grep -o 'ARBOR_ATTN_PREFILL_ROWS[^)]*)' "$OUT/prefill-badenv.log" | head -n 1)"
else
    note "FAIL  ARBOR_ATTN_PREFILL_ROWS=80 failed without naming the variable (prefill-badenv.log)"
fi

for rows in $BUILDS; do
    step "attention alone, prefill build $rows" "$OUT/prefill-attention.log" 60 \
        env ARBOR_ATTN_PREFILL_ROWS=$rows "$ARBOR" bench attention \
        --prefill "$PREFILL" --decode "$DECODE" --out "$OUT/prefill-attention-$rows.json"
done
step "PyTorch flash reference" "$OUT/prefill-reference.log" 90 python3 scripts/bench/attention-reference.py \
    --prefill "$PREFILL" --decode "$DECODE" --out "$OUT/prefill-reference.json"
grep -E "^reference" "$OUT/prefill-reference.log" | tee -a "$SUMMARY"

python3 - "$OUT" $BUILDS <<'PY' | tee -a "$SUMMARY"
import json, os, sys
d, builds = sys.argv[1], sys.argv[2:]
def load(name):
    try:
        return {(x["kind"], x["batch"], x["tokens"]): x["us"] for x in json.load(open(os.path.join(d, name)))}
    except Exception as e:
        print(f"({name}: {e})")
        return {}
runs = {b: load(f"prefill-attention-{b}.json") for b in builds}
ref = load("prefill-reference.json")
H, HD = 32, 128
print("\none layer of llama3-8b (32 heads, 8 KV heads, head_dim 128), us per call (median of 20);")
print("columns: ARBOR_ATTN_PREFILL_ROWS=" + ", ".join(builds) + "; flash: PyTorch SDPA; ratios: build / flash")
print("TFLOP/s: causal 4*B*H*T^2*hd/2 (prefill), 4*B*H*T*hd (decode)")
def f(x, w, p=1):
    return f"{x:>{w}.{p}f}" if x else f"{'-':>{w}}"
head = f"{'shape':>17}" + "".join(f" {b + ' us':>10}" for b in builds) + f" {'flash us':>9}"
head += "".join(f" {b + '/fl':>9}" for b in builds) + "".join(f" {b + ' TF/s':>11}" for b in builds) + f" {'flash TF/s':>11}"
print(head)
keys = set(ref).union(*[set(r) for r in runs.values()])
for key in sorted(keys, key=lambda k: (k[0] != "prefill", k[2], k[1])):
    kind, b, t = key
    r = ref.get(key)
    fl = 4 * b * H * t * t * HD / 2 if kind == "prefill" else 4 * b * H * t * HD
    tf = lambda us: fl / us / 1e6 if us else None
    us = [runs[x].get(key) for x in builds]
    line = f"{kind:>8} {b:>3}x{t:<5}" + "".join(f" {f(u, 10)}" for u in us) + f" {f(r, 9)}"
    line += "".join(f" {f(u / r if u and r else None, 9, 2)}" for u in us)
    line += "".join(f" {f(tf(u), 11)}" for u in us) + f" {f(tf(r), 11)}"
    print(line)
PY
note "==== ab-attention-prefill ($(elapsed) s)"
