"""`CausalLM`: a Llama / Mistral / Qwen2 / Qwen3 (dense) model as a `torch.nn.Module`
whose `token_logprobs` values are arbor's bits and whose gradient is PyTorch's.

The parameters carry transformers' names (`model.layers.0.self_attn.q_proj.weight`, ...),
so `state_dict()` is what an HF checkpoint holds and what `arbor serve`'s
`/update_weights_from_tensor` takes. The values of `token_logprobs` come from arbor's own
engine in this process (`arbor._native.Model.score`, the path of `arbor score`), run on
the module's current parameters: when they changed since the engine last saw them, they
are pushed to it first (`sync_weights`). The gradient comes from the PyTorch forward
below, joined to arbor's values by a straight-through function (`_ArborValues`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from arbor import _native
from arbor.torch import ops
from arbor.torch.config import ArchConfig


class _ArborValues(torch.autograd.Function):
    """Forward: arbor's values, untouched (bit for bit). Backward: the upstream gradient
    goes to the PyTorch log-probs, as if the forward had returned them. This is the
    identity `arbor_lp + (torch_lp - torch_lp.detach())` without its arithmetic, which
    would turn -0.0 into +0.0 and a non-finite PyTorch value into NaN."""

    @staticmethod
    def forward(arbor_lp: torch.Tensor, torch_lp: torch.Tensor) -> torch.Tensor:
        return arbor_lp.clone()

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


class Attention(nn.Module):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.q_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.kv_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.kv_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.q_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.c.head_dim
        q = self.q_proj(x).view(b, t, self.c.num_heads, hd)
        k = self.k_proj(x).view(b, t, self.c.num_kv_heads, hd)
        v = self.v_proj(x).view(b, t, self.c.num_kv_heads, hd)
        if self.c.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = ops.apply_rope(q.transpose(1, 2), cos, sin)
        k = ops.apply_rope(k.transpose(1, 2), cos, sin)
        a = ops.causal_attention(q, k, v.transpose(1, 2))
        return self.o_proj(a.transpose(1, 2).reshape(b, t, self.c.q_dim))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_mlp(x, self.gate_proj, self.up_proj, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


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


class CausalLM(nn.Module):
    """A decoder LM with HF parameter names; `token_logprobs` gives arbor's values.

    Build it with `from_pretrained`. `forward` is the plain PyTorch forward (its logits
    are NOT arbor's bits: within bf16 noise of them); `token_logprobs` is the contract.
    """

    def __init__(self, config: ArchConfig, engine: _native.Model | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.engine = engine
        self._synced: tuple[tuple[str, int, int, torch.dtype], ...] | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

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
        dequantized), stored as `dtype`. `max_seq_len` bounds the context (default: the
        model's)."""
        if device != "cpu":
            raise NotImplementedError(
                f"device {device!r}: arbor.torch runs on the CPU only so far "
                "(arbor's GPU engine serves from the CLI; its bits are the GPU's, not the CPU's)"
            )
        if dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"dtype {dtype}: bfloat16 (arbor's) or float32 (master weights)")
        engine = _native.Model(os.fspath(path), device=device, max_seq_len=max_seq_len)
        if engine.config["arch"] in ("qwen3_moe", "mixtral"):
            raise NotImplementedError(
                f"{path}: {engine.config['arch_name']} is a mixture-of-experts model; "
                "arbor.torch's PyTorch forward is dense only so far (arbor.Model scores it)"
            )
        config = ArchConfig.from_native(engine.config)
        # Built on the meta device, then given uninitialized memory of `dtype`: every value
        # is overwritten from the checkpoint below.
        with torch.device("meta"):
            model = cls(config).to(dtype)
        model = model.to_empty(device="cpu")
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        shapes = engine.weight_shapes()
        names = dict(model.named_parameters())
        if set(names) != set(shapes):
            raise _native.CheckpointError(
                f"{path}: the module's parameters and the tensors arbor reads differ: "
                f"only the module has {sorted(set(names) - set(shapes))}, "
                f"only arbor {sorted(set(shapes) - set(names))}"
            )
        with torch.no_grad():
            for name, raw in _native.read_checkpoint(os.fspath(path), shapes).items():
                value = torch.frombuffer(raw, dtype=torch.bfloat16).view(shapes[name])
                names[name].copy_(value)
        model.engine = engine
        model._mark_synced()
        return model

    def arbor_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors arbor reads, by HF name (a tied head once, as an HF checkpoint file
        stores it): what `save_pretrained` writes and `sync_weights` pushes."""
        return {n: p.detach() for n, p in self.named_parameters()}

    def save_pretrained(self, out_dir: str | os.PathLike[str]) -> Path:
        """Writes an HF directory arbor (and transformers) can load: the source directory's
        config and tokenizer files, and `model.safetensors` of the current parameters in
        their dtype. Needs the `safetensors` package and a model loaded from a directory."""
        from safetensors.torch import save_file

        src = Path(self._engine().path)
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

    # ---- arbor's engine -----------------------------------------------------------

    def _engine(self) -> _native.Model:
        if self.engine is None:
            raise RuntimeError("no arbor engine: build the model with CausalLM.from_pretrained")
        return self.engine

    def _fingerprint(self) -> tuple[tuple[str, int, int, torch.dtype], ...]:
        # An in-place change bumps a tensor's version counter; a replaced tensor has
        # another data pointer (or dtype).
        return tuple((n, p.data_ptr(), p._version, p.dtype) for n, p in self.named_parameters())

    def _mark_synced(self) -> None:
        self._synced = self._fingerprint()

    def weights_changed(self) -> bool:
        """Whether the parameters changed since the engine last took them."""
        return self._synced != self._fingerprint()

    def sync_weights(self, force: bool = False) -> bool:
        """Pushes the parameters to arbor's engine if they changed (or `force`): the path of
        `/update_weights_from_tensor`. Returns whether it pushed.

        The copy: arbor reads each parameter's memory (`data_ptr()`) once, into a
        safetensors image in host memory, then converts that image into its own bf16
        weights (f32 parameters round to nearest even there). Nothing is shared with torch
        afterwards: later in-place updates reach arbor only through the next push.
        """
        if not force and not self.weights_changed():
            return False
        tensors = [(n, t.contiguous()) for n, t in self.arbor_state_dict().items()]
        self._engine().update_weights(tensors)
        self._mark_synced()
        return True

    # ---- the forward ----------------------------------------------------------------

    def _rope_table(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """arbor's cos/sin for positions `0..t`, each half repeated: `[t, head_dim]` f32."""
        if self._rope is None or self._rope[0].shape[0] < t:
            n = max(t, 1)
            cos_raw, sin_raw = self._engine().rope_table(n)
            half = self.config.head_dim // 2
            cos = torch.frombuffer(cos_raw, dtype=torch.float32).view(n, half)
            sin = torch.frombuffer(sin_raw, dtype=torch.float32).view(n, half)
            self._rope = (torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))
        return self._rope[0][:t], self._rope[1][:t]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The PyTorch forward: logits `[B, T, V]` in f32. Differentiable; within bf16
        noise of arbor's logits, not equal to them (use `token_logprobs` for arbor's)."""
        ids = _check_ids(input_ids, self.config.vocab_size)
        cos, sin = self._rope_table(ids.shape[1])
        x = self.model(ids, cos, sin)
        return self.lm_head(x).to(torch.promote_types(x.dtype, torch.float32))

    def torch_token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`token_logprobs` of the PyTorch forward alone (what the gradient follows)."""
        ids = _check_ids(input_ids, self.config.vocab_size)
        lengths = _lengths(ids, attention_mask)
        ids = _pad_to_zero(ids, lengths)
        lp = ops.gather_logprobs(self.forward(ids)[:, :-1], ids[:, 1:])
        return torch.where(_valid(lengths, ids.shape[1]), lp, torch.zeros((), dtype=lp.dtype))

    def arbor_token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """arbor's `log p(ids[:, t+1] | ids[:, :t+1])`, f32 `[B, T-1]`, on the current
        parameters (pushed first if they changed); 0 where `attention_mask` pads. No
        gradient."""
        ids = _check_ids(input_ids, self.config.vocab_size)
        lengths = _lengths(ids, attention_mask)
        self.sync_weights()
        rows = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
        lps, _ = self._engine().score(rows, [1] * len(rows))
        out = torch.zeros(ids.shape[0], max(ids.shape[1] - 1, 0), dtype=torch.float32)
        for i, lp in enumerate(lps):
            if lp:
                out[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return out

    def token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`log p(ids[:, t+1] | ids[:, :t+1])`, f32 `[B, T-1]`: arbor's values bit for bit
        (what `arbor score` and `arbor serve` give for the same weights), with the
        gradient of the PyTorch forward when autograd records. `attention_mask` (right
        padding only) zeroes the padded positions, value and gradient."""
        values = self.arbor_token_logprobs(input_ids, attention_mask)
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in self.parameters()):
            return values
        return _ArborValues.apply(values, self.torch_token_logprobs(input_ids, attention_mask))


def _check_ids(input_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"input_ids must hold integers (torch.long), got {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
    if input_ids.device.type != "cpu":
        raise ValueError(f"input_ids is on {input_ids.device}: arbor.torch runs on the CPU")
    ids = input_ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        bad = ((ids < 0) | (ids >= vocab)).nonzero()[0].tolist()
        raise _native.InvalidInput(
            f"input_ids[{bad[0]}, {bad[1]}] = {int(ids[bad[0], bad[1]])} is outside the "
            f"vocabulary (size {vocab})"
        )
    return ids


def _real(lengths: list[int], t: int) -> torch.Tensor:
    """`[B, t]`: True at the positions that hold a real token (p < length)."""
    return torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def _pad_to_zero(ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """`ids` with padded positions set to token 0 (any id would do: causal attention keeps
    them out of the real positions)."""
    if all(n == ids.shape[1] for n in lengths):
        return ids
    return torch.where(_real(lengths, ids.shape[1]), ids, torch.zeros_like(ids))


def _valid(lengths: list[int], t: int) -> torch.Tensor:
    """`[B, t-1]`: True where output position p predicts a real token (p + 1 < length)."""
    return _real(lengths, t)[:, 1:]
