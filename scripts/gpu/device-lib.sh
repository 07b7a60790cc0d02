# Shared helpers of the device scripts in scripts/gpu/ and scripts/bench/; sourced from the
# repository root (`source scripts/gpu/device-lib.sh`), not run.
# The caller sets T0 (start, epoch seconds), BUDGET_S and SUMMARY before calling `step`;
# STEP_MIN_LEFT (default 15) and STEP_KILL_AFTER (default 10) tune `step`.

# cuBLAS (the GEMM baseline) lives outside the default loader path on the lent machines.
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# NVLink multicast stays off (docs/allreduce.md, NVLS refusal): never enabled by arbor, kept off here too.
export NCCL_NVLS_ENABLE=0
export RUST_LOG=${RUST_LOG:-warn}

elapsed() { echo $(($(date +%s) - T0)); }
# wait_up PORT PID: waits until the server PID answers /health on loopback PORT (at most
# 240 s, and within BUDGET_S) and prints the seconds it took; 1 if PID exited first, 2 if
# the time ran out.
wait_up() {
    local port=$1 pid=$2 i
    for i in $(seq 1 480); do
        if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
            echo $((i / 2))
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || return 1
        (($(elapsed) > BUDGET_S)) && return 2
        sleep 0.5
    done
    return 2
}

# stop_pid PID: SIGTERM, up to 30 s to exit, then SIGKILL; reaps it.
stop_pid() {
    local pid=$1 i
    kill -TERM "$pid" 2>/dev/null
    for i in $(seq 1 60); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
}

# A loopback port nothing holds now (the kernel's choice): a random one in 20000-40000
# could be one of the ephemeral ports the ranks' own connections took.
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME LOG TIMEOUT CMD... : runs CMD with a time limit, output appended to LOG; a step
# that would start with less than STEP_MIN_LEFT seconds of BUDGET_S left is skipped.
step() {
    local name=$1 log=$2 limit=$3
    shift 3
    local left=$((BUDGET_S - $(elapsed)))
    if ((left < ${STEP_MIN_LEFT:-15})); then
        note "SKIP  $name (time budget spent at $(elapsed) s)"
        return 3
    fi
    ((limit > left)) && limit=$left
    local t=$(date +%s)
    echo "=== $name  ($(date -u +%T), limit ${limit}s): $*" >>"$log"
    timeout --signal=TERM --kill-after="${STEP_KILL_AFTER:-10}" "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    local dt=$(($(date +%s) - t))
    if ((rc == 0)); then
        note "PASS  $name (${dt} s)"
    elif ((rc == 124 || rc == 137)); then
        note "TIME  $name (killed after ${dt} s)"
    else
        note "FAIL  $name (exit $rc, ${dt} s; see $(basename "$log"))"
    fi
    return $rc
}

# prompts FILE COUNT VOCAB: token-id prompts of varied lengths (4..~120), deterministic.
prompts() {
    local file=$1 count=$2 vocab=$3
    awk -v n="$count" -v v="$vocab" 'BEGIN {
        for (i = 0; i < n; i++) {
            len = 4 + (i * 37) % 117; s = "";
            for (j = 0; j < len; j++) s = s (j ? "," : "") ((i * 7919 + j * 104729 + 13) % (v - 1)) + 1;
            printf "{\"id\":%d,\"tokens\":[%s]}\n", i, s;
        }
    }' >"$file"
}

# long_prompts FILE COUNT VOCAB MIN MAX SHARED: token-id prompts of MIN..MAX tokens
# (deterministic), the even-numbered ones starting with the same SHARED tokens (a system
# prompt: the prefix cache shares its blocks), the odd ones all their own.
long_prompts() {
    local file=$1 count=$2 vocab=$3 min=$4 max=$5 shared=$6
    awk -v n="$count" -v v="$vocab" -v lo="$min" -v hi="$max" -v sh="$shared" 'BEGIN {
        for (i = 0; i < n; i++) {
            len = lo + (i * 7919) % (hi - lo + 1); s = "";
            for (j = 0; j < len; j++) {
                k = (i % 2 == 0 && j < sh) ? (j * 104729 + 7) : (i * 7919 + j * 104729 + 13);
                s = s (j ? "," : "") (k % (v - 1)) + 1;
            }
            printf "{\"id\":%d,\"tokens\":[%s]}\n", i, s;
        }
    }' >"$file"
}

# Wall-clock timing of `generate` runs (decode cost = the N-token run minus the 1-token run,
# which has the same load and prefill). WALL[KEY] seconds, TOKS[KEY] new tokens.
declare -A WALL TOKS
# timed_generate KEY LOG LIMIT OUTFILE CMD... : CMD must write its records to OUTFILE.
timed_generate() {
    local key=$1 log=$2 limit=$3 out=$4
    shift 4
    rm -f "$out"
    local t t1 rc
    t=$(date +%s.%N)
    step "generate $key" "$log" "$limit" "$@"
    rc=$?
    t1=$(date +%s.%N)
    if ((rc == 0)); then
        # generate's own timing line (rank 0, stderr): prefill and decode measured in-process.
        local line
        line=$(grep -h 'timing (rank 0' "$log" | tail -n 1 | sed 's/^\[rank 0\] //')
        # "TIMING", not "TIME": the callers fail a run whose summary has a "TIME" (timeout) line.
        [[ -n $line ]] && note "TIMING $key: $line"
        WALL[$key]=$(awk -v a="$t" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
        TOKS[$key]=$(grep -o '"tokens":\[[^]]*\]' "$out" |
            awk -F, '{ n += ($0 ~ /\[\]/) ? 0 : NF } END { print n + 0 }')
        echo "wall $key: ${WALL[$key]} s, ${TOKS[$key]} new tokens" >>"$log"
    fi
    return $rc
}
# decode_report A B N STEPS: notes the decode seconds (A-N minus A-1) of A and B and their
# ratio, for runs recorded by timed_generate under the keys A-1, A-N, B-1, B-N.
decode_report() {
    local a=$1 b=$2 n=$3 steps=$4 kind
    for kind in "$a" "$b"; do
        if [[ -n ${WALL[$kind-1]:-} && -n ${WALL[$kind-$n]:-} ]]; then
            note "WALL  $kind: ${WALL[$kind-$n]} s wall (${TOKS[$kind-$n]} new tokens), load+prefill ${WALL[$kind-1]} s, decode ($steps steps) $(awk -v a="${WALL[$kind-$n]}" -v b="${WALL[$kind-1]}" -v s="$steps" 'BEGIN { printf "%.2f s = %.1f ms/step", a - b, 1000 * (a - b) / s }')"
        fi
    done
    if [[ -n ${WALL[$a-1]:-} && -n ${WALL[$a-$n]:-} && -n ${WALL[$b-1]:-} && -n ${WALL[$b-$n]:-} ]]; then
        note "WALL  $b / $a decode: $(awk -v t1="${WALL[$b-1]}" -v t="${WALL[$b-$n]}" -v s1="${WALL[$a-1]}" -v s="${WALL[$a-$n]}" 'BEGIN { d = s - s1; if (d > 0) printf "%.3f", (t - t1) / d; else print "n/a" }') (below 1: $b faster)"
    fi
}

# need_binaries NAME FILE...: exits 2, naming script NAME and the file, unless each FILE
# (relative to BIN) is an executable there; then sets ARBOR and LAUNCH from BIN.
need_binaries() {
    local name=$1 f
    shift
    for f in "$@"; do
        if [[ ! -x "$BIN/$f" ]]; then
            echo "$name: $BIN/$f is missing: run scripts/gpu/build-device.sh here first" >&2
            exit 2
        fi
    done
    ARBOR=$BIN/arbor
    LAUNCH=$BIN/arbor-launch
}

# script_start SUMMARY_NAME: the shared start of the decode scripts. OUT (exported, default
# /tmp/arbor-out), SUMMARY=$OUT/SUMMARY_NAME (emptied), BIN (.device) and ARBOR.
script_start() {
    export OUT=${OUT:-/tmp/arbor-out}
    mkdir -p "$OUT"
    SUMMARY=$OUT/$1
    : >"$SUMMARY"
    BIN=${ARBOR_DEVICE_DIR:-.device}
    ARBOR=$BIN/arbor
}

# pack_raw NAME GLOB...: the files of $OUT that match the globs, but the summary and other
# archives, packed into $OUT/NAME.tgz and removed. The device tool brings back at most 8
# files from $OUT, so a script that leaves more loses some (its summary among them); the
# summary beside one archive always comes back.
pack_raw() {
    local name=$1 f g
    shift
    local files=()
    for g in "$@"; do
        for f in "$OUT"/$g; do
            [[ -f $f && $f != "${SUMMARY:-}" && $f != *.tgz ]] && files+=("$(basename "$f")")
        done
    done
    ((${#files[@]})) || return 0
    (cd "$OUT" && tar czf "$name.tgz" "${files[@]}" && rm -f "${files[@]}")
}

# l8b_model LOG: sets L8B to the llama3-8b-shape model, made once per machine: a model
# left by another script on a still-warm machine is reused (its marker says the make
# finished).
l8b_model() {
    L8B=${L8B_DIR:-/tmp/arbor-l8b}
    if [[ -f $L8B.complete ]]; then
        note "reusing the llama3-8b model in $L8B"
    else
        rm -rf "$L8B"
        step "make llama3-8b" "$1" 150 "$ARBOR" make-model --preset llama3-8b --out "$L8B" --force &&
            touch "$L8B.complete"
    fi
}

# rank_model N LOG: sets RANK_MODEL to the llama3-8b shape one rank of a TP=N group computes
# (`make-model --per-rank-of-tp N`), made once per machine like l8b_model.
rank_model() {
    RANK_MODEL=/tmp/arbor-l8b-rank-of-tp$1
    if [[ -f $RANK_MODEL.complete ]]; then
        note "reusing the one-rank-of-TP-$1 model in $RANK_MODEL"
    else
        rm -rf "$RANK_MODEL"
        step "make llama3-8b, one rank of TP $1" "$2" 120 "$ARBOR" make-model --preset llama3-8b \
            --per-rank-of-tp "$1" --out "$RANK_MODEL" --force && touch "$RANK_MODEL.complete"
    fi
}

# use_torch_nccl: arbor loads the NCCL of the torch wheel (the trainer's), when there is one:
# one library on both sides of a weight-update group. Links it under $WORK/nccl.
use_torch_nccl() {
    NCCL_DIR=$(python3 -c '
import glob, os, torch
base = os.path.dirname(os.path.dirname(torch.__file__))
hits = sorted(glob.glob(os.path.join(base, "nvidia/nccl/lib/libnccl.so*")))
print(os.path.dirname(hits[0]) if hits else "")
')
    if [[ -n $NCCL_DIR ]]; then
        # cudarc opens "libnccl.so": give it the wheel's library under that name.
        mkdir -p "$WORK/nccl"
        ln -sf "$(ls "$NCCL_DIR"/libnccl.so* | head -n 1)" "$WORK/nccl/libnccl.so"
        export LD_LIBRARY_PATH=$WORK/nccl:$NCCL_DIR:$LD_LIBRARY_PATH
        note "libnccl: torch's, from $NCCL_DIR"
    fi
}
