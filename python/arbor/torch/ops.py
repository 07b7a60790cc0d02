"""arbor's forward as torch operations, each a `torch.autograd.Function`.

The forward of each runs arbor's own kernel on the tensors' memory: on CPU tensors the CPU
backend's kernel (`arbor._native`, no copy in or out); on CUDA tensors the CUDA backend's
method a serving rank runs (`arbor._native.CudaOps`: inputs and weights read in place,
the kernels writing into the output tensor torch allocated, ordered with torch's current
stream, the host never waiting for the device). A model
built from these operations computes, value for value, what `arbor score` and `arbor
serve` compute on the same kind of device at any TP size (the CPU's bits and the GPU's
differ from each other). The backward is PyTorch's:
the textbook gradient of the same function, from PyTorch operations. Gradients are not
promised to be invariant; only the forward's values are.

Activations are f32, weights bf16 (an f32 master weight is rounded to bf16, nearest even,
as arbor rounds the weights it is given); a linear rounds its input to bf16. Tensors of
dtype f64 take PyTorch's formula of the same function instead of arbor's kernel: that is
how `torch.autograd.gradcheck` checks the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F

from arbor import _native

Ctx = Any


def _f64(*xs: torch.Tensor) -> bool:
    return any(x.dtype == torch.float64 for x in xs)


def _bf16(w: torch.Tensor) -> torch.Tensor:
    """The bf16 values arbor computes with (a copy only when `w` is not bf16 and
    contiguous already)."""
    return w.to(torch.bfloat16).contiguous()


def _with_bf16(out: torch.Tensor, outb: torch.Tensor) -> torch.Tensor:
    """`out` carrying `outb`, its values rounded to bf16 by the kernel that wrote them
    (the engine's bf16 companion, `CudaAct.bf16`), so that a linear reading `out` next
    takes it instead of converting again. Tied to `out`'s version: an in-place change of
    `out` drops it."""
    out._arbor_bf16 = (outb, out._version)  # type: ignore[attr-defined]
    return out


def _input_bf16(x: torch.Tensor) -> torch.Tensor:
    """`bf16(x)` of an f32 activation: the companion its producer wrote, else a conversion
    (round to nearest even, as arbor rounds: the same bits either way)."""
    held = getattr(x, "_arbor_bf16", None)
    if held is not None:
        outb, version = held
        if version == x._version and outb.shape == x.shape:
            return outb
    return _bf16(x)


def _device_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting for the device: a plain
    `.to("cuda")` of pageable memory synchronises the stream; a pinned one is queued."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _activations(op: str, *xs: torch.Tensor) -> None:
    """arbor's activations are f32: a bf16 one means something cast them (e.g. FSDP2's
    `MixedPrecisionPolicy` with its default `cast_forward_inputs=True`)."""
    for x in xs:
        if x.dtype != torch.float32:
            raise TypeError(
                f"{op}: an activation of dtype {x.dtype}; arbor's activations are float32 "
                "(only parameters are bf16). Under FSDP2 pass "
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)"
            )


_CUDA: dict[int, _native.CudaOps] = {}


def _cuda(x: torch.Tensor) -> tuple[_native.CudaOps, int]:
    """arbor's CUDA backend on `x`'s GPU (made once per GPU) and torch's current stream
    there, which the op is ordered with."""
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _CUDA:
        _CUDA[index] = _native.CudaOps(index)
    return _CUDA[index], torch.cuda.current_stream(x.device).cuda_stream


def _grad_as(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if g is None else g.to(like.dtype)


def _linear_values(x: torch.Tensor, xb: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """arbor's `bf16(x) · bf16(W)ᵀ`, f32 `[M, N]`, for `x` f32 `[M, K]` (`xb` its bf16). On
    CUDA the GEMM writes the output tensor itself."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        # An expert no row was routed to (see `SparseMoeBlock`): nothing to compute.
        return out
    if x.is_cuda:
        cuda, stream = _cuda(x)
        _retry(cuda.tree_linear, x.contiguous(), xb, _bf16(weight), out, stream)
    else:
        _native.tree_linear(xb, _bf16(weight), out)
    return out


def _logprob_values(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """arbor's token log-probs of the rows of `logits` (f32 `[R, V]`, contiguous).

    On CUDA everything stays on the device: the targets go to the row-stats kernel as a
    device tensor and the log-prob is `picked - lse` of its results, subtracted by torch
    (one IEEE subtraction, the bits the host computes from the same two values). The
    targets must be in the vocabulary (`_check_targets`): the kernel gives NaN for one
    that is not, it does not raise."""
    if logits.is_cuda:
        cuda, stream = _cuda(logits)
        rows, vocab = logits.shape
        params = torch.zeros(rows, 3, dtype=torch.int64, device=logits.device)
        params[:, 0] = targets
        stats = torch.empty(rows, 6, dtype=torch.float32, device=logits.device)
        words = torch.empty(rows, 3, dtype=torch.int64, device=logits.device)
        if rows:
            _retry(cuda.row_stats, logits, vocab, params, stats, words, stream)
        return stats[:, 2] - stats[:, 1]
    out = torch.empty(logits.shape[0], dtype=torch.float32)
    _native.token_logprobs(logits, targets.tolist(), out)
    return out


def _check_targets(targets: torch.Tensor, vocab: int) -> None:
    """Raises for a target outside `[0, vocab)` (for CUDA logits: the kernel itself gives
    NaN there, it cannot raise). On CUDA tensors this is one device sync (the check's
    result comes to the host) per call of the op, before its kernels are queued; the
    model's own forward skips it (its targets are its input ids, checked when they came
    in). The CPU kernel checks its targets itself."""
    if targets.numel() == 0:
        return
    bad = (targets < 0) | (targets >= vocab)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        raise _native.InvalidInput(
            f"token_logprobs: target {int(targets[r])} of row {r} is outside the vocabulary "
            f"(size {vocab})"
        )


def _retry(op: Any, *args: Any) -> Any:
    """`op(*args)`, once more after torch's allocator gave its cached blocks back when
    arbor's own allocation found the GPU full (arbor's results are allocated by arbor,
    then copied into torch's tensors)."""
    try:
        return op(*args)
    except _native.ArborError as e:
        if "OUT_OF_MEMORY" not in str(e):
            raise
        torch.cuda.empty_cache()
        return op(*args)


class TreeLinear(torch.autograd.Function):
    """`y = bf16(x) · bf16(W)ᵀ` in f32, each output the sum over K in arbor's tree order (8
    segments, as every TP size cuts K). `x` `[..., K]` f32, `weight` `[N, K]`."""

    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if _f64(x, weight):
            ctx.save_for_backward(x, weight)
            return x @ weight.t()
        _activations("tree_linear", x)
        x2 = x.reshape(-1, x.shape[-1])
        xb = _input_bf16(x).reshape(x2.shape)
        out = _linear_values(x2, xb, weight)
        # The bf16 input is what the backward needs (half the f32 activation's memory).
        ctx.save_for_backward(xb, weight)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        # On a GPU the gradient's products run in bf16 on the tensor cores, as plain bf16
        # training runs them (f32 products there are an order of magnitude slower); on the
        # CPU in f32.
        mm = torch.bfloat16 if grad.is_cuda else grad.dtype
        g = g.to(mm)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            w = weight if weight.dtype == torch.float64 else _bf16(weight)
            gx = (g @ w.to(mm)).to(grad.dtype).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            gw = (g.t() @ x.reshape(-1, x.shape[-1]).to(mm)).to(weight.dtype)
        return gx, gw


class RMSNorm(torch.autograd.Function):
    """`y = x / sqrt(mean(x²) + eps) · bf16(weight)` over the last dimension, f32."""

    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        if _f64(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
        _activations("rms_norm", x)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(x2)
        if x.is_cuda:
            cuda, stream = _cuda(x)
            outb = torch.empty(out.shape, dtype=torch.bfloat16, device=x.device)
            _retry(cuda.rms_norm, x2, _bf16(weight).float(), eps, out, stream, outb)
            return _with_bf16(out.view(x.shape), outb.view(x.shape))
        else:
            _native.rms_norm(x2, _bf16(weight).float(), eps, out)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dt = torch.promote_types(grad.dtype, x.dtype)
        x, g = x.to(dt), grad.to(dt)
        w = weight.to(dt) if dt == torch.float64 else _bf16(weight).to(dt)
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)
        gw_x = g * w
        gx = inv * (gw_x - x * inv.pow(2) * (gw_x * x).mean(-1, keepdim=True))
        gweight = (g * x * inv).reshape(-1, x.shape[-1]).sum(0)
        return gx.to(grad.dtype), _grad_as(gweight, weight), None


class SiluMul(torch.autograd.Function):
    """`y = silu(gate) · up`, `silu(g) = g / (1 + exp(-g))`, f32."""

    @staticmethod
    def forward(ctx: Ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if _f64(gate, up):
            ctx.save_for_backward(gate, up)
            return F.silu(gate) * up
        # On a GPU the backward reads bf16 copies, as much memory as plain bf16 training
        # keeps for it (its gradient is PyTorch's, not promised to be invariant).
        keep = (lambda t: t.to(torch.bfloat16)) if gate.is_cuda else (lambda t: t)
        ctx.save_for_backward(keep(gate), keep(up))
        _activations("silu_mul", gate, up)
        g2 = gate.reshape(-1, gate.shape[-1]).contiguous()
        out = torch.empty_like(g2)
        u2 = up.reshape(g2.shape).contiguous()
        if g2.numel() == 0:
            return out.view(gate.shape)
        if gate.is_cuda:
            cuda, stream = _cuda(gate)
            _retry(cuda.silu_mul, g2, u2, out, stream)
        else:
            _native.silu_mul(g2, u2, out)
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up = (t.to(grad.dtype) for t in ctx.saved_tensors)
        s = torch.sigmoid(gate)
        gg = grad * up * s * (1 + gate * (1 - s))
        gu = grad * gate * s
        return gg, gu


def _gate_up_weight(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The engine's gate/up weight: rows alternating gate and up, bf16 (a copy)."""
    return torch.stack((_bf16(gate), _bf16(up)), dim=1).reshape(-1, gate.shape[1])


class FusedLinear(torch.autograd.Function):
    """Several linears of one input as one GEMM: `bf16(x) · bf16(W)ᵀ` for `W` the weights'
    rows one after another (q|k|v, the engine's fused attention input). The tree GEMM's
    output element depends on its X row and W row alone, so each column holds the bits its
    own linear gives; the weights are concatenated (a copy of them) per forward, the
    parameters stay separate. The backward is the linears' (one GEMM for the input's
    gradient over the concatenated weight, one for the weights')."""

    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.widths = [w.shape[0] for w in weights]
        if _f64(x, *weights):
            ctx.save_for_backward(x, *weights)
            return torch.cat([x @ w.t() for w in weights], dim=1)
        _activations("tree_linear", x)
        xb = _input_bf16(x)
        out = _linear_values(x, xb, torch.cat([_bf16(w) for w in weights]))
        ctx.save_for_backward(xb, *weights)
        return out

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        f64 = grad.dtype == torch.float64
        mm = torch.bfloat16 if grad.is_cuda else grad.dtype
        g = grad.to(mm)
        gx = None
        if ctx.needs_input_grad[0]:
            w = torch.cat([w if f64 else _bf16(w) for w in weights]).to(mm)
            gx = (g @ w).to(grad.dtype)
        gws: list[torch.Tensor | None] = [None] * len(weights)
        if any(ctx.needs_input_grad[1:]):
            parts = (g.t() @ x.to(mm)).split(ctx.widths)
            gws = [
                gw.to(w.dtype) if ctx.needs_input_grad[1 + i] else None
                for i, (gw, w) in enumerate(zip(parts, weights, strict=True))
            ]
        return gx, *gws


def fused_linear(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """[`FusedLinear`]: the linears of `x` by `weights` as one GEMM, f32 `[M, ΣN]`."""
    return FusedLinear.apply(x, *weights)


def _silu_mul_grads(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `silu(gate)·up` by gate and by up, in `grad`'s dtype (PyTorch's
    own SiLU backward kernel)."""
    gg = torch.ops.aten.silu_backward(grad * up, gate)
    return gg, grad * F.silu(gate)


class GateUpSilu(torch.autograd.Function):
    """`silu(bf16(x)·bf16(Wg)ᵀ) · (bf16(x)·bf16(Wu)ᵀ)`: the MLP's first half as the engine
    runs it, one GEMM over the interleaved gate/up weight, then the paired SiLU·mul kernel;
    the bits of `silu_mul(tree_linear(x, Wg), tree_linear(x, Wu))`. What the backward keeps
    is `bf16(x)` and the gate/up values in bf16 (as plain bf16 training keeps them); on a
    GPU its element-wise work runs in bf16 and its products on the tensor cores, and the
    gradients by gate and by up go to their own GEMMs (no interleaved `[M, 2I]` gradient)."""

    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if _f64(x, gate, up):
            g, u = x @ gate.t(), x @ up.t()
            ctx.save_for_backward(x, gate, up, g, u)
            return F.silu(g) * u
        _activations("tree_linear", x)
        xb = _input_bf16(x)
        gu = _linear_values(x, xb, _gate_up_weight(gate, up))
        rows, c = gu.shape[0], gu.shape[1] // 2
        out = torch.empty(rows, c, dtype=torch.float32, device=gu.device)
        if gu.is_cuda:
            gub = gu.to(torch.bfloat16)
            ctx.save_for_backward(xb, gate, up, gub[:, 0::2], gub[:, 1::2])
            outb = torch.empty(rows, c, dtype=torch.bfloat16, device=gu.device)
            if out.numel():
                cuda, stream = _cuda(gu)
                _retry(cuda.silu_mul_pairs, gu, out, outb, stream)
            return _with_bf16(out, outb)
        g, u = gu[:, 0::2].contiguous(), gu[:, 1::2].contiguous()
        ctx.save_for_backward(xb, gate, up, g, u)
        if out.numel():
            _native.silu_mul(g, u, out)
        return out

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, gate, up, g, u = ctx.saved_tensors
        f64 = grad.dtype == torch.float64
        mm = torch.bfloat16 if grad.is_cuda else grad.dtype
        gg, gu = _silu_mul_grads(grad.to(mm), g.to(mm), u.to(mm))
        gx = None
        if ctx.needs_input_grad[0]:
            wg = gate if f64 else _bf16(gate)
            wu = up if f64 else _bf16(up)
            gx = (gg @ wg.to(mm)).to(grad.dtype) + (gu @ wu.to(mm)).to(grad.dtype)
        xm = x.to(mm)
        ggate = (gg.t() @ xm).to(gate.dtype) if ctx.needs_input_grad[1] else None
        gup = (gu.t() @ xm).to(up.dtype) if ctx.needs_input_grad[2] else None
        return gx, ggate, gup


def gate_up_silu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[`GateUpSilu`]. With no gradient wanted, on CUDA, the GEMM's own SiLU·mul epilogue
    (no `[M, 2I]` intermediate): the same bits."""
    wants_grad = torch.is_grad_enabled() and (
        x.requires_grad or gate.requires_grad or up.requires_grad
    )
    if x.is_cuda and not wants_grad and not _f64(x, gate, up) and x.numel():
        _activations("tree_linear", x)
        x = x.contiguous()
        rows, c = x.shape[0], gate.shape[0]
        out = torch.empty(rows, c, dtype=torch.float32, device=x.device)
        outb = torch.empty(rows, c, dtype=torch.bfloat16, device=x.device)
        if out.numel():
            cuda, stream = _cuda(x)
            _retry(
                cuda.tree_linear_silu,
                x,
                _input_bf16(x),
                _gate_up_weight(gate, up),
                out,
                outb,
                stream,
            )
        return _with_bf16(out, outb)
    return GateUpSilu.apply(x, gate, up)


def _top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The `top_k` largest logits of each row (the most probable experts), ties to the
    lower index, in increasing index: the engine's choice, in PyTorch (f64 tensors)."""
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return order.sort(dim=-1).values


def _route_weights(logits: torch.Tensor, experts: torch.Tensor, norm: bool) -> torch.Tensor:
    """The chosen experts' softmax probabilities, renormalised to sum to 1 where `norm`."""
    p = torch.softmax(logits, dim=-1).gather(1, experts)
    return p / p.sum(-1, keepdim=True) if norm else p


class MoeRoute(torch.autograd.Function):
    """A token's experts and their weights from its router logits `[R, E]`: the f32
    softmax, the `top_k` most probable (ties to the lower index), their probabilities
    renormalised where `norm`. Returns `(weights [R, k], experts [R, k])`, each row's
    experts in increasing index. The choice is the engine's own routing: with `on_device`
    (CUDA logits) its device kernel, run on the logits where they are (the engine's
    default on a GPU; the GPU's `exp` is not the host's, so the weights' last bits may
    differ from the host routing's); otherwise its host function (the logits of CUDA
    tensors come to the CPU, the result goes back). The choice has no gradient. The
    weights' gradient is the softmax's (and the renormalisation's), as transformers' MoE
    blocks have it."""

    @staticmethod
    def forward(
        ctx: Ctx, logits: torch.Tensor, top_k: int, norm: bool, on_device: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, n = logits.shape
        if not 1 <= top_k <= n:
            raise ValueError(f"moe_route: top_k {top_k} for {n} experts")
        if _f64(logits):
            experts = _top_k(logits, top_k)
            weights = _route_weights(logits, experts, norm)
        elif on_device:
            if not logits.is_cuda:
                raise ValueError("moe_route: on_device routing needs CUDA logits")
            _activations("moe_route", logits)
            weights = torch.empty(rows, top_k, dtype=torch.float32, device=logits.device)
            ids = torch.empty(rows, top_k, dtype=torch.int32, device=logits.device)
            if rows:
                cuda, stream = _cuda(logits)
                _retry(
                    cuda.moe_route, logits.detach().contiguous(), top_k, norm, weights, ids, stream
                )
            experts = ids.to(torch.int64)
        else:
            _activations("moe_route", logits)
            host = logits.detach().to("cpu").contiguous()
            weights = torch.empty(rows, top_k, dtype=torch.float32)
            raw = _native.moe_route(host, top_k, norm, weights)
            experts = torch.frombuffer(raw, dtype=torch.int64) if raw else torch.empty(0)
            experts = experts.to(torch.int64).view(rows, top_k)
            weights = weights.to(logits.device)
            experts = experts.to(logits.device)
        ctx.norm = norm
        ctx.save_for_backward(logits, experts)
        ctx.mark_non_differentiable(experts)
        return weights, experts

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, experts = ctx.saved_tensors
        dt = torch.promote_types(grad.dtype, logits.dtype)
        p = torch.softmax(logits.to(dt), dim=-1)
        chosen = p.gather(1, experts)
        g = grad.to(dt)
        if ctx.norm:
            total = chosen.sum(-1, keepdim=True)
            g = (g - (g * chosen).sum(-1, keepdim=True) / total) / total
        gp = torch.zeros_like(p).scatter_(1, experts, g)
        gl = p * (gp - (gp * p).sum(-1, keepdim=True))
        return gl.to(logits.dtype), None, None, None


def moe_combine(weights: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """A row's output: `Σ_j weights[:, j] · outputs[:, j]` over its k experts `[R, k, H]`
    (slot j the j-th lowest expert index), added in slot order from +0, one multiply and
    one add per term: the engine's order (docs/invariance.md, "Mixture of experts").
    PyTorch's element-wise multiply and add are one IEEE operation each, on the CPU and
    the GPU, so these are the engine's bits; autograd differentiates them."""
    out = outputs.new_zeros(outputs.shape[0], outputs.shape[2])
    for j in range(outputs.shape[1]):
        out = out + weights[:, j : j + 1] * outputs[:, j]
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int) -> torch.Tensor:
    """RoPE in PyTorch: per head, `(a, b) -> (a·cos - b·sin, b·cos + a·sin)` over its two
    halves; `cos`, `sin` `[rows, head_dim/2]`."""
    rows = x.shape[0]
    h = x.view(rows, n_heads, -1)
    half = h.shape[-1] // 2
    a, b = h[..., :half], h[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).reshape(x.shape)


# arbor's RoPE table on a device, per (spec, device): (spec, positions, cos, sin). The
# spec is held so that its id is not reused while the entry lives.
_RopeEntry = tuple[_native.ModelSpec, int, torch.Tensor, torch.Tensor]
_ROPE: dict[tuple[int, torch.device], _RopeEntry] = {}


def _rope_table(
    spec: _native.ModelSpec, n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """arbor's RoPE table of positions `0..n` (at least) on `device`, `[n', head_dim/2]`
    each: made and uploaded once, again only when a longer sequence comes."""
    key = (id(spec), device)
    held = _ROPE.get(key)
    if held is None or held[1] < n:
        # Grow by doubling, as the spec's own table does, so a run of rising lengths
        # uploads a few times only.
        size = max(n, 2 * held[1]) if held is not None else n
        size = min(size, max(n, int(spec.config["max_position_embeddings"])))
        cos, sin = spec.rope_table(size)
        half = len(cos) // (4 * size) if size else 0
        cos_t, sin_t = (
            _device_copy(torch.frombuffer(t, dtype=torch.float32).view(size, half), device)
            for t in (cos, sin)
        )
        held = (spec, size, cos_t, sin_t)
        _ROPE[key] = held
    return held[2], held[3]


class Positions:
    """Packed sequences (`cu_seqlens`: each one's first row, then the row count), each
    starting at position 0, with arbor's RoPE table for them (`spec`: the checkpoint's
    `arbor._native.ModelSpec`). The table lives on the device once; the rows' positions
    go up pinned, so making one queues work without waiting for the device."""

    def __init__(
        self, cu_seqlens: Sequence[int], spec: _native.ModelSpec, device: torch.device
    ) -> None:
        self.cu_seqlens = [int(c) for c in cu_seqlens]
        self.spec = spec
        pos = [p for s, e in pairwise(self.cu_seqlens) for p in range(e - s)]
        n = max(pos, default=0) + 1
        cos, sin = _rope_table(spec, n, device)
        index = _device_copy(torch.tensor(pos, dtype=torch.long), device)
        self.cos, self.sin = cos[index], sin[index]
        self.positions = pos


class RopeAttention(torch.autograd.Function):
    """RoPE on `q` and `k`, then causal attention of the packed sequences with arbor's
    key-block order, reading keys and values rounded to bf16 as arbor's KV cache holds
    them: a layer's attention as a serving rank's prefill step computes it. `q`
    `[T, n_heads·d]`, `k`, `v` `[T, n_kv_heads·d]`, f32; query head h reads KV head
    `h // (n_heads / n_kv_heads)`. On CUDA, `fused` takes the engine's one-pass kernel
    (models without q/k norms), as the engine does."""

    @staticmethod
    def forward(
        ctx: Ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        at: Positions,
        n_heads: int,
        n_kv_heads: int,
        fused: bool,
    ) -> torch.Tensor:
        ctx.at, ctx.heads = at, (n_heads, n_kv_heads)
        if q.is_cuda:
            # bf16 copies for the backward, which runs flash attention in bf16 on a GPU.
            ctx.save_for_backward(*(t.to(torch.bfloat16) for t in (q, k, v)))
        else:
            ctx.save_for_backward(q, k, v)
        if _f64(q, k, v):
            with torch.no_grad():
                qr = _rotate(q, at.cos.to(q.dtype), at.sin.to(q.dtype), n_heads)
                kr = _rotate(k, at.cos.to(k.dtype), at.sin.to(k.dtype), n_kv_heads)
                return _sdpa_packed(qr, kr, v, at.cu_seqlens, n_heads, n_kv_heads)
        _activations("rope_attention", q, k, v)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if q.is_cuda:
            inputs = (torch.cat((q, k, v), dim=1), None, None, None) if fused else (None, q, k, v)
            return _cuda_attention(inputs, at, n_heads, n_kv_heads, q.shape)
        out = torch.empty_like(q)
        qr, kr = q.clone(), k.clone()
        at.spec.rope(qr, at.positions, n_heads)
        at.spec.rope(kr, at.positions, n_kv_heads)
        _native.attention(qr, kr, v, at.cu_seqlens, n_heads, n_kv_heads, q.shape[1] // n_heads, out)
        return out

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        gq, gk, gv = _attention_grads(q, k, v, ctx.at, *ctx.heads, grad)
        return gq, gk, gv, None, None, None, None


def _cuda_attention(
    inputs: tuple[torch.Tensor | None, ...],
    at: Positions,
    n_heads: int,
    n_kv_heads: int,
    shape: Sequence[int],
) -> torch.Tensor:
    """`CudaOps.rope_attention` of `inputs` (`(qkv, None, None, None)` or `(None, q, k,
    v)`) into a new f32 output of `shape` with its bf16 companion."""
    like = next(t for t in inputs if t is not None)
    out = torch.empty(*shape, dtype=torch.float32, device=like.device)
    outb = torch.empty(out.shape, dtype=torch.bfloat16, device=like.device)
    cuda, stream = _cuda(like)
    _retry(
        cuda.rope_attention,
        at.spec,
        *inputs,
        at.cu_seqlens,
        n_heads,
        n_kv_heads,
        out,
        stream,
        outb,
    )
    return _with_bf16(out, outb)


class RopeAttentionQKV(torch.autograd.Function):
    """`RopeAttention` with q, k and v side by side in one tensor `qkv` `[T, (n_heads +
    2·n_kv_heads)·d]` (what `fused_linear` of the three projections gives): on CUDA the
    engine's one-pass kernel reads it as it is (models without q/k norms)."""

    @staticmethod
    def forward(
        ctx: Ctx, qkv: torch.Tensor, at: Positions, n_heads: int, n_kv_heads: int
    ) -> torch.Tensor:
        ctx.at, ctx.heads = at, (n_heads, n_kv_heads)
        d = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
        ctx.widths = [n_heads * d, n_kv_heads * d, n_kv_heads * d]
        if not qkv.is_cuda or _f64(qkv):
            q, k, v = qkv.split(ctx.widths, dim=1)
            if qkv.is_cuda:
                ctx.save_for_backward(qkv.to(torch.bfloat16))
            else:
                ctx.save_for_backward(qkv)
            with torch.no_grad():
                return RopeAttention.forward(_NoCtx(), q, k, v, at, n_heads, n_kv_heads, False)
        _activations("rope_attention", qkv)
        qkv = qkv.contiguous()
        # bf16 for the backward, which runs flash attention in bf16 on a GPU.
        ctx.save_for_backward(qkv.to(torch.bfloat16))
        inputs = (qkv, None, None, None)
        return _cuda_attention(inputs, at, n_heads, n_kv_heads, (qkv.shape[0], ctx.widths[0]))

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (qkv,) = ctx.saved_tensors
        q, k, v = qkv.split(ctx.widths, dim=1)
        grads = _attention_grads(q, k, v, ctx.at, *ctx.heads, grad)
        return torch.cat(grads, dim=1), None, None, None


class _NoCtx:
    """A stand-in context for calling another Function's forward from inside one (its
    saved tensors are dropped; the caller saves its own)."""

    def save_for_backward(self, *_: torch.Tensor) -> None:
        pass


def _attention_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    at: Positions,
    n_heads: int,
    n_kv_heads: int,
    grad: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `RopeAttention` with respect to q, k and v (as saved by its
    forward: bf16 on a GPU)."""
    dt = torch.bfloat16 if grad.is_cuda else grad.dtype
    cos, sin = at.cos.to(dt), at.sin.to(dt)
    with torch.enable_grad():
        q_, k_, v_ = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        qr = _rotate(q_, cos, sin, n_heads)
        kr = _rotate(k_, cos, sin, n_kv_heads)
        if dt == torch.float32:
            # The keys and values the forward read (the rounding's gradient is the identity).
            kr = kr + (kr.to(torch.bfloat16).to(dt) - kr).detach()
            v2 = v_ + (v_.to(torch.bfloat16).to(dt) - v_).detach()
        else:
            v2 = v_
        out = _sdpa_packed(qr, kr, v2, at.cu_seqlens, n_heads, n_kv_heads)
        gq, gk, gv = torch.autograd.grad(out, (q_, k_, v_), grad.to(dt))
    f = grad.dtype
    return gq.to(f), gk.to(f), gv.to(f)


def _sdpa_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Sequence[int],
    n_heads: int,
    n_kv_heads: int,
) -> torch.Tensor:
    """PyTorch's causal SDPA of the packed sequences (the backward's function), in one
    call: the sequences padded to the longest, each query row masked to its own
    sequence's keys up to its position."""
    lens = [e - s for s, e in pairwise(cu_seqlens) if e > s]
    if not lens:
        return q.new_zeros(q.shape)
    d = q.shape[1] // n_heads
    if q.is_cuda:
        # One causal call per sequence: flash attention's kernels, no mask in memory.
        outs = []
        for s, e in pairwise(cu_seqlens):
            if e == s:
                continue
            qs, ks, vs = (t[s:e].view(e - s, -1, d).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(e - s, n_heads * d))
        return torch.cat(outs)
    n, longest = len(lens), max(lens)
    # Packed row -> its padded slot (sequence i, position p) = i·longest + p.
    slot = torch.cat([torch.arange(m) + i * longest for i, m in enumerate(lens)])

    def pad(x: torch.Tensor, heads: int) -> torch.Tensor:
        padded = x.new_zeros(n * longest, x.shape[1]).index_copy(0, slot, x)
        return padded.view(n, longest, heads, d).transpose(1, 2)

    groups = n_heads // n_kv_heads
    qp = pad(q, n_heads)
    kp = pad(k, n_kv_heads).repeat_interleave(groups, dim=1)
    vp = pad(v, n_kv_heads).repeat_interleave(groups, dim=1)
    pos = torch.arange(longest)
    causal = pos.unsqueeze(1) >= pos.unsqueeze(0)
    real_key = pos.unsqueeze(0) < torch.tensor(lens).unsqueeze(1)  # [n, keys]
    mask = causal.unsqueeze(0) & real_key.unsqueeze(1)  # [n, queries, keys]
    o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask.unsqueeze(1))
    return o.transpose(1, 2).reshape(n * longest, n_heads * d)[slot]


class HeadLogprobs(torch.autograd.Function):
    """The LM head and the token log-probs in one: `log_softmax(bf16(x) · bf16(W)ᵀ)[t]` per
    row, arbor's values. The logits never exist whole: rows go through in chunks of at
    most `HEAD_CHUNK_BYTES` of f32 logits, and the backward recomputes each chunk's (with
    PyTorch's matmul), so what is kept for it is `x` in bf16, not `[R, V]` logits."""

    @staticmethod
    def forward(
        ctx: Ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, checked: bool
    ) -> torch.Tensor:
        if _f64(x, weight):
            ctx.save_for_backward(x, weight, targets)
            lp = torch.log_softmax(x @ weight.t(), -1)
            return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        _activations("head_logprobs", x)
        if x.is_cuda and not checked:
            _check_targets(targets, weight.shape[0])
        xb = _input_bf16(x)
        out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for r in _chunks(x.shape[0], weight.shape[0]):
            logits = _linear_values(x[r], xb[r], weight)
            out[r] = _logprob_values(logits, targets[r])
            del logits
        ctx.save_for_backward(xb, weight, targets)
        return out

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, targets = ctx.saved_tensors
        if grad.is_cuda:
            return (*_head_grads_cuda(x, weight, targets, grad), None, None)
        f64 = weight.dtype == torch.float64
        gx = torch.empty(x.shape, dtype=grad.dtype, device=x.device)
        gw = torch.zeros(weight.shape, dtype=grad.dtype, device=weight.device)
        w = weight if f64 else _bf16(weight).to(grad.dtype)
        for r in _chunks(x.shape[0], weight.shape[0]):
            g = _logprob_grad(x[r].to(grad.dtype) @ w.t(), targets[r], grad[r])
            gx[r] = g @ w
            gw += g.t() @ x[r].to(grad.dtype)
        return gx, gw.to(weight.dtype), None, None


def _head_grads_cuda(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`HeadLogprobs`' gradients on a GPU, as plain bf16 training computes them: each
    chunk's logits recomputed in bf16, the softmax in f32, the logits' gradient kept in
    bf16 for all rows (half the f32 logits plain PyTorch keeps) so that the weight's
    gradient is one GEMM, not an f32 sum over the chunks."""
    wb = _bf16(weight)
    gx = torch.empty(x.shape, dtype=grad.dtype, device=x.device)
    gl = torch.empty(x.shape[0], wb.shape[0], dtype=torch.bfloat16, device=x.device)
    for r in _chunks(x.shape[0], weight.shape[0]):
        p = torch.softmax(x[r] @ wb.t(), -1, dtype=torch.float32)
        gl[r] = _logprob_grad_from_softmax(p, targets[r], grad[r])
        del p
        gx[r] = (gl[r] @ wb).to(grad.dtype)
    return gx, (gl.t() @ x).to(weight.dtype)


# f32 logits a chunk of `HeadLogprobs` holds at once.
HEAD_CHUNK_BYTES = 1 << 30


def _chunks(rows: int, vocab: int) -> list[slice]:
    step = max(1, HEAD_CHUNK_BYTES // (4 * max(vocab, 1)))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def _logprob_grad(logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of `log_softmax(logits)[targets]` weighted by `grad`, per row:
    `grad · (onehot(target) - softmax(logits))`."""
    return _logprob_grad_from_softmax(torch.softmax(logits, -1), targets, grad)


def _logprob_grad_from_softmax(
    p: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """[`_logprob_grad`] given the rows' softmax `p`, which it overwrites."""
    p.mul_(-grad.unsqueeze(-1))
    return p.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1))


class TokenLogprobs(torch.autograd.Function):
    """`log_softmax(logits[r])[targets[r]]` per row as arbor computes a token's log-prob
    (`row[t] - logsumexp(row)`, the exponentials summed in index order). `logits` `[R, V]`
    f32, `targets` `[R]` integers; f32 `[R]`."""

    @staticmethod
    def forward(ctx: Ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        if _f64(logits):
            return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        _activations("token_logprobs", logits)
        if logits.is_cuda:
            _check_targets(targets, logits.shape[1])
        return _logprob_values(logits.contiguous(), targets)

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, targets = ctx.saved_tensors
        return _logprob_grad(logits.to(grad.dtype), targets, grad), None


def tree_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """A linear layer with arbor's bits; a bias (rounded to bf16) is added in f32 after the
    sum, as arbor adds it."""
    y = TreeLinear.apply(x, weight)
    return y if bias is None else y + _bias(bias, y)


def _bias(b: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return b if like.dtype == torch.float64 else b.to(torch.bfloat16).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNorm.apply(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SiluMul.apply(gate, up)


def rope_attention_qkv(
    qkv: torch.Tensor, at: Positions, n_heads: int, n_kv_heads: int
) -> torch.Tensor:
    return RopeAttentionQKV.apply(qkv, at, n_heads, n_kv_heads)


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    at: Positions,
    n_heads: int,
    n_kv_heads: int,
    fused: bool = True,
) -> torch.Tensor:
    return RopeAttention.apply(q, k, v, at, n_heads, n_kv_heads, fused)


def head_logprobs(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, checked: bool = False
) -> torch.Tensor:
    """`HeadLogprobs`. `checked`: the caller vouches that every target is in the
    vocabulary (skips `_check_targets`, the one host sync of the op on CUDA)."""
    return HeadLogprobs.apply(x, weight, targets, checked)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return TokenLogprobs.apply(logits, targets)


def moe_route(
    logits: torch.Tensor, top_k: int, norm: bool, on_device: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return MoeRoute.apply(logits, top_k, norm, on_device)


def moe_routes_on_device(
    x: torch.Tensor, hidden: int, inter: int, experts: int, top_k: int
) -> bool:
    """Whether the engine runs this MoE block on the device for activations like `x`: on
    CUDA, where its backend has the tensor GEMM and `ARBOR_MOE` is unset or `device`
    (`model/src/backend/cuda/moe.rs`); there it routes with its device kernel
    (`moe_route(..., on_device=True)` runs the same) and its grouped expert GEMM, whose
    bits the GPU tests find equal to the dense tree GEMM's. Otherwise it routes on the
    host."""
    if not x.is_cuda or _f64(x):
        return False
    cuda, _ = _cuda(x)
    return bool(cuda.moe_routes_on_device(hidden, inter, experts, top_k))


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the bf16 table, as f32 (exact: bf16 widens to f32 without rounding)."""
    e = F.embedding(ids, weight)
    return e if weight.dtype == torch.float64 else e.to(torch.bfloat16).float()
