#!/usr/bin/env bash
# examples/rl_grpo.py's GRPO loop on GPUs, in one device call (carry [".device"]) on a
# 4-GPU kind (nvidia-h100-x4), or a 2-GPU one (nvidia-h100-x2). Run from the repository
# root after `bash scripts/gpu/build-device.sh`:
#   bash scripts/gpu/rl-grpo-gpu.sh       # writes $OUT/rl-grpo-summary.txt, rl-grpo.log
#   1. The model: `arbor make-model --preset llama3-8b --layers LAYERS` (default 2: Llama-3-8B
#      shapes, 1.5 B parameters, 3 GB of bf16; the machine has no network, so no trained
#      model). Random weights: `--reward even-ids` (the share of a sample's tokens with an
#      even id) varies between samples, so each step moves the weights; nothing is learnt.
#   2. 4 GPUs or more: the trainer under FSDP2 on GPUs 0 and 1 (torchrun, bf16 compute over
#      f32 masters), `arbor serve --device cuda` at TP 2 on GPUs 2 and 3. 2 or 3 GPUs: the
#      trainer on GPU 0 alone, the server at TP 1 on GPU 1. STEPS (3) steps, each pushing the
#      new bf16 weights over NCCL (arbor loads torch's libnccl: use_torch_nccl).
# PASS lines: the script's exit (1 if any token's ratio before a step is not exactly 1.0),
# every step's tokens all exactly 1.0, pushes that changed the weights, the plain PyTorch
# forward's gap. The last line says RL GRPO GPU: PASS or FAIL. Budget BUDGET_S (470 s).
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
STEPS=${STEPS:-3}
LAYERS=${LAYERS:-2}
source scripts/gpu/device-lib.sh
script_start rl-grpo-summary.txt
WORK=/tmp/arbor-rl-grpo
rm -rf "$WORK"
mkdir -p "$WORK"
FAILED=0
fail() { note "FAIL  $*"; FAILED=1; }
finish() {
    ((FAILED)) && note "RL GRPO GPU: FAIL" || note "RL GRPO GPU: PASS"
    exit $FAILED
}

GPUS=$(nvidia-smi -L | grep -c '^GPU')
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1 | tee -a "$SUMMARY"
python3 -c 'import torch; print("torch", torch.__version__)' | tee -a "$SUMMARY"
if ((GPUS < 2)); then
    fail "$GPUS GPU(s): the trainer and the server need one each"
    finish
fi
export PYTHONPATH=$PWD/$BIN/py${PYTHONPATH:+:$PYTHONPATH}
use_torch_nccl

MODEL=$WORK/model
step "make-model llama3-8b, $LAYERS layers" "$OUT/rl-grpo-make.log" 150 \
    "$ARBOR" make-model --preset llama3-8b --layers "$LAYERS" --seed 1 --out "$MODEL" || {
    FAILED=1
    finish
}

ARGS=(examples/rl_grpo.py --model "$MODEL" --arbor "$ARBOR" --launcher "$BIN/arbor-launch"
    --steps "$STEPS" --reward even-ids --lr "${LR:-1e-4}" --workdir "$OUT/rl-grpo-work")
if ((GPUS >= 4)); then
    note "layout: trainer under FSDP2 on GPUs 0,1; arbor serve at TP 2 on GPUs 2,3; NCCL push"
    CMD=(python3 -m torch.distributed.run --standalone --nproc-per-node 2 "${ARGS[@]}"
        --device cuda --serve-gpus 2,3 --tp 2)
else
    note "layout: trainer on GPU 0; arbor serve at TP 1 on GPU 1; NCCL push"
    CMD=(python3 "${ARGS[@]}" --device cuda:0 --serve-gpus 1 --tp 1)
fi
LOG=$OUT/rl-grpo.log
step "GRPO, $STEPS steps" "$LOG" 420 "${CMD[@]}" || FAILED=1
grep -E '^(trainer:|arbor serve|libnccl|step [0-9]|  |OK|MISMATCH)' "$LOG" >>"$SUMMARY"

# The log's own lines, read back: the NCCL push, each step all exactly 1.0, the pushes
# changed the weights.
grep -q 'pushes over NCCL' "$LOG" && note "PASS  the weights went over NCCL" ||
    fail "the weights did not go over NCCL"
exact=$(grep -cE ' ([0-9]+)/\1 exactly 1\.0, \1/\1 log-probs bit-equal' "$LOG")
((exact == STEPS)) && note "PASS  $exact/$STEPS steps: every token's ratio exactly 1.0, every log-prob bit-equal" ||
    fail "$exact/$STEPS steps with every token's ratio exactly 1.0"
changed=$(grep -oE 'push: [0-9]+/' "$LOG" | grep -vc 'push: 0/')
((changed > 0)) && note "PASS  $changed/$STEPS pushes changed the weights (the next step's bits are the new weights')" ||
    fail "no push changed the weights: the loop did not show an update"
gap=$(grep -oE 'plain PyTorch bf16 forward, same tokens: [0-9]+/[0-9]+ log-probs equal, max \|dp\| [0-9.]+' "$LOG" |
    sed 's/.*tokens: //' | tr '\n' ';')
note "plain PyTorch bf16 forward per step: ${gap:-none}"
finish
