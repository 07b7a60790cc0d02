#!/usr/bin/env python3
"""The PyTorch reference for arbor's mixture-of-experts speed: the model of an arbor model
directory (Qwen3-MoE or Mixtral, its config.json; random bf16 weights, or the directory's
own with --weights) run the fastest way this torch offers, next to `arbor bench decode`
on the same directory, in one table.

The reference's fast path:
- the experts through `torch._grouped_mm` (tokens sorted by expert on the GPU, the
  experts' offsets from a scatter-add: no host sync), else a loop over the experts that
  have tokens (a host sync per layer, no CUDA graph);
- `torch.compile` of the decode step and of the prefill (`--compile`);
- every decode step replayed from one CUDA graph per batch size (the next token and the
  positions are written inside the graph, so replays chain with no host work);
- attention by `scaled_dot_product_attention` (flash for the causal prefill; decode reads
  the batch's static KV cache with a position mask).

Run on the GPU machine, from the repository root, after scripts/gpu/build-device.sh:

  python3 scripts/bench/moe_reference.py --model DIR [--batch 1,64,256] [--prompt-len 128]
      [--steps 32] [--prefill 8x2048] [--arbor .device/arbor] [--skip-arbor] [--json OUT]

DIR: e.g. `arbor make-model --preset qwen3-30b-a3b --layers 12 --out DIR`. Only shapes
matter to the timing, so the default random weights give the reference's speed without
reading the checkpoint; --weights reads it (small models: the reader is plain Python).
`--check-logprobs FILE` (with --weights, any device) prints the reference's teacher-forced
log-probs against an `arbor score` JSONL of the same model: a check that the reference
computes the model arbor runs.
"""

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def fail(msg):
    print(f"moe_reference: {msg}", file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------- the model's shape


def read_config(model_dir):
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path}: {e}")
    arch = (c.get("architectures") or ["?"])[0]
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        fail(
            f"{path}: architecture {arch} is not Qwen3MoeForCausalLM or MixtralForCausalLM"
        )
    if c.get("rope_scaling") not in (None, {}) or (
        c.get("rope_parameters", {}).get("rope_type", "default") != "default"
    ):
        fail(f"{path}: RoPE scaling is not implemented in the reference")
    layers = c["num_hidden_layers"]
    hidden = c["hidden_size"]
    heads = c["num_attention_heads"]
    qwen = arch == "Qwen3MoeForCausalLM"
    experts = c.get("num_experts", c.get("num_local_experts"))
    if qwen:
        step = c.get("decoder_sparse_step", 1) or 1
        dense = set(c.get("mlp_only_layers") or [])
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
        inter = c["moe_intermediate_size"]
        norm = bool(c.get("norm_topk_prob", False))
    else:
        sparse = [True] * layers
        inter = c["intermediate_size"]
        norm = True
    theta = c.get("rope_theta", c.get("rope_parameters", {}).get("rope_theta", 10000.0))
    return {
        "arch": arch,
        "qk_norm": qwen,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": c.get("num_key_value_heads", heads),
        "head_dim": c.get("head_dim") or hidden // heads,
        "vocab": c["vocab_size"],
        "eps": c.get("rms_norm_eps", 1e-6),
        "theta": float(theta),
        "tie": bool(c.get("tie_word_embeddings", False)),
        "experts": experts,
        "top_k": c["num_experts_per_tok"],
        "inter": inter,
        "dense_inter": c["intermediate_size"],
        "norm_topk": norm,
        "sparse": sparse,
        "block": "mlp" if qwen else "block_sparse_moe",
        "names": ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2"),
    }


# ---------------------------------------------------------------- weights


class SafeTensors:
    """The tensors of a directory's safetensors files (single or sharded), read on demand."""

    def __init__(self, model_dir):
        self.dtypes = {
            "BF16": torch.bfloat16,
            "F16": torch.float16,
            "F32": torch.float32,
        }
        idx = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(idx):
            with open(idx) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self.where = {}
        for name in files:
            path = os.path.join(model_dir, name)
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for k, v in header.items():
                if k != "__metadata__":
                    self.where[k] = (path, 8 + n, v)

    def get(self, name):
        if name not in self.where:
            fail(f"tensor {name} is missing from the checkpoint")
        path, base, v = self.where[name]
        begin, end = v["data_offsets"]
        with open(path, "rb") as f:
            f.seek(base + begin)
            data = bytearray(f.read(end - begin))
        dtype = self.dtypes.get(v["dtype"])
        if dtype is None:
            fail(f"tensor {name}: dtype {v['dtype']} is not read here")
        return torch.frombuffer(data, dtype=dtype).reshape(v["shape"])


def make_weights(cfg, device, from_dir=None, seed=0):
    """Per-layer weights in the layouts the forward uses: q/k/v stacked; each MoE layer's
    experts stacked as [E, 2I, h] (gate rows, then up rows) and [E, h, I]."""
    h, hd = cfg["hidden"], cfg["head_dim"]
    q, kv = cfg["heads"] * hd, cfg["kv_heads"] * hd
    e, inter = cfg["experts"], cfg["inter"]
    bf = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(seed)
    st = SafeTensors(from_dir) if from_dir else None

    def rnd(*shape, fan_in):
        t = torch.empty(*shape, dtype=bf, device=device)
        return t.uniform_(-1.0, 1.0, generator=gen).mul_(math.sqrt(3.0 / fan_in))

    def norm_w(n):
        return torch.empty(n, dtype=bf, device=device).uniform_(0.8, 1.2, generator=gen)

    def load(name):
        return st.get(name).to(device=device, dtype=bf)

    w = {"layers": []}
    if st:
        w["embed"] = load("model.embed_tokens.weight")
        w["final_norm"] = load("model.norm.weight")
        w["head"] = w["embed"] if cfg["tie"] else load("lm_head.weight")
    else:
        w["embed"] = rnd(cfg["vocab"], h, fan_in=1)
        w["final_norm"] = norm_w(h)
        w["head"] = w["embed"] if cfg["tie"] else rnd(cfg["vocab"], h, fan_in=h)
    g_name, u_name, d_name = cfg["names"]
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}"
        L = {}
        if st:
            L["ln1"] = load(f"{p}.input_layernorm.weight")
            L["ln2"] = load(f"{p}.post_attention_layernorm.weight")
            L["qkv"] = torch.cat(
                [load(f"{p}.self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
            )
            L["o"] = load(f"{p}.self_attn.o_proj.weight")
            if cfg["qk_norm"]:
                L["q_norm"] = load(f"{p}.self_attn.q_norm.weight")
                L["k_norm"] = load(f"{p}.self_attn.k_norm.weight")
        else:
            L["ln1"], L["ln2"] = norm_w(h), norm_w(h)
            L["qkv"] = rnd(q + 2 * kv, h, fan_in=h)
            L["o"] = rnd(h, q, fan_in=q)
            if cfg["qk_norm"]:
                L["q_norm"], L["k_norm"] = norm_w(hd), norm_w(hd)
        if cfg["sparse"][i]:
            b = f"{p}.{cfg['block']}"
            if st:
                L["router"] = load(f"{b}.gate.weight")
                L["gu"] = torch.stack(
                    [
                        torch.cat(
                            [
                                load(f"{b}.experts.{x}.{g_name}.weight"),
                                load(f"{b}.experts.{x}.{u_name}.weight"),
                            ]
                        )
                        for x in range(e)
                    ]
                )
                L["down"] = torch.stack(
                    [load(f"{b}.experts.{x}.{d_name}.weight") for x in range(e)]
                )
            else:
                L["router"] = rnd(e, h, fan_in=h)
                L["gu"] = rnd(e, 2 * inter, h, fan_in=h)
                L["down"] = rnd(e, h, inter, fan_in=inter)
        else:
            di = cfg["dense_inter"]
            if st:
                L["gu"] = torch.cat(
                    [load(f"{p}.mlp.gate_proj.weight"), load(f"{p}.mlp.up_proj.weight")]
                )
                L["down"] = load(f"{p}.mlp.down_proj.weight")
            else:
                L["gu"] = rnd(2 * di, h, fan_in=h)
                L["down"] = rnd(h, di, fan_in=di)
        w["layers"].append(L)
    return w


# ---------------------------------------------------------------- the forward


def grouped_mm_works(device):
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(32, 64, dtype=torch.bfloat16, device=device)
        wt = torch.ones(2, 128, 64, dtype=torch.bfloat16, device=device)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        y = torch._grouped_mm(x, wt.transpose(-2, -1), offs=offs)
        torch.cuda.synchronize()
        return bool((y == 64).all())
    except (
        RuntimeError,
        NotImplementedError,
    ) as e:  # the op exists but not for this GPU
        print(
            f"torch._grouped_mm unusable here ({e}): experts in a loop", file=sys.stderr
        )
        return False


class Reference:
    def __init__(self, cfg, weights, device, grouped):
        self.c, self.w, self.dev, self.grouped = cfg, weights, device, grouped
        hd = cfg["head_dim"]
        self.inv_freq = 1.0 / (
            cfg["theta"]
            ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
        )

    def rms(self, x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.c["eps"])
        return w * xf.to(x.dtype)

    def rope(self, x, pos):
        # x [..., T, hd] with pos broadcastable to [..., T]: HF's rotate-half RoPE.
        f = pos.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([f, f], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def experts(self, x, L):
        """x [T, h] → the weighted sum of each token's top-k experts, [T, h]."""
        c = self.c
        e, k, inter = c["experts"], c["top_k"], c["inter"]
        probs = torch.softmax((x @ L["router"].T).float(), dim=-1)
        wts, idx = torch.topk(probs, k, dim=-1)
        if c["norm_topk"]:
            wts = wts / wts.sum(-1, keepdim=True)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        xs = x[token]
        if self.grouped:
            counts = torch.zeros(e, dtype=torch.int32, device=x.device)
            counts.scatter_add_(0, flat.int(), torch.ones_like(flat, dtype=torch.int32))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            gu = torch._grouped_mm(xs, L["gu"].transpose(-2, -1), offs=offs)
            a = F.silu(gu[:, :inter]) * gu[:, inter:]
            y = torch._grouped_mm(a, L["down"].transpose(-2, -1), offs=offs)
        else:
            counts = torch.bincount(flat, minlength=e).tolist()
            ys, start = [], 0
            for x_e, n in enumerate(counts):
                if n:
                    gu = xs[start : start + n] @ L["gu"][x_e].T
                    a = F.silu(gu[:, :inter]) * gu[:, inter:]
                    ys.append(a @ L["down"][x_e].T)
                start += n
            y = torch.cat(ys)
        y = y * wts.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)

    def mlp(self, x, L, sparse):
        if sparse:
            return self.experts(x, L)
        gu = x @ L["gu"].T
        d = gu.shape[-1] // 2
        return (F.silu(gu[..., :d]) * gu[..., d:]) @ L["down"].T

    def qkv(self, h, L, pos):
        """h [B, T, hidden] → q [B, nh, T, hd], k and v [B, kvh, T, hd], rotated."""
        c = self.c
        hd, nh, nkv = c["head_dim"], c["heads"], c["kv_heads"]
        b, t, _ = h.shape
        qkv = h @ L["qkv"].T
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = q.view(b, t, nh, hd)
        k = k.view(b, t, nkv, hd)
        v = v.view(b, t, nkv, hd)
        if c["qk_norm"]:
            q, k = self.rms(q, L["q_norm"]), self.rms(k, L["k_norm"])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        p = pos.unsqueeze(1)  # [B, 1, T]
        return self.rope(q, p), self.rope(k, p), v

    def prefill(self, tokens, cache=None, last_only=False):
        """tokens [B, T] from position 0 → logits of every position [B, T, V] (of the last
        only, [B, 1, V], with last_only: what a generating engine computes); writes K and V
        into cache[l] = (K, V) [B, kvh, S, hd] when given."""
        b, t = tokens.shape
        pos = torch.arange(t, device=tokens.device).expand(b, t)
        x = self.w["embed"][tokens]
        for li, L in enumerate(self.w["layers"]):
            q, k, v = self.qkv(self.rms(x, L["ln1"]), L, pos)
            if cache is not None:
                cache[li][0][:, :, :t] = k
                cache[li][1][:, :, :t] = v
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, t, -1) @ L["o"].T
            h = self.rms(x, L["ln2"])
            x = x + self.mlp(h.reshape(b * t, -1), L, self.c["sparse"][li]).view(
                b, t, -1
            )
        if last_only:
            x = x[:, -1:]
        return self.rms(x, self.w["final_norm"]) @ self.w["head"].T

    def prefill_last(self, tokens):
        return self.prefill(tokens, None, last_only=True)

    def decode(self, tokens, pos, cache):
        """One new token per row: tokens, pos [B] → logits [B, V]; the cache holds
        positions below pos and gets pos."""
        b = tokens.shape[0]
        s = cache[0][0].shape[2]
        rows = torch.arange(b, device=tokens.device)
        mask = (torch.arange(s, device=tokens.device) <= pos.unsqueeze(1)).view(
            b, 1, 1, s
        )
        x = self.w["embed"][tokens].unsqueeze(1)
        for li, L in enumerate(self.w["layers"]):
            q, k, v = self.qkv(self.rms(x, L["ln1"]), L, pos.unsqueeze(1))
            kc, vc = cache[li]
            kc[rows, :, pos] = k[:, :, 0]
            vc[rows, :, pos] = v[:, :, 0]
            a = F.scaled_dot_product_attention(
                q, kc, vc, attn_mask=mask, enable_gqa=True
            )
            x = x + a.transpose(1, 2).reshape(b, 1, -1) @ L["o"].T
            h = self.rms(x, L["ln2"])
            x = x + self.mlp(h.reshape(b, -1), L, self.c["sparse"][li]).view(b, 1, -1)
        return (self.rms(x, self.w["final_norm"]) @ self.w["head"].T)[:, 0]

    def new_cache(self, b, s):
        c = self.c
        shape = (b, c["kv_heads"], s, c["head_dim"])
        return [
            (
                torch.zeros(shape, dtype=torch.bfloat16, device=self.dev),
                torch.zeros(shape, dtype=torch.bfloat16, device=self.dev),
            )
            for _ in range(c["layers"])
        ]


# ---------------------------------------------------------------- timing


def prompt_ids(b, t, vocab, salt):
    g = torch.Generator().manual_seed(1000 + salt)
    return torch.randint(1, vocab, (b, t), generator=g)


def time_decode(ref, b, prompt_len, steps, compiled, graphs):
    """ms per decode step at batch b after a prompt of prompt_len, and the experts' weight
    bytes the first step reads (the experts that got a token)."""
    dev = ref.dev
    warm = 3
    s = prompt_len + warm + steps + 2
    cache = ref.new_cache(b, s)
    tokens = prompt_ids(b, prompt_len, ref.c["vocab"], b).to(dev)
    with torch.no_grad():
        logits = ref.prefill(tokens, cache, last_only=True)
    tok = logits[:, -1].argmax(-1)
    pos = torch.full((b,), prompt_len, dtype=torch.long, device=dev)
    fwd = compiled if compiled is not None else ref.decode

    def step():
        nxt = fwd(tok, pos, cache).argmax(-1)
        tok.copy_(nxt)
        pos.add_(1)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warm):
                step()
        torch.cuda.current_stream().wait_stream(side)
        run = step
        if graphs:
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g):
                    step()
                run = g.replay
            except RuntimeError as e:
                # Timed without the graph rather than not at all; the row says so.
                print(
                    f"batch {b}: CUDA graph capture failed ({e}): timed op by op",
                    file=sys.stderr,
                )
                graphs = False
        torch.cuda.synchronize()
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(steps):
            run()
        t1.record()
        torch.cuda.synchronize()
    return t0.elapsed_time(t1) / steps, graphs


def active_expert_bytes(ref, b, prompt_len):
    """Bytes of expert weights one decode step at batch b reads: per MoE layer, the
    experts some row was routed to (measured on the first step's hidden states)."""
    c = ref.c
    per_expert = 3 * c["hidden"] * c["inter"] * 2
    total = 0
    x = ref.w["embed"][prompt_ids(b, 1, c["vocab"], b + 7).to(ref.dev)[:, 0]]
    with torch.no_grad():
        for li, L in enumerate(ref.w["layers"]):
            if c["sparse"][li]:
                h = ref.rms(x, L["ln2"])
                idx = torch.topk(
                    (h @ L["router"].T).float(), c["top_k"], dim=-1
                ).indices
                total += int(torch.unique(idx).numel()) * per_expert
    return total


def time_prefill(ref, b, t, compiled, reps=3):
    dev = ref.dev
    tokens = prompt_ids(b, t, ref.c["vocab"], 99).to(dev)
    fwd = compiled if compiled is not None else ref.prefill_last
    with torch.no_grad():
        for _ in range(2):
            fwd(tokens)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fwd(tokens)
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / reps


def run_arbor(arbor, model, numerics, batch, prompt_len, steps, work, routing="device"):
    out = os.path.join(
        work,
        f"arbor-{numerics}-{routing}-{'-'.join(map(str, batch))}-{prompt_len}.json",
    )
    cmd = [
        arbor,
        "bench",
        "decode",
        "--model",
        model,
        "--device",
        "cuda",
        "--numerics",
        numerics,
        "--batch",
        ",".join(map(str, batch)),
        "--prompt-len",
        str(prompt_len),
        "--steps",
        str(steps),
        "--out",
        out,
    ]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    env = dict(os.environ, ARBOR_MOE=routing)
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
    if r.returncode != 0:
        print(
            f"arbor bench decode ({numerics}) failed with exit {r.returncode}",
            file=sys.stderr,
        )
        return None
    with open(out) as f:
        return {row["batch"]: row for row in json.load(f)}


# ---------------------------------------------------------------- the check on arbor's model


def check_logprobs(ref, score_file):
    """Mean and max |Δ log-prob| of the reference (f32 activations of bf16 weights, on any
    device) against `arbor score`'s records of the same model."""
    deltas = []
    with open(score_file) as f:
        for line in f:
            r = json.loads(line)
            toks = r["tokens"]
            plen = r.get("prompt_len", 1)
            ids = torch.tensor([toks], device=ref.dev)
            with torch.no_grad():
                lp = torch.log_softmax(ref.prefill(ids).float()[0], dim=-1)
            got = r["logprobs"]
            for j, want in enumerate(got):
                p = plen + j
                deltas.append(abs(float(lp[p - 1, toks[p]]) - want))
    if not deltas:
        fail(f"{score_file}: no scored positions")
    print(
        f"reference vs arbor score: {len(deltas)} positions, mean |Δ log-prob| "
        f"{sum(deltas) / len(deltas):.4f}, max {max(deltas):.4f}"
    )


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", default="1,64,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", default="8x2048", help="BATCHxTOKENS, or 'none'")
    ap.add_argument("--arbor", default=".device/arbor")
    ap.add_argument("--skip-arbor", action="store_true")
    ap.add_argument(
        "--host-routing",
        action="store_true",
        help="also time arbor with ARBOR_MOE=host (the experts routed on the host)",
    )
    ap.add_argument("--compile", choices=["off", "on"], default="on")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument(
        "--weights", action="store_true", help="read the directory's weights"
    )
    ap.add_argument("--check-logprobs", metavar="SCORE_JSONL")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    ap.add_argument("--work", default="/tmp/arbor-moe-reference")
    a = ap.parse_args()
    cfg = read_config(a.model)
    dev = torch.device(a.device)
    if a.check_logprobs:
        if not a.weights:
            fail("--check-logprobs compares with arbor's model: pass --weights")
        w = make_weights(cfg, dev, a.model)
        # f32 activations of the bf16 weights: the precision arbor computes in.
        w = {
            k: (
                [{n: t.float() for n, t in L.items()} for L in v]
                if k == "layers"
                else v.float()
            )
            for k, v in w.items()
        }
        ref = Reference(cfg, w, dev, grouped=False)
        check_logprobs(ref, a.check_logprobs)
        return
    if dev.type != "cuda" or not torch.cuda.is_available():
        fail("the timing needs a CUDA device")
    batches = [int(x) for x in a.batch.split(",") if x]
    prefill = (
        None if a.prefill == "none" else tuple(int(x) for x in a.prefill.split("x"))
    )
    os.makedirs(a.work, exist_ok=True)

    arbor = {}
    if not a.skip_arbor:
        # arbor first: each run is its own process and gives the GPU back when it ends.
        # "host": invariant numerics with the experts routed on the host
        # (ARBOR_MOE=host), what the device routing replaced.
        runs = [("invariant", "invariant", "device"), ("fast", "fast", "device")]
        if a.host_routing:
            runs.append(("host", "invariant", "host"))
        for name, numerics, routing in runs:
            arbor[name] = (
                run_arbor(
                    a.arbor,
                    a.model,
                    numerics,
                    batches,
                    a.prompt_len,
                    a.steps,
                    a.work,
                    routing,
                )
                or {}
            )
            if prefill:
                pre = run_arbor(
                    a.arbor,
                    a.model,
                    numerics,
                    [prefill[0]],
                    prefill[1],
                    2,
                    a.work,
                    routing,
                )
                arbor[name]["prefill"] = (pre or {}).get(prefill[0])

    torch.manual_seed(0)
    grouped = grouped_mm_works(dev)
    t = time.perf_counter()
    w = make_weights(cfg, dev, a.model if a.weights else None)
    print(
        f"reference weights ready in {time.perf_counter() - t:.1f} s", file=sys.stderr
    )
    ref = Reference(cfg, w, dev, grouped)
    graphs = grouped and not a.no_graphs
    cdec = cpre = None
    if a.compile == "on":
        cdec = torch.compile(ref.decode, dynamic=False)
        cpre = torch.compile(ref.prefill_last, dynamic=False)
    path = (
        f"{'grouped_mm' if grouped else 'expert loop'}"
        f"{', torch.compile' if cdec else ''}{', CUDA graph' if graphs else ''}"
    )
    rows = []
    for b in batches:
        t = time.perf_counter()
        ms, graphed = time_decode(ref, b, a.prompt_len, a.steps, cdec, graphs)
        nbytes = active_expert_bytes(ref, b, a.prompt_len)
        rows.append(
            {
                "what": f"decode batch {b}"
                + ("" if graphed == graphs else " (no graph)"),
                "batch": b,
                "torch_ms": ms,
                "expert_bytes": nbytes,
            }
        )
        print(
            f"torch decode batch {b}: {ms:.3f} ms/step ({time.perf_counter() - t:.1f} s "
            "with compile and capture)",
            file=sys.stderr,
            flush=True,
        )
    if prefill:
        ms = time_prefill(ref, prefill[0], prefill[1], cpre)
        rows.append(
            {
                "what": f"prefill {prefill[0]}x{prefill[1]}",
                "batch": "prefill",
                "torch_ms": ms,
            }
        )

    c = cfg
    print()
    print(
        f"{c['arch']} shape: {c['layers']} layers, hidden {c['hidden']}, {c['heads']}/"
        f"{c['kv_heads']} heads, {c['experts']} experts, {c['top_k']} per token, expert "
        f"width {c['inter']}; prompt {a.prompt_len}, {a.steps} decode steps"
    )
    print(
        f"reference: torch {torch.__version__} on {torch.cuda.get_device_name()}: {path}"
    )
    head = (
        f"{'':<20}{'torch ms':>11}{'arbor inv':>11}{'arbor fast':>11}"
        f"{'inv/torch':>11}{'inv/fast':>10}{'experts GB/s (torch)':>22}"
        f"{'inv host-routed':>17}"
    )
    print(head)
    for r in rows:
        inv = arbor.get("invariant", {}).get(r["batch"])
        fast = arbor.get("fast", {}).get(r["batch"])
        key = "prefill_ms" if r["batch"] == "prefill" else "decode_ms_per_step"
        vi = inv[key] if inv else None
        vf = fast[key] if fast else None
        host = arbor.get("host", {}).get(r["batch"])
        vh = host[key] if host else None
        r["arbor_invariant_ms"], r["arbor_fast_ms"] = vi, vf
        r["arbor_invariant_host_routed_ms"] = vh

        def f(x, p=3):
            return f"{x:.{p}f}" if x is not None else "-"

        bw = (
            (r["expert_bytes"] / (r["torch_ms"] * 1e-3) / 1e9)
            if "expert_bytes" in r
            else None
        )
        print(
            f"{r['what']:<20}{f(r['torch_ms']):>11}{f(vi):>11}{f(vf):>11}"
            f"{f(vi / r['torch_ms'] if vi else None, 2):>11}"
            f"{f(vi / vf if vi and vf else None, 2):>10}{f(bw, 0):>22}{f(vh):>17}"
        )
    print(
        "(experts GB/s: the expert weights the step's routes touch, over the whole step's "
        "time: a lower bound of the expert GEMMs' bandwidth)"
    )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                {"config": c, "path": path, "rows": rows}, fh, indent=1, default=str
            )


if __name__ == "__main__":
    main()
