"""A colocated trainer handing its weights to `arbor serve` on the same GPU(s) by CUDA IPC
handle, as slime and verl do with SGLang: the checkpoint's tensors loaded onto the GPU in
bfloat16, reduced by torch's `ForkingPickler` (torch/multiprocessing/reductions.py
`reduce_tensor`), optionally in SGLang's patched form (python/sglang/srt/patch_torch.py:
the GPU's UUID inserted at argument 6), as a list of (name, tensor) pairs or as SGLang's
FlattenedTensorBucket (python/sglang/srt/weight_sync/tensor_bucket.py), base64-encoded
(SGLang's MultiprocessingSerializer) and POSTed to /update_weights_from_tensor as JSON.
One element per TP rank: rank i's from tensors on cuda:i.

    python3 scripts/gpu/ipc_trainer.py --server 127.0.0.1:PORT --model DIR \
        [--form torch|sglang] [--layout pairs|bucket] [--bucket-gib 2] [--tp 1] \
        [--scale NAME=FACTOR] [--version V]

Prints one JSON line: seconds until arbor answered, bytes, GB/s, arbor's answer.
"""

import argparse
import base64
import dataclasses
import io
import json
import os
import struct
import sys
import time
import types
import urllib.request
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file on the host (bf16, f16 or f32)."""
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = bytearray(f.read())
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        raw = torch.frombuffer(data, dtype=torch.uint8, count=b - a, offset=a)
        out[name] = raw.view(dtypes[t["dtype"]]).reshape(t["shape"])
    return out


def stub(path: str) -> types.ModuleType:
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        sys.modules.setdefault(name, types.ModuleType(name))
    return sys.modules[path]


def _rebuild_cuda_tensor_modified(*args: Any) -> None:
    raise RuntimeError("only pickled by reference")


_rebuild_cuda_tensor_modified.__module__ = "sglang.srt.patch_torch"
stub("sglang.srt.patch_torch")._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified


@dataclasses.dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


FlattenedTensorMetadata.__module__ = "sglang.srt.weight_sync.tensor_bucket"
stub("sglang.srt.weight_sync.tensor_bucket").FlattenedTensorMetadata = FlattenedTensorMetadata


def sglang_reduce(t: torch.Tensor) -> tuple:
    """SGLang's `_reduce_tensor_modified` (the inserting version)."""
    _, args = reductions.reduce_tensor(t)
    uuid = str(torch.cuda.get_device_properties(args[6]).uuid)
    return (_rebuild_cuda_tensor_modified, (*args[:6], uuid, *args[6:]))


def serialize(obj: object) -> str:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def post(server: str, body: dict, query: str = "") -> dict:
    req = urllib.request.Request(
        f"http://{server}/update_weights_from_tensor{query}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, **json.loads(e.read() or b"{}")}


def buckets(named: list, limit: int) -> list:
    """Consecutive groups of at most `limit` bytes (a larger tensor alone)."""
    out, cur, size = [], [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if cur and size + n > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        out.append(cur)
    return out


def flatten(group: list) -> dict:
    flat, meta, at = [], [], 0
    for name, t in group:
        flat.append(t.flatten())
        meta.append(FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + t.numel(), t.numel()))
        at += t.numel()
    return {"flattened_tensor": torch.cat(flat), "metadata": meta}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--form", choices=["torch", "sglang"], default="torch")
    p.add_argument("--layout", choices=["pairs", "bucket"], default="pairs")
    p.add_argument("--bucket-gib", type=float, default=2.0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--scale", default=None)
    p.add_argument("--version", default=None)
    a = p.parse_args()

    host: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(a.model)):
        if f.endswith(".safetensors"):
            host.update(read_safetensors(os.path.join(a.model, f)))
    if a.scale:
        name, factor = a.scale.split("=")
        host[name] = (host[name].float() * float(factor)).to(host[name].dtype)
    if a.form == "sglang":
        ForkingPickler.register(torch.Tensor, sglang_reduce)
        ForkingPickler.register(torch.nn.Parameter, sglang_reduce)
    per_rank = []
    for r in range(a.tp):
        dev = torch.device("cuda", r)
        per_rank.append([(n, t.to(dev, torch.bfloat16)) for n, t in sorted(host.items())])
    total = sum(t.numel() * t.element_size() for _, t in per_rank[0])
    if a.layout == "pairs":
        calls = [[ranked for ranked in per_rank]]
    else:
        limit = int(a.bucket_gib * (1 << 30))
        grouped = [buckets(named, limit) for named in per_rank]
        calls = [[flatten(g[i]) for g in grouped] for i in range(len(grouped[0]))]
    for r in range(a.tp):
        torch.cuda.synchronize(r)
    t0 = time.time()
    answers = []
    for i, call in enumerate(calls):
        body = {
            "serialized_named_tensors": [serialize(obj) for obj in call],
            "load_format": "flattened_bucket" if a.layout == "bucket" else None,
            "flush_cache": True,
        }
        if i == len(calls) - 1 and a.version:
            body["weight_version"] = a.version
        answers.append(post(a.server, body))
    dt = time.time() - t0
    last = answers[-1]
    ok = all(x.get("success") for x in answers)
    print(
        json.dumps(
            {
                "form": a.form,
                "layout": a.layout,
                "tp": a.tp,
                "calls": len(calls),
                "ok": ok,
                "bytes": total,
                "seconds_until_answer": round(dt, 3),
                "GBps": round(total / dt / 1e9, 2),
                "answer": last if ok else [x for x in answers if not x.get("success")][:1],
            }
        ),
        flush=True,
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
