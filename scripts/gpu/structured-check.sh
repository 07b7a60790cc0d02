#!/usr/bin/env bash
# Structured decoding on the GPU, in one device call: its cost in decode throughput and its
# bits across TP sizes. Run ON the GPU machine from the repo root, with binaries staged by
# scripts/gpu/build-device.sh (device tool: carry [".device"]):
#
#   scripts/gpu/structured-check.sh
#
# 1. A random-weight model of the llama3-8b shape cut to $LAYERS layers (default 8: ~5.5 GB
#    of bf16; decode at batch 64 is bound by the GPU), its byte-level tokenizer given
#    128256 tokens (scripts/gpu/structured-check.py vocab) so that llguidance's tables
#    have a real vocabulary's size, and a chat template that calls tools Hermes-style.
# 2. `arbor serve` at TP 1: $STREAMS concurrent streams (default 64) of $TOKENS tokens
#    (default 256) each, unconstrained, with a JSON schema (response_format) and with a
#    forced tool call, $REPEAT rounds in turn (default 5; the median reported); decode
#    tokens/s side by side with each constrained mode's ratio to the unconstrained one.
#    PASS when both cost at most $MAX_COST (default 0.05) of the throughput, measured as
#    rank 0's loop time per step (plan, execute, apply; /metrics), next to the whole-run
#    engine rate and the clients' window rate.
# 3. The same constrained requests (JSON schema and forced tool call, greedy and seeded,
#    with log-probs) at TP 1, 2 and 4, all ranks on this one GPU
#    (ARBOR_RANKS_PER_GPU=auto): PASS when tokens, log-probs and digests are identical.
# Output in $OUT (default ./structured-check-out): summary.txt, serve-tp*.log, speed.json,
# bits-tp*.json. The summary prints last; exit 1 if anything failed or timed out.
# Environment: DEVICE=cpu runs the same steps on the tiny model on the CPU (a check of
# this script; binaries from target/release unless ARBOR_DEVICE_DIR is set), BUDGET_S
# (default 570), TPS (default 1,2,4), MODEL_DIR (default /tmp/arbor-structured-model-$DEVICE,
# reused if it holds the model of the same MODEL_ARGS), MODEL_ARGS (make-model's flags;
# default "--preset llama3-8b --layers $LAYERS", on the CPU "--preset tiny"), VOCAB (give the
# model this many tokens, embedding and LM head widened: `DEVICE=cpu VOCAB=128256 STREAMS=64
# TPS=1` measures the host's cost of constrained rows, the tiny model's forward being cheap).
set -uo pipefail
cd "$(dirname "$0")/../.."

DEVICE=${DEVICE:-cuda}
OUT=${OUT:-./structured-check-out}
if [[ $DEVICE == cpu ]]; then
    BIN=${ARBOR_DEVICE_DIR:-target/release}
    STREAMS=${STREAMS:-8}
    TOKENS=${TOKENS:-48}
    REPEAT=${REPEAT:-2}
    BITS_TOKENS=${BITS_TOKENS:-40}
else
    BIN=${ARBOR_DEVICE_DIR:-.device}
    STREAMS=${STREAMS:-64}
    TOKENS=${TOKENS:-256}
    REPEAT=${REPEAT:-5}
    BITS_TOKENS=${BITS_TOKENS:-96}
fi
LAYERS=${LAYERS:-8}
TPS=${TPS:-1,2,4}
MAX_COST=${MAX_COST:-0.05}
BUDGET_S=${BUDGET_S:-570}
MODEL_DIR=${MODEL_DIR:-/tmp/arbor-structured-model-$DEVICE}
T0=$(date +%s)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
rm -f "$OUT"/*.log "$OUT"/*.json
source scripts/gpu/device-lib.sh
need_binaries structured-check arbor arbor-launch
export ARBOR_RANKS_PER_GPU=auto
PY=scripts/gpu/structured-check.py
FAILED=0

{
    echo "structured-check on $(hostname) at $(date -u +%FT%TZ), device $DEVICE"
    [[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
} | tee -a "$SUMMARY"

# 1. The model.
LOG=$OUT/model.log
if [[ -z ${MODEL_ARGS:-} ]]; then
    if [[ $DEVICE == cpu ]]; then
        MODEL_ARGS="--preset tiny"
    else
        MODEL_ARGS="--preset llama3-8b --layers $LAYERS"
    fi
fi
STAMP=$MODEL_DIR/.structured-check
if [[ -f $STAMP && $(cat "$STAMP") == "$MODEL_ARGS${VOCAB:+ vocab $VOCAB}" ]]; then
    note "PASS  the model in $MODEL_DIR (reused: $MODEL_ARGS)"
else
    rm -rf "$MODEL_DIR"
    # shellcheck disable=SC2086 # MODEL_ARGS is a list of flags
    step "make the model: $MODEL_ARGS" "$LOG" 300 "$ARBOR" make-model $MODEL_ARGS --out "$MODEL_DIR" ||
        FAILED=1
    if [[ -n ${VOCAB:-} ]]; then
        step "widen the model to $VOCAB tokens" "$LOG" 120 python3 "$PY" widen "$MODEL_DIR" \
            "$VOCAB" || FAILED=1
    fi
    vocab=$(grep -o '"vocab_size": *[0-9]*' "$MODEL_DIR/config.json" | grep -o '[0-9]*$')
    if ((${vocab:-0} > 258)); then
        step "a tokenizer of $vocab tokens" "$LOG" 60 python3 "$PY" vocab "$MODEL_DIR" "$vocab" ||
            FAILED=1
    fi
    ((FAILED == 0)) && echo "$MODEL_ARGS${VOCAB:+ vocab $VOCAB}" >"$STAMP"
fi
python3 - "$MODEL_DIR" <<'EOF'
import json, sys
tmpl = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if tools %}<|tools|>{{ tools | tojson }} Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": tmpl}
open(f"{sys.argv[1]}/tokenizer_config.json", "w").write(json.dumps(cfg))
EOF

# serve_up TP LOG: starts `arbor serve` at TP ranks in the background (SERVER_PID, PORT) and
# waits for /health; 1 if it did not come up. The KV cache holds every stream whole: the
# prompt (the template writes the tools into it) is ~760 tokens of the byte-level encoding.
serve_up() {
    local tp=$1 log=$2
    PORT=$(free_port)
    echo "=== serve TP=$tp on port $PORT ($(date -u +%T))" >>"$log"
    "$LAUNCH" -n "$tp" -- "$ARBOR" serve --model "$MODEL_DIR" --device "$DEVICE" \
        --host 127.0.0.1 --port "$PORT" --max-num-seqs "$STREAMS" --kv-blocks $((STREAMS * 20)) \
        --max-seq-len 2048 >>"$log" 2>&1 &
    SERVER_PID=$!
    local secs rc
    secs=$(wait_up "$PORT" "$SERVER_PID")
    rc=$?
    if ((rc == 0)); then
        note "PASS  serve TP=$tp up after $secs s"
        return 0
    elif ((rc == 1)); then
        note "FAIL  serve TP=$tp exited (see $(basename "$log"))"
        return 1
    fi
    note "TIME  serve TP=$tp not up"
    stop_pid "$SERVER_PID"
    return 1
}

# 2. Throughput at TP 1, and the TP 1 bits.
LOG=$OUT/serve-tp1.log
if serve_up 1 "$LOG"; then
    step "decode throughput: $STREAMS streams x $TOKENS tokens, plain / json_schema / tool" \
        "$LOG" 300 python3 "$PY" speed --addr "127.0.0.1:$PORT" --streams "$STREAMS" \
        --tokens "$TOKENS" --repeat "$REPEAT" --max-cost "$MAX_COST" --out "$OUT/speed.json" ||
        FAILED=1
    sed -n '/^decode throughput/,/^\(PASS\|FAIL\) structured/p' "$LOG" | tee -a "$SUMMARY"
    step "constrained requests at TP 1" "$LOG" 120 python3 "$PY" bits --addr "127.0.0.1:$PORT" \
        --tokens "$BITS_TOKENS" --out "$OUT/bits-tp1.json" || FAILED=1
    stop_pid "$SERVER_PID"
else
    FAILED=1
fi

# 3. The same constrained requests at the other TP sizes, all ranks on this GPU.
BITS=("$OUT/bits-tp1.json")
for tp in ${TPS//,/ }; do
    ((tp == 1)) && continue
    LOG=$OUT/serve-tp$tp.log
    if serve_up "$tp" "$LOG"; then
        step "constrained requests at TP $tp" "$LOG" 180 python3 "$PY" bits \
            --addr "127.0.0.1:$PORT" --tokens "$BITS_TOKENS" --out "$OUT/bits-tp$tp.json" &&
            BITS+=("$OUT/bits-tp$tp.json") || FAILED=1
        stop_pid "$SERVER_PID"
    else
        FAILED=1
    fi
done
LOG=$OUT/compare.log
if ((${#BITS[@]} > 1)) && [[ -f ${BITS[0]} ]]; then
    python3 "$PY" compare "${BITS[@]}" >"$LOG" 2>&1 || FAILED=1
    tee -a "$SUMMARY" <"$LOG"
else
    note "FAIL  constrained bits: fewer than two TP sizes ran"
    FAILED=1
fi

echo
echo "=== summary ($(elapsed) s)"
cat "$SUMMARY"
exit "$FAILED"
