#!/usr/bin/env bash
# The trainer's log-probs against the rollout engine's, token by token, in one device call.
# Run ON the GPU machine from the repository root after `bash scripts/gpu/build-device.sh`
# here (device tool: carry [".device"]; nvidia-h100-x4, or one GPU with the ranks sharing
# it: ARBOR_RANKS_PER_GPU=auto):
#
#   bash scripts/gpu/rollout-bits.sh
#
# For each model ($MODELS, default "smollm2 l8b"):
#   smollm2  random weights of SmolLM2-135M-Instruct's config, all 30 layers
#            (scripts/gpu/rollout_bits.py make-smollm2: transformers' LlamaForCausalLM,
#            bf16), made on the machine: the real weights are more than a call carries
#   l8b      `arbor make-model --preset llama3-8b --layers $L8B_LAYERS` (default 2)
#   tiny     `arbor make-model --preset tiny` (the CPU dry run's)
# and each TP size in $TPS (default "1 2 4"): `arbor serve` (under arbor-launch), $PROMPTS
# prompts (8) sampled for $MAX_NEW tokens (96) through SGLang's /generate (temperature 1,
# one seed, log-probs returned). A TP size the model's heads do not split over must be
# refused by the server naming the sizes that do (SmolLM2's 9 heads: TP 1 only). Then
# rollout_bits.py check: the TP sizes' rollouts identical (ids and log-prob bits),
# `arbor.torch` CausalLM.token_logprobs of every rollout bit-equal to the server's, and the
# gap (equal tokens, max |dp|, mean |d log p|) of two plain PyTorch bf16 forwards:
# arbor.torch.reference and transformers' model with SDPA.
# Prints the summary last, `ALL PASS` or `FAILED`; exit 1 on any failure. Logs and JSON in
# $OUT (default ./rollout-bits-out).
# Environment: DEVICE=cpu (a dry run: MODELS "smollm2 tiny", SMOL_LAYERS 2, TPS "1 2",
# binaries from target/release unless ARBOR_DEVICE_DIR is set), SMOL_LAYERS (30),
# L8B_LAYERS, TPS, PROMPTS, MAX_NEW, BUDGET_S (450), ARBOR_PY_DIR (the staged Python
# package, default $BIN/py).
set -uo pipefail
cd "$(dirname "$0")/../.."

DEVICE=${DEVICE:-cuda}
OUT=${OUT:-./rollout-bits-out}
if [[ $DEVICE == cpu ]]; then
    BIN=${ARBOR_DEVICE_DIR:-target/release}
    MODELS=${MODELS:-smollm2 tiny}
    SMOL_LAYERS=${SMOL_LAYERS:-2}
    TPS=${TPS:-1 2}
    MAX_NEW=${MAX_NEW:-32}
else
    BIN=${ARBOR_DEVICE_DIR:-.device}
    MODELS=${MODELS:-smollm2 l8b}
    SMOL_LAYERS=${SMOL_LAYERS:-30}
    TPS=${TPS:-1 2 4}
    MAX_NEW=${MAX_NEW:-96}
fi
L8B_LAYERS=${L8B_LAYERS:-2}
PROMPTS=${PROMPTS:-8}
BUDGET_S=${BUDGET_S:-450}
WORK=${WORK:-/tmp/arbor-rollout-bits-$DEVICE}
T0=$(date +%s)
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
rm -f "$OUT"/*.log "$OUT"/*.json
source scripts/gpu/device-lib.sh
need_binaries rollout-bits arbor arbor-launch
PY_DIR=${ARBOR_PY_DIR:-$BIN/py}
[[ $PY_DIR == /* ]] || PY_DIR=$PWD/$PY_DIR
export PYTHONPATH=$PY_DIR${PYTHONPATH:+:$PYTHONPATH}
# Ranks share a GPU only where there are fewer GPUs than ranks.
export ARBOR_RANKS_PER_GPU=auto
PY=scripts/gpu/rollout_bits.py
FAILED=0
fail() { note "FAIL  $*"; FAILED=1; }

{
    echo "rollout-bits on $(hostname) at $(date -u +%FT%TZ), device $DEVICE, TP $TPS"
    [[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee -a "$SUMMARY"
if ! python3 -c 'import arbor.torch' 2>>"$OUT/setup.log"; then
    fail "import arbor.torch from $PY_DIR (see setup.log; build-device.sh stages it)"
fi

# make_model NAME LOG: sets MODEL_DIR to NAME's checkpoint, made now.
make_model() {
    local name=$1 log=$2
    MODEL_DIR=$WORK/$name
    rm -rf "$MODEL_DIR"
    case $name in
    smollm2)
        step "make $name: SmolLM2-135M-Instruct config, $SMOL_LAYERS layers, random bf16" "$log" 150 \
            python3 "$PY" make-smollm2 --out "$MODEL_DIR" --layers "$SMOL_LAYERS" --seed 1
        ;;
    l8b)
        step "make $name: llama3-8b shape, $L8B_LAYERS layers" "$log" 150 \
            "$ARBOR" make-model --preset llama3-8b --layers "$L8B_LAYERS" --seed 1 --out "$MODEL_DIR"
        ;;
    tiny)
        step "make $name: tiny llama" "$log" 60 "$ARBOR" make-model --preset tiny --seed 1 \
            --out "$MODEL_DIR"
        ;;
    *)
        note "FAIL  unknown model '$name' (smollm2, l8b or tiny)"
        return 1
        ;;
    esac
}

# rollouts NAME TP LOG: serves MODEL_DIR at TP ranks and samples the rollouts into
# $WORK/NAME-tpTP.json; 1 on a failure. A TP size the heads do not split over must be
# refused (2: refused as it should be).
rollouts() {
    local name=$1 tp=$2 log=$3 port pid secs rc
    local file=$WORK/$name-tp$tp.json
    rm -f "$file"
    if ! python3 "$PY" splits "$MODEL_DIR" "$tp"; then
        echo "=== serve $name TP=$tp: expected to be refused ($(date -u +%T))" >>"$log"
        timeout --signal=TERM --kill-after=10 120 "$LAUNCH" -n "$tp" -- "$ARBOR" serve \
            --model "$MODEL_DIR" --device "$DEVICE" --host 127.0.0.1 --port "$(free_port)" \
            >"$WORK/refusal.out" 2>&1
        rc=$?
        cat "$WORK/refusal.out" >>"$log"
        if ((rc != 0 && rc != 124 && rc != 137)) &&
            grep -q 'TP sizes that split this model' "$WORK/refusal.out"; then
            note "PASS  $name TP $tp refused: $(grep -m 1 -o 'TP sizes that split this model: [^)]*' "$WORK/refusal.out")"
            return 2
        fi
        fail "$name TP $tp: expected a refusal naming the TP sizes that split the model (exit $rc; see $(basename "$log"))"
        return 1
    fi
    port=$(free_port)
    echo "=== serve $name TP=$tp on port $port ($(date -u +%T))" >>"$log"
    "$LAUNCH" -n "$tp" -- "$ARBOR" serve --model "$MODEL_DIR" --device "$DEVICE" \
        --host 127.0.0.1 --port "$port" --max-num-seqs "$PROMPTS" --max-seq-len 512 \
        --kv-blocks 128 >>"$log" 2>&1 &
    pid=$!
    secs=$(wait_up "$port" "$pid")
    rc=$?
    if ((rc != 0)); then
        fail "$name serve TP=$tp did not come up ($( ((rc == 1)) && echo exited || echo 'time out'); see $(basename "$log"))"
        stop_pid "$pid"
        return 1
    fi
    note "PASS  $name serve TP=$tp up after $secs s"
    local vocab
    vocab=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' \
        "$MODEL_DIR/config.json")
    step "$name TP $tp: $PROMPTS rollouts x $MAX_NEW tokens (/generate, temperature 1, seed 1234)" \
        "$log" 120 python3 "$PY" sample --addr "127.0.0.1:$port" --vocab "$vocab" \
        --prompts "$PROMPTS" --max-new "$MAX_NEW" --seed 1234 --out "$file"
    rc=$?
    stop_pid "$pid"
    ((rc == 0)) || FAILED=1
    return $rc
}

for name in $MODELS; do
    LOG=$OUT/$name.log
    make_model "$name" "$LOG" || {
        FAILED=1
        continue
    }
    FILES=()
    for tp in $TPS; do
        rollouts "$name" "$tp" "$LOG"
        (($? == 0)) && FILES+=("$tp=$WORK/$name-tp$tp.json")
    done
    if ((${#FILES[@]} == 0)); then
        fail "$name: no rollouts to check"
        continue
    fi
    CHECK=$OUT/$name-check.log
    step "$name: rescore the rollouts of TP ${FILES[*]%%=*} (arbor.torch, plain PyTorch)" "$CHECK" 240 \
        python3 "$PY" check --model "$MODEL_DIR" --name "$name" --device "$DEVICE" \
        --json "$OUT/$name-check.json" "${FILES[@]}" || FAILED=1
    grep -E '^(PASS|FAIL|gap|time) ' "$CHECK" | tee -a "$SUMMARY" >/dev/null
    grep -q '^FAIL ' "$CHECK" && FAILED=1
done

echo
echo "=== summary ($(elapsed) s)"
cat "$SUMMARY"
if ((FAILED)) || grep -qE '^(FAIL|TIME|SKIP) ' "$SUMMARY"; then
    echo "FAILED"
    exit 1
fi
echo "ALL PASS"
