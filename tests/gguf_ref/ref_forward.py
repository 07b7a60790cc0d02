"""An independent reference forward of a `llama` GGUF model in float64 (numpy), for
tests/smollm2.rs. It shares nothing with arbor: the file is read and dequantized by the
`gguf` Python package (llama.cpp's own), and the math runs on the tensors as llama.cpp
stores them, with GGML's interleaved RoPE (pairs 2i, 2i+1) on the permuted q/k rows,
where arbor un-permutes the rows and rotates HF style.

usage: ref_forward.py MODEL.gguf INPUT.jsonl OUT.jsonl [--bf16]
--bf16 rounds where a bf16 engine stores numbers (weights, every matmul's input, the KV
cache) and computes everything else in float64: the distance between the two modes is
what bf16 alone costs. INPUT: {"id": N, "tokens": [...]} per line. OUT: {"id": N, "logprobs": [...],
"argmax": [...]}, where logprobs[i] = log p(tokens[i + 1] | tokens[:i + 1]).
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

path, inp, out = sys.argv[1:4]
BF16 = "--bf16" in sys.argv[4:]
r = GGUFReader(path)


def bf16(x):
    """Round to the nearest bfloat16 (ties to even), back to float64; identity unless --bf16."""
    if not BF16:
        return x
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def mm(x, wt):
    return bf16(x) @ wt.T


def meta(key, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


assert meta("general.architecture") == "llama", meta("general.architecture")
n_layer = int(meta("llama.block_count"))
n_head = int(meta("llama.attention.head_count"))
n_kv = int(meta("llama.attention.head_count_kv", n_head))
hidden = int(meta("llama.embedding_length"))
hd = hidden // n_head
eps = float(meta("llama.attention.layer_norm_rms_epsilon"))
theta = float(meta("llama.rope.freq_base", 10000.0))
tensors = {t.name: t for t in r.tensors}


def w(name):
    t = tensors[name]
    return bf16(dequantize(t.data, t.tensor_type).astype(np.float64))


emb = w("token_embd.weight")  # [vocab, hidden]
head = w("output.weight") if "output.weight" in tensors else emb
layers = [
    {k: w(f"blk.{i}.{k}.weight") for k in
     ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]}
    for i in range(n_layer)
]
out_norm = w("output_norm.weight")


def rms(x, g):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def rope_interleaved(x, n):
    """x: [T, n * hd], GGML_ROPE_TYPE_NORM: rotate (x[2i], x[2i + 1]) by pos * theta^(-2i/hd)."""
    t = x.shape[0]
    x = x.reshape(t, n, hd // 2, 2)
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(t, dtype=np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0], x[..., 1]
    return np.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(t, n * hd)


def forward(tokens):
    t = len(tokens)
    x = emb[tokens]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for L in layers:
        h = rms(x, L["attn_norm"])
        q = rope_interleaved(mm(h, L["attn_q"]), n_head).reshape(t, n_head, hd)
        k = bf16(rope_interleaved(mm(h, L["attn_k"]), n_kv)).reshape(t, n_kv, hd)
        v = bf16(mm(h, L["attn_v"])).reshape(t, n_kv, hd)
        o = np.empty((t, n_head, hd))
        for hh in range(n_head):
            kv = hh // (n_head // n_kv)
            sc = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(hd) + mask
            p = np.exp(sc - sc.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            o[:, hh, :] = p @ v[:, kv, :]
        x = x + mm(o.reshape(t, hidden), L["attn_output"])
        h = rms(x, L["ffn_norm"])
        g = mm(h, L["ffn_gate"])
        x = x + mm((g / (1.0 + np.exp(-g))) * mm(h, L["ffn_up"]), L["ffn_down"])
    logits = mm(rms(x, out_norm), head)
    m = logits.max(axis=-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))


with open(inp) as fi, open(out, "w") as fo:
    for line in fi:
        if not line.strip():
            continue
        req = json.loads(line)
        toks = req["tokens"]
        lp = forward(toks)
        fo.write(json.dumps({
            "id": req["id"],
            "logprobs": [float(lp[i, toks[i + 1]]) for i in range(len(toks) - 1)],
            "argmax": [int(a) for a in lp[:-1].argmax(axis=-1)],
        }) + "\n")
