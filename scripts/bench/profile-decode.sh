#!/usr/bin/env bash
# One device call (carry [".device"]): the decode step kernel by kernel, arbor and the
# PyTorch reference loop side by side, to see where arbor's step loses time.
# Run from the repo root after `bash scripts/gpu/build-device.sh` (and, for the reference, a copy
# of the PyTorch reference loop at .device/decode_baseline.py, not part of this repository:
# docs/step.md, "The reference loop"):
#   bash scripts/bench/profile-decode.sh            # writes $OUT/profile-summary.txt and
#                                                   # profile-decode.tgz (the CSVs and logs:
#                                                   # a call returns at most 8 files)
# arbor: Nsight Compute (`ncu`, the profiler the lent machines have; no nsys there) times
# every kernel of a short `bench decode` run (one metric, gpu__time_duration, clocks and
# caches left alone); scripts/bench/profile-report.py splits the launches into steps at the
# row-stats kernel and sums the last decode step by kernel. The step's wall time from an
# unprofiled run in the same call minus the kernels' sum is what the GPU spends between
# kernels. Reference: torch.profiler (CUPTI) over graph replays of decode_baseline.py.
# BATCHES (default "1 64"), NUMERICS (default "invariant fast"), REFERENCE=0 skips torch,
# PROMPT_LEN=T decodes after prompts of T tokens (default: bench decode's) and then profiles
# .device/long_context_reference.py at that context instead of decode_baseline.py,
# PER_RANK_OF_TP=N profiles one rank's shape of TP=N instead (bench-rank-shape.sh),
# DETAIL="kernel-regex[@skip] ..." adds ncu's full sections for one launch of each, at
# batch DETAIL_BATCH (default 1).
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
source scripts/gpu/device-lib.sh
script_start profile-summary.txt
BATCHES=${BATCHES:-1 64}
NUMERICS=${NUMERICS:-invariant fast}
PLEN=()
[[ -n ${PROMPT_LEN:-} ]] && PLEN=(--prompt-len "$PROMPT_LEN")
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
note "ncu: ${NCU:-not found}"

if [[ -n ${PER_RANK_OF_TP:-} ]]; then
    rank_model "$PER_RANK_OF_TP" "$OUT/profile-make.log"
    L8B=$RANK_MODEL
else
    l8b_model "$OUT/profile-make.log"
fi
for num in $NUMERICS; do
    step "wall TP 1 $num" "$OUT/profile-wall.log" 90 "$ARBOR" bench decode --model "$L8B" \
        --device cuda --numerics "$num" --batch "$(echo "$BATCHES" | tr ' ' ,)" --steps 64 "${PLEN[@]}"
    grep -E "TP 1 $num" "$OUT/profile-wall.log" | tail -n 2 | tee -a "$SUMMARY"
done
if [[ -n $NCU ]]; then
    for num in $NUMERICS; do
        for b in $BATCHES; do
            # Op by op (ARBOR_CUDA_GRAPHS=0): the kernels a recorded step replays, launched
            # one by one, so every launch is its own ncu row.
            step "ncu TP 1 $num batch $b" "$OUT/profile-ncu.log" 120 env ARBOR_CUDA_GRAPHS=0 "$NCU" --clock-control none \
                --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \
                --log-file "$OUT/profile-ncu-$num-b$b.csv" "$ARBOR" bench decode --model "$L8B" \
                --device cuda --numerics "$num" --batch "$b" --steps 4 "${PLEN[@]}"
            python3 scripts/bench/profile-report.py arbor "$OUT/profile-ncu-$num-b$b.csv" \
                "$OUT/profile-wall.log" "$num" "$b" | tee -a "$SUMMARY"
        done
    done
fi
# DETAIL="regex ...": Nsight Compute's full sections for one decode-step launch of each
# kernel named (batch DETAIL_BATCH, default 1, after SKIP launches of that kernel,
# "regex@SKIP", default 300: past prefill and warm-up for a kernel launched per layer).
for d in ${DETAIL:-}; do
    [[ -n $NCU ]] || break
    k=${d%@*}
    skip=300
    [[ $d == *@* ]] && skip=${d#*@}
    step "ncu detail $k batch ${DETAIL_BATCH:-1}" "$OUT/profile-detail-$k.txt" 120 "$NCU" --clock-control none \
        --set full -k "regex:$k" --launch-skip "$skip" --launch-count 1 "$ARBOR" bench decode \
        --model "$L8B" --device cuda --numerics invariant --batch "${DETAIL_BATCH:-1}" --steps 16 "${PLEN[@]}"
    grep -E "^  [a-z_0-9]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Est. Speedup|stall" \
        "$OUT/profile-detail-$k.txt" | head -n 30 | tee -a "$SUMMARY"
done
if [[ ${REFERENCE:-1} == 1 && -n ${PROMPT_LEN:-} && -f $BIN/long_context_reference.py ]]; then
    # The context the unprofiled run's last steps see (bench decode's 64 steps).
    step "reference torch.profiler" "$OUT/profile-reference.log" 300 python3 \
        scripts/bench/profile-report.py reference "$BIN/long_context_reference.py" --compile --prefill "" \
        --decode "$(echo "$BATCHES" | tr ' ' ,)" --ctx "$((PROMPT_LEN + 63))"
    grep -A 40 '^reference profile' "$OUT/profile-reference.log" | tee -a "$SUMMARY"
elif [[ ${REFERENCE:-1} == 1 && -f $BIN/decode_baseline.py ]]; then
    step "reference torch.profiler" "$OUT/profile-reference.log" 240 python3 \
        scripts/bench/profile-report.py reference "$BIN/decode_baseline.py" --compile \
        --batch "$(echo "$BATCHES" | tr ' ' ,)" --steps 8
    grep -A 40 '^reference profile' "$OUT/profile-reference.log" | tee -a "$SUMMARY"
fi
(
    cd "$OUT" || exit
    shopt -s nullglob
    f=(profile-*.csv profile-*.log profile-detail-*.txt)
    ((${#f[@]})) && tar czf profile-decode.tgz "${f[@]}" && rm -f "${f[@]}"
)
echo "==== profile-decode ($(elapsed) s)"
