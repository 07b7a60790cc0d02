#!/usr/bin/env bash
# One device call (carry [".device"]): how long an RL weight update takes on a
# llama3-8b-shape model (docs/rl.md). Run from the repo root after
# `bash scripts/gpu/build-device.sh`:
#   bash scripts/bench/rl-update-bench.sh          # writes $OUT/rl-summary.txt and logs
#   RL_PARTS=disk,nccl bash scripts/bench/rl-update-bench.sh   # some of the steps below
# On nvidia-h200-x2 (or any 2+ GPU kind) it times every path; on one GPU, the disk and
# HTTP-push paths (a NCCL group needs a GPU per member: the trainer's and arbor's).
#   1. `arbor serve --device cuda` (TP 1, GPU 0) on the 8B model; a greedy probe.
#   2. POST /update_weights_from_disk of the same checkpoint (page cache warm), then again
#      after dropping the page cache where allowed (cold read): wall time and arbor's
#      own `seconds`; the probe's bits must not change (same weights).
#   3. examples/rl_push_nccl.py on GPU 1 (PyTorch) joins the group and broadcasts all the
#      tensors twice: first with model.norm.weight scaled by 1.01 (the probe's bits must
#      change), then exact (they must come back). Broadcast time and time until arbor
#      answered, and arbor's split of it: receive (the broadcasts into device memory, with
#      the GB/s), cut (every shard cut, converted and checked on the device) and swap.
#   4. release_memory_occupation / resume_memory_occupation (from the checkpoint on disk:
#      the last weights were pushed): GPU memory before and after,
#      and the resume time.
# Every step's raw output is in $OUT/rl-*.log; PASS/FAIL lines in the summary.
# RL_PARTS (a comma list; default disk,http,nccl,memory; not PARTS, which
# multi-gpu-run.sh, the script that runs this one, has its own): disk (two warm updates,
# one cold, then the load's and each update's split: host_read — read, convert, cut into
# the upload buffers —, upload_wait — waiting for copies to the device —, the rest), http
# (the HTTP push), nccl (step 3), memory (step 4).
set -uo pipefail
T0=$(date +%s)
RL_PARTS=${RL_PARTS:-disk,http,nccl,memory}
for part in ${RL_PARTS//,/ }; do
    case $part in disk | http | nccl | memory) ;; *) echo "RL_PARTS: $part is not disk, http, nccl or memory" >&2; exit 2 ;; esac
done
has() { [[ ,$RL_PARTS, == *,$1,* ]]; }
BUDGET_S=${BUDGET_S:-580}
source scripts/gpu/device-lib.sh
script_start rl-summary.txt
WORK=/tmp/arbor-rl-bench
mkdir -p "$WORK"
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1 | tee -a "$SUMMARY"
note "GPUs $GPUS"
LOG=$OUT/rl-steps.log

l8b_model "$OUT/rl-make.log"
[[ -f $L8B.complete ]] || { note "FAIL  no model"; exit 1; }

# arbor and the trainer must load the same libnccl: torch's, first in the loader path.
use_torch_nccl

PORT=${PORT:-18700}
ADDR=127.0.0.1:$PORT
# arbor is rank 0 of its own group (GPU 0: LOCAL_RANK unset); every GPU stays visible, so
# NCCL can reach the trainer's GPU directly.
RUST_LOG=info "$ARBOR" serve --model "$L8B" --device cuda --port "$PORT" \
    --max-seq-len 1024 >"$OUT/rl-serve.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; sleep 3; kill -KILL $SERVER 2>/dev/null' EXIT
t=$(date +%s)
until curl -sf "$ADDR/health" >/dev/null; do
    if ! kill -0 $SERVER 2>/dev/null; then note "FAIL  arbor serve exited; see rl-serve.log"; exit 1; fi
    if (($(date +%s) - t > 240)); then note "FAIL  arbor serve not ready in 240 s"; exit 1; fi
    sleep 1
done
note "PASS  arbor serve up in $(($(date +%s) - t)) s (load + NVRTC)"

PROBE='{"prompt":[128000,9906,11,1917,0,1226,374,264],"max_tokens":16,"temperature":0,"logprobs":1}'
# Helpers that read arbor's answers (files, so that no quoting gets in the way).
cat >"$WORK/answer.py" <<'PY'
import json, sys
r = json.load(sys.stdin)
if r.get("success"):
    print("%.2f s, version %s" % (r["seconds"], r["weight_version"]))
else:
    print(r)
PY
cat >"$WORK/nccl-report.py" <<'PY'
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    a = r["answer"]
    print("TIMED NCCL %s: %.1f GB broadcast in %.2f s (%s GB/s); arbor answered after %.2f s (apply %s s)"
          % (r["update"], r["bytes"] / 1e9, r["broadcast_seconds"], r["broadcast_GBps"],
             r["seconds_until_answer"], a.get("seconds", "n/a")))
PY
# arbor's own split of an update, from its log lines (key=value fields).
cat >"$WORK/split.py" <<'PY'
import re, sys
ansi = re.compile(r"\x1b\[[0-9;]*m")
want = {
    "received tensors from the trainer": ("receive", ["receive_seconds", "gb_per_s", "bytes", "broadcasts"]),
    "new weights prepared": ("cut", ["cut_seconds", "host_read_seconds"]),
    "new weights swapped in": ("swap", ["swap_seconds"]),
}
for line in sys.stdin:
    line = ansi.sub("", line)
    for msg, (part, keys) in want.items():
        if msg in line:
            kv = dict(re.findall(r"(\w+)=([^\s]+)", line))
            print("SPLIT %-7s " % part + " ".join("%s=%s" % (k, kv[k]) for k in keys if k in kv))
PY
probe() { # greedy: the version, the first tokens, a hash of the log-prob bits
    curl -s "$ADDR/v1/completions" -d "$PROBE" | python3 scripts/gpu/probe_digest.py
}
P0=$(probe); note "probe v0: $P0"
same_bits() { [[ ${1##* } == "${P0##* }" ]]; }

timed_update() { # timed_update NAME BODY
    local t0 t1 r
    t0=$(date +%s.%N)
    r=$(curl -s "$ADDR/update_weights_from_disk" -d "$2")
    t1=$(date +%s.%N)
    echo "$1: $r" >>"$LOG"
    note "TIMED $1: wall $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}') s, arbor $(echo "$r" | python3 "$WORK/answer.py")"
}
split() { # the load's and the updates' time split, from arbor's log
    grep -h 'model loaded\|new weights prepared' "$OUT/rl-serve.log" | sed 's/\x1b\[[0-9;]*m//g' | tee -a "$SUMMARY"
}
if has disk; then
    timed_update "update_weights_from_disk (page cache warm)" "{\"model_path\":\"$L8B\",\"weight_version\":\"disk-warm\"}"
    P=$(probe); note "probe: $P"; same_bits "$P" && note "PASS  same bits after the disk update" || note "FAIL  bits changed (same weights)"
    timed_update "update_weights_from_disk (page cache warm, again)" "{\"model_path\":\"$L8B\",\"weight_version\":\"disk-warm-2\"}"
    P=$(probe); same_bits "$P" && note "PASS  same bits after the second disk update" || note "FAIL  bits changed (same weights)"
    if sync && echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then
        timed_update "update_weights_from_disk (page cache dropped)" "{\"model_path\":\"$L8B\",\"weight_version\":\"disk-cold\"}"
        P=$(probe); same_bits "$P" && note "PASS  same bits after the cold disk update" || note "FAIL  bits changed"
    else
        note "SKIP  cold read (cannot drop the page cache here)"
    fi
    split
fi

if has http; then

# The HTTP push path (no NCCL: any trainer, one GPU): a separate process cuts the checkpoint
# into safetensors parts and posts them, then commits.
step "HTTP push (update_weights_from_tensor, 512 MiB parts; a larger tensor alone)" "$OUT/rl-http.log" 300 python3 examples/rl_push_http.py \
    --addr "${ADDR#http://}" --model "$L8B" --weight-version http-push
grep -h '^pushed' "$OUT/rl-http.log" | tail -n 1 | sed 's/^/TIMED HTTP push: /' | tee -a "$SUMMARY"
# What bounds an update: the host's reading, converting and cutting vs waiting for copies.
split
P=$(probe); same_bits "$P" && note "PASS  same bits after the HTTP push (same weights)" || note "FAIL  bits changed after the HTTP push: $P"
fi

if ! has nccl; then
    :
elif ((GPUS >= 2)); then
    step "NCCL push from PyTorch (GPU 1), model.norm.weight scaled" "$OUT/rl-nccl.log" 300 python3 examples/rl_push_nccl.py \
        --server "$ADDR" --model "$L8B" --device cuda:1 --updates 1 --version-prefix nccl-scaled \
        --scale model.norm.weight=1.01
    P=$(probe); note "probe after the scaled push: $P"
    same_bits "$P" && note "FAIL  the scaled push did not change the bits" || note "PASS  the scaled push changed the bits"
    step "NCCL push, exact weights" "$OUT/rl-nccl.log" 240 python3 examples/rl_push_nccl.py \
        --server "$ADDR" --model "$L8B" --device cuda:1 --updates 1 --version-prefix nccl-exact
    P=$(probe); note "probe after the exact push: $P"
    same_bits "$P" && note "PASS  the exact push restored the bits" || note "FAIL  bits differ after the exact push"
    grep -h '"update"' "$OUT/rl-nccl.log" | python3 "$WORK/nccl-report.py" | tee -a "$SUMMARY"
    # The last two updates (the scaled and the exact push): receive / cut / swap.
    grep -h 'received tensors\|new weights prepared\|new weights swapped' "$OUT/rl-serve.log" \
        | tail -n 6 | python3 "$WORK/split.py" | tee -a "$SUMMARY"
else
    note "SKIP  NCCL push: one GPU (the trainer needs a GPU of its own: run on nvidia-h200-x2)"
fi

if ! has memory; then
    note "done in $(elapsed) s (RL_PARTS=$RL_PARTS)"
    exit 0
fi
mem() { nvidia-smi --query-gpu=memory.used --format=csv,noheader -i 0; }
note "GPU 0 memory used: $(mem)"
r=$(curl -s "$ADDR/release_memory_occupation" -d '{}'); echo "release: $r" >>"$LOG"
sleep 2
note "after release_memory_occupation: $(mem) ($r)"
grep -h 'device memory given back' "$OUT/rl-serve.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -n 1 | tee -a "$SUMMARY"
t0=$(date +%s.%N)
# The serving weights came from the push (no copy on disk): resume names the checkpoint.
r=$(curl -s "$ADDR/resume_memory_occupation" -d "{\"model_path\":\"$L8B\"}"); echo "resume: $r" >>"$LOG"
note "TIMED resume_memory_occupation: $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b-a}') s; $(mem) ($r)"
P=$(probe); same_bits "$P" && note "PASS  same bits after release + resume" || note "FAIL  bits changed after resume: $P"
note "done in $(elapsed) s"
