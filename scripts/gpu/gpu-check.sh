#!/usr/bin/env bash
# The GPU check of the CUDA backend, in one device call. Run ON the GPU machine from the repo
# root, with binaries staged by scripts/gpu/build-device.sh (device tool: carry [".device"]):
#
#   scripts/gpu/gpu-check.sh [smoke|full|timing|shared]      (default: full)
#
# smoke: nvidia-smi, the GPU kernel tests (NVRTC compile of every kernel for the device's
#        arch, bit-identity across batch / TP split / prefill-decode), the model tests (CPU vs
#        GPU logits with the measured relative error), tiny-model generate at TP 1, 2, 4,
#        then (time allowing) the llama3-8b-shape model: make it, one TP=4 generate, timed.
# full:  the tests, then `arbor check --device cuda --tp $TPS --batch 1,8,32` on the tiny
#        model (greedy, seeded top-p sampling on the host, seeded top-k + top-p from candidates
#        selected on the GPU, seeded pure temperature drawn on
#        the GPU) and on the llama3-8b-shape model (random bf16 weights made on the
#        machine; the same four, >= 64 new tokens), each with
#        score == generate, plus `generate --shadow-tp1` at the largest TP, generate records
#        with decode steps from CUDA graphs vs op by op (byte-identical), then decode
#        timing at the largest TP (this run's GEMM vs the simple kernel). On the tiny model
#        also prompts of 600-1100 tokens (attention splits of 512, the prefill kernel's
#        tiles, decode steps recorded at split buckets of 2 and 4), half of them sharing a
#        300-token prefix: `arbor check` on them, CUDA graphs vs op by op, and records with
#        the prefix cache vs without it (byte-identical). LONG=0 skips these.
# timing: only the llama3-8b-shape decode timing, at every TP in $TPS.
# shared: every TP size in $TPS (default 1,2,4,8) on whatever GPUs there are, with
#        ARBOR_RANKS_PER_GPU=auto exported for every launch: on one GPU all ranks share it
#        (collectives staged through the host); on >= 8 GPUs one rank per GPU, the normal
#        path. Parts ($PARTS, default tests,tiny,l8b,serve,ipc,extra, run in that order while
#        the budget lasts): tests = the GPU kernel and model tests (as in smoke);
#        tiny = without the flag TP 2 on one GPU is refused naming it, tiny
#        generate at each TP, `check` greedy and seeded at TP $TPS x batch 1,8,32;
#        l8b = `check` greedy on the llama3-8b shape at TP $TPS x batch $L8B_BATCH (default
#        1,8; L8B_PROMPTS default 4, L8B_TOKENS 32); serve = `arbor serve` at TP 4 under
#        concurrent load, a request alone == under load (scripts/gpu/serve-alone-vs-load.py),
#        then `arbor bench serve`; ipc (only where ranks share a GPU) = `bench allreduce` at
#        TP 2 and 8 with the one-shot / two-shot IPC kernels next to the host-staged tree
#        (watchdog $IPC_SPIN_MS ms), and tiny decode at TP 4 and 8 with
#        ARBOR_GPU_ALLREDUCE=oneshot vs the default (records identical, step times);
#        extra = the tiny temperature / top-k checks, graphs vs op by op and --shadow-tp1
#        at the largest TP, then the llama3-8b seeded check, graphs vs op by op, shadow.
#        The steps are in scripts/gpu/gpu-check-shared.sh.
#
# Prints the unique-output / divergence tables LAST; full logs go to $OUT (default
# ./gpu-check-out): summary.txt, tests.log, tiny.log, l8b.log, reports.tar (shared: also
# serve.log, ipc.log).
# Environment: TPS (default 1,2,4; shared 1,2,4,8), L8B_PROMPTS (default 8; shared 4),
# L8B_TOKENS (default 64; shared 32), L8B_DIR (default /tmp/arbor-l8b; reused if it holds a
# model), SKIP_L8B=1 (tiny only), BUDGET_S (default 570: steps that would start after it are
# skipped and reported); shared only: PARTS, L8B_BATCH (default 1,8), IPC_SPIN_MS (10000).
set -uo pipefail
cd "$(dirname "$0")/../.."

MODE=${1:-full}
OUT=${OUT:-./gpu-check-out}
BIN=${ARBOR_DEVICE_DIR:-.device}
if [[ $MODE == shared ]]; then
    TPS=${TPS:-1,2,4,8}
    L8B_PROMPTS=${L8B_PROMPTS:-4}
    L8B_TOKENS=${L8B_TOKENS:-32}
    L8B_BATCH=${L8B_BATCH:-1,8}
    PARTS=${PARTS:-tests,tiny,l8b,serve,ipc,extra}
    IPC_SPIN_MS=${IPC_SPIN_MS:-10000}
    # Every launch below, arbor check's included, inherits it: ranks share a GPU only
    # where there are fewer GPUs than ranks.
    export ARBOR_RANKS_PER_GPU=auto
elif [[ $MODE != smoke && $MODE != full && $MODE != timing ]]; then
    echo "gpu-check: unknown mode '$MODE' (smoke, full, timing or shared)" >&2
    exit 2
fi
TPS=${TPS:-1,2,4}
L8B_PROMPTS=${L8B_PROMPTS:-8}
L8B_TOKENS=${L8B_TOKENS:-64}
PARTS=${PARTS:-}
CHECK_BATCH=${CHECK_BATCH:-1,8,32}
part() { [[ ,$PARTS, == *,$1,* ]]; }
if [[ $MODE == shared ]] && ! part l8b && ! part extra; then
    SKIP_L8B=1
fi
L8B_DIR=${L8B_DIR:-/tmp/arbor-l8b}
BUDGET_S=${BUDGET_S:-570}
WORK=${WORK:-/tmp/arbor-gpu-check}
T0=$(date +%s)
mkdir -p "$OUT" "$WORK"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

source scripts/gpu/device-lib.sh
need_binaries gpu-check arbor arbor-launch tests/kernels-gpu tests/model-gpu

TESTS_LOG=$OUT/tests.log
TINY_LOG=$OUT/tiny.log
L8B_LOG=$OUT/l8b.log
SERVE_LOG=$OUT/serve.log
IPC_LOG=$OUT/ipc.log
REPORTS=$WORK/reports
rm -rf "$REPORTS"
mkdir -p "$REPORTS"

{
    echo "gpu-check $MODE on $(hostname) at $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-<unset>} NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE ARBOR_GPU_ALLREDUCE=${ARBOR_GPU_ALLREDUCE:-auto (default)} ARBOR_GPU_GEMM=${ARBOR_GPU_GEMM:-auto (default)} ARBOR_RANKS_PER_GPU=${ARBOR_RANKS_PER_GPU:-<unset>}"
} 2>&1 | tee -a "$SUMMARY"

# The 8B model is written by the CPU while the GPU tests and the tiny checks run.
# A model left by an earlier call on a still-warm machine is reused only if its make
# finished (marker written after a successful make-model).
MAKE_PID=
L8B_OK=$L8B_DIR.complete
if [[ ${SKIP_L8B:-0} != 1 && ! -f $L8B_OK ]]; then
    rm -rf "$L8B_DIR"
    (
        t=$(date +%s)
        "$ARBOR" make-model --preset llama3-8b --out "$L8B_DIR" >"$WORK/make-l8b.log" 2>&1
        rc=$?
        ((rc == 0)) && touch "$L8B_OK"
        echo "exit $rc after $(($(date +%s) - t)) s" >>"$WORK/make-l8b.log"
    ) &
    MAKE_PID=$!
elif [[ -f $L8B_OK ]]; then
    note "reusing the llama3-8b model in $L8B_DIR"
fi

# --- tests: kernels (NVRTC + invariance on the GPU) and model (CPU vs GPU, prefill == decode)
[[ $MODE == timing ]] || { [[ $MODE == shared ]] && ! part tests; } || step "kernel tests (NVRTC sm_90a compile, bit-identity on GPU)" "$TESTS_LOG" 120 \
    "$BIN/tests/kernels-gpu" --test-threads=1 --nocapture cuda::
[[ $MODE == timing ]] || { [[ $MODE == shared ]] && ! part tests; } || step "model tests (CPU vs GPU logits, prefill == decode, batch)" "$TESTS_LOG" 180 \
    "$BIN/tests/model-gpu" --test-threads=1 --nocapture
grep -s -h -o "CPU vs GPU logits (.*" "$TESTS_LOG" | tee -a "$SUMMARY"
# On the GPU machine a skipped GPU test means the GPU was not used: that is a failure.
if grep -s -q "skipped:" "$TESTS_LOG"; then
    note "FAIL  GPU tests skipped: $(grep -h -o 'skipped: .*' "$TESTS_LOG" | sort -u | head -n 1)"
fi

# decode_timing TP: the llama3-8b shape, 8 prompts x $L8B_TOKENS tokens at batch 8 on TP
# ranks, with this run's GEMM and with the simple kernel; generate reports its own prefill
# and decode time (in-process, rank 0), noted as TIME lines.
decode_timing() {
    local tp=$1 kind
    for kind in "${ARBOR_GPU_GEMM:-auto}" simple; do
        timed_generate "tp$tp-$kind" "$L8B_LOG" 90 "$WORK/l8b-tp$tp-$kind.jsonl" \
            env ARBOR_GPU_GEMM="$kind" "$LAUNCH" -n "$tp" --output rank0 -- "$ARBOR" generate \
            --model "$L8B_DIR" --device cuda --prompts "$WORK/l8b-prompts.jsonl" --batch 8 \
            --max-tokens "$L8B_TOKENS" --out "$WORK/l8b-tp$tp-$kind.jsonl"
    done
}

# graphs_vs_eager NAME LOG MODEL PROMPTS BATCH EXTRA...: generate at the largest TP with decode
# steps replayed from CUDA graphs (the default) and op by op (ARBOR_CUDA_GRAPHS=0); the
# records (tokens, log-prob bits, top-N, digests) must be byte-identical. Odd batches pad
# the recorded steps; requests of different lengths change the bucket as they finish.
graphs_vs_eager() {
    local name=$1 log=$2 model=$3 prompts=$4 batch=$5 tp=${TPS##*,}
    shift 5
    local a=$WORK/$name-graphs.jsonl b=$WORK/$name-eager.jsonl
    rm -f "$a" "$b"
    step "$name: generate TP=$tp, CUDA graphs" "$log" 150 "$LAUNCH" -n "$tp" --output rank0 -- \
        "$ARBOR" generate --model "$model" --device cuda --prompts "$prompts" --batch "$batch" \
        --out "$a" "$@" || return
    step "$name: generate TP=$tp, op by op" "$log" 150 env ARBOR_CUDA_GRAPHS=0 "$LAUNCH" -n "$tp" \
        --output rank0 -- "$ARBOR" generate --model "$model" --device cuda --prompts "$prompts" \
        --batch "$batch" --out "$b" "$@" || return
    if [[ -s $a ]] && cmp -s "$a" "$b"; then
        note "PASS  $name: CUDA-graph records byte-identical to op by op ($(wc -l <"$a") records)"
    else
        note "FAIL  $name: CUDA-graph records differ from op by op (see $a, $b)"
    fi
}

# cached_vs_recomputed NAME LOG MODEL PROMPTS BATCH EXTRA...: generate at the largest TP with
# the prefix cache (the default; a small cache, so blocks are evicted too) and without it
# (--no-prefix-cache): the records must be byte-identical.
cached_vs_recomputed() {
    local name=$1 log=$2 model=$3 prompts=$4 batch=$5 tp=${TPS##*,}
    shift 5
    local a=$WORK/$name-cached.jsonl b=$WORK/$name-recomputed.jsonl c=$WORK/$name-small.jsonl
    rm -f "$a" "$b" "$c"
    step "$name: generate TP=$tp, prefix cache" "$log" 150 "$LAUNCH" -n "$tp" --output rank0 -- \
        "$ARBOR" generate --model "$model" --device cuda --prompts "$prompts" --batch "$batch" \
        --out "$a" "$@" || return
    step "$name: generate TP=$tp, prefix cache, 40 KV blocks" "$log" 150 "$LAUNCH" -n "$tp" \
        --output rank0 -- "$ARBOR" generate --model "$model" --device cuda --prompts "$prompts" \
        --batch "$batch" --kv-blocks 40 --out "$c" "$@" || return
    step "$name: generate TP=$tp, no prefix cache" "$log" 150 "$LAUNCH" -n "$tp" --output rank0 -- \
        "$ARBOR" generate --model "$model" --device cuda --prompts "$prompts" --batch "$batch" \
        --no-prefix-cache --out "$b" "$@" || return
    if [[ -s $a ]] && cmp -s "$a" "$b" && cmp -s "$c" "$b"; then
        note "PASS  $name: prefix-cached records byte-identical to recomputed ($(wc -l <"$a") records)"
    else
        note "FAIL  $name: prefix-cached records differ from recomputed (see $a, $c, $b)"
    fi
}

run_check() { # run_check NAME LOG MODEL TIMEOUT EXTRA... (batches: $CHECK_BATCH)
    local name=$1 log=$2 model=$3 limit=$4
    shift 4
    step "check $name" "$log" "$limit" "$ARBOR" check --model "$model" --device cuda \
        --tp "$TPS" --batch "$CHECK_BATCH" --json "$REPORTS/$name.json" "$@"
}

# wait_l8b: waits (within the budget) for the background make of the llama3-8b model.
wait_l8b() {
    [[ -n $MAKE_PID ]] || return 0
    local left=$((BUDGET_S - $(elapsed)))
    if ((left > 30)); then
        (sleep "$left"; kill "$MAKE_PID" 2>/dev/null) &
        local waiter=$!
        wait "$MAKE_PID"
        kill "$waiter" 2>/dev/null
    else
        kill "$MAKE_PID" 2>/dev/null
    fi
    cat "$WORK/make-l8b.log" >>"$L8B_LOG" 2>/dev/null
    note "make llama3-8b: $(tail -n 1 "$WORK/make-l8b.log" 2>/dev/null) (at $(elapsed) s)"
    MAKE_PID=
}

# --- tiny model
if [[ $MODE != timing && $MODE != shared ]]; then
    TINY=$WORK/tiny
    rm -rf "$TINY"
    step "make tiny model" "$TINY_LOG" 60 "$ARBOR" make-model --out "$TINY"
    prompts "$WORK/tiny-prompts.jsonl" 34 250
    for tp in ${TPS//,/ }; do
        step "tiny generate TP=$tp" "$TINY_LOG" 90 \
            "$LAUNCH" -n "$tp" -- "$ARBOR" generate --model "$TINY" --device cuda \
            --prompt "hello world" --prompt "the quick brown fox" --max-tokens 16
    done

    if [[ $MODE == full ]]; then
        run_check tiny-greedy "$TINY_LOG" "$TINY" 120 --prompts "$WORK/tiny-prompts.jsonl" --max-tokens 32
        run_check tiny-seeded "$TINY_LOG" "$TINY" 120 --prompts "$WORK/tiny-prompts.jsonl" --max-tokens 32 \
            --temperature 0.8 --top-p 0.9 --seed 1234
        # Pure temperature: the draw happens on the GPU (Gumbel max in the row-stats kernel).
        run_check tiny-temp "$TINY_LOG" "$TINY" 120 --prompts "$WORK/tiny-prompts.jsonl" --max-tokens 32 \
            --temperature 0.8 --seed 1234
        # Top-k: the candidates are selected on the GPU (select.cu), the draw on the host.
        run_check tiny-topk "$TINY_LOG" "$TINY" 120 --prompts "$WORK/tiny-prompts.jsonl" --max-tokens 32 \
            --temperature 0.8 --top-k 50 --top-p 0.9 --seed 1234
        graphs_vs_eager tiny-graphs-greedy "$TINY_LOG" "$TINY" "$WORK/tiny-prompts.jsonl" 3 \
            --max-tokens 24 --logprobs 3
        graphs_vs_eager tiny-graphs-topk "$TINY_LOG" "$TINY" "$WORK/tiny-prompts.jsonl" 5 \
            --max-tokens 24 --logprobs 2 --temperature 0.8 --top-k 20 --top-p 0.9 --seed 3
        step "tiny generate --shadow-tp1 (TP=${TPS##*,})" "$TINY_LOG" 60 \
            "$LAUNCH" -n "${TPS##*,}" -- "$ARBOR" generate --model "$TINY" --device cuda --shadow-tp1 \
            --prompts "$WORK/tiny-prompts.jsonl" --batch 8 --max-tokens 16
        if [[ ${LONG:-1} != 0 ]]; then
            long_prompts "$WORK/tiny-long.jsonl" 12 250 600 1100 300
            run_check tiny-long "$TINY_LOG" "$TINY" 150 --prompts "$WORK/tiny-long.jsonl" --max-tokens 16 \
                --temperature 0.8 --top-p 0.9 --seed 7
            graphs_vs_eager tiny-long-graphs "$TINY_LOG" "$TINY" "$WORK/tiny-long.jsonl" 5 \
                --max-tokens 24 --logprobs 2
            cached_vs_recomputed tiny-long-prefix "$TINY_LOG" "$TINY" "$WORK/tiny-long.jsonl" 4 \
                --max-tokens 16 --logprobs 2 --temperature 0.8 --seed 5
        fi
    fi
fi

# --- shared: every TP on the GPUs there are (ranks share a GPU where needed)
[[ $MODE == shared ]] && source scripts/gpu/gpu-check-shared.sh

# --- llama3-8b-shape model
[[ $MODE == shared ]] || wait_l8b
if [[ $MODE == shared ]]; then
    :
elif [[ ${SKIP_L8B:-0} == 1 ]]; then
    note "SKIP  llama3-8b (SKIP_L8B=1)"
elif [[ -f $L8B_OK ]]; then
    vocab=$(grep -o '"vocab_size": *[0-9]*' "$L8B_DIR/config.json" | grep -o '[0-9]*$')
    prompts "$WORK/l8b-prompts.jsonl" "$L8B_PROMPTS" "${vocab:-128256}"
    if [[ $MODE == full ]]; then
        run_check l8b-greedy "$L8B_LOG" "$L8B_DIR" 300 --prompts "$WORK/l8b-prompts.jsonl" \
            --max-tokens "$L8B_TOKENS"
        run_check l8b-seeded "$L8B_LOG" "$L8B_DIR" 300 --prompts "$WORK/l8b-prompts.jsonl" \
            --max-tokens "$L8B_TOKENS" --temperature 0.8 --top-p 0.9 --seed 1234
        run_check l8b-temp "$L8B_LOG" "$L8B_DIR" 300 --prompts "$WORK/l8b-prompts.jsonl" \
            --max-tokens "$L8B_TOKENS" --temperature 0.8 --seed 1234
        run_check l8b-topk "$L8B_LOG" "$L8B_DIR" 300 --prompts "$WORK/l8b-prompts.jsonl" \
            --max-tokens "$L8B_TOKENS" --temperature 0.8 --top-k 50 --top-p 0.9 --seed 1234
        graphs_vs_eager l8b-graphs "$L8B_LOG" "$L8B_DIR" "$WORK/l8b-prompts.jsonl" 5 \
            --max-tokens 32 --logprobs 3 --temperature 0.8 --seed 9
        step "l8b generate --shadow-tp1 (TP=${TPS##*,})" "$L8B_LOG" 120 \
            "$LAUNCH" -n "${TPS##*,}" -- "$ARBOR" generate --model "$L8B_DIR" --device cuda --shadow-tp1 \
            --prompts "$WORK/l8b-prompts.jsonl" --batch 8 --max-tokens 16
        # Decode timing at the largest TP (last: skipped when the time budget is spent).
        decode_timing "${TPS##*,}"
    elif [[ $MODE == timing ]]; then
        for tp in ${TPS//,/ }; do
            decode_timing "$tp"
        done
    else
        step "l8b generate TP=${TPS##*,} ($L8B_TOKENS tokens, 1 prompt)" "$L8B_LOG" 200 \
            "$LAUNCH" -n "${TPS##*,}" -- "$ARBOR" generate --model "$L8B_DIR" --device cuda \
            --prompt "hello world" --max-tokens "$L8B_TOKENS"
    fi
else
    note "SKIP  llama3-8b checks: the model was not made (see l8b.log)"
fi

tar -C "$WORK" -cf "$OUT/reports.tar" reports 2>/dev/null

# --- the tables, last
echo
echo "==================== gpu-check $MODE: results (TP $TPS; $(elapsed) s) ===================="
cat "$SUMMARY"
for log in "$TINY_LOG" "$L8B_LOG" "$SERVE_LOG" "$IPC_LOG"; do
    [[ -f $log ]] || continue
    # Each check's table: from its "N prompts x M configurations" line through RESULT.
    awk '/^=== check /{name=$3} /prompts x [0-9]+ configurations/{p=1; print "\n--- " name} p{print} /^RESULT:/{p=0}' "$log" |
        grep -v '^unique outputs: \|^top-5 divergence: '
done
grep -q '^FAIL\|^TIME' "$SUMMARY" && exit 1
exit 0
