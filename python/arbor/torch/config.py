"""The architecture of a model as arbor read it, for the PyTorch forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchConfig:
    """What the forward needs of a Llama / Mistral / Qwen2 / Qwen3 (dense) config."""

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

    @classmethod
    def from_native(cls, c: dict[str, Any]) -> ArchConfig:
        """From `arbor._native.Model.config` (arbor's own reading of config.json or GGUF)."""
        return cls(**{f: c[f] for f in cls.__dataclass_fields__})

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim
