#!/usr/bin/env bash
# Two builds of `arbor bench gemm` side by side on one GPU, alternating, each next to
# cuBLAS in its own process: the A/B of a GEMM kernel change. Prints one line per (shape,
# M): arbor µs and its speed as a fraction of cuBLAS's (cuBLAS time / arbor time) for A and B, and whether every check passed.
#   A=.gemmab/arbor-base B=.gemmab/arbor bash scripts/bench/gemm-ab.sh [bench args...]
# (device tool: carry the folder holding both binaries). ROUNDS=2 alternates A, B twice
# and reports each round, so the drift between calls shows next to the difference.
set -euo pipefail
A=${A:?set A to the baseline arbor binary}
B=${B:?set B to the changed arbor binary}
DEST=${OUT:-.}
ROUNDS=${ROUNDS:-1}
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader || true
status=0
for r in $(seq 1 "$ROUNDS"); do
    for side in A B; do
        bin=${!side}
        if ! "$bin" bench gemm --family wgmma --json "$DEST/gemm-$side-$r.json" "$@" >"$DEST/gemm-$side-$r.log" 2>&1; then
            echo "$side round $r: bench failed (exit $?); tail of its log:"
            tail -n 15 "$DEST/gemm-$side-$r.log"
            status=1
        fi
    done
done
python3 - "$DEST" "$ROUNDS" <<'PY'
import json, sys
dest, rounds = sys.argv[1], int(sys.argv[2])
def rows(side, r):
    try:
        rep = json.load(open(f"{dest}/gemm-{side}-{r}.json"))
    except (OSError, ValueError):
        return {}, None
    out = {}
    for x in rep["results"]:
        out[(x["global_k"], x["n"], x["tp"], x["m"])] = x
    return out, rep["all_checks_pass"]
for r in range(1, rounds + 1):
    a, a_ok = rows("A", r)
    b, b_ok = rows("B", r)
    print(f"round {r}: checks A {a_ok} B {b_ok}")
    print(f"{'K x N':>12} {'tp':>2} {'M':>5} | {'A path':>18} {'A us':>8} {'A speed':>8} | {'B path':>18} {'B us':>8} {'B speed':>8} | B/A time")
    for key in sorted(set(a) | set(b)):
        k, n, tp, m = key
        xa, xb = a.get(key), b.get(key)
        def cell(x):
            if x is None:
                return f"{'-':>18} {'-':>8} {'-':>8}"
            return f"{x['path']:>18} {x['arbor_ms']*1e3:8.1f} {x['ratio']:8.3f}"
        speed = f"{xb['arbor_ms']/xa['arbor_ms']:.3f}" if xa and xb else "-"
        print(f"{k:>6}x{n:<6} {tp:>2} {m:>5} | {cell(xa)} | {cell(xb)} | {speed}")
PY
exit "$status"
