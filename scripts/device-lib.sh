# Shared helpers of the device scripts (gpu-check.sh, gpu-gemm-model.sh); sourced, not run.
# The caller sets T0 (start, epoch seconds), BUDGET_S and SUMMARY before calling `step`;
# STEP_MIN_LEFT (default 15) and STEP_KILL_AFTER (default 10) tune `step`.

# cuBLAS (the GEMM baseline) lives outside the default loader path on the lent machines.
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# NVLink multicast stays off (GPU.md): never enabled by arbor, kept off here too.
export NCCL_NVLS_ENABLE=0
export RUST_LOG=${RUST_LOG:-warn}

elapsed() { echo $(($(date +%s) - T0)); }
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
