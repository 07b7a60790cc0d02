#!/usr/bin/env bash
# `arbor bench gemm` on a GPU machine: tree GEMM vs cuBLAS in one process, invariance
# checked bitwise. Build here first:
#   cargo build --release && mkdir -p .device && cp target/release/arbor .device/
# then run this script there (device tool: carry [".device"]); extra arguments go to the
# bench (e.g. --m 1,64,4096 --iters 100). Results: $OUT/gemm.json, gemm.log and the
# mma.sync comparison gemm_mma.json, gemm_mma.log ($OUT defaults to the current
# directory; GEMM_SKIP_MMA=1 skips the comparison).
set -euo pipefail
BIN=${ARBOR_BIN:-.device/arbor}
DEST=${OUT:-.}
if [[ ! -x "$BIN" ]]; then
    echo "bench-gemm: no arbor binary at $BIN (build it and copy it there, or set ARBOR_BIN)" >&2
    exit 2
fi
# cuBLAS (the baseline) is not on the loader path by default on the lent machines.
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader || true
# The device's own leaf family first (wgmma on Hopper), then the portable mma.sync family
# for comparison, each in its own process so that a failure of one leaves the other's
# numbers; the exit status is the first run's.
set +e
"$BIN" bench gemm --json "$DEST/gemm.json" "$@" 2>&1 | tee "$DEST/gemm.log"
status=${PIPESTATUS[0]}
if [[ -z "${GEMM_SKIP_MMA:-}" ]]; then
    echo "--- comparison: mma.sync family ---"
    "$BIN" bench gemm --family mma --json "$DEST/gemm_mma.json" "$@" 2>&1 | tee "$DEST/gemm_mma.log"
fi
exit "$status"
