"""`arbor.nemo_rl`: `arbor serve` at TP 2 behind NeMo-RL's `GenerationInterface`.

The calls and the layouts are NeMo-RL's (nemo_rl/models/generation/interfaces.py:
`generate(data: GenerationDatumSpec, greedy) -> GenerationOutputSpec`,
`prepare_for_generation(tags=...)`, `finish_generation()`; the GRPO refit in
nemo_rl/algorithms/grpo.py calls `prepare_for_generation(tags=["weights"])`, moves the
weights, then `prepare_for_generation(tags=["kv_cache"])`; the output is laid out as
nemo_rl/models/generation/sglang/sglang_generation.py's `generate` lays it out).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import Cli, f32_bits
from safetensors.torch import load_file

from arbor.nemo_rl import ArborGeneration
from arbor.verl import ArborProcess

PAD = 0
PROMPTS = [[1, 2, 3], [256, 72, 101, 108, 108], [9], [77, 78, 79, 80]]
MAX_NEW = 10
CONFIG = {
    "max_new_tokens": MAX_NEW,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "stop_token_ids": None,
    "stop_strings": None,
    "_pad_token_id": PAD,
}


def batch() -> dict[str, torch.Tensor]:
    width = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), width), PAD, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = torch.tensor(p)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in PROMPTS])}


def completion(address: str, prompt: list[int], **kw: object) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_NEW, "logprobs": 0, **kw}
    req = urllib.request.Request(f"http://{address}/v1/completions", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]


@pytest.fixture(scope="module")
def gen(cli: Cli, tiny: dict[str, Path]):
    g = ArborGeneration(
        CONFIG, model=tiny["llama"], tp=2, arbor_bin=cli.arbor, launch_bin=cli.launch
    )
    yield g
    g.shutdown()


def check_layout(out: dict, address: str, seeds: list | None = None, **kw: object) -> None:
    for i, p in enumerate(PROMPTS):
        n, g = len(p), int(out["generation_lengths"][i])
        assert out["output_ids"][i, :n].tolist() == p
        assert out["unpadded_sequence_lengths"][i] == n + g
        assert torch.all(out["output_ids"][i, n + g :] == PAD)
        assert torch.all(out["logprobs"][i, :n] == 0) and torch.all(
            out["logprobs"][i, n + g :] == 0
        )
        ref = completion(address, p, **({"seed": seeds[i]} if seeds else {}), **kw)
        assert out["output_ids"][i, n : n + g].tolist() == ref["token_ids"], i
        assert f32_bits(out["logprobs"][i, n : n + g].tolist()) == f32_bits(
            ref["logprobs"]["token_logprobs"]
        ), i
        assert bool(out["truncated"][i]) == (ref["finish_reason"] == "length"), i


def test_generate_matches_completions(gen: ArborGeneration) -> None:
    out = gen.generate(batch(), greedy=False)
    assert out["output_ids"].shape[0] == len(PROMPTS)
    check_layout(out, gen.address, seeds=out["sampling_seeds"])
    greedy = gen.generate(batch(), greedy=True)
    check_layout(greedy, gen.address, temperature=0.0)

    async def one() -> list:
        return [r async for r in gen.generate_async({k: v[1:2] for k, v in batch().items()})]

    [(idx, single)] = asyncio.run(one())
    assert idx == 0
    seed = single["sampling_seeds"][0]
    ref = completion(gen.address, PROMPTS[1], seed=seed)
    n = len(PROMPTS[1])
    assert single["output_ids"][0, n:].tolist() == ref["token_ids"]


def test_stop_token_and_sleep(gen: ArborGeneration) -> None:
    seeded = ArborGeneration(CONFIG, address=gen.address, seed=5)
    first = seeded.generate(batch())
    row = first["output_ids"][0, 3 : 3 + int(first["generation_lengths"][0])].tolist()
    stop = row[2]
    cut = ArborGeneration({**CONFIG, "stop_token_ids": [stop]}, address=gen.address, seed=5)
    out = cut.generate(batch())
    assert (
        out["output_ids"][0, 3 : 3 + int(out["generation_lengths"][0])].tolist()
        == row[: row.index(stop) + 1]
    )
    assert not bool(out["truncated"][0])

    # GRPO's refit order around a release.
    assert seeded.finish_generation()
    assert seeded.prepare_for_generation(tags=["weights"])
    assert seeded.prepare_for_generation(tags=["kv_cache"])
    assert seeded.invalidate_kv_cache()
    again = seeded.generate(batch())
    assert torch.equal(again["output_ids"], first["output_ids"])
    assert torch.equal(again["logprobs"], first["logprobs"])
    cut.shutdown()
    seeded.shutdown()


def test_push_gives_a_fresh_server_on_the_new_weights(
    gen: ArborGeneration, cli: Cli, tiny: dict[str, Path], tmp_path: Path
) -> None:
    b = tmp_path / "b"
    cli.run(1, "make-model", "--arch", "llama", "--preset", "tiny", "--seed", "8", "--out", str(b))
    r = gen.update_weights_from_tensors(
        load_file(b / "model.safetensors").items(), weight_version="s1"
    )
    assert r["weight_version"] == "s1"
    try:
        out = gen.generate(batch())
        with ArborProcess(b, 1, arbor_bin=cli.arbor) as fresh:
            check_layout(out, fresh.address, seeds=out["sampling_seeds"])
    finally:
        gen.update_weights_from_disk(tiny["llama"], "0")


def test_is_nemo_rls_generation_interface(gen: ArborGeneration) -> None:
    """Where NeMo-RL imports (its GitHub checkout: PyPI's nemo-rl is a placeholder)."""
    interfaces = pytest.importorskip("nemo_rl.models.generation.interfaces")
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    assert isinstance(gen, interfaces.GenerationInterface)
    out = gen.generate(BatchedDataDict(batch()), greedy=True)
    assert isinstance(out, BatchedDataDict)
    ok, why = interfaces.verify_right_padding(out, pad_value=PAD, raise_error=False)
    assert ok, why
