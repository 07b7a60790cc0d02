"""Bad input raises a clear Python exception, never crashes the interpreter, and a refused
weight push changes nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import arbor
from arbor import _native
from arbor.torch import CausalLM


@pytest.fixture(scope="module")
def llama(tiny: dict[str, Path]) -> CausalLM:
    return CausalLM.from_pretrained(tiny["llama"], max_seq_len=32)


@pytest.fixture(scope="module")
def engine(tiny: dict[str, Path]) -> arbor.Model:
    return arbor.Model(tiny["llama"], max_seq_len=32)


def test_input_ids_of_the_wrong_type_dtype_or_range(llama: CausalLM) -> None:
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        llama.token_logprobs([[1, 2, 3]])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="integers"):
        llama.token_logprobs(torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        llama.token_logprobs(torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to the token count 4"):
        llama.token_logprobs(torch.ones(4, dtype=torch.long), cu_seqlens=[0, 3, 2, 4][:2])
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        llama.token_logprobs(torch.ones(4, dtype=torch.long), cu_seqlens=[0, 3, 2, 4])
    with pytest.raises(
        arbor.InvalidInput, match=r"input_ids\[0, 2\] = 258 is outside the vocabulary"
    ):
        llama.token_logprobs(torch.tensor([[1, 2, 258]]))
    with pytest.raises(arbor.InvalidInput, match="outside the vocabulary"):
        llama.token_logprobs(torch.tensor([[1, -1]]))


def test_a_sequence_longer_than_the_context(llama: CausalLM, engine: arbor.Model) -> None:
    assert llama.max_seq_len == 32 and engine.max_seq_len == 32
    with pytest.raises(arbor.InvalidInput, match="33 tokens is longer than the context of 32"):
        llama.token_logprobs(torch.zeros(1, 33, dtype=torch.long))
    assert llama.token_logprobs(torch.zeros(1, 32, dtype=torch.long)).shape == (1, 31)


def test_bad_attention_masks(llama: CausalLM) -> None:
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="right-padded"):
        llama.token_logprobs(ids, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="empty"):
        llama.token_logprobs(ids, attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="shape"):
        llama.token_logprobs(ids, attention_mask=torch.ones(2, 3))


def test_native_score_refuses_bad_batches(engine: arbor.Model) -> None:
    m = engine
    with pytest.raises(arbor.InvalidInput, match="2 sequences but 1 prompt lengths"):
        m.score([[1, 2], [3, 4]], [1])
    with pytest.raises(arbor.InvalidInput, match="sequence 1: token id -5 at index 0"):
        m.score([[1, 2], [-5, 4]], [1, 1])
    with pytest.raises(arbor.InvalidInput, match="prompt length 3"):
        m.score([[1, 2]], [3])
    with pytest.raises(TypeError):
        m.score("abc", [1])  # type: ignore[arg-type]
    assert m.score([], []) == ([], [])


def test_unreadable_checkpoints(tiny: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(arbor.CheckpointError, match=r"config\.json"):
        CausalLM.from_pretrained(tmp_path / "missing")
    bad = tmp_path / "truncated"
    shutil.copytree(tiny["llama"], bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(arbor.CheckpointError, match=r"model\.safetensors"):
        CausalLM.from_pretrained(bad)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(arbor.CheckpointError, match=r"junk\.gguf"):
        arbor.Model(junk)
    notmodel = tmp_path / "notes.txt"
    notmodel.write_text("hello")
    with pytest.raises(arbor.CheckpointError, match="not a GGUF file"):
        arbor.Model(notmodel)


def test_devices_not_there_yet(tiny: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match='runs on "cpu" or "cuda"'):
        CausalLM.from_pretrained(tiny["llama"], device="mps")
    with pytest.raises(NotImplementedError, match="CPU only"):
        arbor.Model(tiny["llama"], device="cuda:0")
    with pytest.raises(arbor.InvalidInput, match='expected "cpu"'):
        arbor.Model(tiny["llama"], device="tpu")


def test_refused_pushes_change_nothing(llama: CausalLM, tiny: dict[str, Path]) -> None:
    m = arbor.Model(tiny["llama"])
    seqs = torch.randint(0, 258, (2, 9), generator=torch.Generator().manual_seed(2)).tolist()
    before = m.score(seqs, [1, 1])
    sd = llama.arbor_state_dict()
    good = [(n, t.contiguous()) for n, t in sd.items()]
    name = "model.layers.0.mlp.up_proj.weight"

    def without(n: str) -> list[tuple[str, torch.Tensor]]:
        return [(k, t) for k, t in good if k != n]

    cases: list[tuple[type[Exception], str, list[tuple[str, object]]]] = [
        (TypeError, "dtype torch.int32", [*without(name), (name, sd[name].to(torch.int32))]),
        (TypeError, "not a torch.Tensor", [*without(name), (name, [1.0, 2.0])]),
        (arbor.InvalidInput, "meta device", [*without(name), (name, sd[name].to("meta"))]),
        (arbor.InvalidInput, "not contiguous", [*without(name), (name, sd[name].t())]),
        (arbor.InvalidInput, "shape", [*without(name), (name, sd[name][:-1].contiguous())]),
        (arbor.InvalidInput, "missing", without(name)),
        (arbor.InvalidInput, "no such tensor", [*good, ("model.layers.9.typo.weight", sd[name])]),
        (arbor.InvalidInput, "given twice", [*good, (name, sd[name])]),
    ]
    nan = sd[name].clone()
    nan[0, 0] = float("nan")
    cases.append((arbor.InvalidInput, "finite|NaN|nan", [*without(name), (name, nan)]))
    for exc, msg, tensors in cases:
        with pytest.raises(exc, match=msg):
            m.update_weights(tensors)  # type: ignore[arg-type]
    assert m.updates == 0
    assert m.score(seqs, [1, 1]) == before
    m.update_weights(good)
    assert m.updates == 1


def test_ops_refuse_what_their_kernels_cannot_read() -> None:
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    w = torch.zeros(3, 8, dtype=torch.bfloat16)
    out = torch.empty(2, 3)
    with pytest.raises(
        TypeError, match="tree_linear: x: dtype F16 where arbor's kernel takes BF16"
    ):
        _native.tree_linear(x.half(), w, out)
    with pytest.raises(arbor.InvalidInput, match=r"weight is \[3, 7\]"):
        _native.tree_linear(x, w[:, :7].contiguous(), out)
    with pytest.raises(arbor.InvalidInput, match="not contiguous"):
        _native.tree_linear(x, w, torch.empty(3, 2).t())
    with pytest.raises(arbor.InvalidInput, match=r"out has shape \[2, 4\]"):
        _native.tree_linear(x, w, torch.empty(2, 4))
    with pytest.raises(NotImplementedError, match="on the meta device"):
        _native.tree_linear(x.to("meta"), w, out)
    y = torch.zeros(4, 8)
    with pytest.raises(arbor.InvalidInput, match="shares memory with an input"):
        _native.silu_mul(y, y, y)
    with pytest.raises(arbor.InvalidInput, match="cu_seqlens decreases at index 2"):
        _native.attention(
            y,
            y[:, :4].contiguous(),
            y[:, :4].contiguous(),
            [0, 3, 1, 4],
            2,
            1,
            4,
            torch.empty(4, 8),
        )
    with pytest.raises(arbor.InvalidInput, match="target 9 of row 1 is outside the vocabulary"):
        _native.token_logprobs(y, [0, 9, 0, 0], torch.empty(4))
    with pytest.raises(TypeError, match=r"not a torch\.Tensor"):
        _native.rms_norm([1.0], torch.ones(8), 1e-6, y)


def test_bf16_activations_are_refused_with_the_fsdp2_hint(llama: CausalLM) -> None:
    with pytest.raises(TypeError, match="cast_forward_inputs=False"):
        llama.model.norm(torch.ones(2, 64, dtype=torch.bfloat16))


def test_score_runs_without_the_gil(engine: arbor.Model) -> None:
    """Two Python threads score at once (one waits for the model's lock, not the GIL)."""
    import threading

    seqs = torch.randint(0, 258, (4, 32), generator=torch.Generator().manual_seed(6)).tolist()
    want = engine.score(seqs, [1] * 4)
    got: list[object] = []
    threads = [
        threading.Thread(target=lambda: got.append(engine.score(seqs, [1] * 4))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 3 and all(g == want for g in got)
