"""The plain PyTorch forward of a `CausalLM`'s parameters, written as transformers writes
Llama, Qwen and their mixture-of-experts blocks (bf16 activations, `nn.functional.linear`,
SDPA): what a trainer computes without arbor. It is the yardstick of the tests (the gap
arbor's forward removes, the gradients it should be close to) and of
`scripts/bench/torch_forward.py`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from arbor.torch.model import CausalLM, MixtralExpert, SparseMoeBlock


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w.to(dtype) * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _moe(block: SparseMoeBlock, x: torch.Tensor, lin: Callable[..., torch.Tensor]) -> torch.Tensor:
    """transformers' sparse MoE block (`Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`):
    the f32 softmax of the router's logits, `torch.topk`, the renormalisation, and each
    expert's weighted output scattered back with `index_add_`."""
    shape = x.shape
    h = x.reshape(-1, shape[-1])
    logits = lin(block.gate, h)
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(h.dtype, torch.float32))
    weights, chosen = torch.topk(probs, block.top_k, dim=-1)
    if block.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(h.dtype)
    out = torch.zeros_like(h)
    for e, expert in enumerate(block.experts):
        token, slot = torch.where(chosen == e)
        if token.numel() == 0:
            continue
        if isinstance(expert, MixtralExpert):
            gate, up, down = expert.w1, expert.w3, expert.w2
        else:
            gate, up, down = expert.gate_proj, expert.up_proj, expert.down_proj
        xe = h[token]
        y = lin(down, F.silu(lin(gate, xe)) * lin(up, xe))
        out.index_add_(0, token, y * weights[token, slot, None])
    return out.view(shape)


def token_logprobs(
    model: CausalLM, input_ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """`log p(ids[:, t+1] | ids[:, :t+1])` `[B, T-1]` (f32; f64 when `dtype` is f64) of the
    plain forward with parameters and activations in `dtype`, arbor's RoPE table."""
    c = model.config
    b, t = input_ids.shape
    cos_raw, sin_raw = model._spec().rope_table(max(t, 1))
    half = c.head_dim // 2
    cos = torch.frombuffer(cos_raw, dtype=torch.float32).view(-1, half)[:t]
    sin = torch.frombuffer(sin_raw, dtype=torch.float32).view(-1, half)[:t]
    cos = torch.cat((cos, cos), -1).to(device=input_ids.device, dtype=dtype)
    sin = torch.cat((sin, sin), -1).to(device=input_ids.device, dtype=dtype)

    def lin(m: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if m.bias is None else m.bias.to(dtype)
        return F.linear(x, m.weight.to(dtype), bias)

    x = F.embedding(input_ids, model.model.embed_tokens.weight).to(dtype)
    groups = c.num_heads // c.num_kv_heads
    for layer in model.model.layers:
        a = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight, c.rms_norm_eps)
        q = lin(a.q_proj, h).view(b, t, c.num_heads, c.head_dim)
        k = lin(a.k_proj, h).view(b, t, c.num_kv_heads, c.head_dim)
        v = lin(a.v_proj, h).view(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = _rms(q, a.q_norm.weight, c.rms_norm_eps)
            k = _rms(k, a.k_norm.weight, c.rms_norm_eps)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + lin(a.o_proj, o.transpose(1, 2).reshape(b, t, c.q_dim))
        h = _rms(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
        m = getattr(layer, layer.feed_forward)
        if isinstance(m, SparseMoeBlock):
            x = x + _moe(m, h, lin)
        else:
            x = x + lin(m.down_proj, F.silu(lin(m.gate_proj, h)) * lin(m.up_proj, h))
    x = _rms(x, model.model.norm.weight, c.rms_norm_eps)
    logits = lin(model.lm_head, x).to(torch.promote_types(dtype, torch.float32))
    lp = torch.log_softmax(logits[:, :-1], dim=-1)
    return lp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
