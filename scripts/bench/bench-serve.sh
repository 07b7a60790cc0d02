#!/usr/bin/env bash
# One device call (carry [".device"]): `arbor serve` with its DEFAULT engine flags under a
# long-prompt load, invariant numerics next to --numerics fast, llama3-8b shape, one GPU.
# Run from the repo root after `bash scripts/gpu/build-device.sh`:
#   bash scripts/bench/bench-serve.sh
# Environment: CLIENTS (256), REQUESTS (768), PROMPTS (128:2048), OUTPUTS (128:1024),
# REPEATS (2), SHARED (0: tokens every prompt starts with, for the prefix cache), EXTRA
# (more server flags for both runs), TP (1: the server's ranks, one per GPU), NUMERICS
# ("invariant fast"). Prints throughput, TTFT and inter-token percentiles per numerics and
# their ratio, and the engine's steps split into decode-only steps and steps with prompt
# rows (count, mean ms, rows); distinct outputs per repeated prompt must be 1 for the
# invariant server (the fast one may differ: it says so). Writes $OUT/serve-*.json|log and
# serve-summary.txt.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
source scripts/gpu/device-lib.sh
script_start serve-summary.txt
CLIENTS=${CLIENTS:-256}
REQUESTS=${REQUESTS:-768}
PROMPTS=${PROMPTS:-128:2048}
OUTPUTS=${OUTPUTS:-128:1024}
REPEATS=${REPEATS:-2}
SHARED=${SHARED:-0}
TP=${TP:-1}
NUMERICS=${NUMERICS:-invariant fast}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1 | tee -a "$SUMMARY"
l8b_model "$OUT/serve-make.log"
for num in $NUMERICS; do
    # shellcheck disable=SC2086 # EXTRA is a list of flags on purpose
    step "serve TP $TP $num" "$OUT/serve-$num.log" 260 "$ARBOR" bench serve --model "$L8B" --device cuda --tp "$TP" \
        --requests "$REQUESTS" --concurrency "$CLIENTS" --prompt-len "$PROMPTS" --output-len "$OUTPUTS" \
        --repeat "$REPEATS" --shared-prefix "$SHARED" --temperature 0.8 --server-args "--numerics $num ${EXTRA:-}" \
        --json "$OUT/serve-$num.json"
    grep -E "listening|capacity|KV cache|^requests|^throughput|^TTFT|^inter-token|^end-to-end|^distinct|^prefix cache|^engine steps|^decode-only steps|^serving loop|fast numerics" \
        "$OUT/serve-$num.log" | tee -a "$SUMMARY"
done
python3 - "$OUT" <<'PY' | tee -a "$SUMMARY"
import json, os, sys
d = sys.argv[1]
r = {}
for n in ("invariant", "fast"):
    try:
        r[n] = json.load(open(os.path.join(d, f"serve-{n}.json")))
    except Exception:
        pass
if len(r) == 2:
    a, b = r["invariant"], r["fast"]
    print(f"output tok/s: invariant {a['output_tokens_per_s']:.0f}, fast {b['output_tokens_per_s']:.0f}, "
          f"invariant / fast {a['output_tokens_per_s'] / b['output_tokens_per_s']:.3f}")
    for n, x in r.items():
        print(f"{n:>9}: TTFT p50/p90/p99 {x['ttft_ms_p50']:.0f}/{x['ttft_ms_p90']:.0f}/{x['ttft_ms_p99']:.0f} ms, "
              f"inter-token p50/p90/p99 {x['itl_ms_p50']:.1f}/{x['itl_ms_p90']:.1f}/{x['itl_ms_p99']:.1f} ms, "
              f"distinct outputs per repeated prompt {x['max_distinct_outputs_per_prompt']}, failed {x['requests_failed']}")
PY
echo "==== bench-serve ($(elapsed) s)"
