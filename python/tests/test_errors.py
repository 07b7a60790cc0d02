"""Bad input raises a clear Python exception, never crashes the interpreter, and a refused
weight push changes nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import arbor
from arbor.torch import CausalLM


@pytest.fixture(scope="module")
def llama(tiny: dict[str, Path]) -> CausalLM:
    return CausalLM.from_pretrained(tiny["llama"], max_seq_len=32)


def test_input_ids_of_the_wrong_type_dtype_or_range(llama: CausalLM) -> None:
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        llama.token_logprobs([[1, 2, 3]])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="integers"):
        llama.token_logprobs(torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        llama.token_logprobs(torch.ones(4, dtype=torch.long))
    with pytest.raises(
        arbor.InvalidInput, match=r"input_ids\[0, 2\] = 258 is outside the vocabulary"
    ):
        llama.token_logprobs(torch.tensor([[1, 2, 258]]))
    with pytest.raises(arbor.InvalidInput, match="outside the vocabulary"):
        llama.token_logprobs(torch.tensor([[1, -1]]))


def test_a_sequence_longer_than_the_context(llama: CausalLM) -> None:
    assert llama.engine.max_seq_len == 32
    with pytest.raises(arbor.InvalidInput, match="33 tokens, longer than the context of 32"):
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


def test_native_score_refuses_bad_batches(llama: CausalLM) -> None:
    m = llama.engine
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
    with pytest.raises(NotImplementedError, match="CPU only"):
        CausalLM.from_pretrained(tiny["llama"], device="cuda")
    with pytest.raises(NotImplementedError, match="CPU only"):
        arbor.Model(tiny["llama"], device="cuda:0")
    with pytest.raises(arbor.InvalidInput, match='expected "cpu"'):
        arbor.Model(tiny["llama"], device="tpu")


def test_refused_pushes_change_nothing(llama: CausalLM) -> None:
    m = llama.engine
    ids = torch.randint(0, 258, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = llama.token_logprobs(ids)
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
    with torch.no_grad():
        after = llama.token_logprobs(ids)
    assert torch.equal(before, after)
    m.update_weights(good)
    assert m.updates == 1


def test_score_runs_without_the_gil(llama: CausalLM) -> None:
    """Two Python threads score at once (one waits for the model's lock, not the GIL)."""
    import threading

    ids = torch.randint(0, 258, (4, 32), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = llama.arbor_token_logprobs(ids)
    got: list[torch.Tensor] = []
    threads = [
        threading.Thread(target=lambda: got.append(llama.arbor_token_logprobs(ids)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 3 and all(torch.equal(g, want) for g in got)
