#!/usr/bin/env python3
"""A PyTorch trainer on its own GPU pushes a checkpoint to `arbor serve` over NCCL, joining
arbor by address (POST /init_weights_update_group with master_address / master_port), the
way the RL frameworks' trainers do:

  --style sglang  torch.distributed: SGLang's `init_custom_process_group` (slime's
                  `slime/utils/distributed_utils.py` copy of it, below) at
                  tcp://127.0.0.1:PORT as rank 0, then slime's bucketed update: one
                  /update_weights_from_distributed per bucket (names, dtypes, shapes,
                  weight_version, no commit) while `dist.broadcast(..., async_op=True)`
                  sends the bucket's tensors.
  --style vllm    vLLM's StatelessProcessGroup (a TCPStore, legacy server) and
                  PyNcclCommunicator (the ncclUniqueId pickled under broadcast_from/0/0,
                  ncclCommInitRank, a one-element all-reduce to warm up), copied below
                  without vLLM; then one /update_weights_from_distributed per tensor, as
                  OpenRLHF's clients send them.
  --style packed  vLLM's weight-transfer API: /init_weight_transfer_engine (the vLLM-style
                  group), then /start_weight_update, one /update_weights with packed: true
                  while the tensors go in a few uint8 buffers (vLLM's packed layout), and
                  /finish_weight_update.
  --style prime-rl  prime-rl's NCCL broadcast: /init_broadcaster (the vLLM-style group,
                  trainer at rank 0), /pause?mode=keep, /update_weights {weight_dir} while
                  the trainer broadcasts the count of state dicts and, per state dict, its
                  pickled {dtype: [(name, shape, numel)]} and one tensor per dtype, /resume.
  --style trl     TRL's VLLMClient (trl/generation/vllm_client.py) against `trl
                  vllm-serve`'s routes: GET /get_world_size/, POST /init_communicator/
                  (host 0.0.0.0, as TRL sends it), then StatelessProcessGroup.create as the
                  LAST rank (arbor's rank 0 runs the store and makes the id), and
                  PyNcclCommunicator's side of it; then per tensor POST
                  /update_named_param/ (answered at once), ncclBroadcast from the trainer's
                  rank, and vLLM's store barrier; /reset_prefix_cache/,
                  /close_communicator/.

    python3 scripts/gpu/rendezvous-trainer.py --server 127.0.0.1:8000 --model DIR \
        --device cuda:1 --style sglang --port 29555 --version sglang-B

Prints one JSON line per call with arbor's answer; exits 0 when every call succeeded and
the last one applied the update (its answer names --version).
"""

import argparse
import ctypes
import json
import os
import pickle
import socket
import sys
import time
import types
import urllib.error
import urllib.request
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from rl_push_nccl import (
    NAMES,
    NCCL_TYPES,
    Nccl,
    UniqueId,
    find_nccl,
    in_thread,
    load_safetensors,
    post,
)


def say(**kw):
    print(json.dumps(kw), flush=True)


# Copied from slime (slime/utils/distributed_utils.py, init_process_group), itself a copy of
# SGLang's init_custom_process_group (python/sglang/srt/utils): a process group outside
# the default one, on the store of `init_method`.
def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                              rank=-1, store=None, group_name=None, pg_options=None):
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    assert (store is None) or (init_method is None), "Cannot specify both init_method and store."
    if store is not None:
        assert world_size > 0, "world_size must be positive if using store"
        assert rank >= 0, "rank must be non-negative if using store"
    elif init_method is None:
        init_method = "env://"
    backend = Backend(backend) if backend else Backend("undefined")
    if timeout is None:
        timeout = default_pg_timeout
    if store is None:
        rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
        store, rank, world_size = next(rendezvous_iterator)
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store,
                                      group_name=group_name, backend_options=pg_options,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def check(status, body, what):
    say(call=what, status=status, answer=body)
    if status != 200:
        raise SystemExit(f"{what}: {status} {body}")


def sglang_style(args, weights, world):
    group = "slime-pp_0"
    th, res = in_thread(args.server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": args.port, "rank_offset": 1,
        "world_size": world, "group_name": group, "backend": "nccl"})
    pg = init_custom_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                                   world_size=world, rank=0, group_name=group)
    th.join()
    check(*res[0], "init_weights_update_group")
    names = list(weights)
    buckets = [names[i:i + args.bucket] for i in range(0, len(names), args.bucket)]
    last = None
    for i, bucket in enumerate(buckets):
        # slime's update_weights_from_distributed: the call, then the bucket's broadcasts.
        th, res = in_thread(args.server, "/update_weights_from_distributed", {
            "names": bucket, "dtypes": [NAMES[weights[n].dtype] for n in bucket],
            "shapes": [list(weights[n].shape) for n in bucket], "group_name": group,
            "weight_version": args.version})
        handles = [dist.broadcast(weights[n].data, 0, group=pg, async_op=True) for n in bucket]
        for h in handles:
            h.wait()
        th.join()
        last = res[0]
        check(*last, f"bucket {i + 1}/{len(buckets)}")
    th, res = in_thread(args.server, "/destroy_weights_update_group", {"group_name": group})
    dist.destroy_process_group(pg)
    th.join()
    check(*res[0], "destroy_weights_update_group")
    return last


def stub_vllm_id_class():
    """vLLM's `ncclUniqueId` (pynccl_wrapper), under vLLM's module name: pickle names it."""
    name = "vllm.distributed.device_communicators.pynccl_wrapper"
    if name not in sys.modules:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))

        class ncclUniqueId(ctypes.Structure):
            _fields_ = [("internal", ctypes.c_byte * 128)]

        # Pickle finds a class by module and qualified name: vLLM's, not this function's.
        ncclUniqueId.__module__ = name
        ncclUniqueId.__qualname__ = "ncclUniqueId"
        sys.modules[name].ncclUniqueId = ncclUniqueId
    return sys.modules[name].ncclUniqueId


def nccl_with_all_reduce(args):
    """The NCCL library, its all-reduce typed for the warm-up a vLLM member runs."""
    nccl = Nccl(args.nccl or find_nccl())
    nccl.lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                       ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_void_p]
    nccl.lib.ncclAllReduce.restype = ctypes.c_int
    return nccl


class VllmGroupRank0:
    """The trainer as rank 0 of a vLLM `StatelessProcessGroup` + `PyNcclCommunicator`,
    while the server joins it (its join call `th` / `res`, on the route `route`).

    StatelessProcessGroup.create, rank 0 (vllm/distributed/utils.py): it listens itself
    and hands the socket to a legacy-server TCPStore that waits for `world` members.
    PyNcclCommunicator.__init__ (vllm/distributed/device_communicators/pynccl.py): rank 0
    makes the id and broadcast_obj's it (pickled, key broadcast_from/0/0), every member
    inits its rank, then all-reduces one zero to warm up."""

    def __init__(self, nccl, port, world, dev, th, res, route):
        self.listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listen.bind(("127.0.0.1", port))
        self.listen.listen()
        self.store = dist.TCPStore(host_name="127.0.0.1", port=port, world_size=world,
                                   is_master=True, timeout=timedelta(seconds=300),
                                   use_libuv=False, master_listen_fd=self.listen.fileno())
        uid = nccl.unique_id()
        vuid = stub_vllm_id_class()()
        ctypes.memmove(ctypes.addressof(vuid), ctypes.addressof(uid), 128)
        self.store.set("broadcast_from/0/0", pickle.dumps(vuid))
        th.join()
        check(*res[0], route)
        self.comm = nccl.init_rank(world, uid, 0)
        self.stream = torch.cuda.current_stream(dev).cuda_stream
        warm = torch.zeros(1, device=dev)
        ptr = ctypes.c_void_p(warm.data_ptr())
        nccl.check(nccl.lib.ncclAllReduce(ptr, ptr, 1, NCCL_TYPES[torch.float32], 0, self.comm,
                                          ctypes.c_void_p(self.stream)),
                   "ncclAllReduce (warm-up)")
        torch.cuda.synchronize()

    def close(self):
        del self.store
        try:
            self.listen.close()
        except OSError:
            pass  # the store took the socket over and closed it


def vllm_style(args, weights, world, dev):
    nccl = nccl_with_all_reduce(args)
    th, res = in_thread(args.server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": args.port, "rank_offset": 1,
        "world_size": world, "group_name": "vllm", "backend": "nccl", "rendezvous": "vllm"})
    group = VllmGroupRank0(nccl, args.port, world, dev, th, res, "init_weights_update_group")
    comm, stream = group.comm, group.stream
    last = None
    for i, n in enumerate(weights):
        th, res = in_thread(args.server, "/update_weights_from_distributed", {
            "names": [n], "dtypes": [NAMES[weights[n].dtype]], "shapes": [list(weights[n].shape)],
            "group_name": "vllm", "weight_version": args.version})
        nccl.broadcast(weights[n], comm, stream)
        torch.cuda.synchronize()
        th.join()
        last = res[0]
        check(*last, f"tensor {i + 1}/{len(weights)} {n}")
    th, res = in_thread(args.server, "/destroy_weights_update_group", {"group_name": "vllm"})
    nccl.destroy(comm)
    th.join()
    check(*res[0], "destroy_weights_update_group")
    group.close()
    return last


def pack_buffers(weights: dict[str, torch.Tensor], buffer_bytes: int) -> list[torch.Tensor]:
    """vLLM's packed layout (vllm/distributed/weight_transfer/packed_tensor.py,
    `pack_tensors`): each tensor's bytes back to back in a uint8 buffer, the buffer closed
    after the tensor that takes it past `buffer_bytes`."""
    buffers, flat, total = [], [], 0
    for t in weights.values():
        b = t.contiguous().view(torch.uint8).view(-1)
        flat.append(b)
        total += b.numel()
        if total > buffer_bytes:
            buffers.append(torch.cat(flat))
            flat, total = [], 0
    if flat:
        buffers.append(torch.cat(flat))
    return buffers


def packed_style(args: argparse.Namespace, weights: dict[str, torch.Tensor], world: int,
                 dev: torch.device) -> tuple[int, dict]:
    """vLLM's weight-transfer API (NCCLWeightTransferEngine.trainer_init and
    trainer_send_weights with packed=True, as SkyRL's broadcast_strategy.py and NeMo-RL
    drive it): /init_weight_transfer_engine while the trainer makes the group vLLM style,
    /start_weight_update, /update_weights (names, dtype_names, shapes, packed) while the
    packed uint8 buffers are broadcast, /finish_weight_update."""
    nccl = nccl_with_all_reduce(args)
    lib = nccl.lib
    th, res = in_thread(args.server, "/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": args.port, "rank_offset": 1,
        "world_size": world}})
    group = VllmGroupRank0(nccl, args.port, world, dev, th, res, "init_weight_transfer_engine")
    comm, stream = group.comm, group.stream
    status, body = post_wait(args.server, "/start_weight_update", {"is_checkpoint_format": True})
    check(status, body, "start_weight_update")
    names = list(weights)
    buffers = pack_buffers(weights, args.packed_buffer_bytes)
    th, res = in_thread(args.server, "/update_weights", {"update_info": {
        "names": names, "dtype_names": [NAMES[weights[n].dtype] for n in names],
        "shapes": [list(weights[n].shape) for n in names], "packed": True,
        "packed_buffer_size_bytes": args.packed_buffer_bytes, "packed_num_buffers": 2}})
    ncclUint8 = 1
    for b in buffers:
        ptr = ctypes.c_void_p(b.data_ptr())
        nccl.check(lib.ncclBroadcast(ptr, ptr, b.numel(), ncclUint8, 0, comm,
                                     ctypes.c_void_p(stream)), "ncclBroadcast (packed)")
    torch.cuda.synchronize()
    th.join()
    check(*res[0], f"update_weights ({len(names)} tensors in {len(buffers)} packed buffers)")
    status, body = post_wait(args.server, "/finish_weight_update", {})
    check(status, body, "finish_weight_update")
    # vLLM's API names no version: arbor's (SGLang's) route sets the one the check reads.
    status, body = post_wait(args.server, "/update_weight_version", {"new_version": args.version})
    check(status, body, "update_weight_version")
    # vLLM's API has no call that leaves the group; arbor's does, and ncclCommDestroy
    # returns only once every member destroys its communicator.
    th, res = in_thread(
        args.server, "/destroy_weights_update_group", {"group_name": "vllm-weight-transfer"}
    )
    nccl.destroy(comm)
    th.join()
    check(*res[0], "destroy_weights_update_group")
    group.close()
    return 200, {"weight_version": args.version}


def prime_style(args: argparse.Namespace, weights: dict[str, torch.Tensor], world: int,
                dev: torch.device) -> tuple[int, dict]:
    """prime-rl's NCCL broadcast (src/prime_rl/transports/weights/nccl.py, the trainer;
    src/prime_rl/utils/client.py, the orchestrator): /init_broadcaster while the trainer's
    NCCLWeightBroadcastSender makes the group vLLM style (trainer at rank 0); then
    /pause?mode=keep, /update_weights {weight_dir} while the trainer broadcasts the
    number of state dicts, and per state dict (the non-layer weights, then each layer) the
    pickled {dtype: [(name, shape, numel)]} metadata and one concatenated tensor per dtype;
    then /resume."""
    nccl = nccl_with_all_reduce(args)
    lib = nccl.lib
    th, res = in_thread(args.server, "/init_broadcaster", {
        "host": "127.0.0.1", "port": args.port, "rank_offset": 0,
        "inference_world_size": world - 1, "timeout": 300,
        "quantize_in_weight_transfer": False})
    group = VllmGroupRank0(nccl, args.port, world, dev, th, res, "init_broadcaster")
    comm, stream = group.comm, group.stream
    types_ = {**NCCL_TYPES, torch.int64: 4, torch.uint8: 1}

    def bcast(t: torch.Tensor) -> None:
        ptr = ctypes.c_void_p(t.data_ptr())
        nccl.check(lib.ncclBroadcast(ptr, ptr, t.numel(), types_[t.dtype], 0, comm,
                                     ctypes.c_void_p(stream)), "ncclBroadcast")

    def broadcast_state_dict(state_dict: dict[str, torch.Tensor]) -> None:
        groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for key, value in state_dict.items():
            groups.setdefault(value.dtype, []).append((key, value))
        metadata = {d: [(k, v.shape, v.numel()) for k, v in items] for d, items in groups.items()}
        state = pickle.dumps(metadata)
        bcast(torch.tensor([len(state)], dtype=torch.long, device=dev))
        bcast(torch.tensor(list(state), dtype=torch.uint8, device=dev))
        for items in groups.values():
            bcast(torch.cat([v.flatten() for _, v in items]))

    status, body = post_wait(args.server, "/pause?mode=keep&clear_cache=false", {})
    check(status, body, "pause")
    th, res = in_thread(args.server, "/update_weights", {"weight_dir": "/nonexistent/step_1"})
    prefix = "model.layers."
    layers = 1 + max(int(k[len(prefix):].split(".")[0]) for k in weights if k.startswith(prefix))
    bcast(torch.tensor([layers + 1], dtype=torch.long, device=dev))
    broadcast_state_dict({k: v for k, v in weights.items() if not k.startswith(prefix)})
    for i in range(layers):
        broadcast_state_dict({k: v for k, v in weights.items() if k.startswith(f"{prefix}{i}.")})
    torch.cuda.synchronize()
    th.join()
    check(*res[0], f"update_weights ({layers + 1} state dicts, metadata in band)")
    status, body = post_wait(args.server, "/resume", {})
    check(status, body, "resume")
    # prime-rl names no version: arbor's (SGLang's) route sets the one the check reads.
    status, body = post_wait(args.server, "/update_weight_version", {"new_version": args.version})
    check(status, body, "update_weight_version")
    th, res = in_thread(
        args.server, "/destroy_weights_update_group", {"group_name": "prime-rl-broadcast"}
    )
    nccl.destroy(comm)
    th.join()
    check(*res[0], "destroy_weights_update_group")
    group.close()
    return 200, {"weight_version": args.version}


def post_wait(server: str, path: str, body: dict) -> tuple[int, dict]:
    th, res = in_thread(server, path, body)
    th.join()
    return res[0]


def get(addr, path):
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=60) as r:
        return r.status, json.loads(r.read())


def post_now(addr, path, body=None):
    """A POST that waits for its answer (TRL's client posts, then broadcasts)."""
    res = []
    if body is None:
        post_empty(addr, path, res)
    else:
        post(addr, path, body, res)
    return res[0]


def post_empty(addr, path, res):
    req = urllib.request.Request(f"http://{addr}{path}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            res.append((r.status, json.loads(r.read() or b"{}")))
    except urllib.error.HTTPError as e:
        res.append((e.code, json.loads(e.read() or b"{}")))


class Stateless:
    """vLLM's StatelessProcessGroup (vllm/distributed/utils.py) for a rank other than 0:
    `create` (a legacy-server TCPStore client counted in `world_size`), `broadcast_obj` as a
    receiver, and the multi-phase `barrier`."""

    def __init__(self, host, port, rank, world):
        self.rank, self.world = rank, world
        self.store = dist.TCPStore(host_name=host, port=port, world_size=world, is_master=False,
                                   timeout=timedelta(seconds=300), use_libuv=False)
        self.recv = {i: 0 for i in range(world)}
        self.sent = 0

    def broadcast_recv(self, src):
        obj = pickle.loads(self.store.get(f"broadcast_from/{src}/{self.recv[src]}"))
        self.recv[src] += 1
        return obj

    def barrier(self, timeout=30.0):
        barrier_id = self.broadcast_recv(0)
        self.store.set(f"arrival_{barrier_id}_{self.rank}", b"1")
        arrived, t0 = set(), time.time()
        while len(arrived) < self.world:
            if time.time() - t0 > timeout:
                raise RuntimeError(f"Barrier timed out after {timeout:.2f} seconds")
            for i in range(self.world):
                if i not in arrived:
                    try:
                        self.store.get(f"arrival_{barrier_id}_{i}")
                        arrived.add(i)
                    except KeyError:
                        pass
        self.store.set(f"departure_{barrier_id}_{self.rank}", b"1")


def trl_style(args, weights, dev):
    nccl = nccl_with_all_reduce(args)
    lib = nccl.lib
    before = get(args.server, "/get_weight_version")[1]["weight_version"]
    # VLLMClient.init_communicator: the server's world size, the client last.
    status, body = get(args.server, "/get_world_size/")
    check(status, body, "get_world_size")
    world = body["world_size"] + 1
    rank = body["world_size"]
    check(*post_now(args.server, "/init_communicator/", {
        "host": args.store_host, "port": args.port, "world_size": world,
        "client_device_uuid": str(torch.cuda.get_device_properties(dev).uuid)}),
        "init_communicator")
    time.sleep(0.1)
    host = args.server.rsplit(":", 1)[0]
    pg = Stateless(host, args.port, rank, world)
    # PyNcclCommunicator.__init__ at a rank other than 0: the id rank 0 broadcast_obj'd,
    # unpickled as vLLM's class (the stub stands in for vLLM, which is not installed).
    stub = stub_vllm_id_class()
    vuid = pg.broadcast_recv(0)
    if type(vuid) is not stub:
        raise SystemExit(f"broadcast_from/0/0 unpickled to {type(vuid)}, not vLLM's ncclUniqueId")
    uid = UniqueId()
    ctypes.memmove(ctypes.addressof(uid), ctypes.addressof(vuid), 128)
    comm = nccl.init_rank(world, uid, rank)
    stream = torch.cuda.current_stream(dev).cuda_stream
    warm = torch.zeros(1, device=dev)
    nccl.check(lib.ncclAllReduce(ctypes.c_void_p(warm.data_ptr()), ctypes.c_void_p(warm.data_ptr()),
                                 1, NCCL_TYPES[torch.float32], 0, comm, ctypes.c_void_p(stream)),
               "ncclAllReduce (warm-up)")
    torch.cuda.synchronize()
    say(call="joined", rank=rank, world=world)
    # VLLMClient.update_named_param, per tensor: the call, the broadcast from the client's
    # rank, the group's barrier.
    for i, n in enumerate(weights):
        w = weights[n]
        check(*post_now(args.server, "/update_named_param/", {
            "name": n, "dtype": str(w.dtype), "shape": list(w.shape)}),
            f"tensor {i + 1}/{len(weights)} {n}")
        ptr = ctypes.c_void_p(w.data_ptr())
        nccl.check(lib.ncclBroadcast(ptr, ptr, w.numel(), NCCL_TYPES[w.dtype], rank, comm,
                                     ctypes.c_void_p(stream)), "ncclBroadcast")
        torch.cuda.synchronize()
        pg.barrier()
    check(*post_now(args.server, "/reset_prefix_cache/"), "reset_prefix_cache")
    check(*post_now(args.server, "/close_communicator/"), "close_communicator")
    nccl.destroy(comm)
    status, body = get(args.server, "/get_weight_version")
    say(version_before=before, version_after=body.get("weight_version"))
    # TRL's routes name no version: the update makes a new one.
    if body.get("weight_version") == before:
        status = 0
    return status, body


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True, help="the model directory to push")
    ap.add_argument("--device", default="cuda:1")
    ap.add_argument("--style", choices=["sglang", "vllm", "packed", "trl", "prime-rl"], required=True)
    ap.add_argument("--store-host", default="0.0.0.0",
                    help="trl style: the host /init_communicator/ names (TRL sends 0.0.0.0)")
    ap.add_argument("--port", type=int, required=True, help="the trainer's TCPStore port")
    ap.add_argument("--version", required=True)
    ap.add_argument("--bucket", type=int, default=8, help="tensors per bucket (sglang style)")
    ap.add_argument("--nccl", default=None, help="libnccl to load (default: torch's)")
    ap.add_argument("--packed-buffer-bytes", type=int, default=1 << 16,
                    help="packed_buffer_size_bytes (packed style; small, for several buffers)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    weights = load_safetensors(args.model, dev)
    torch.cuda.synchronize()
    world = 2
    t0 = time.time()
    if args.style == "sglang":
        status, body = sglang_style(args, weights, world)
    elif args.style == "packed":
        status, body = packed_style(args, weights, world, dev)
    elif args.style == "vllm":
        status, body = vllm_style(args, weights, world, dev)
    elif args.style == "prime-rl":
        status, body = prime_style(args, weights, world, dev)
    else:
        status, body = trl_style(args, weights, dev)
        args.version = body.get("weight_version")
    applied = status == 200 and body.get("weight_version") == args.version
    say(style=args.style, applied=applied, seconds=round(time.time() - t0, 3))
    raise SystemExit(0 if applied else 1)


if __name__ == "__main__":
    main()
