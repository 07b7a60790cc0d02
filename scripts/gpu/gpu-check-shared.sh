# The `shared` mode of scripts/gpu/gpu-check.sh (sourced by it, not run): every TP size in $TPS
# on the GPUs there are, ARBOR_RANKS_PER_GPU=auto exported (ranks share a GPU only where
# there are fewer GPUs than ranks). Uses gpu-check.sh's variables and functions (step,
# note, run_check, graphs_vs_eager, timed_generate, wait_l8b, part, prompts).

# Visible GPUs, as the ranks count them.
gpu_count() {
    if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
        tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .
    else
        nvidia-smi -L 2>/dev/null | grep -c '^GPU'
    fi
}

NGPU=$(gpu_count)
MAXTP=${TPS##*,}
if ((NGPU < MAXTP)); then
    note "shared: TP $TPS on $NGPU visible GPU(s): up to $(((MAXTP + NGPU - 1) / NGPU)) ranks per GPU, collectives staged through the host"
else
    note "shared: TP $TPS on $NGPU visible GPU(s): one rank per GPU (the normal NCCL / IPC path)"
fi

# expect_refusal NAME LOG NEEDLE CMD...: CMD must fail, and its output name NEEDLE.
expect_refusal() {
    local name=$1 log=$2 needle=$3
    shift 3
    local tmp=$WORK/refusal.out
    echo "=== $name ($(date -u +%T)): $*" >>"$log"
    timeout --signal=TERM --kill-after=10 120 "$@" >"$tmp" 2>&1
    local rc=$?
    cat "$tmp" >>"$log"
    if ((rc != 0 && rc != 124 && rc != 137)) && grep -q -e "$needle" "$tmp"; then
        note "PASS  $name (exit $rc): $(grep -m 1 -o -e "LOCAL_RANK=.*" "$tmp" | cut -c 1-160)"
    else
        note "FAIL  $name (exit $rc; expected a refusal naming '$needle'; see $(basename "$log"))"
    fi
}

# serve_under_load TP: `arbor serve` on the tiny model at TP ranks; a request alone and the
# same request under concurrent load must be identical (tokens, log-probs with top-N,
# digests, prompt log-probs); then `arbor bench serve` against it (distinct outputs per
# repeated prompt must be 1).
serve_under_load() {
    local tp=$1 log=$SERVE_LOG
    if ((BUDGET_S - $(elapsed) < 60)); then
        note "SKIP  serve TP=$tp (time budget spent at $(elapsed) s)"
        return
    fi
    local port
    port=$(free_port)
    local vocab
    vocab=$(grep -o '"vocab_size": *[0-9]*' "$TINY/config.json" | grep -o '[0-9]*$')
    echo "=== serve TP=$tp on port $port ($(date -u +%T))" >>"$log"
    "$LAUNCH" -n "$tp" -- "$ARBOR" serve --model "$TINY" --device cuda --port "$port" \
        --max-num-seqs 16 >>"$log" 2>&1 &
    local spid=$!
    mkdir -p "$WORK/serve"
    step "serve TP=$tp: a request alone == the same request under load" "$log" 240 \
        python3 scripts/gpu/serve-alone-vs-load.py --addr "127.0.0.1:$port" --vocab "${vocab:-256}" \
        --clients 16 --load-requests 96 --probes 4 --wait 180 --out "$WORK/serve"
    grep -h "^serve alone vs under load" "$log" | tail -n 1 | tee -a "$SUMMARY"
    step "serve TP=$tp: arbor bench serve" "$log" 180 "$ARBOR" bench serve \
        --addr "127.0.0.1:$port" --requests 64 --concurrency 16 --json "$WORK/serve-bench.json"
    grep -h "^distinct outputs per repeated prompt" "$log" | tail -n 1 | tee -a "$SUMMARY"
    stop_pid "$spid"
}

# ipc_probe: what the one-shot / two-shot IPC kernels do with ranks time-sliced on one GPU
# (they spin on their peers' flags): progress or not (the watchdog ends a wait of
# $IPC_SPIN_MS ms with an error), and their times next to the host-staged tree.
ipc_probe() {
    local log=$IPC_LOG w
    for w in 2 8; do
        step "ipc: bench allreduce TP=$w (host-staged tree vs one-shot / two-shot IPC)" "$log" 150 \
            env ARBOR_IPC_SPIN_TIMEOUT_MS="$IPC_SPIN_MS" "$LAUNCH" -n "$w" --output rank0 -- \
            "$ARBOR" bench allreduce --sizes 8K,128K,1M --dtypes f32 \
            --algos allgather-tree,oneshot,twoshot --iters 10 --graph-max 0 \
            --json "$WORK/ipc-w$w.json" --svg "$WORK/ipc-w$w.svg"
        [[ -f $WORK/ipc-w$w.json ]] && python3 - "$WORK/ipc-w$w.json" <<'EOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
for row in r["rows"]:
    what = (f"error: {row['error'].splitlines()[0][:150]}" if row["error"]
            else f"{row['time_us']:.1f} us per call, bits {'ok' if row['bits_ok'] else 'WRONG'}")
    print(f"IPC   W={r['world']} {row['bytes'] >> 10}K {row['algo']}: {what}")
EOF
    done
    # Decode with the IPC all-reduce: the same records, and the step times.
    local tp
    for tp in 4 8; do
        timed_generate "ipc-tp$tp-default" "$log" 150 "$WORK/ipc-tp$tp-default.jsonl" \
            "$LAUNCH" -n "$tp" --output rank0 -- "$ARBOR" generate --model "$TINY" --device cuda \
            --prompts "$WORK/tiny-prompts.jsonl" --batch 8 --max-tokens 32 --logprobs 2 \
            --out "$WORK/ipc-tp$tp-default.jsonl" || continue
        timed_generate "ipc-tp$tp-oneshot" "$log" 150 "$WORK/ipc-tp$tp-oneshot.jsonl" \
            env ARBOR_GPU_ALLREDUCE=oneshot ARBOR_IPC_SPIN_TIMEOUT_MS="$IPC_SPIN_MS" \
            "$LAUNCH" -n "$tp" --output rank0 -- "$ARBOR" generate --model "$TINY" --device cuda \
            --prompts "$WORK/tiny-prompts.jsonl" --batch 8 --max-tokens 32 --logprobs 2 \
            --out "$WORK/ipc-tp$tp-oneshot.jsonl" || continue
        if cmp -s "$WORK/ipc-tp$tp-default.jsonl" "$WORK/ipc-tp$tp-oneshot.jsonl"; then
            note "PASS  ipc TP=$tp: records with the one-shot IPC all-reduce == host-staged"
        else
            note "FAIL  ipc TP=$tp: records with the one-shot IPC all-reduce differ from host-staged"
        fi
    done
}

TINY=$WORK/tiny
if part tiny || part serve || part ipc || part extra; then
    rm -rf "$TINY"
    step "make tiny model" "$TINY_LOG" 60 "$ARBOR" make-model --out "$TINY"
    prompts "$WORK/tiny-prompts.jsonl" 34 250
fi

if part tiny; then
    if ((NGPU < 2)); then
        expect_refusal "TP 2 on one GPU without --ranks-per-gpu is refused, naming the flag" \
            "$TINY_LOG" "--ranks-per-gpu" env -u ARBOR_RANKS_PER_GPU "$LAUNCH" -n 2 -- \
            "$ARBOR" generate --model "$TINY" --device cuda --prompt "hello" --max-tokens 2
    fi
    for tp in ${TPS//,/ }; do
        step "tiny generate TP=$tp" "$TINY_LOG" 90 \
            "$LAUNCH" -n "$tp" -- "$ARBOR" generate --model "$TINY" --device cuda \
            --prompt "hello world" --prompt "the quick brown fox" --max-tokens 16
    done
    run_check tiny-greedy "$TINY_LOG" "$TINY" 180 --prompts "$WORK/tiny-prompts.jsonl" --max-tokens 32
    run_check tiny-seeded "$TINY_LOG" "$TINY" 180 --prompts "$WORK/tiny-prompts.jsonl" --max-tokens 32 \
        --temperature 0.8 --top-p 0.9 --seed 1234
    # Prompts of 600-1100 tokens (two or three attention splits) sharing a 300-token prefix:
    # the paged cache, split attention and the prefix cache at every TP. LONG=0 skips.
    if [[ ${LONG:-1} != 0 ]]; then
        long_prompts "$WORK/tiny-long.jsonl" 8 250 600 1100 300
        run_check tiny-long "$TINY_LOG" "$TINY" 180 --prompts "$WORK/tiny-long.jsonl" --max-tokens 16 \
            --temperature 0.8 --top-p 0.9 --seed 7
    fi
fi

if part l8b; then
    wait_l8b
    if [[ -f $L8B_OK ]]; then
        vocab=$(grep -o '"vocab_size": *[0-9]*' "$L8B_DIR/config.json" | grep -o '[0-9]*$')
        prompts "$WORK/l8b-prompts.jsonl" "$L8B_PROMPTS" "${vocab:-128256}"
        CHECK_BATCH=$L8B_BATCH run_check l8b-greedy "$L8B_LOG" "$L8B_DIR" 420 \
            --prompts "$WORK/l8b-prompts.jsonl" --max-tokens "$L8B_TOKENS"
    else
        note "SKIP  llama3-8b checks: the model was not made (see l8b.log)"
    fi
fi

part serve && serve_under_load 4

if part ipc; then
    if ((NGPU < MAXTP)); then
        ipc_probe
    else
        note "SKIP  ipc probe: no ranks share a GPU here"
    fi
fi

if part extra; then
    run_check tiny-temp "$TINY_LOG" "$TINY" 180 --prompts "$WORK/tiny-prompts.jsonl" --max-tokens 32 \
        --temperature 0.8 --seed 1234
    run_check tiny-topk "$TINY_LOG" "$TINY" 180 --prompts "$WORK/tiny-prompts.jsonl" --max-tokens 32 \
        --temperature 0.8 --top-k 50 --top-p 0.9 --seed 1234
    graphs_vs_eager tiny-graphs-greedy "$TINY_LOG" "$TINY" "$WORK/tiny-prompts.jsonl" 3 \
        --max-tokens 24 --logprobs 3
    graphs_vs_eager tiny-graphs-topk "$TINY_LOG" "$TINY" "$WORK/tiny-prompts.jsonl" 5 \
        --max-tokens 24 --logprobs 2 --temperature 0.8 --top-k 20 --top-p 0.9 --seed 3
    step "tiny generate --shadow-tp1 (TP=$MAXTP)" "$TINY_LOG" 90 \
        "$LAUNCH" -n "$MAXTP" -- "$ARBOR" generate --model "$TINY" --device cuda --shadow-tp1 \
        --prompts "$WORK/tiny-prompts.jsonl" --batch 8 --max-tokens 16
    wait_l8b
    if [[ -f $L8B_OK ]]; then
        vocab=$(grep -o '"vocab_size": *[0-9]*' "$L8B_DIR/config.json" | grep -o '[0-9]*$')
        [[ -f $WORK/l8b-prompts.jsonl ]] ||
            prompts "$WORK/l8b-prompts.jsonl" "$L8B_PROMPTS" "${vocab:-128256}"
        CHECK_BATCH=$L8B_BATCH run_check l8b-seeded "$L8B_LOG" "$L8B_DIR" 420 \
            --prompts "$WORK/l8b-prompts.jsonl" --max-tokens "$L8B_TOKENS" \
            --temperature 0.8 --top-p 0.9 --seed 1234
        graphs_vs_eager l8b-graphs "$L8B_LOG" "$L8B_DIR" "$WORK/l8b-prompts.jsonl" 3 \
            --max-tokens 16 --logprobs 3 --temperature 0.8 --seed 9
        step "l8b generate --shadow-tp1 (TP=$MAXTP)" "$L8B_LOG" 180 \
            "$LAUNCH" -n "$MAXTP" -- "$ARBOR" generate --model "$L8B_DIR" --device cuda --shadow-tp1 \
            --prompts "$WORK/l8b-prompts.jsonl" --batch 4 --max-tokens 8
    fi
fi
