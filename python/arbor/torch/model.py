"""`CausalLM`: a Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral model as a
`torch.nn.Module` whose forward is arbor's, operation by operation (`arbor.torch.ops`).

The parameters carry transformers' names (`model.layers.0.self_attn.q_proj.weight`, ...),
so `state_dict()` is what an HF checkpoint holds and what `arbor serve`'s
`/update_weights_from_tensor` takes. Every operation of the forward runs arbor's kernel on
the parameters and activations in place, so the logits and log-probs are the values
`arbor score` and `arbor serve` compute for the same weights, at any TP size and batch;
the gradient is the backward of that same forward.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import torch
from torch import nn

from arbor import _native
from arbor.torch import ops
from arbor.torch.config import ArchConfig


class Linear(nn.Linear):
    """`nn.Linear`'s parameters (and names), arbor's tree-ordered product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.tree_linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = Linear(c.hidden_size, c.q_dim, bias=c.qkv_bias)
        self.k_proj = Linear(c.hidden_size, c.kv_dim, bias=c.qkv_bias)
        self.v_proj = Linear(c.hidden_size, c.kv_dim, bias=c.qkv_bias)
        self.o_proj = Linear(c.q_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, at: ops.Positions) -> torch.Tensor:
        c = self.c
        rows = x.shape[0]
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not c.qk_norm:
            # The engine's path: q, k and v by one GEMM over the three weights (each
            # column the bits of its own linear), read side by side by the one-pass
            # RoPE + KV + attention kernel.
            qkv = ops.fused_linear(x, [p.weight for p in projs])
            if c.qkv_bias:
                bias = torch.cat([p.bias for p in projs])  # type: ignore[misc]
                qkv = qkv + ops._bias(bias, qkv)
            a = ops.rope_attention_qkv(qkv, at, c.num_heads, c.num_kv_heads)
            return self.o_proj(a)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if c.qk_norm:
            # Per head: rows of head_dim.
            q = self.q_norm(q.view(rows * c.num_heads, c.head_dim)).view(rows, c.q_dim)
            k = self.k_norm(k.view(rows * c.num_kv_heads, c.head_dim)).view(rows, c.kv_dim)
        # The engine rotates and caches q/k/v in one pass unless q/k norms come between.
        a = ops.rope_attention(q, k, v, at, c.num_heads, c.num_kv_heads, fused=not c.qk_norm)
        return self.o_proj(a)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj.bias is None and self.up_proj.bias is None and x.dim() == 2:
            # The engine's path: one GEMM over the interleaved gate/up weight.
            return self.down_proj(ops.gate_up_silu(x, self.gate_proj.weight, self.up_proj.weight))
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class MixtralExpert(nn.Module):
    """One Mixtral expert under its checkpoint's names: `w1` the gate, `w3` the up and
    `w2` the down projection."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = Linear(hidden, intermediate, bias=False)
        self.w2 = Linear(intermediate, hidden, bias=False)
        self.w3 = Linear(hidden, intermediate, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.w2(ops.gate_up_silu(x, self.w1.weight, self.w3.weight))
        return self.w2(ops.silu_mul(self.w1(x), self.w3(x)))


class SparseMoeBlock(nn.Module):
    """A mixture-of-experts MLP with the checkpoint's names (`gate.weight`, the router;
    `experts.N.…`) and the engine's bits (model/src/layers/moe.rs): the router's logits
    through the tree GEMM in f32, the engine's own routing (`ops.moe_route`: on CUDA
    tensors its device kernel where the engine routes on the device), each expert
    the dense MLP on the rows routed to it (in row order), and each row's k weighted
    outputs added in expert-index order (`ops.moe_combine`)."""

    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        m = c.moe
        if m is None:
            raise ValueError(f"{c.arch_name} has no experts")
        self.top_k = m.top_k
        self.norm_topk_prob = m.norm_topk_prob
        self.hidden = c.hidden_size
        self.inter = m.expert_intermediate
        self.gate = Linear(c.hidden_size, m.num_experts, bias=False)
        expert: Callable[[], nn.Module] = (
            (lambda: MixtralExpert(c.hidden_size, m.expert_intermediate))
            if c.arch == "mixtral"
            else (lambda: MLP(c.hidden_size, m.expert_intermediate))
        )
        self.experts = nn.ModuleList(expert() for _ in range(m.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape[0], self.top_k
        # Where the engine routes such a block (on a GPU: its device kernel, unless
        # ARBOR_MOE=host), so that the weights have its bits.
        on_device = ops.moe_routes_on_device(x, self.hidden, self.inter, len(self.experts), k)
        weights, experts = ops.moe_route(self.gate(x), k, self.norm_topk_prob, on_device)
        # Which (row, slot) pairs each expert serves, in row order; the grouping is made
        # on the host (the routes are there already on CUDA tensors' path).
        flat = experts.reshape(-1).cpu()
        pairs: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        # Every expert runs, one no row was routed to on no rows: each parameter is then
        # in the graph and gets a gradient (zeros), as DDP and FSDP expect of a module.
        for e, expert in enumerate(self.experts):
            at = (flat == e).nonzero().squeeze(1)
            pairs.append(at)
            outs.append(expert(x[(at // k).to(x.device)]))
        order = torch.cat(pairs)
        # Back to (row, slot) order: the outputs of pair `order[i]` are at `i`.
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        y = torch.cat(outs)[back.to(x.device)].view(rows, k, -1)
        return ops.moe_combine(weights.to(y.dtype), y)


class DecoderLayer(nn.Module):
    def __init__(self, c: ArchConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # The checkpoints' names: Mixtral's experts are `block_sparse_moe`, Qwen3-MoE's
        # `mlp` (as its dense layers are).
        self.feed_forward = "mlp"
        if c.sparse(index) and c.arch == "mixtral":
            self.feed_forward = "block_sparse_moe"
            self.block_sparse_moe = SparseMoeBlock(c)
        elif c.sparse(index):
            self.mlp = SparseMoeBlock(c)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, c.mlp_bias)

    def forward(self, x: torch.Tensor, at: ops.Positions) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), at)
        ff = getattr(self, self.feed_forward)
        return x + ff(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, ids: torch.Tensor, at: ops.Positions) -> torch.Tensor:
        x = ops.embedding(ids, self.embed_tokens.weight)
        for layer in self.layers:
            x = layer(x, at)
        return x


class CausalLM(nn.Module):
    """A decoder LM with HF parameter names whose forward computes arbor's values.

    Build it with `from_pretrained`. `forward` gives arbor's logits (or, with
    `return_token_logprobs=True`, the log-probs of the given tokens) with a gradient.
    """

    def __init__(self, config: ArchConfig, spec: _native.ModelSpec | None = None) -> None:
        super().__init__()
        self.config = config
        self.spec = spec
        self.max_seq_len = config.max_position_embeddings
        self.model = Decoder(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # ---- loading and saving -------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        device: str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        max_seq_len: int | None = None,
    ) -> CausalLM:
        """Loads an HF directory or a GGUF file with arbor's loader: the parameters are the
        bf16 values arbor computes with (f16 / f32 checkpoints rounded, GGUF blocks
        dequantized), stored as `dtype` (bf16, or f32 for master weights). `max_seq_len`
        bounds the sequences `forward` takes (default and upper bound: the model's context)."""
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f'device {device!r}: arbor.torch runs on "cpu" or "cuda"')
        if dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"dtype {dtype}: bfloat16 (arbor's) or float32 (master weights)")
        spec = _native.ModelSpec(os.fspath(path))
        config = ArchConfig.from_native(spec.config)
        # Built on the meta device, then given uninitialized memory of `dtype`: every value
        # is overwritten from the checkpoint below.
        with torch.device("meta"):
            model = cls(config).to(dtype)
        model = model.to_empty(device="cpu")
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.spec = spec
        if max_seq_len is not None:
            if not 1 <= max_seq_len <= config.max_position_embeddings:
                raise ValueError(
                    f"max_seq_len {max_seq_len}: between 1 and the model's context "
                    f"({config.max_position_embeddings})"
                )
            model.max_seq_len = max_seq_len
        params = dict(model.named_parameters())
        shapes = {n: list(p.shape) for n, p in params.items()}
        with torch.no_grad():
            for name, raw in _native.read_checkpoint(os.fspath(path), shapes).items():
                value = torch.frombuffer(raw, dtype=torch.bfloat16).view(shapes[name])
                params[name].copy_(value)
        return model.to(dev)

    def arbor_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors arbor reads, by HF name (a tied head once, as an HF checkpoint file
        stores it): what `save_pretrained` writes and `/update_weights_from_tensor` takes."""
        return {n: p.detach() for n, p in self.named_parameters()}

    def save_pretrained(self, out_dir: str | os.PathLike[str]) -> Path:
        """Writes an HF directory arbor (and transformers) can load: the source directory's
        config and tokenizer files, and `model.safetensors` of the current parameters in
        their dtype. Needs the `safetensors` package and a model loaded from a directory."""
        from safetensors.torch import save_file

        src = Path(self._spec().path)
        if not src.is_dir():
            raise NotImplementedError(
                f"{src} is not a directory: saving a model loaded from a GGUF file would need "
                "its config as config.json; push its state_dict to the server instead"
            )
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            weights = f.suffix == ".safetensors" or f.name.startswith("model.safetensors")
            if f.is_file() and not weights:
                shutil.copy(f, out / f.name)
        save_file(
            {n: t.contiguous() for n, t in self.arbor_state_dict().items()},
            str(out / "model.safetensors"),
            metadata={"format": "pt"},
        )
        return out

    def _spec(self) -> _native.ModelSpec:
        if self.spec is None:
            raise RuntimeError("no checkpoint: build the model with CausalLM.from_pretrained")
        return self.spec

    # ---- the forward ----------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | list[int] | None = None,
        return_token_logprobs: bool = False,
    ) -> torch.Tensor:
        """arbor's forward, with a gradient.

        - `input_ids` `[B, T]` (rows of different lengths: right padding with an
          `attention_mask`), or packed `[N]` with `cu_seqlens` (`[0, l0, l0+l1, …, N]`).
        - Returns the logits, f32 `[B, T, V]` (`[N, V]` packed; 0 at padded positions), or
          with `return_token_logprobs=True`, `log p(ids[t+1] | ids[:t+1])`, f32 `[B, T-1]`
          (packed: `[N]`, 0 at each sequence's last position; 0 where padding is predicted).
        Under `DistributedDataParallel`, call the wrapper with `return_token_logprobs=True`.
        """
        device = self.model.embed_tokens.weight.device
        ids, lengths, batched = _unpack(
            input_ids, attention_mask, cu_seqlens, self.config.vocab_size, device
        )
        if lengths and max(lengths) > self.max_seq_len:
            raise _native.InvalidInput(
                f"a sequence of {max(lengths)} tokens is longer than the context of "
                f"{self.max_seq_len} positions"
            )
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        at = ops.Positions(cu, self._spec(), device)
        h = self.model(ids, at)
        if return_token_logprobs:
            # Rows that predict a token of their own sequence: all but each one's last.
            rows = ops._device_copy(
                torch.tensor(
                    [r for s, e in pairwise(cu) for r in range(s, e - 1)], dtype=torch.long
                ),
                device,
            )
            x = self.model.norm(h[rows])
            # The targets are input ids, checked against the vocabulary by `_unpack`.
            lp = ops.head_logprobs(x, self.lm_head.weight, ids[rows + 1], checked=True)
            out = lp.new_zeros(ids.shape[0]).index_put((rows,), lp)
            if not batched:
                return out
            return _to_batch(out, lengths, input_ids.shape[1])[:, :-1]
        logits = self.lm_head(self.model.norm(h))
        return _to_batch(logits, lengths, input_ids.shape[1]) if batched else logits

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | list[int] | None = None,
    ) -> torch.Tensor:
        """`log p(ids[t+1] | ids[:t+1])`, f32 `[B, T-1]`: arbor's values bit for bit (what
        `arbor score` and `arbor serve` give for the same weights), with a gradient. See
        `forward` for the shapes."""
        return self(input_ids, attention_mask, cu_seqlens=cu_seqlens, return_token_logprobs=True)


def _check_ids(
    input_ids: torch.Tensor, vocab: int, dims: int, device: torch.device
) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"input_ids must hold integers (torch.long), got {input_ids.dtype}")
    if input_ids.dim() != dims:
        want = "[batch, time]" if dims == 2 else "[tokens] (packed, with cu_seqlens)"
        raise ValueError(f"input_ids must be {want}, got shape {tuple(input_ids.shape)}")
    if input_ids.device != device:
        raise ValueError(f"input_ids is on {input_ids.device}, the model on {device}")
    ids = input_ids.long()
    # One host sync on CUDA ids (the check's answer), before any of the forward's work is
    # queued: the embedding and the log-probs' targets rely on it.
    out_of_range = (ids < 0) | (ids >= vocab)
    if ids.numel() and bool(out_of_range.any()):
        bad = out_of_range.nonzero()[0].tolist()
        at = ", ".join(str(i) for i in bad)
        raise _native.InvalidInput(
            f"input_ids[{at}] = {int(ids[tuple(bad)])} is outside the vocabulary (size {vocab})"
        )
    return ids


def _unpack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | list[int] | None,
    vocab: int,
    device: torch.device,
) -> tuple[torch.Tensor, list[int], bool]:
    """The real tokens packed `[N]`, each sequence's length, and whether the input was a
    batch `[B, T]`."""
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("pass either cu_seqlens (packed input) or attention_mask, not both")
        ids = _check_ids(input_ids, vocab, 1, device)
        cu = [
            int(c)
            for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)
        ]
        if not cu or cu[0] != 0 or cu[-1] != ids.shape[0] or any(b < a for a, b in pairwise(cu)):
            raise ValueError(
                f"cu_seqlens must rise from 0 to the token count {ids.shape[0]}, got {cu[:8]}"
                + ("…" if len(cu) > 8 else "")
            )
        return ids, [b - a for a, b in pairwise(cu)], False
    ids = _check_ids(input_ids, vocab, 2, device)
    lengths = _lengths(ids, attention_mask)
    real = ops._device_copy(_real(lengths, ids.shape[1]), device)
    return ids[real], lengths, True


def _to_batch(packed: torch.Tensor, lengths: list[int], t: int) -> torch.Tensor:
    """Packed rows `[N, ...]` back to `[B, T, ...]`, zeros where a row is padded."""
    out = packed.new_zeros(len(lengths), t, *packed.shape[1:])
    return out.index_put((ops._device_copy(_real(lengths, t), packed.device),), packed)


def _lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Each row's length: all of `T`, or the ones of a right-padded `attention_mask`."""
    b, t = input_ids.shape
    if attention_mask is None:
        return [t] * b
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, "
            f"input_ids {tuple(input_ids.shape)}"
        )
    m = attention_mask.to(device="cpu", dtype=torch.long)
    if not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1")
    lengths = m.sum(dim=1)
    pos = torch.arange(t).expand(b, t)
    if not bool((m == (pos < lengths.unsqueeze(1)).long()).all()):
        raise ValueError(
            "attention_mask must be right-padded (each row: ones, then zeros); "
            "left padding would shift positions"
        )
    if bool((lengths == 0).any()):
        raise ValueError(f"row {int((lengths == 0).nonzero()[0])} of attention_mask is empty")
    return [int(n) for n in lengths]


def _real(lengths: list[int], t: int) -> torch.Tensor:
    """`[B, t]`: True at the positions that hold a real token (p < length)."""
    return torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
