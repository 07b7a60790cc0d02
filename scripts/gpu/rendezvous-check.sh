#!/usr/bin/env bash
# One device call on a 2-GPU kind (carry [".device"]): a PyTorch trainer joins arbor's
# weight-update group by address, as the RL frameworks do, and pushes weights over NCCL
# (docs/rl.md). Run from the repository root after `bash scripts/gpu/build-device.sh`:
#   bash scripts/gpu/rendezvous-check.sh        # writes $OUT/rendezvous-summary.txt, logs
#   1. Two tiny Llama checkpoints A and B; `arbor serve --device cuda` (TP 1, GPU 0) on A.
#      Reference probes (greedy, log-probs): B and A loaded from disk
#      (/update_weights_from_disk), whose bits a fresh load gives.
#   2. SGLang style (scripts/gpu/rendezvous-trainer.py --style sglang, GPU 1): slime's
#      init_process_group at tcp://127.0.0.1:PORT (torch's ProcessGroupNCCL), arbor joins
#      through the store with master_address/master_port, then B in buckets of 8 tensors
#      (no commit: the last bucket applies). The probe must give B's disk bits.
#   3. vLLM style (--style vllm): StatelessProcessGroup + PyNcclCommunicator, then A one
#      tensor per call. The probe must give A's disk bits.
#   4. vLLM's weight-transfer API with the packed layout (--style packed); see below.
#   5. TRL style (--style trl): TRL's VLLMClient routes, the trainer at the LAST rank of
#      the StatelessProcessGroup (arbor's rank 0 runs the store and makes the NCCL id),
#      then A one tensor per /update_named_param/ with vLLM's barrier after each. The
#      probe must give A's disk bits.
#   6. prime-rl style (--style prime-rl): /init_broadcaster, then B as prime-rl's trainer
#      broadcasts it (the tensor list pickled in band, one tensor per dtype per state
#      dict) under /update_weights {weight_dir}. The probe must give B's disk bits.
#   `bash scripts/gpu/rendezvous-check.sh packed` runs steps 1 and 4 only;
#   `bash scripts/gpu/rendezvous-check.sh prime-rl` steps 1 and 6 only.
# PASS/FAIL per step; the last line says RENDEZVOUS CHECK: PASS or FAIL.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
source scripts/gpu/device-lib.sh
script_start rendezvous-summary.txt
WORK=/tmp/arbor-rendezvous
rm -rf "$WORK"
mkdir -p "$WORK"
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1 | tee -a "$SUMMARY"
if ((GPUS < 2)); then
    note "FAIL  $GPUS GPU(s): the trainer and arbor need one each"
    note "RENDEZVOUS CHECK: FAIL"
    exit 1
fi
python3 -c 'import torch; print("torch", torch.__version__)' | tee -a "$SUMMARY"
FAILED=0
fail() { note "FAIL  $*"; FAILED=1; }

for m in A:7 B:8; do
    "$ARBOR" make-model --preset tiny --seed "${m#*:}" --out "$WORK/${m%%:*}" >>"$OUT/rendezvous-make.log" 2>&1 ||
        { fail "make-model ${m%%:*}"; note "RENDEZVOUS CHECK: FAIL"; exit 1; }
done

# arbor and the trainer must load the same libnccl: torch's, first in the loader path.
use_torch_nccl

PORT=${PORT:-18710}
ADDR=127.0.0.1:$PORT
# arbor on GPU 0 (rank 0 of its own group, LOCAL_RANK unset), every GPU visible so that
# NCCL reaches the trainer's GPU directly; the trainer on GPU 1.
RUST_LOG=info "$ARBOR" serve --model "$WORK/A" --device cuda --port "$PORT" \
    --max-seq-len 256 >"$OUT/rendezvous-serve.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; sleep 3; kill -KILL $SERVER 2>/dev/null' EXIT
t=$(date +%s)
until curl -sf "$ADDR/health" >/dev/null; do
    if ! kill -0 $SERVER 2>/dev/null; then fail "arbor serve exited; see rendezvous-serve.log"; note "RENDEZVOUS CHECK: FAIL"; exit 1; fi
    if (($(date +%s) - t > 180)); then fail "arbor serve not ready in 180 s"; note "RENDEZVOUS CHECK: FAIL"; exit 1; fi
    sleep 1
done
note "PASS  arbor serve up in $(($(date +%s) - t)) s"

PROBE='{"prompt":[1,17,42,99,7,3,250,11],"max_tokens":16,"temperature":0,"logprobs":1}'
probe() { curl -s "$ADDR/v1/completions" -d "$PROBE" | python3 scripts/gpu/probe_digest.py; }
bits() { echo "${1##* }"; }
version() { echo "${1%% *}"; }
disk() { # disk DIR VERSION
    curl -s "$ADDR/update_weights_from_disk" -d "{\"model_path\": \"$1\", \"weight_version\": \"$2\"}" >>"$OUT/rendezvous-steps.log"
    echo >>"$OUT/rendezvous-steps.log"
}

P0=$(probe); note "probe A (start): $P0"
disk "$WORK/B" disk-B; PB=$(probe); note "probe B (disk):  $PB"
disk "$WORK/A" disk-A; PA=$(probe); note "probe A (disk):  $PA"
[[ $(bits "$PA") == $(bits "$P0") ]] || fail "A from disk differs from A at start"
[[ $(bits "$PA") != $(bits "$PB") ]] || fail "A and B give the same probe bits: the check could not see an update"

trainer() { # trainer STYLE MODEL VERSION STORE_PORT
    step "trainer, $1 style, pushes $(basename "$2") as $3" "$OUT/rendezvous-trainer-$1.log" 240 \
        python3 scripts/gpu/rendezvous-trainer.py --server "$ADDR" --model "$2" --device cuda:1 \
        --style "$1" --port "$4" --version "$3"
}

ONLY=${1:-all}
if [[ $ONLY == prime-rl ]]; then
    disk "$WORK/A" disk-A
elif [[ $ONLY == packed ]]; then
    # The packed step alone: A serves, B is pushed.
    disk "$WORK/A" disk-A
elif trainer sglang "$WORK/B" sglang-B 29561; then
    P=$(probe); note "probe after the SGLang-style push: $P"
    [[ $(version "$P") == sglang-B ]] || fail "version after the SGLang-style push: $(version "$P")"
    [[ $(bits "$P") == $(bits "$PB") ]] && note "PASS  SGLang style: B's bits, as from disk" || fail "SGLang style: bits differ from B from disk"
else
    FAILED=1
fi
if [[ $ONLY == packed || $ONLY == prime-rl ]]; then
    :
elif trainer vllm "$WORK/A" vllm-A 29562; then
    P=$(probe); note "probe after the vLLM-style push: $P"
    [[ $(version "$P") == vllm-A ]] || fail "version after the vLLM-style push: $(version "$P")"
    [[ $(bits "$P") == $(bits "$PA") ]] && note "PASS  vLLM style: A's bits, as from disk" || fail "vLLM style: bits differ from A from disk"
else
    FAILED=1
fi
# 4. vLLM's weight-transfer API, packed (--style packed, or `rendezvous-check.sh packed`
#    for this step alone): B in 64 KiB uint8 buffers; the probe must give B's disk bits.
if [[ $ONLY == prime-rl ]]; then
    :
elif trainer packed "$WORK/B" packed-B 29563; then
    P=$(probe); note "probe after the packed push: $P"
    [[ $(version "$P") == packed-B ]] || fail "version after the packed push: $(version "$P")"
    [[ $(bits "$P") == $(bits "$PB") ]] && note "PASS  vLLM packed: B's bits, as from disk" || fail "vLLM packed: bits differ from B from disk"
    grep -h "received tensors from the trainer" "$OUT/rendezvous-serve.log" | tail -n 1 >>"$SUMMARY"
else
    FAILED=1
fi
# 5. TRL style: A one tensor per call, the trainer at the last rank (B serves now).
if [[ $ONLY == all ]]; then
    if trainer trl "$WORK/A" trl-A 29564; then
        P=$(probe); note "probe after the TRL-style push: $P"
        [[ $(bits "$P") == $(bits "$PA") ]] && note "PASS  TRL style (trainer last): A's bits, as from disk" || fail "TRL style: bits differ from A from disk"
    else
        FAILED=1
    fi
fi
# 6. prime-rl style: B, its tensor list in band (A serves now).
if [[ $ONLY == all || $ONLY == prime-rl ]]; then
    if trainer prime-rl "$WORK/B" prime-rl-B 29565; then
        P=$(probe); note "probe after the prime-rl push: $P"
        [[ $(version "$P") == prime-rl-B ]] || fail "version after the prime-rl push: $(version "$P")"
        [[ $(bits "$P") == $(bits "$PB") ]] && note "PASS  prime-rl style (metadata in band): B's bits, as from disk" || fail "prime-rl style: bits differ from B from disk"
        grep -h "received a prime-rl update" "$OUT/rendezvous-serve.log" | tail -n 1 >>"$SUMMARY"
    else
        FAILED=1
    fi
fi
grep -h "weight-update group\|joined\|TCPStore" "$OUT/rendezvous-serve.log" | tail -n 12 >>"$SUMMARY"
((FAILED)) && note "RENDEZVOUS CHECK: FAIL" || note "RENDEZVOUS CHECK: PASS"
exit $FAILED
