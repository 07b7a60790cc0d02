"""The architecture of a model as arbor read it, for the PyTorch forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoeArch:
    """The experts of a mixture-of-experts config (Qwen3-MoE, Mixtral), as arbor read it."""

    num_experts: int
    top_k: int
    expert_intermediate: int
    norm_topk_prob: bool
    # Per layer: whether its MLP is the experts (`decoder_sparse_step`, `mlp_only_layers`).
    sparse_layers: tuple[bool, ...]


@dataclass(frozen=True)
class ArchConfig:
    """What the forward needs of a Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral
    config."""

    arch: str
    arch_name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    moe: MoeArch | None = None

    @classmethod
    def from_native(cls, c: dict[str, Any]) -> ArchConfig:
        """From `arbor._native.Model.config` (arbor's own reading of config.json or GGUF)."""
        fields = {f: c[f] for f in cls.__dataclass_fields__ if f != "moe"}
        m = c.get("moe")
        moe = None
        if m is not None:
            moe = MoeArch(
                num_experts=m["num_experts"],
                top_k=m["top_k"],
                expert_intermediate=m["expert_intermediate"],
                norm_topk_prob=m["norm_topk_prob"],
                sparse_layers=tuple(m["sparse_layers"]),
            )
        return cls(**fields, moe=moe)

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the experts."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim
