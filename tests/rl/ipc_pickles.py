"""The JSON body of SGLang's `/update_weights_from_tensor` with CUDA IPC handles, made
without a GPU: each tensor is an object whose `__reduce__` is what torch's
`reduce_tensor` returns for a CUDA tensor (torch/multiprocessing/reductions.py), with real
`torch.Size`, dtype, tensor and storage classes, pickled by the real
`multiprocessing.reduction.ForkingPickler` and base64-encoded as SGLang's
`MultiprocessingSerializer.serialize(obj, output_str=True)` does (sglang
python/sglang/srt/utils). SGLang's patched reduction (python/sglang/srt/patch_torch.py)
names `sglang.srt.patch_torch._rebuild_cuda_tensor_modified`: a stub module of that name
is made here so that pickle can name the function, as on a trainer with SGLang.

    python3 ipc_pickles.py FORM,LAYOUT,RANKS,VARIANT ...

FORM: torch | sglang16 (UUID inserted before the index) | sglang15 (UUID replaces it);
LAYOUT: pairs | bucket; VARIANT: ok | evil_global | float64 | truncated | strided.
Prints one JSON body per line, one per spec (torch is imported once); rank r's handle
bytes are (r * 64 + i) % 256.
"""

import base64
import dataclasses
import io
import json
import os
import sys
import types
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor


def stub_module(path: str) -> types.ModuleType:
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        sys.modules.setdefault(name, types.ModuleType(name))
    return sys.modules[path]


def _rebuild_cuda_tensor_modified(*args: Any) -> None:
    raise RuntimeError("never called: only pickled by reference")


_rebuild_cuda_tensor_modified.__module__ = "sglang.srt.patch_torch"
stub_module("sglang.srt.patch_torch")._rebuild_cuda_tensor_modified = (
    _rebuild_cuda_tensor_modified
)


@dataclasses.dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


FlattenedTensorMetadata.__module__ = "sglang.srt.weight_sync.tensor_bucket"
stub_module("sglang.srt.weight_sync.tensor_bucket").FlattenedTensorMetadata = (
    FlattenedTensorMetadata
)

UUID = "f1e2d3c4-b5a6-9788-6958-4a3b2c1d0e0f"


class Reduced:
    """Pickles as `fn(*args)`, as torch's reduction of a CUDA tensor does."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return (self.fn, self.args)


def cuda_tensor(form: str, rank: int, shape: list, offset: int, variant: str) -> Reduced:
    dtype = torch.float64 if variant == "float64" else torch.bfloat16
    numel = 1
    for d in shape:
        numel *= d
    stride, step = [], 1
    for d in reversed(shape):
        stride.insert(0, step)
        step *= d
    stride = tuple(stride)
    if variant == "strided" and len(shape) == 2:
        stride = (1, shape[0])
    args = (
        torch.Tensor,
        torch.Size(shape),
        stride,
        offset,  # tensor_offset (elements)
        torch.storage.TypedStorage,
        dtype,
        0,  # device index
        # torch's storage handle: version 2, type 'c' (a cudaMalloc block), then the
        # 64-byte cudaIpcMemHandle_t (c10 CUDACachingAllocator::shareIpcHandle).
        b"\x02c" + bytes((rank * 64 + i) % 256 for i in range(64)),
        2 * (offset + numel) + 256,  # storage_size_bytes
        1024 * (rank + 1),  # storage_offset_bytes
        False,
        b"/torch_%d_77_0" % rank,
        3,
        bytes(range(64)) if rank == 1 else None,
        rank == 1,
    )
    if form == "torch":
        return Reduced(rebuild_cuda_tensor, args)
    if form == "sglang16":
        return Reduced(_rebuild_cuda_tensor_modified, (*args[:6], UUID, *args[6:]))
    return Reduced(_rebuild_cuda_tensor_modified, (*args[:6], UUID, *args[7:]))


def payload(form: str, layout: str, rank: int, variant: str) -> object:
    named = [("model.embed_tokens.weight", [16, 8]), ("model.norm.weight", [8])]
    if layout == "pairs":
        return [
            (name, cuda_tensor(form, rank, shape, 4 * i, variant))
            for i, (name, shape) in enumerate(named)
        ]
    metadata, at = [], 0
    for name, shape in named:
        n = 1
        for d in shape:
            n *= d
        metadata.append(
            FlattenedTensorMetadata(name, torch.Size(shape), torch.bfloat16, at, at + n, n)
        )
        at += n
    return {"flattened_tensor": cuda_tensor(form, rank, [at], 0, variant), "metadata": metadata}


def body(form: str, layout: str, ranks: int, variant: str) -> dict:
    out = []
    for rank in range(ranks):
        obj = payload(form, layout, rank, variant)
        if variant == "evil_global":
            obj = [("x", Reduced(os.system, ("true",)))]
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        raw = buf.getvalue()
        if variant == "truncated":
            raw = raw[: len(raw) // 2]
        out.append(base64.b64encode(raw).decode())
    return {
        "serialized_named_tensors": out,
        "load_format": "flattened_bucket" if layout == "bucket" else None,
        "flush_cache": True,
    }


def main() -> None:
    for spec in sys.argv[1:]:
        form, layout, ranks, variant = spec.split(",")
        print(json.dumps(body(form, layout, int(ranks), variant)))


if __name__ == "__main__":
    main()
