"""The forward's pieces as plain PyTorch operations, written as transformers writes them
for Llama and Qwen: the gradient of `CausalLM.token_logprobs` is theirs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """f32, or f64 for f64 inputs (gradient checks)."""
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x²) + eps)` over the last dimension, the statistic in f32."""
    dtype = x.dtype
    h = x.to(_compute_dtype(x))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' `rotate_half` convention. `x` is `[B, heads, T, head_dim]`;
    `cos` / `sin` are `[T, head_dim]` (each half repeated), already scaled by whatever
    schedule the config names (arbor's table: default, linear, dynamic, llama3, YaRN)."""
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled dot-product attention, `[B, heads, T, d]`; `k` and `v` may have fewer
    heads (grouped-query attention: query head h reads KV head h // (heads / kv_heads))."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def silu_mlp(
    x: torch.Tensor, gate: torch.nn.Linear, up: torch.nn.Linear, down: torch.nn.Linear
) -> torch.Tensor:
    return down(F.silu(gate(x)) * up(x))


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits)[target]` in f32 (f64 for f64 logits): `[B, T, V]`, `[B, T]`."""
    lp = torch.log_softmax(logits.to(_compute_dtype(logits)), dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
