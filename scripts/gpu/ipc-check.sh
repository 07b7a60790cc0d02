#!/usr/bin/env bash
# One device call (carry [".device"]): colocated weight updates by CUDA IPC handle
# (docs/rl.md): `arbor serve --device cuda` and a PyTorch trainer (scripts/gpu/ipc_trainer.py)
# on the same GPU, the llama3-8b-shape model. Run from the repo root after
# `bash scripts/gpu/build-device.sh`:
#   bash scripts/gpu/ipc-check.sh          # TP 1 on GPU 0; writes $OUT/ipc-summary.txt
#   TP=2 bash scripts/gpu/ipc-check.sh     # TP 2 on GPUs 0 and 1 (nvidia-h100-x2)
#   1. arbor serve (KV cache of 256 blocks, ~2 GiB: the trainer's copy of the weights shares the GPU); a
#      greedy probe.
#   2. the trainer pushes the weights with model.norm.weight scaled by 1.01: the probe's
#      bits must change;
#   3. then the exact weights in each form (torch's reduction and SGLang's patched one,
#      a list of pairs and flattened buckets): after each, the probe's bits must equal the
#      first probe's (a fresh load's). Seconds until arbor answered and GB/s of each.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-580}
source scripts/gpu/device-lib.sh
script_start ipc-summary.txt
WORK=/tmp/arbor-ipc-check
mkdir -p "$WORK"
TP=${TP:-1}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1 | tee -a "$SUMMARY"
LOG=$OUT/ipc-steps.log

l8b_model "$OUT/ipc-make.log"
[[ -f $L8B.complete ]] || { note "FAIL  no model"; exit 1; }

PORT=$(free_port)
ADDR=127.0.0.1:$PORT
if ((TP == 1)); then
    RUST_LOG=info "$ARBOR" serve --model "$L8B" --device cuda --port "$PORT" \
        --max-seq-len 1024 --kv-blocks 256 >"$OUT/ipc-serve.log" 2>&1 &
else
    RUST_LOG=info "$BIN/arbor-launch" -n "$TP" -- "$ARBOR" serve --model "$L8B" --device cuda \
        --port "$PORT" --max-seq-len 1024 --kv-blocks 256 >"$OUT/ipc-serve.log" 2>&1 &
fi
SERVER=$!
trap 'stop_pid $SERVER' EXIT
if up=$(wait_up "$PORT" "$SERVER"); then
    note "PASS  arbor serve (TP $TP) up in $up s"
else
    note "FAIL  arbor serve not up; see ipc-serve.log"
    exit 1
fi

PROBE='{"prompt":[128000,9906,11,1917,0,1226,374,264],"max_tokens":16,"temperature":0,"logprobs":1}'
probe() { curl -s "$ADDR/v1/completions" -d "$PROBE" | python3 scripts/gpu/probe_digest.py; }
P0=$(probe)
note "probe v0: $P0"
same_bits() { [[ ${1##* } == "${P0##* }" ]]; }
report() { # the trainer's JSON line as a summary line
    grep -h '"seconds_until_answer"' "$LOG" | tail -n 1 | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
print("TIMED %s %s TP %d (%d calls): %.1f GB in %.2f s until arbor answered (%.2f GB/s); arbor: %s"
      % (r["form"], r["layout"], r["tp"], r["calls"], r["bytes"] / 1e9, r["seconds_until_answer"],
         r["GBps"], r["answer"].get("message") if isinstance(r["answer"], dict) else r["answer"]))
' | tee -a "$SUMMARY"
}
TRAINER=(python3 scripts/gpu/ipc_trainer.py --server "$ADDR" --model "$L8B" --tp "$TP")

step "IPC push, model.norm.weight scaled by 1.01" "$LOG" 240 "${TRAINER[@]}" --scale model.norm.weight=1.01 --version scaled
report
P=$(probe); note "probe after the scaled push: $P"
same_bits "$P" && note "FAIL  the scaled push did not change the bits" || note "PASS  the scaled push changed the bits"

for form in torch sglang; do
    for layout in pairs bucket; do
        step "IPC push, exact weights ($form, $layout)" "$LOG" 240 "${TRAINER[@]}" --form "$form" --layout "$layout" \
            --version "exact-$form-$layout"
        report
        P=$(probe); note "probe: $P"
        same_bits "$P" && note "PASS  the exact push ($form, $layout) gives a fresh load's bits" ||
            note "FAIL  bits differ after the exact push ($form, $layout)"
    done
done
# Where an update's time goes: the device-to-device copies, the cut, the swap.
grep -h 'copied tensors handed over by CUDA IPC\|new weights prepared\|new weights swapped in' "$OUT/ipc-serve.log" |
    sed 's/\x1b\[[0-9;]*m//g' | tail -n 6 | tee -a "$SUMMARY"
note "done in $(elapsed) s"
