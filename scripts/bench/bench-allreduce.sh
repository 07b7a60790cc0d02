#!/usr/bin/env bash
# Runs `arbor bench allreduce` on the lent H200s (nvidia-h200-x4) from prebuilt binaries in
# .device/ (build here: cargo build --release && mkdir -p .device &&
#  cp target/release/arbor target/release/arbor-launch .device/; call with carry [".device"]),
# for world sizes 2 (CUDA_VISIBLE_DEVICES=0,1) and 4. A short smoke run per world size
# first (a hang there costs 60 s, not the call). JSON, SVG, full tables and logs go to $OUT
# (8 files); the per-size summaries print last. About 3 minutes.
# Usage (device): bash scripts/bench/bench-allreduce.sh [extra bench args...]
# Env: ARBOR_BIN (binary folder), WORLDS ("2 4"), SIZES, ALGOS, TUNE=1 (grid sweep).
set -u
OUT=${OUT:-$(pwd)/bench-out}
mkdir -p "$OUT"
BIN=${ARBOR_BIN:-$(pwd)/.device}
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export RUST_LOG=${RUST_LOG:-warn}
# Never switch NVLink multicast on: keep the machine's setting, default to off.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export ARBOR_OP_TIMEOUT_SECS=${ARBOR_OP_TIMEOUT_SECS:-120}
SIZES=${SIZES:-8K,32K,128K,512K,1M,2M,8M,32M,128M,256M}
ALGOS=${ALGOS:-nccl,allgather-tree,oneshot,twoshot,twoshot-copy,auto,nvls}
WORLDS=${WORLDS:-"2 4"}

GPUS=$(nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null || true)
SMOKE=$(mktemp -d)

launch() { # world, timeout seconds, args...
    local w=$1 t=$2; shift 2
    local devs; devs=$(seq -s, 0 $((w - 1)))
    if "$BIN/arbor-launch" --help >/dev/null 2>&1; then
        CUDA_VISIBLE_DEVICES=$devs timeout "$t" "$BIN/arbor-launch" -n "$w" -- "$BIN/arbor" bench allreduce "$@"
    else
        # arbor-launch not available: start the ranks by hand with torchrun's variables.
        local pids=() port=$((29600 + RANDOM % 1000)) rc=0
        for r in $(seq 0 $((w - 1))); do
            CUDA_VISIBLE_DEVICES=$devs RANK=$r WORLD_SIZE=$w LOCAL_RANK=$r LOCAL_WORLD_SIZE=$w \
                MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
                timeout "$t" "$BIN/arbor" bench allreduce "$@" &
            pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || rc=$?; done
        return $rc
    fi
}

status=0
for w in $WORLDS; do
    echo "== world $w: smoke (8K, 1M; 3 iterations)"
    if ! launch "$w" 60 --sizes 8K,1M --iters 3 --algos nccl,allgather-tree,oneshot,twoshot \
        --json "$SMOKE/w$w.json" --svg "$SMOKE/w$w.svg" "$@" > "$SMOKE/w$w.txt" 2> "$SMOKE/w$w.log"; then
        echo "smoke run for world $w failed"; tail -30 "$SMOKE/w$w.log"; cp "$SMOKE/w$w.log" "$OUT/smoke-w$w.log"; status=1; continue
    fi
    echo "== world $w: full"
    launch "$w" 200 --sizes "$SIZES" --algos "$ALGOS" \
        --json "$OUT/allreduce-w$w.json" --svg "$OUT/allreduce-w$w.svg" "$@" \
        > "$OUT/allreduce-w$w.txt" 2> "$OUT/allreduce-w$w.log" || { echo "world $w failed (rc $?)"; tail -20 "$OUT/allreduce-w$w.log"; status=1; }
done
# Optional grid-size sweep of two-shot at large sizes (TUNE=1), printed only.
if [ "${TUNE:-0}" = 1 ]; then
    for b in ${TUNE_BLOCKS:-32 64}; do
        echo "== tune: world 4, two-shot grid cap $b"
        launch 4 120 --sizes 32M,256M --algos nccl,twoshot,twoshot-copy --twoshot-blocks "$b" --iters 10 \
            --json "$SMOKE/t$b.json" --svg "$SMOKE/t$b.svg" 2>/dev/null | grep -v "^json"
    done
fi
echo "$GPUS"
# Full tables are in $OUT/allreduce-w*.txt; the per-size summaries print last.
for w in $WORLDS; do
    [ -s "$OUT/allreduce-w$w.txt" ] && sed -n '/summary, /,$p' "$OUT/allreduce-w$w.txt"
done
exit $status
