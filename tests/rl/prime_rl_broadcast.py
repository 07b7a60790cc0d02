"""prime-rl's trainer side of its NCCL weight broadcast, with the communicator replaced by
one that records what each `broadcast(tensor, src=0)` sends, so the receiving order can
be checked on CPU against the bytes real Python pickling and torch produce.

`broadcast_integer`, `broadcast_state_dict` and `filter_state_dict_by_layers` follow
PrimeIntellect-ai/prime-rl `src/prime_rl/transports/weights/nccl.py` line for line, but
for `.cuda()` (the tensors stay on the CPU) and the pickle protocol, which a test may
choose (prime-rl uses `pickle.dumps`'s default).

    python3 tests/rl/prime_rl_broadcast.py MODEL_DIR OUT_DIR [PROTOCOL ...]

Per protocol (`default`: pickle's own), writes OUT_DIR/stream-PROTOCOL (each broadcast as
an 8-byte little-endian length and its bytes); and OUT_DIR/expected.safetensors (the
state dict as broadcast: bfloat16, the norms float32, so that a state dict holds two
dtypes).
"""

import pickle
import struct
import sys
from collections.abc import Generator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

PROTOCOL: int | None = None


class Recorder:
    """Stands for `PyNcclCommunicator` at the trainer's rank 0."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def broadcast(self, tensor: Tensor, src: int) -> None:
        assert src == 0
        flat = tensor.detach().contiguous().reshape(-1)
        self.sent.append(flat.view(torch.uint8).numpy().tobytes())


def broadcast_integer(integer: int, communicator: Recorder) -> None:
    integer_tensor = torch.tensor([integer], dtype=torch.long)
    communicator.broadcast(integer_tensor, src=0)


def broadcast_state_dict(state_dict: dict[str, Tensor], communicator: Recorder) -> None:
    dtype_groups: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
    for key, value in state_dict.items():
        dtype = value.dtype
        if dtype not in dtype_groups:
            dtype_groups[dtype] = []
        dtype_groups[dtype].append((key, value))

    metadata = {}
    for dtype, items in dtype_groups.items():
        metadata[dtype] = [(key, value.shape, value.numel()) for key, value in items]

    state = pickle.dumps(metadata, protocol=PROTOCOL)
    size_tensor = torch.tensor([len(state)], dtype=torch.long)
    communicator.broadcast(size_tensor, src=0)
    state_tensor = torch.ByteTensor(list(state))
    communicator.broadcast(state_tensor, src=0)

    for items in dtype_groups.values():
        flat_tensors = [value.flatten() for _, value in items]
        concatenated = torch.cat(flat_tensors)
        communicator.broadcast(concatenated, src=0)


def filter_state_dict_by_layers(
    state_dict: dict[str, torch.Tensor], num_layers: int, layer_prefix: str
) -> Generator[tuple[int, dict[str, torch.Tensor]], None, None]:
    yield (
        -1,
        {key: value for key, value in state_dict.items() if not key.startswith(layer_prefix)},
    )
    for i in range(num_layers):
        yield (
            i,
            {
                key: value
                for key, value in state_dict.items()
                if key.startswith(f"{layer_prefix}{i}.")
            },
        )


def main(model_dir: str, out_dir: str, protocols: list[str]) -> None:
    global PROTOCOL
    state_dict = load_file(str(Path(model_dir) / "model.safetensors"))
    state_dict = {
        k: v.to(torch.float32 if k.endswith("norm.weight") else torch.bfloat16)
        for k, v in state_dict.items()
    }
    layer_prefix = "model.layers."
    # prime-rl's get_max_layer_num: the highest layer index plus one.
    num_layers = 1 + max(
        int(k[len(layer_prefix) :].split(".")[0]) for k in state_dict if k.startswith(layer_prefix)
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for protocol in protocols:
        PROTOCOL = None if protocol == "default" else int(protocol)
        communicator = Recorder()
        broadcast_integer(num_layers + 1, communicator)
        for _, layer_dict in filter_state_dict_by_layers(state_dict, num_layers, layer_prefix):
            broadcast_state_dict(layer_dict, communicator)
        with open(out / f"stream-{protocol}", "wb") as f:
            for b in communicator.sent:
                f.write(struct.pack("<Q", len(b)))
                f.write(b)
        print(f"{protocol}: {len(communicator.sent)} broadcasts, {num_layers + 1} state dicts")
    save_file(state_dict, str(out / "expected.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:] or ["default"])
