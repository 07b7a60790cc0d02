"""The PyTorch forward (the gradient's path): within bf16 noise of arbor's values, and its
pieces pass `torch.autograd.gradcheck` in f64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ARCHS
from torch.autograd import gradcheck

from arbor.torch import CausalLM, ops

# Measured on the tiny models (4 x 64 random ids): max |d log p| 0.06 to 0.08
# with bf16 weights, 0.03 to 0.04 with the same weights in f32; mean 0.016 to 0.026.
MAX_ABS = 0.25
MEAN_ABS = 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_torch_forward_is_within_bf16_noise_of_arbor(arch: str, tiny: dict[str, Path]) -> None:
    model = CausalLM.from_pretrained(tiny[arch])
    ids = torch.randint(0, 258, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.arbor_token_logprobs(ids)
        theirs = model.torch_token_logprobs(ids)
    d = (ours - theirs).abs()
    assert float(d.max()) < MAX_ABS and float(d.mean()) < MEAN_ABS, (d.max(), d.mean())
    assert not torch.equal(ours, theirs)  # two computations, not one


def _f64(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)


def test_gradcheck_rms_norm() -> None:
    x, w = _f64(3, 5, 8), _f64(8, seed=1)
    assert gradcheck(lambda x, w: ops.rms_norm(x, w, 1e-6), (x, w))


def test_gradcheck_rope_and_gqa_attention() -> None:
    t, hd = 6, 8
    pos = torch.arange(t, dtype=torch.float64).unsqueeze(1)
    freq = pos * (1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    cos = torch.cat((freq.cos(), freq.cos()), -1)
    sin = torch.cat((freq.sin(), freq.sin()), -1)
    q, k, v = _f64(2, 4, t, hd), _f64(2, 2, t, hd, seed=1), _f64(2, 2, t, hd, seed=2)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ops.causal_attention(ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin), v)

    assert gradcheck(f, (q, k, v), fast_mode=True)


class _Logprobs(torch.nn.Module):
    """`torch_token_logprobs` as `forward`, for `torch.func.functional_call`."""

    def __init__(self, m: CausalLM) -> None:
        super().__init__()
        self.m = m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m.torch_token_logprobs(ids)


def test_gradcheck_logprobs_of_a_whole_tiny_model(tiny: dict[str, Path]) -> None:
    """The PyTorch forward of tiny Qwen3 in f64 (its first two layers), through q/k norms,
    RoPE, GQA attention, the MLP, the final norm, the tied head and the log-softmax, with
    respect to a few parameters."""
    model = CausalLM.from_pretrained(tiny["qwen3"], dtype=torch.float32).double()
    del model.model.layers[2:]
    names = [
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
    ]
    params = dict(model.named_parameters())
    inputs = tuple(params[n].detach().clone().requires_grad_(True) for n in names)
    ids = torch.randint(0, 258, (2, 5), generator=torch.Generator().manual_seed(4))
    call = _Logprobs(model)

    def f(*ws: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(
            call, {f"m.{n}": w for n, w in zip(names, ws, strict=True)}, (ids,)
        )

    assert gradcheck(f, inputs, eps=1e-6, atol=1e-5, fast_mode=True)
