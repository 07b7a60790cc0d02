#!/usr/bin/env bash
# The multi-GPU run in ONE device call on a machine of N >= 2 GPUs (nvidia-h200-x4 or -x2,
# nvidia-h100-x4, ...), one rank per GPU. Run from the repo root after
# `bash scripts/gpu/build-device.sh` here and a copy of the PyTorch reference loop at
# .device/decode_baseline.py (device tool: carry [".device"]):
#   bash scripts/gpu/multi-gpu-run.sh
# 1. correctness (CHECK_S seconds, default 250): scripts/gpu/gpu-check.sh shared at TP 1,2,..,N
#    with one rank per GPU (the NCCL / IPC path, decode steps from CUDA graphs with the
#    collectives captured inside): the tiny model at every TP
#    (greedy, seeded, long prompts with a shared prefix), the llama3-8b shape greedy at
#    TP x batch 1,8, then the extras (temperature / top-k, graphs vs op by op, --shadow-tp1,
#    the llama3-8b seeded check) while the budget lasts. The one-GPU kernel and model tests
#    are not repeated here (gpu-check.sh smoke runs them).
# 2. speed (DECODE_S, default 300): scripts/bench/bench-decode.sh at TP 1 (invariant) and TP N
#    (invariant and fast), batches 1,8,64, the reference loop under torchrun at TP N.
# 2b. profile (PROFILE_S, default 200; only when PARTS names it): scripts/bench/profile-tp-step.sh,
#    one TP N step split into one rank's compute, the all-reduces and the rest.
# 3. RL weight updates (what is left, if at least 200 s): scripts/bench/rl-update-bench.sh, whose
#    NCCL push needs the second GPU (the trainer on GPU 1, arbor on GPU 0).
# 4. serving (what is left of TOTAL_S, default 580, if at least 150 s): scripts/bench/bench-serve.sh
#    at TP N, invariant, 256 clients.
# PARTS (default check,decode,serve) picks the parts, run in the order above: e.g. PARTS=check,decode
# in one call and PARTS=rl,serve in the next.
# $OUT receives check-summary.txt, decode-summary.txt, profile-tp-summary.txt,
# serve-summary.txt, rl-summary.txt, decode-report.json and logs.tar.gz (every log and JSON); the summaries print at the end.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
FINAL=${OUT:-/tmp/arbor-out}
mkdir -p "$FINAL"
WORKDIR=/tmp/arbor-multi-gpu
rm -rf "$WORKDIR"
mkdir -p "$WORKDIR"
GPUS=$(nvidia-smi -L | grep -c '^GPU')
TOTAL_S=${TOTAL_S:-580}
CHECK_S=${CHECK_S:-250}
DECODE_S=${DECODE_S:-300}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PARTS=${PARTS:-check,decode,serve}
left() { echo $((TOTAL_S - ($(date +%s) - T0))); }
part() { [[ ,$PARTS, == *,$1,* ]]; }

if ((GPUS < 2)); then
    echo "multi-gpu-run: $GPUS GPU(s) visible; this run needs at least 2 (use gpu-check.sh shared on one GPU)" >&2
    exit 2
fi
TPS=1
tp=2
while ((tp <= GPUS)); do
    TPS="$TPS,$tp"
    tp=$((tp * 2))
done
MAXTP=${TPS##*,}
echo "multi-gpu-run: $GPUS GPUs, TP $TPS, budget $TOTAL_S s ($(date -u +%FT%TZ))"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -n $((GPUS + 1))

# 1. correctness
if part check; then
    mkdir -p "$WORKDIR/check"
    OUT=$WORKDIR/check TPS=$TPS BUDGET_S=$CHECK_S PARTS=tiny,l8b,extra \
        bash scripts/gpu/gpu-check.sh shared >"$WORKDIR/check.out" 2>&1
    echo "check exit $? after $(($(date +%s) - T0)) s" >>"$WORKDIR/check/summary.txt"
    cp "$WORKDIR/check/summary.txt" "$FINAL/check-summary.txt"
fi

# 2. speed
if part decode; then
    budget=$(left)
    ((budget > DECODE_S)) && budget=$DECODE_S
    OUT=$WORKDIR/decode TPS="1 $MAXTP" REF_TPS=$MAXTP TP1_NUMERICS=invariant BATCHES=1,8,64 \
        EAGER=0 SAMPLED=0 PREFILL=0 BUDGET_S=$budget bash scripts/bench/bench-decode.sh >"$WORKDIR/decode.out" 2>&1
    cp "$WORKDIR/decode/decode-summary.txt" "$FINAL/decode-summary.txt" 2>/dev/null
    cp "$WORKDIR/decode/decode-report.json" "$FINAL/decode-report.json" 2>/dev/null
fi

# 2b. one TP N step, taken apart
if part profile; then
    budget=$(left)
    ((budget > ${PROFILE_S:-200})) && budget=${PROFILE_S:-200}
    OUT=$WORKDIR/profile TP=$MAXTP BUDGET_S=$budget bash scripts/bench/profile-tp-step.sh >"$WORKDIR/profile.out" 2>&1
    cp "$WORKDIR/profile/profile-tp-summary.txt" "$FINAL/profile-tp-summary.txt" 2>/dev/null
fi

# 3. RL weight updates, the NCCL push included (GPU 1 is the trainer's)
if part rl; then
    budget=$(($(left) - 10))
    if ((budget >= 200)); then
        OUT=$WORKDIR/rl BUDGET_S=$budget bash scripts/bench/rl-update-bench.sh >"$WORKDIR/rl.out" 2>&1
        cp "$WORKDIR/rl/rl-summary.txt" "$FINAL/rl-summary.txt" 2>/dev/null
    else
        echo "SKIP  rl-update-bench: $budget s left" | tee "$FINAL/rl-summary.txt"
    fi
fi

# 4. serving, only with time for it
if part serve; then
    budget=$(($(left) - 10))
    if ((budget >= 150)); then
        OUT=$WORKDIR/serve TP=$MAXTP NUMERICS=invariant CLIENTS=256 REQUESTS=512 OUTPUTS=32:256 \
            BUDGET_S=$budget bash scripts/bench/bench-serve.sh >"$WORKDIR/serve.out" 2>&1
        cp "$WORKDIR/serve/serve-summary.txt" "$FINAL/serve-summary.txt" 2>/dev/null
    else
        echo "SKIP  arbor bench serve --tp $MAXTP: $budget s left" | tee "$FINAL/serve-summary.txt"
    fi
fi

tar -C "$WORKDIR" --exclude='*.safetensors' -czf "$FINAL/logs.tar.gz" . 2>/dev/null
echo
echo "==================== multi-gpu-run ($(($(date +%s) - T0)) s) ===================="
for f in check-summary.txt decode-summary.txt profile-tp-summary.txt rl-summary.txt serve-summary.txt; do
    [[ -f $FINAL/$f ]] || continue
    echo "---- $f"
    cat "$FINAL/$f"
done
