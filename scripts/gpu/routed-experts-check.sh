#!/usr/bin/env bash
# SGLang's `return_routed_experts` on the CUDA backend, in one device call. Run ON the GPU
# machine from the repo root, with binaries staged by scripts/gpu/build-device.sh (device
# tool: carry [".device"]):
#
#   scripts/gpu/routed-experts-check.sh
#
# A model of the Qwen3-30B-A3B shape cut to 4 layers (`make-model --preset qwen3-30b-a3b
# --layers 4`: 128 experts, 8 per token) served four ways: TP 1 with the device routing
# (ARBOR_MOE=device, the default), TP 1 with the host's (ARBOR_MOE=host), and TP 2 with
# each (both ranks on this GPU where there is one: ARBOR_RANKS_PER_GPU=auto). Each server
# answers scripts/gpu/routed-experts-check.py's requests: 6 prompts alone and as one batch,
# seeded top-p, 24 new tokens, with and without `return_routed_experts` (asking must not
# change a token: a request that asks runs op by op, the others from CUDA graphs). PASS
# when the experts (every position of every prompt, every layer) and the tokens and
# log-probs are identical across TP sizes for each routing (device and host are each their
# own: their experts' GEMMs are different kernels), and a batch's prompt rows equal its
# prompts' alone.
# Output in $OUT (default ./routed-experts-check-out): summary.txt, serve-*.log,
# routes-*.json. Exit 1 if anything failed or timed out.
# Environment: DEVICE=cpu runs the same on the tiny qwen3-moe (a check of this script;
# binaries from target/release unless ARBOR_DEVICE_DIR is set; ARBOR_MOE changes nothing
# there), TPS (default "1 2"), BUDGET_S (default 570), MODEL_ARGS (make-model's flags).
set -uo pipefail
cd "$(dirname "$0")/../.."

DEVICE=${DEVICE:-cuda}
OUT=${OUT:-./routed-experts-check-out}
if [[ $DEVICE == cpu ]]; then
    BIN=${ARBOR_DEVICE_DIR:-target/release}
    MODEL_ARGS=${MODEL_ARGS:---arch qwen3-moe --preset tiny}
else
    BIN=${ARBOR_DEVICE_DIR:-.device}
    MODEL_ARGS=${MODEL_ARGS:---preset qwen3-30b-a3b --layers 4}
fi
TPS=${TPS:-1 2}
BUDGET_S=${BUDGET_S:-570}
WORK=${WORK:-/tmp/arbor-routed-check-$DEVICE}
MODEL_DIR=$WORK/model
T0=$(date +%s)
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
source scripts/gpu/device-lib.sh
need_binaries routed-experts-check arbor arbor-launch
export ARBOR_RANKS_PER_GPU=auto
PY=scripts/gpu/routed-experts-check.py

{
    echo "routed-experts-check on $(hostname) at $(date -u +%FT%TZ), device $DEVICE"
    [[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
} | tee -a "$SUMMARY"

rm -rf "$MODEL_DIR"
# shellcheck disable=SC2086 # MODEL_ARGS is a list of flags
step "make the model: $MODEL_ARGS" "$OUT/model.log" 300 "$ARBOR" make-model $MODEL_ARGS --out "$MODEL_DIR" ||
    exit 1

# run_one TP MOE: serves at TP ranks with ARBOR_MOE=MOE and asks; routes-tpTP-MOE.json.
DEVICE_FILES=()
HOST_FILES=()
run_one() {
    local tp=$1 moe=$2 name="tp$1-$2"
    local log=$OUT/serve-$name.log port
    port=$(free_port)
    echo "=== serve $name on port $port ($(date -u +%T))" >>"$log"
    ARBOR_MOE=$moe "$LAUNCH" -n "$tp" -- "$ARBOR" serve --model "$MODEL_DIR" --device "$DEVICE" \
        --host 127.0.0.1 --port "$port" --max-num-seqs 8 --max-seq-len 512 >>"$log" 2>&1 &
    SERVER_PID=$!
    if ! wait_up "$port" "$SERVER_PID" >/dev/null; then
        note "FAIL  serve $name did not come up (see $(basename "$log"))"
        stop_pid "$SERVER_PID"
        return 1
    fi
    if step "ask $name" "$log" 240 python3 "$PY" ask "$port" "$MODEL_DIR" "$OUT/routes-$name.json"; then
        if [[ $moe == device ]]; then
            DEVICE_FILES+=("$OUT/routes-$name.json")
        else
            HOST_FILES+=("$OUT/routes-$name.json")
        fi
    fi
    stop_pid "$SERVER_PID"
}

for tp in $TPS; do
    for moe in device host; do
        run_one "$tp" "$moe"
    done
done
# The two routings are compared each with itself across TP sizes: their experts' GEMMs
# are different kernels (the grouped GEMM, or each expert as a dense MLP), so their logits,
# and from the first differing token on their routes, are each their own.
for group in DEVICE_FILES HOST_FILES; do
    declare -n files=$group
    if ((${#files[@]} > 1)); then
        python3 "$PY" compare "${files[@]}" 2>&1 | tee -a "$SUMMARY"
    else
        note "FAIL  fewer than two servers of one routing answered (${group%_FILES})"
    fi
done

echo
echo "==================== routed-experts-check ($(elapsed) s) ===================="
cat "$SUMMARY"
grep -q '^FAIL\|^TIME' "$SUMMARY" && exit 1
exit 0
