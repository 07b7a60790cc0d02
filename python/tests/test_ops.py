"""Each operation of `arbor.torch.ops`: its backward passes `torch.autograd.gradcheck` in
f64 (PyTorch's formula of the same function), its f32 forward (arbor's kernel) computes
that function, and its f32 gradients agree with autograd through PyTorch's own ops."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

from arbor import _native
from arbor.torch import CausalLM, ops, reference

HEADS, KV_HEADS = 4, 2
CU = [0, 5, 6, 13, 83]  # four packed sequences of 5, 1, 7 and 70 rows (past a KV block)


def _f64(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)


@pytest.fixture(scope="module")
def spec(tiny: dict[str, Path]) -> _native.ModelSpec:
    """A tiny model's config: head_dim 16 (its RoPE table)."""
    return _native.ModelSpec(tiny["llama"])


def _at(spec: _native.ModelSpec) -> ops.Positions:
    return ops.Positions(CU, spec, torch.device("cpu"))


def _packed_qkv(spec: _native.ModelSpec) -> list[torch.Tensor]:
    hd = spec.config["head_dim"]
    rows = CU[-1]
    return [
        _f64(rows, HEADS * hd),
        _f64(rows, KV_HEADS * hd, seed=1),
        _f64(rows, KV_HEADS * hd, seed=2),
    ]


def test_gradcheck_each_op_in_f64(spec: _native.ModelSpec) -> None:
    assert gradcheck(ops.tree_linear, (_f64(3, 2, 16), _f64(5, 16, seed=1), _f64(5, seed=2)))
    assert gradcheck(lambda x, w: ops.rms_norm(x, w, 1e-6), (_f64(3, 5, 8), _f64(8, seed=1)))
    assert gradcheck(ops.silu_mul, (_f64(4, 6), _f64(4, 6, seed=1)))
    assert gradcheck(lambda lg: ops.token_logprobs(lg, torch.tensor([0, 5, 2])), (_f64(3, 7),))
    at = _at(spec)
    assert gradcheck(
        lambda q, k, v: ops.rope_attention(q, k, v, at, HEADS, KV_HEADS),
        tuple(_packed_qkv(spec)),
        fast_mode=True,
    )


def _close_forward_and_grads(
    f: Callable[..., torch.Tensor],
    ref: Callable[..., torch.Tensor],
    inputs: list[torch.Tensor],
    rtol: float,
    atol: float,
) -> None:
    """`f` on f32 inputs (arbor's kernel) against `ref` in f64 on the same values: the
    outputs and the gradients of a random weighting of them."""
    xs = [x.detach().float().requires_grad_(True) for x in inputs]
    x64 = [x.detach().double().requires_grad_(True) for x in xs]
    y, y64 = f(*xs), ref(*x64)
    torch.testing.assert_close(y.double(), y64, rtol=rtol, atol=atol)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (y.double() * w).sum().backward()
    (y64 * w).sum().backward()
    for a, b in zip(xs, x64, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=rtol, atol=atol)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16, as arbor reads it (the rounding's gradient is the identity)."""
    return x + (x.to(torch.bfloat16).to(x.dtype) - x).detach()


def test_f32_kernels_compute_the_function_and_its_gradient(spec: _native.ModelSpec) -> None:
    # The linear rounds x and W to bf16 and sums 64 products in f32.
    _close_forward_and_grads(
        ops.tree_linear,
        lambda x, w: _bf16(x) @ _bf16(w).t(),
        [_f64(6, 64), _f64(10, 64, seed=1)],
        rtol=1e-5,
        atol=1e-5,
    )
    _close_forward_and_grads(
        lambda x, w: ops.rms_norm(x, w, 1e-5),
        lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * _bf16(w),
        [_f64(6, 32), _f64(32, seed=1)],
        rtol=1e-5,
        atol=1e-5,
    )
    _close_forward_and_grads(
        ops.silu_mul, lambda g, u: F.silu(g) * u, [_f64(6, 32), _f64(6, 32, seed=1)], 1e-5, 1e-6
    )
    targets = torch.tensor([3, 0, 99, 42])
    _close_forward_and_grads(
        lambda lg: ops.token_logprobs(lg, targets),
        lambda lg: torch.log_softmax(lg, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1),
        [_f64(4, 100) * 3],
        rtol=1e-5,
        atol=1e-5,
    )
    # Attention reads the rotated keys and the values rounded to bf16.
    at = _at(spec)

    def rounded_after_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kr = ops._rotate(k, at.cos.double(), at.sin.double(), KV_HEADS)
        qr = ops._rotate(q, at.cos.double(), at.sin.double(), HEADS)
        return ops._sdpa_packed(qr, _bf16(kr), _bf16(v), at.cu_seqlens, HEADS, KV_HEADS)

    _close_forward_and_grads(
        lambda q, k, v: ops.rope_attention(q, k, v, at, HEADS, KV_HEADS),
        rounded_after_rope,
        _packed_qkv(spec),
        rtol=1e-4,
        atol=1e-5,
    )


def test_head_chunks_change_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """`head_logprobs` in chunks of 3 rows equals one chunk, and the logits' own log-probs."""
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(5))
    w = torch.randn(50, 32, generator=torch.Generator().manual_seed(6)).bfloat16()
    t = torch.randint(0, 50, (10,), generator=torch.Generator().manual_seed(7))
    whole = ops.head_logprobs(x, w, t)
    monkeypatch.setattr(ops, "HEAD_CHUNK_BYTES", 3 * 50 * 4)
    assert len(ops._chunks(10, 50)) == 4
    assert torch.equal(ops.head_logprobs(x, w, t), whole)
    assert torch.equal(ops.token_logprobs(ops.tree_linear(x, w), t), whole)


def test_rope_rotates_as_the_table_says(spec: _native.ModelSpec) -> None:
    """arbor's RoPE (the kernel behind `rope_attention`) against PyTorch's rotation with
    arbor's table: position 0 is the identity, every row within f32 rounding."""
    hd = spec.config["head_dim"]
    at = _at(spec)
    x = torch.randn(CU[-1], 2 * hd, generator=torch.Generator().manual_seed(1))
    y = x.clone()
    spec.rope(y, at.positions, 2)
    assert torch.equal(y[0], x[0]) and at.positions[0] == 0
    torch.testing.assert_close(y, ops._rotate(x, at.cos, at.sin, 2), rtol=1e-6, atol=1e-6)


def test_whole_model_gradcheck_in_f64(tiny: dict[str, Path]) -> None:
    """Tiny Qwen3 in f64 (two layers): q/k norms, RoPE, GQA attention, the MLP, the final
    norm, the tied head and the log-softmax, with respect to a few parameters."""
    model = CausalLM.from_pretrained(tiny["qwen3"], dtype=torch.float32).double()
    del model.model.layers[2:]
    names = [
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.norm.weight",
    ]
    params = dict(model.named_parameters())
    inputs = tuple(params[n].detach().clone().requires_grad_(True) for n in names)
    ids = torch.randint(0, 258, (2, 5), generator=torch.Generator().manual_seed(4))

    def f(*ws: torch.Tensor) -> torch.Tensor:
        over = {n: w for n, w in zip(names, ws, strict=True)}
        return torch.func.functional_call(model, over, (ids,), {"return_token_logprobs": True})

    assert gradcheck(f, inputs, eps=1e-6, atol=1e-5, fast_mode=True)


# Measured on the tiny models (3 x 24 random ids, f32 plain forward): the cosine similarity
# of each parameter's gradient with the plain forward's is at least 0.9998 (llama 0.99995,
# qwen2 0.99990, qwen3 0.99994).
MIN_COSINE = 0.99


def test_gradients_agree_with_the_plain_pytorch_forward(tiny: dict[str, Path]) -> None:
    model = CausalLM.from_pretrained(tiny["qwen3"], dtype=torch.float32)
    ids = torch.randint(0, 258, (3, 24), generator=torch.Generator().manual_seed(3))
    w = torch.randn(3, 23, generator=torch.Generator().manual_seed(1))
    (model.token_logprobs(ids) * w).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (reference.token_logprobs(model, ids, dtype=torch.float32) * w).sum().backward()
    worst = min(
        (float(F.cosine_similarity(ours[n].flatten(), p.grad.flatten(), dim=0)), n)
        for n, p in model.named_parameters()
    )
    assert worst[0] > MIN_COSINE, worst


def test_fused_ops_gradcheck_in_f64_and_give_each_linears_bits(spec: _native.ModelSpec) -> None:
    """`fused_linear` (q|k|v), `gate_up_silu` and `RopeAttentionQKV`:
    their backward is the separate ops' (gradcheck in f64), and in f32 each column has the
    bits of its own linear / the separate ops' result."""
    ws = (_f64(5, 16, seed=1), _f64(3, 16, seed=2), _f64(3, 16, seed=3))
    assert gradcheck(lambda x, *w: ops.fused_linear(x, w), (_f64(4, 16), *ws))
    assert gradcheck(
        lambda x, g, u: ops.gate_up_silu(x, g, u), (_f64(4, 16), ws[1], ws[2].detach().clone())
    )
    at = _at(spec)
    assert gradcheck(
        lambda qkv: ops.rope_attention_qkv(qkv, at, HEADS, KV_HEADS),
        (torch.cat([t.detach() for t in _packed_qkv(spec)], 1).requires_grad_(),),
        fast_mode=True,
    )

    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(3))
    w32 = [torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (48, 16, 16)]
    w = [t.to(torch.bfloat16) for t in w32]
    fused = ops.fused_linear(x, w)
    assert torch.equal(fused, torch.cat([ops.tree_linear(x, t) for t in w], 1))
    want = ops.silu_mul(ops.tree_linear(x, w[1]), ops.tree_linear(x, w[2]))
    assert torch.equal(ops.gate_up_silu(x, w[1], w[2]), want)
    q, k, v = fused.split([48, 16, 16], 1)
    cu = [0, 30, 37]
    at = ops.Positions(cu, spec, torch.device("cpu"))
    assert torch.equal(
        ops.rope_attention_qkv(fused, at, 3, 1), ops.rope_attention(q, k, v, at, 3, 1)
    )


def test_the_gpu_head_backward_computes_the_head_gradient() -> None:
    """`HeadLogprobs`' GPU backward (bf16 products, the logits' gradient kept in bf16 for
    one weight GEMM), run here on CPU tensors, against the f64 gradient of the same
    function, within bf16 rounding."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(300, 64, generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, 300, (37,), generator=gen)
    grad = torch.randn(37, generator=gen)
    gx, gw = ops._head_grads_cuda(x, w, targets, grad)
    assert gx.dtype == torch.float32 and gw.dtype == torch.bfloat16
    x64, w64 = (t.double().requires_grad_() for t in (x, w))
    lp = torch.log_softmax(x64 @ w64.t(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_x, want_w = torch.autograd.grad(lp, (x64, w64), grad.double())
    for got, want in ((gx, want_x), (gw, want_w)):
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 2e-2, err
