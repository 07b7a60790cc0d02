#!/usr/bin/env bash
# The paged attention kernels next to PyTorch's flash attention, one device call:
#   scripts/gpu/build-device.sh            (here)
#   bash scripts/bench/bench-attention.sh    (there; carry .device)
# Prints both tables and the ratio arbor / reference per shape; files under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/arbor-out}
mkdir -p "$OUT"
BIN=${ARBOR_DEVICE_DIR:-.device}
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
ARGS=("$@")
"$BIN/arbor" bench attention "${ARGS[@]}" --out "$OUT/attention-arbor.json" 2>&1 | tee "$OUT/attention-arbor.txt"
python3 scripts/bench/attention-reference.py --out "$OUT/attention-reference.json" 2>&1 | tee "$OUT/attention-reference.txt"
python3 - "$OUT/attention-arbor.json" "$OUT/attention-reference.json" <<'PY'
import json, sys
a, r = (json.load(open(f)) for f in sys.argv[1:3])
ref = {(x["kind"], x["batch"], x["tokens"]): x for x in r}
print(f"\n{'kind':>8} {'batch':>6} {'tokens':>7} {'arbor us':>10} {'ref us':>10} {'arbor/ref':>10}")
for x in a:
    y = ref.get((x["kind"], x["batch"], x["tokens"]))
    if y:
        print(f"{x['kind']:>8} {x['batch']:>6} {x['tokens']:>7} {x['us']:>10.1f} {y['us']:>10.1f} {x['us'] / y['us']:>10.2f}")
PY
