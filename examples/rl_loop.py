#!/usr/bin/env python3
"""An RL loop against `arbor serve`, on CPU, in about a minute.

A PyTorch "trainer" holds the policy's weights. Each step it
  1. takes an optimizer step (here: a seeded nudge of every weight),
  2. pushes the new weights to `arbor serve` running at TP 2, over HTTP
     (POST /update_weights_from_tensor, safetensors bodies, the last one commits),
  3. requests rollouts with log-probs (POST /v1/completions),
  4. scores the same sequences with `arbor score` at TP 1 on a checkpoint of the same
     weights (the trainer's teacher-forced path),
and checks that the rollout log-probs equal the scored ones bit for bit and that every
rollout reports the version it pushed. arbor's promise is that they do, whatever the TP
size, the batch or the load (docs/rl.md).

Run from the repository root:

    cargo build --release
    python3 -m pip install torch safetensors numpy     # CPU wheels are enough
    python3 examples/rl_loop.py --steps 3

It makes a tiny random Llama with `arbor make-model` (or takes --model DIR), starts the
server under arbor-launch, and stops it at the end. Exit status 0 when every log-prob
matched.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import torch
from safetensors.torch import load_file, save, save_file


def call(addr, path, body=None, data=None, ctype="application/json", timeout=600):
    """One HTTP request; returns (status, JSON body)."""
    if body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://{addr}{path}", data=data, headers={"Content-Type": ctype}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, model, port):
    cmd = [args.launcher, "-n", str(args.tp), "--", args.arbor, "serve",
           "--model", model, "--port", str(port), "--max-seq-len", "256"]
    # The server writes to its own copy of the descriptor; this side closes its copy.
    with open(os.path.join(args.workdir, "serve.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    addr = f"127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"arbor serve exited early; see {log.name}")
        try:
            if call(addr, "/health", timeout=2)[0] == 200:
                return proc, addr
        except OSError:
            pass
        time.sleep(0.1)
    sys.exit("arbor serve did not come up in 60 s")


def push(addr, weights, version, max_part_bytes):
    """Sends every tensor in safetensors parts of at most max_part_bytes; the last part
    commits them as `version`. Returns the server's answer and the parts sent."""
    parts, cur, size = [], {}, 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > max_part_bytes:
            parts.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += nbytes
    parts.append(cur)
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        query = f"commit=true&weight_version={version}" if last else "commit=false"
        status, body = call(addr, f"/update_weights_from_tensor?{query}",
                            data=save(part), ctype="application/octet-stream")
        if status != 200:
            sys.exit(f"push of part {i + 1}/{len(parts)} failed ({status}): {body}")
    return body, len(parts)


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arbor", default="target/release/arbor")
    ap.add_argument("--launcher", default="target/release/arbor-launch")
    ap.add_argument("--model", help="an HF model directory (default: a tiny random Llama)")
    ap.add_argument("--tp", type=int, default=2, help="the rollout server's TP size")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3, help="size of each step's nudge")
    ap.add_argument("--part-bytes", type=int, default=1 << 20,
                    help="largest safetensors part per HTTP call")
    ap.add_argument("--workdir", help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="arbor-rl-")
    os.makedirs(args.workdir, exist_ok=True)

    model = args.model
    if model is None:
        model = os.path.join(args.workdir, "tiny")
        subprocess.run([args.arbor, "make-model", "--preset", "tiny", "--seed", "7",
                        "--out", model], check=True, capture_output=True)
    weights = load_file(os.path.join(model, "model.safetensors"))
    print(f"trainer: {len(weights)} tensors, "
          f"{sum(t.numel() for t in weights.values())} parameters from {model}")

    proc, addr = start_server(args, model, free_port())
    print(f"arbor serve at TP {args.tp} on {addr}, weight version "
          f"{call(addr, '/get_weight_version')[1]['weight_version']}")
    gen = torch.Generator().manual_seed(0)
    prompts = [[7 + 13 * j + p for j in range(4 + p)] for p in range(3)]
    ok = True
    try:
        for step in range(1, args.steps + 1):
            # 1. The optimizer step: every weight moves a little (in f32, stored as bf16).
            with torch.no_grad():
                for name, w in weights.items():
                    noise = torch.randn(w.shape, generator=gen, dtype=torch.float32)
                    weights[name] = (w.float() + args.lr * noise * w.float().abs().mean()).to(w.dtype)
            version = f"step-{step}"

            # 2. Push the weights: no restart, no disk.
            t0 = time.time()
            answer, nparts = push(addr, weights, version, args.part_bytes)
            pushed = time.time() - t0

            # 3. Rollouts with log-probs; each reports the version it ran on.
            seqs, rollout_lps = [], []
            for p, prompt in enumerate(prompts):
                status, r = call(addr, "/v1/completions", {
                    "prompt": prompt, "max_tokens": 16, "n": 4, "temperature": 1.0,
                    "seed": step, "sample_id": 100 * p, "logprobs": 0})
                assert status == 200, r
                if r["weight_version"] != version:
                    print(f"  rollout on version {r['weight_version']}, pushed {version}")
                    ok = False
                for c in r["choices"]:
                    seqs.append({"id": len(seqs), "tokens": prompt + c["token_ids"],
                                 "prompt_len": len(prompt)})
                    rollout_lps.append(c["logprobs"]["token_logprobs"])

            # 4. The trainer's path: the same weights as a checkpoint, scored at TP 1.
            ckpt = os.path.join(args.workdir, version)
            os.makedirs(ckpt, exist_ok=True)
            for f in os.listdir(model):
                if f != "model.safetensors" and os.path.isfile(os.path.join(model, f)):
                    shutil.copy(os.path.join(model, f), ckpt)
            save_file(weights, os.path.join(ckpt, "model.safetensors"))
            inp = os.path.join(args.workdir, f"{version}-rollouts.jsonl")
            out = os.path.join(args.workdir, f"{version}-scored.jsonl")
            with open(inp, "w") as f:
                f.writelines(json.dumps(s) + "\n" for s in seqs)
            subprocess.run([args.arbor, "score", "--model", ckpt, "--input", inp,
                            "--out", out], check=True, capture_output=True)
            with open(out) as f:
                scored = [json.loads(line)["logprobs"] for line in f if line.strip()]

            tokens = sum(len(lp) for lp in rollout_lps)
            same = sum(f32_bits(a) == f32_bits(b)
                       for got, want in zip(rollout_lps, scored) for a, b in zip(got, want))
            ok &= same == tokens and len(scored) == len(rollout_lps)
            mean = sum(sum(lp) for lp in rollout_lps) / tokens
            print(f"step {step}: pushed {version} in {nparts} parts ({pushed:.2f} s, applied in "
                  f"{answer['seconds']:.3f} s); {len(seqs)} rollouts, mean log-prob {mean:.4f}; "
                  f"TP {args.tp} rollout == TP 1 score on {same}/{tokens} tokens")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    print("OK: bit-identical log-probs and matching versions" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
