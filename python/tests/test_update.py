"""Training steps: the forward reads the parameters themselves, so after an optimizer step
`token_logprobs` are arbor's values for the new weights, equal to `arbor score` on a
checkpoint saved from them (what a server gets when the trainer pushes them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ARCHS, Cli, f32_bits

import arbor
from arbor.torch import CausalLM


def _ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 258, (3, 24), generator=g)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adamw_step_then_bits_equal_score_of_the_saved_checkpoint(
    arch: str, dtype: torch.dtype, tiny: dict[str, Path], cli: Cli, tmp_path: Path
) -> None:
    model = CausalLM.from_pretrained(tiny[arch], dtype=dtype)
    layer = model.model.layers[1]
    trained = [layer.self_attn.q_proj.weight, layer.mlp.down_proj.weight, model.model.norm.weight]
    if arch == "qwen2":
        trained.append(layer.self_attn.k_proj.bias)  # zero in the tiny model: now it moves
    for p in model.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trained, lr=3e-2)
    ids = _ids()

    before = model.token_logprobs(ids)
    (-before.mean()).backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in trained)
    opt.step()
    after = model.token_logprobs(ids).detach()
    assert not torch.equal(before.detach(), after)

    ckpt = model.save_pretrained(tmp_path / "ckpt")
    seqs = ids.tolist()
    for tp in (1, 2):
        recs = cli.score(ckpt, seqs, [1] * len(seqs), tp, tmp_path / "score")
        for i in range(len(seqs)):
            assert f32_bits(after[i].tolist()) == f32_bits(recs[i]["logprobs"]), (tp, i)


def test_an_in_place_edit_is_seen_at_once(tiny: dict[str, Path]) -> None:
    model = CausalLM.from_pretrained(tiny["llama"])
    ids = _ids()
    with torch.no_grad():
        first = model.token_logprobs(ids)
        model.lm_head.weight.mul_(2.0)
        assert not model.token_logprobs(ids).equal(first)
        model.lm_head.weight.div_(2.0)  # doubling then halving is exact in bf16
        again = model.token_logprobs(ids)
    assert f32_bits(again.flatten().tolist()) == f32_bits(first.flatten().tolist())


def test_the_state_dict_is_what_arbor_reads(tiny: dict[str, Path]) -> None:
    model = CausalLM.from_pretrained(tiny["qwen3"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sd = model.state_dict()
    assert "lm_head.weight" in sd  # as transformers' own module lists it
    assert "lm_head.weight" not in model.arbor_state_dict()
    engine = arbor.Model(tiny["qwen3"])
    shapes = engine.weight_shapes()
    assert {n: list(t.shape) for n, t in model.arbor_state_dict().items()} == shapes
    # What `/update_weights_from_tensor` takes: the engine accepts the module's tensors.
    engine.update_weights([(n, t.contiguous()) for n, t in model.arbor_state_dict().items()])
    assert engine.updates == 1
