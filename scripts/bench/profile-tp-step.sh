#!/usr/bin/env bash
# One device call on a machine of N >= 2 GPUs (carry [".device"]): where a TP=N decode step's
# time goes — one rank's compute vs the collectives vs waits and launch gaps — all measured
# in the same call. Run from the repo root after `bash scripts/gpu/build-device.sh`:
#   bash scripts/bench/profile-tp-step.sh            # TP = every visible GPU; TP=4 to pick
# 1. The TP=N step: `arbor-launch -n N -- arbor bench decode` (CUDA graphs), BATCHES.
# 2. One rank's compute alone: the model a rank holds (`make-model --per-rank-of-tp N`) run
#    at TP 1 on GPU 0 with rank 0's o / down tiles (`--rank-of-tp N`), CUDA graphs.
# 3. The collectives alone: `arbor bench allreduce` at N ranks, f32, the decode step's
#    message sizes (hidden 4096 x batch x 4 bytes), arbor's `auto` next to NCCL, timed
#    inside CUDA graphs like the step's.
# 4. `ARBOR_PROFILE=1` at TP N, batch PROFILE_BATCH (default 1; op by op, synchronised
#    around every op): rank 0's per-op table, the all-reduce's in-step cost with the ranks'
#    skew included.
# The summary prints step - rank compute (what TP costs) next to 2 x layers x the measured
# all-reduce (what the collectives alone explain); the rest is waiting between ranks and
# the launch gaps the graphs do not hide.
set -uo pipefail
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-240}
source scripts/gpu/device-lib.sh
script_start profile-tp-summary.txt
GPUS=$(nvidia-smi -L | grep -c '^GPU')
TP=${TP:-$GPUS}
BATCHES=${BATCHES:-1,8,64}
PROFILE_BATCH=${PROFILE_BATCH:-1}
STEPS=${STEPS:-64}
LAYERS=32 # the llama3-8b shape's
HIDDEN=4096
if ((TP < 2 || TP > GPUS)); then
    note "profile-tp-step: TP=$TP needs 2..$GPUS GPUs (one rank per GPU)"
    exit 2
fi
note "profile of one TP $TP decode step: $GPUS GPUs, batches $BATCHES, $STEPS steps"

l8b_model "$OUT/profile-tp-make.log"
step "TP $TP step (graphs)" "$OUT/profile-tp-step.log" 150 "$BIN/arbor-launch" -n "$TP" -- \
    "$ARBOR" bench decode --model "$L8B" --device cuda --numerics invariant --batch "$BATCHES" \
    --steps "$STEPS" --out "$OUT/profile-tp-step.json"
grep -E "TP $TP invariant" "$OUT/profile-tp-step.log" | sed 's/^\[rank 0\] //' | tee -a "$SUMMARY"

rank_model "$TP" "$OUT/profile-tp-make.log"
step "one rank of TP $TP alone (graphs)" "$OUT/profile-tp-rank.log" 120 env CUDA_VISIBLE_DEVICES=0 \
    "$ARBOR" bench decode --model "$RANK_MODEL" --device cuda --numerics invariant \
    --batch "$BATCHES" --steps "$STEPS" --rank-of-tp "$TP" --out "$OUT/profile-tp-rank.json"
grep -E "^TP 1 invariant" "$OUT/profile-tp-rank.log" | sed "s/^TP 1/rank of TP $TP/" | tee -a "$SUMMARY"

sizes=""
for b in ${BATCHES//,/ }; do
    sizes="$sizes${sizes:+,}$((HIDDEN * b * 4))"
done
devs=$(seq -s, 0 $((TP - 1)))
step "bench allreduce, $TP ranks, sizes $sizes" "$OUT/profile-tp-allreduce.log" 120 \
    env CUDA_VISIBLE_DEVICES="$devs" "$BIN/arbor-launch" -n "$TP" -- "$ARBOR" bench allreduce \
    --sizes "$sizes" --dtypes f32 --algos nccl,auto --iters 50 \
    --json "$OUT/profile-tp-allreduce.json" --svg "$OUT/profile-tp-allreduce.svg"
sed 's/^\[rank 0\] //' "$OUT/profile-tp-allreduce.log" | sed -n '/summary, /,$p' | head -n 20 |
    tee -a "$SUMMARY"

step "ARBOR_PROFILE=1 TP $TP batch $PROFILE_BATCH" "$OUT/profile-tp-ops.log" 120 env ARBOR_PROFILE=1 \
    "$BIN/arbor-launch" -n "$TP" -- "$ARBOR" bench decode --model "$L8B" --device cuda \
    --numerics invariant --batch "$PROFILE_BATCH" --steps 16
# Rank 0's table, the decode-step rows (m = the batch) first.
sed -n 's/^\[rank 0\] //p' "$OUT/profile-tp-ops.log" | grep -E "^profile|^op |m=$PROFILE_BATCH( |$)" |
    head -n 24 | tee -a "$SUMMARY"

python3 - "$OUT" "$TP" "$LAYERS" "$HIDDEN" <<'PY' | tee -a "$SUMMARY"
import json, os, sys
out, tp, layers, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None
def per_batch(doc):
    # bench decode's JSON: a list, one object per batch with its decode ms per step.
    return {int(r["batch"]): float(r["decode_ms_per_step"]) for r in (doc or [])
            if r.get("batch") is not None and r.get("decode_ms_per_step") is not None}
step, rank = per_batch(load("profile-tp-step.json")), per_batch(load("profile-tp-rank.json"))
ar = {}
doc = load("profile-tp-allreduce.json") or {}
for r in doc.get("rows", []):
    if r.get("dtype") == "f32" and r.get("algo") in ("auto", "nccl"):
        if r.get("time_us") is not None and not r.get("error"):
            ar[(r["algo"], int(r["bytes"]))] = float(r["time_us"])
print(f"TP {tp} step, ms: batch | step | rank alone | step - rank | {2 * layers} x all-reduce (auto) | rest")
for b in sorted(step):
    s, k = step[b], rank.get(b)
    a = ar.get(("auto", hidden * b * 4))
    coll = 2 * layers * a / 1e3 if a is not None else None
    fmt = lambda v: f"{v:.3f}" if v is not None else "—"
    rest = s - k - coll if k is not None and coll is not None else None
    print(f"  {b:>5} | {fmt(s)} | {fmt(k)} | {fmt(s - k if k is not None else None)} | {fmt(coll)} | {fmt(rest)}")
for (algo, n), us in sorted(ar.items()):
    print(f"  all-reduce {algo:>4} {n:>8} B: {us:.1f} µs per call (median)")
if not step or not rank or not ar:
    print("  (some figures missing: see the logs; JSON keys read: [].batch / decode_ms_per_step, rows[].algo / bytes / time_us)")
PY
pack_raw profile-tp-raw 'profile-tp-*'
echo "==== profile-tp-step ($(elapsed) s)"
