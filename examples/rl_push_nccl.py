#!/usr/bin/env python3
"""A trainer process pushes its weights to `arbor serve --device cuda` over NCCL.

The trainer (this process, PyTorch on its own GPU) makes the NCCL unique id, asks arbor to
join its group (POST /init_weights_update_group: arbor's ranks become ranks
rank_offset.. of the group, the trainer is rank 0), then for each update lists the tensors
(POST /update_weights_from_distributed: names, dtypes, shapes) and broadcasts each one
whole, in that order. arbor's ranks receive them, cut their shards and swap them in between
two steps, all ranks or none (docs/rl.md). NCCL is called through ctypes (no
torch.distributed process group: the id goes over HTTP), as vLLM's pynccl does. A trainer
with a torch.distributed group gives its store's address instead
(scripts/gpu/rendezvous-trainer.py).

    python3 examples/rl_push_nccl.py --server 127.0.0.1:8000 --model DIR --device cuda:1 \
        --updates 2 [--scale model.norm.weight=1.01]

arbor and this process must load the same libnccl: this script prints the path and version
of the one it loaded; start arbor with that directory first in LD_LIBRARY_PATH
(scripts/bench/rl-update-bench.sh does). Every rank of a NCCL group needs a GPU of its own.

Prints one JSON line per update: bytes, seconds to broadcast, seconds until arbor answered,
and arbor's answer.
"""

import argparse
import ctypes
import glob
import json
import mmap
import os
import struct
import threading
import time
import urllib.error
import urllib.request

import torch

# ncclDataType_t of each tensor type: a broadcast names the same count and type on every
# member (arbor's ranks name the type the update lists).
NCCL_TYPES = {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def find_nccl():
    """The libnccl torch uses (its wheel's), else the system's."""
    import torch as t
    base = os.path.dirname(os.path.dirname(t.__file__))
    for pattern in ("nvidia/nccl/lib/libnccl.so*", "torch/lib/libnccl.so*"):
        hits = sorted(glob.glob(os.path.join(base, pattern)))
        if hits:
            return hits[0]
    return "libnccl.so.2"


class Nccl:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.path = path
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        lib = self.lib
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(c_int)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
        # The unique id goes by value, as the C signature says.
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(c_void_p), c_int, UniqueId, c_int]
        lib.ncclBroadcast.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p,
                                      c_void_p]
        lib.ncclCommDestroy.argtypes = [c_void_p]
        lib.ncclGetErrorString.argtypes = [c_int]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        for f in (lib.ncclGetVersion, lib.ncclGetUniqueId, lib.ncclCommInitRank,
                  lib.ncclBroadcast, lib.ncclCommDestroy):
            f.restype = c_int
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        self.version = v.value

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.ncclGetErrorString(rc).decode()} ({rc})")

    def unique_id(self):
        uid = UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return uid

    def init_rank(self, world, uid, rank):
        comm = ctypes.c_void_p()
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank),
                   "ncclCommInitRank")
        return comm

    def broadcast(self, t, comm, stream):
        assert t.is_contiguous(), "a broadcast sends contiguous memory"
        ptr = ctypes.c_void_p(t.data_ptr())
        self.check(self.lib.ncclBroadcast(ptr, ptr, t.numel(), NCCL_TYPES[t.dtype], 0,
                                          comm, ctypes.c_void_p(stream)),
                   "ncclBroadcast")

    def destroy(self, comm):
        self.lib.ncclCommDestroy(comm)


DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def load_safetensors(model_dir, device):
    """Every tensor of a model directory, on `device` (no safetensors package needed)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        with open(os.path.join(model_dir, f), "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            n = struct.unpack("<Q", mm[:8])[0]
            header = json.loads(mm[8:8 + n])
            base = 8 + n
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                b, e = t["data_offsets"]
                dtype = DTYPES[t["dtype"]]
                cpu = torch.frombuffer(bytearray(mm[base + b:base + e]), dtype=dtype)
                out[name] = cpu.reshape(t["shape"]).to(device)
    return out


def post(addr, path, body, result):
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            result.append((r.status, json.loads(r.read())))
    except urllib.error.HTTPError as e:
        result.append((e.code, json.loads(e.read() or b"{}")))
    except OSError as e:
        result.append((0, {"message": str(e)}))


def in_thread(addr, path, body):
    """POSTs in the background (the trainer must enter NCCL while arbor answers)."""
    result = []
    th = threading.Thread(target=post, args=(addr, path, body, result))
    th.start()
    return th, result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="arbor serve's host:port")
    ap.add_argument("--model", required=True, help="the model directory to push")
    ap.add_argument("--device", default="cuda:0", help="the trainer's GPU")
    ap.add_argument("--tp", type=int, default=1, help="arbor's ranks (the group is 1 + tp)")
    ap.add_argument("--updates", type=int, default=1)
    ap.add_argument("--version-prefix", default="nccl")
    ap.add_argument("--scale", action="append", default=[],
                    help="NAME=FACTOR: multiply a tensor before the first push (the update "
                         "must then change the bits); later pushes send it unscaled")
    ap.add_argument("--nccl", default=None, help="libnccl to load (default: torch's)")
    args = ap.parse_args()

    nccl = Nccl(args.nccl or find_nccl())
    print(json.dumps({"libnccl": nccl.path, "nccl_version": nccl.version}), flush=True)
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    t0 = time.time()
    weights = load_safetensors(args.model, dev)
    torch.cuda.synchronize()
    total = sum(t.numel() * t.element_size() for t in weights.values())
    print(json.dumps({"loaded_tensors": len(weights), "bytes": total,
                      "seconds": round(time.time() - t0, 3)}), flush=True)

    world = 1 + args.tp
    uid = nccl.unique_id()
    th, res = in_thread(args.server, "/init_weights_update_group", {
        "unique_id": bytes(uid.internal).hex(), "world_size": world, "rank_offset": 1,
        "group_name": "trainer", "backend": "nccl"})
    t0 = time.time()
    comm = nccl.init_rank(world, uid, 0)
    th.join()
    status, body = res[0]
    print(json.dumps({"init_group_status": status, "seconds": round(time.time() - t0, 3),
                      "answer": body}), flush=True)
    if status != 200:
        raise SystemExit(1)

    stream = torch.cuda.current_stream(dev).cuda_stream
    names = list(weights)
    originals = {}
    for spec in args.scale:
        name, factor = spec.split("=")
        originals[name] = weights[name].clone()
        weights[name].mul_(float(factor))
    ok = True
    for u in range(1, args.updates + 1):
        if u == 2:
            for name, t in originals.items():
                weights[name].copy_(t)
        version = f"{args.version_prefix}-{u}"
        torch.cuda.synchronize()
        th, res = in_thread(args.server, "/update_weights_from_distributed", {
            "names": names, "dtypes": [NAMES[weights[n].dtype] for n in names],
            "shapes": [list(weights[n].shape) for n in names], "group_name": "trainer",
            "weight_version": version})
        t0 = time.time()
        for n in names:
            nccl.broadcast(weights[n], comm, stream)
        torch.cuda.synchronize()
        sent = time.time() - t0
        th.join()
        status, body = res[0]
        done = time.time() - t0
        ok &= status == 200
        print(json.dumps({"update": version, "status": status, "bytes": total,
                          "broadcast_seconds": round(sent, 3),
                          "seconds_until_answer": round(done, 3),
                          "broadcast_GBps": round(total / sent / 1e9, 2), "answer": body}),
              flush=True)

    # ncclCommDestroy returns once every member has called it: destroy here while the
    # server answers, not after (arbor destroys its side in the background too).
    th, res = in_thread(args.server, "/destroy_weights_update_group", {"group_name": "trainer"})
    nccl.destroy(comm)
    th.join()
    print(json.dumps({"destroy_group_status": res[0][0]}), flush=True)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
