# PyTorch's flash attention (SDPA, FLASH_ATTENTION backend, bf16, GQA) on the shapes of
# `arbor bench attention`, one layer, median of CUDA-event-timed calls. Not arbor: the
# non-deterministic reference the paged kernels are measured against (GPU machine only).
# Usage: python3 scripts/bench/attention-reference.py [--prefill 8x1024,...] [--decode 1x1024,...] [--out f.json]
import argparse
import functools
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

p = argparse.ArgumentParser()
p.add_argument("--heads", type=int, default=32)
p.add_argument("--kv-heads", type=int, default=8)
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--prefill", default="8x1024,64x1024,4x8192,2x16384")
p.add_argument("--decode", default="1x1024,64x1024,256x1024,1x8192,32x8192,1x16384,16x16384")
p.add_argument("--iters", type=int, default=20)
p.add_argument("--out", default="")
a = p.parse_args()
dev, bf = "cuda", torch.bfloat16
H, KVH, D = a.heads, a.kv_heads, a.head_dim


def timed(fn):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(a.iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


rows = []
print(f"reference (torch {torch.__version__}, SDPA flash) on {torch.cuda.get_device_name()}: {H} heads, {KVH} KV heads, head_dim {D}")
print(f"{'kind':>8} {'batch':>6} {'tokens':>7} {'us':>10} {'TFLOP/s':>9} {'KV GB/s':>10}")
with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for kind, specs in (("prefill", a.prefill), ("decode", a.decode)):
        for spec in [s for s in specs.split(",") if s]:
            B, T = map(int, spec.split("x"))
            tq = T if kind == "prefill" else 1
            q = torch.randn(B, H, tq, D, device=dev, dtype=bf)
            k = torch.randn(B, KVH, T, D, device=dev, dtype=bf)
            v = torch.randn(B, KVH, T, D, device=dev, dtype=bf)
            fn = functools.partial(
                F.scaled_dot_product_attention, q, k, v, is_causal=(kind == "prefill"), enable_gqa=True
            )
            us = timed(fn)
            keys = B * T if kind == "decode" else B * T * (T + 1) / 2
            fl = 4 * keys * H * D
            kvb = B * T * KVH * D * 4
            rows.append({"kind": kind, "batch": B, "tokens": T, "us": us, "tflops": fl / us / 1e6,
                         "kv_gbs": kvb / us / 1e3})
            print(f"{kind:>8} {B:>6} {T:>7} {us:>10.1f} {fl / us / 1e6:>9.1f} {kvb / us / 1e3:>10.0f}", flush=True)
            del fn, q, k, v
if a.out:
    with open(a.out, "w") as f:
        json.dump(rows, f)
