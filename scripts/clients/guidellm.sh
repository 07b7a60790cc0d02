#!/usr/bin/env bash
# guidellm (vLLM's load generator, >= 0.8) run unmodified against `arbor serve` on the tiny
# random model, on the CPU: makes the model, starts the server on 127.0.0.1, runs a short
# synchronous benchmark of synthetic prompts (guidellm counts their tokens with the
# model's own tokenizer.json, which `arbor make-model` writes), then a short concurrent
# one on /v1/chat/completions, and stops the server. Not in CI.
#
#   scripts/clients/guidellm.sh            (python3 -m pip install guidellm; see serving.md)
#
# Environment: ARBOR (default target/release/arbor), WORK (default /tmp/arbor-guidellm),
# PORT (default a random one), REQUESTS (default 8).
set -euo pipefail
cd "$(dirname "$0")/../.."

ARBOR=${ARBOR:-target/release/arbor}
WORK=${WORK:-/tmp/arbor-guidellm}
PORT=${PORT:-$((20000 + RANDOM % 20000))}
REQUESTS=${REQUESTS:-8}
command -v guidellm >/dev/null || {
    echo "guidellm: not installed (python3 -m pip install guidellm)" >&2
    exit 2
}
[[ -x $ARBOR ]] || {
    echo "guidellm: no $ARBOR (cargo build --release)" >&2
    exit 2
}

rm -rf "$WORK"
mkdir -p "$WORK"
MODEL=$WORK/model
"$ARBOR" make-model --out "$MODEL" >/dev/null
# A chat template, for the chat run (the tiny model has none).
cat >"$MODEL/tokenizer_config.json" <<'EOF'
{"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
 "chat_template": "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"}
EOF

"$ARBOR" serve --model "$MODEL" --device cpu --host 127.0.0.1 --port "$PORT" \
    --served-model-name arbor-tiny --max-num-seqs 8 >"$WORK/server.log" 2>&1 &
SERVER=$!
stop() {
    kill -TERM "$SERVER" 2>/dev/null || true
    for _ in $(seq 1 40); do
        kill -0 "$SERVER" 2>/dev/null || break
        sleep 0.25
    done
    kill -KILL "$SERVER" 2>/dev/null || true
}
trap stop EXIT
for i in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || {
        cat "$WORK/server.log" >&2
        exit 1
    }
    ((i < 120)) || {
        echo "guidellm: the server did not come up" >&2
        exit 1
    }
    sleep 0.5
done

run() {
    local name=$1
    shift
    echo "=== guidellm $name"
    (cd "$WORK" && timeout 300 guidellm run \
        --tokenizer "kind=huggingface_auto,model=$MODEL" \
        --data kind=synthetic_text,prompt_tokens=32,output_tokens=16 \
        --constraint "kind=max_requests,count=$REQUESTS" \
        --output "kind=json,path=$WORK/$name.json" \
        --disable-progress "$@")
}
run completions --backend "kind=openai_http,target=http://127.0.0.1:$PORT,request_format=/v1/completions" \
    --profile kind=synchronous
run chat --backend "kind=openai_http,target=http://127.0.0.1:$PORT,request_format=/v1/chat/completions" \
    --profile kind=concurrent,streams=4

# Every request succeeded, and guidellm read the token counts the server reported.
python3 - "$WORK" "$REQUESTS" <<'EOF'
import json
import sys

work, want = sys.argv[1], int(sys.argv[2])
for name in ("completions", "chat"):
    with open(f"{work}/{name}.json") as f:
        report = json.load(f)
    for b in report["benchmarks"]:
        totals = b["metrics"]["request_totals"]
        ok, errored = totals["successful"], totals["errored"]
        out = b["metrics"]["output_token_count"]["successful"]
        print(f"{name}: {ok} successful, {errored} errored, "
              f"output tokens mean {out['mean']:.1f}")
        assert ok >= want and errored == 0, (name, totals)
print("guidellm against arbor serve: all requests succeeded")
EOF
