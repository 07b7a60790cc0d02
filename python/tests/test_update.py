"""Training steps: after an optimizer step, `token_logprobs` are arbor's values for the new
weights (the push works), equal to `arbor score` on a checkpoint saved from them; the
gradient is the PyTorch forward's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ARCHS, Cli, f32_bits

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
    opt.step()
    assert model.weights_changed()
    pushes = model.engine.updates
    after = model.token_logprobs(ids).detach()
    assert model.engine.updates == pushes + 1 and not model.weights_changed()
    assert not torch.equal(before.detach(), after)

    ckpt = model.save_pretrained(tmp_path / "ckpt")
    seqs = ids.tolist()
    for tp in (1, 2):
        recs = cli.score(ckpt, seqs, [1] * len(seqs), tp, tmp_path / "score")
        for i in range(len(seqs)):
            assert f32_bits(after[i].tolist()) == f32_bits(recs[i]["logprobs"]), (tp, i)


def test_the_gradient_is_the_pytorch_forwards(tiny: dict[str, Path]) -> None:
    model = CausalLM.from_pretrained(tiny["qwen3"])
    ids = _ids()
    weights = torch.randn(
        ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(1)
    )

    (model.token_logprobs(ids) * weights).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (model.torch_token_logprobs(ids) * weights).sum().backward()
    for n, p in model.named_parameters():
        assert torch.equal(ours[n], p.grad), n
    assert any(bool(g.abs().sum() > 0) for g in ours.values())


def test_no_push_without_a_change_and_one_after_an_in_place_edit(tiny: dict[str, Path]) -> None:
    model = CausalLM.from_pretrained(tiny["llama"])
    ids = _ids()
    with torch.no_grad():
        first = model.token_logprobs(ids)
        assert model.token_logprobs(ids).equal(first) and model.engine.updates == 0
        model.lm_head.weight.mul_(2.0)
        second = model.token_logprobs(ids)
        assert model.engine.updates == 1 and not second.equal(first)
        model.lm_head.weight.div_(2.0)  # doubling then halving is exact in bf16
        assert f32_bits(model.token_logprobs(ids).flatten().tolist()) == f32_bits(
            first.flatten().tolist()
        )


def test_a_tied_head_follows_the_embedding(tiny: dict[str, Path]) -> None:
    model = CausalLM.from_pretrained(tiny["qwen3"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sd = model.state_dict()
    assert "lm_head.weight" in sd  # as transformers' own module lists it
    assert "lm_head.weight" not in model.arbor_state_dict()
    assert set(model.arbor_state_dict()) == set(model.engine.weight_shapes())
