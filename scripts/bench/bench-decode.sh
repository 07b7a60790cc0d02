#!/usr/bin/env bash
# One device call (carry [".device"]): the price of determinism in the decode step.
# Run from the repo root after `bash scripts/gpu/build-device.sh` and, for the reference, a copy of
# the PyTorch reference loop at .device/decode_baseline.py (not part of this repository;
# docs/step.md, "The reference loop"):
#   bash scripts/bench/bench-decode.sh              # writes $OUT/decode-summary.txt,
#                                                   # decode-report.json|svg, decode-raw.tgz
# Per TP (TPS, default: 1 and the GPU count) and batch (BATCHES, default 1,8,32,64), on a
# llama3-8b-shape random model: `arbor bench decode` with --numerics invariant and fast (decode
# steps replayed from CUDA graphs), invariant with ARBOR_CUDA_GRAPHS=0 (op by op; EAGER=0 skips),
# the PyTorch reference loop (decode_baseline.py --compile: torch.compile + CUDA graph,
# cuBLAS, NCCL) and the weights roofline (bf16 weight bytes per rank / device copy
# bandwidth measured in this run); scripts/bench/decode-report.py prints the ratios side by side.
# PROFILE=1 adds ARBOR_PROFILE=1 runs (per-op device time) at TP 1, batch 1 and 64;
# REFERENCE=0 skips the reference loop (its compile takes ~2 minutes per TP); PREFILL=0
# skips the 8 × 1024-token prefill runs; SAMPLED=0 skips the sampled-decode runs.
# REF_TPS (default: TPS) picks the reference loop's TPs; TP1_NUMERICS (default: NUMERICS) the
# numerics run at TP 1 (a multi-GPU call that only needs TP 1 as the baseline of TP N).
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-580}
source scripts/gpu/device-lib.sh
script_start decode-summary.txt
WORK=/tmp/arbor-bench-decode
mkdir -p "$WORK"
GPUS=$(nvidia-smi -L | wc -l)
TPS=${TPS:-$( ((GPUS > 1)) && echo "1 $GPUS" || echo 1)}
BATCHES=${BATCHES:-1,8,32,64}
NUMERICS=${NUMERICS:-invariant fast}
STEPS=${STEPS:-64}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | head -n 1 | tee -a "$SUMMARY"
note "GPUs $GPUS; TPs $TPS; batches $BATCHES; numerics $NUMERICS; $STEPS new tokens per sequence after 128 prompt tokens"

# Device copy bandwidth (read + write bytes per second of a 1 GiB copy): the roofline's unit.
step "copy bandwidth" "$OUT/decode-copy.log" 60 python3 - <<'PY'
import json, os, torch
x = torch.empty(1 << 28, dtype=torch.float32, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize(); s.record()
for _ in range(20): y.copy_(x)
e.record(); torch.cuda.synchronize()
gbps = 2 * x.numel() * 4 * 20 / (s.elapsed_time(e) * 1e-3) / 1e9
print(f"copy bandwidth {gbps:.0f} GB/s (read + write, 1 GiB)")
json.dump({"copy_gbps": gbps}, open(os.path.join(os.environ.get("OUT", "/tmp/arbor-out"), "decode-copy.json"), "w"))
PY
tail -n 1 "$OUT/decode-copy.log" | tee -a "$SUMMARY"

l8b_model "$WORK/make.log"
REF_TPS=${REF_TPS:-$TPS}
TP1_NUMERICS=${TP1_NUMERICS:-$NUMERICS}
for tp in $TPS; do
    nums=$NUMERICS
    ((tp == 1)) && nums=$TP1_NUMERICS
    for num in $nums; do
        launch=("$BIN/arbor-launch" -n "$tp" --)
        ((tp == 1)) && launch=()
        step "arbor TP $tp $num" "$OUT/decode-arbor.log" 150 "${launch[@]}" "$ARBOR" bench decode \
            --model "$L8B" --device cuda --numerics "$num" --batch "$BATCHES" --steps "$STEPS" \
            --out "$OUT/decode-arbor-tp$tp-$num.json"
        grep -E "TP $tp $num" "$OUT/decode-arbor.log" | sed 's/^\[rank 0\] //' | tail -n 4 | tee -a "$SUMMARY"
    done
    if [[ ${EAGER:-1} == 1 ]]; then
        step "arbor TP $tp invariant, no CUDA graphs" "$OUT/decode-arbor.log" 150 env ARBOR_CUDA_GRAPHS=0 \
            "${launch[@]}" "$ARBOR" bench decode --model "$L8B" --device cuda --numerics invariant \
            --batch "$BATCHES" --steps "$STEPS" --out "$OUT/decode-arbor-tp$tp-invariant-eager.json"
        grep -E "TP $tp invariant.*no CUDA graphs" "$OUT/decode-arbor.log" | sed 's/^\[rank 0\] //' | tail -n 4 | tee -a "$SUMMARY"
    fi
done
# The reference loop right after arbor's own runs: the targets' table needs it; the
# extras below are skipped first when the time budget runs out.
if [[ ${REFERENCE:-1} != 1 ]]; then
    note "SKIP  reference loop (REFERENCE=0)"
elif [[ -f $BIN/decode_baseline.py ]]; then
    for tp in $REF_TPS; do
        if ((tp == 1)); then
            step "reference TP 1" "$OUT/decode-reference.log" 220 python3 "$BIN/decode_baseline.py" \
                --compile --batch "$BATCHES" --steps "$STEPS" --out "$OUT/decode-reference-tp1.json"
        else
            step "reference TP $tp" "$OUT/decode-reference.log" 240 torchrun --standalone \
                --nproc_per_node="$tp" "$BIN/decode_baseline.py" --compile --batch "$BATCHES" \
                --steps "$STEPS" --out "$OUT/decode-reference-tp$tp.json"
        fi
        grep "^baseline+compile TP=$tp " "$OUT/decode-reference.log" | tee -a "$SUMMARY"
    done
else
    note "SKIP  reference loop (.device/decode_baseline.py missing: it is not part of this repository, see docs/step.md)"
fi
# Sampled decode (invariant numerics): a pure temperature draws on the GPU (Gumbel max in
# the row-stats kernel); top-k 50 selects its candidates on the GPU (select.cu) and draws on
# the host from them; top-p 0.9 too, and a nucleus beyond its 1024 candidates (every row of
# a random model's flat distribution) brings its row to the host. SAMPLED=0 skips.
if [[ ${SAMPLED:-1} == 1 ]]; then
    for tp in $TPS; do
        launch=("$BIN/arbor-launch" -n "$tp" --)
        ((tp == 1)) && launch=()
        for extra in "--temperature 1" "--temperature 1 --top-k 50" "--temperature 1 --top-p 0.9"; do
            tag=$(echo "$extra" | tr -d ' -.')
            # shellcheck disable=SC2086 # $extra is two or four words on purpose
            step "sampled TP $tp $extra" "$OUT/decode-sampled.log" 150 "${launch[@]}" "$ARBOR" bench decode \
                --model "$L8B" --device cuda --numerics invariant --batch "$BATCHES" --steps "$STEPS" \
                $extra --out "$OUT/decode-sampled-tp$tp-$tag.json"
            grep -E "TP $tp invariant" "$OUT/decode-sampled.log" | sed 's/^\[rank 0\] //' | tail -n 4 | tee -a "$SUMMARY"
        done
    done
fi
# Prefill at 8 × 1024 tokens, both numerics, every TP: `bench decode`
# with one decode step; its prefill figure is the number.
if [[ ${PREFILL:-1} == 1 ]]; then
    for tp in $TPS; do
        for num in $NUMERICS; do
            launch=("$BIN/arbor-launch" -n "$tp" --)
            ((tp == 1)) && launch=()
            step "prefill 8x1024 TP $tp $num" "$OUT/decode-prefill.log" 120 "${launch[@]}" "$ARBOR" \
                bench decode --model "$L8B" --device cuda --numerics "$num" --batch 8 \
                --prompt-len 1024 --steps 2 --out "$OUT/prefill-tp$tp-$num.json"
            grep -E "TP $tp $num" "$OUT/decode-prefill.log" | sed 's/^\[rank 0\] //' | tail -n 1 | tee -a "$SUMMARY"
        done
    done
fi
if [[ ${PROFILE:-0} == 1 ]]; then
    for num in $NUMERICS; do
        step "profile TP 1 $num" "$OUT/decode-profile-$num.log" 90 env ARBOR_PROFILE=1 "$ARBOR" bench decode \
            --model "$L8B" --device cuda --numerics "$num" --batch 1,64 --steps 16
        grep -A 14 '^profile' "$OUT/decode-profile-$num.log" | tee -a "$SUMMARY"
    done
fi
python3 scripts/bench/decode-report.py "$OUT" | tee -a "$SUMMARY"
pack_raw decode-raw 'decode-*.log' 'decode-arbor-*.json' 'decode-reference-*.json' 'decode-sampled-*.json' 'prefill-*.json'
echo "==== bench-decode ($(elapsed) s)"
