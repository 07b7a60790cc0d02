#!/usr/bin/env bash
# One device call (carry [".device"]): two or more arbor binaries on the same GPU in the
# same call, to decide whether a change helped. The machine a call lands on varies (clocks,
# neighbours: the same binary measured 6.44 and 6.83 ms/step at batch 1 in one call), so a
# comparison across calls says little; this interleaves the binaries' `bench decode` runs
# (A B A B, so drift shows) and then prints Nsight Compute's kernel table of each.
# Run from the repo root after `bash scripts/gpu/build-device.sh` and copying the baseline
# binary (built from another commit) into .device/:
#   BINS="base=.device/arbor-base new=.device/arbor" bash scripts/bench/ab-decode.sh
# or one binary under two configurations: ENV_<name> holds the variables of that entry's
# runs, e.g. the GEMM rules before the narrow tiles against the default:
#   BINS="before=.device/arbor now=.device/arbor" ENV_before="ARBOR_GEMM_NARROW=0 ARBOR_PDL=1" \
#     BATCHES=128,192,256 NCU_BATCHES="" bash scripts/bench/ab-decode.sh
# BATCHES (wall, default 1,8,32,64), NCU_BATCHES (default "1 64"), ROUNDS (default 2),
# NUMERICS (default invariant), PROMPT_LEN (default: bench decode's), STEPS (wall runs'
# decode steps, default 64); NCU_BATCHES="" skips ncu. Long contexts, e.g. the 8k
# batch-32 step of two builds, three rounds:
#   PROMPT_LEN=8192 STEPS=9 BATCHES=32 ROUNDS=3 NCU_BATCHES="" bash scripts/bench/ab-decode.sh Writes $OUT/ab-wall.log, ab-ncu.log,
# ab-ncu.tgz (the ncu tables), ab-make.log and ab-summary.txt.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
source scripts/gpu/device-lib.sh
script_start ab-summary.txt
BINS=${BINS:-base=.device/arbor-base new=.device/arbor}
BATCHES=${BATCHES:-1,8,32,64}
NCU_BATCHES=${NCU_BATCHES-1 64}
ROUNDS=${ROUNDS:-2}
NUMERICS=${NUMERICS:-invariant}
STEPS=${STEPS:-64}
PROMPT_ARGS=()
[[ -n ${PROMPT_LEN:-} ]] && PROMPT_ARGS=(--prompt-len "$PROMPT_LEN")
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
for b in $BINS; do
    if [[ $b != *=* || ! -x ${b#*=} || ! ${b%%=*} =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]]; then
        note "ab-decode: '$b' is not NAME=EXECUTABLE (NAME: letters, digits, _)"
        exit 2
    fi
done
# envs NAME: the entry's ENV_<NAME> variables as words for `env`.
envs() {
    local var="ENV_$1"
    read -ra ENVS <<<"${!var:-}"
}
note "binaries: $BINS; numerics $NUMERICS; ncu: ${NCU:-not found}"
for b in $BINS; do
    envs "${b%%=*}"
    ((${#ENVS[@]})) && note "  ${b%%=*}: ${ENVS[*]}"
done

l8b_model "$OUT/ab-make.log"
# Each run logs to a file of its own (a run that hangs shows no figures, not the previous
# round's); all of them end up in $OUT/ab-wall.log, and each entry's runs in
# $WORK/ab-wall-NAME.log for the ncu report's wall column. The device tool returns only a
# few files, so the ncu tables go into one archive at the end.
WORK=$(mktemp -d /tmp/arbor-ab.XXXXXX)
for round in $(seq "$ROUNDS"); do
    for b in $BINS; do
        name=${b%%=*}
        envs "$name"
        run_log="$WORK/run-$name-$round.log"
        step "wall $name round $round" "$run_log" 90 env "${ENVS[@]}" "${b#*=}" bench decode \
            --model "$L8B" --device cuda --numerics "$NUMERICS" --batch "$BATCHES" --steps "$STEPS" \
            "${PROMPT_ARGS[@]}"
        cat "$run_log" >>"$OUT/ab-wall.log"
        cat "$run_log" >>"$WORK/ab-wall-$name.log"
        grep -E "TP 1 $NUMERICS +batch" "$run_log" | sed "s/^/$name r$round  /" | tee -a "$SUMMARY"
    done
done
if [[ -n $NCU ]]; then
    for b in $BINS; do
        name=${b%%=*}
        envs "$name"
        for nb in $NCU_BATCHES; do
            step "ncu $name batch $nb" "$OUT/ab-ncu.log" 120 env "${ENVS[@]}" "$NCU" --clock-control none \
                --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \
                --log-file "$OUT/ab-ncu-$name-b$nb.csv" "${b#*=}" bench decode --model "$L8B" \
                --device cuda --numerics "$NUMERICS" --batch "$nb" --steps 4 "${PROMPT_ARGS[@]}" &&
                python3 scripts/bench/profile-report.py arbor "$OUT/ab-ncu-$name-b$nb.csv" \
                    "$WORK/ab-wall-$name.log" "$NUMERICS" "$nb" | sed "s/^arbor/$name/" | tee -a "$SUMMARY"
        done
    done
    (cd "$OUT" && compgen -G "ab-ncu-*.csv" >/dev/null && tar czf ab-ncu.tgz ab-ncu-*.csv && rm -f ab-ncu-*.csv)
fi
rm -rf "$WORK"
echo "==== ab-decode ($(elapsed) s)"
