"""Under `DistributedDataParallel` and FSDP2 (`fully_shard`, bf16 compute over f32 master
weights) on two CPU processes (gloo), each rank's token log-probs are the values of a
single process, bit for bit, and the ranks end the step with the same gradients."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import f32_bits

from arbor.torch import CausalLM

WORLD = 2


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 258, (2, 12), generator=torch.Generator().manual_seed(40 + rank))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, path: str, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = CausalLM.from_pretrained(path, dtype=torch.float32)
        if mode == "ddp":
            wrapped: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            # arbor's activations are f32: the layers' inputs must not be cast to bf16.
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=mp_policy)
            wrapped = fully_shard(model, mp_policy=mp_policy)
        lp = wrapped(_ids(rank), return_token_logprobs=True)
        (-lp.mean()).backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad
            if hasattr(g, "full_tensor"):
                g = g.full_tensor()
            grads[n] = g.detach().clone()
        torch.save({"lp": lp.detach(), "grads": grads}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_distributed_wrappers_keep_the_bits(
    mode: str, arch: str, tiny: dict[str, Path], moe: dict[str, Path], tmp_path: Path
) -> None:
    """Mixtral: a mixture-of-experts model under the same wrappers (test_moe.py checks
    that an expert no token reaches still gets a gradient, as DDP expects)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    path = str(tiny[arch] if arch in tiny else moe[arch])
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, path, mode, outs[r])) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = [torch.load(o) for o in outs]
    single = CausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for r in range(WORLD):
            want = single.token_logprobs(_ids(r))
            assert f32_bits(results[r]["lp"].flatten().tolist()) == f32_bits(
                want.flatten().tolist()
            )
    g0, g1 = results[0]["grads"], results[1]["grads"]
    assert set(g0) == set(dict(single.named_parameters()))
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=0, atol=0, msg=n)
    assert any(bool(g.abs().sum() > 0) for g in g0.values())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
