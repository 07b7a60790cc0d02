"""`CausalLM`'s forward is arbor's: its token log-probs and whole logits rows equal
`arbor score`'s at TP 1, 2, 4 and 8 bit for bit, and the log-probs of `arbor generate`'s
sampled rollouts; batching, packing and the parameters' dtype change no bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ARCHS, Cli, f32_bits

from arbor import _native
from arbor.torch import CausalLM


def _batch() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Four right-padded rows of 33, 20, 7 and 2 tokens (ids across the vocabulary)."""
    g = torch.Generator().manual_seed(11)
    lengths = [33, 20, 7, 2]
    ids = torch.randint(0, 258, (len(lengths), max(lengths)), generator=g)
    mask = (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)).long()
    return ids, mask, lengths


@pytest.mark.parametrize("arch", ARCHS)
def test_token_logprobs_and_logits_equal_arbor_score_at_every_tp(
    arch: str, tiny: dict[str, Path], cli: Cli, tmp_path: Path
) -> None:
    model = CausalLM.from_pretrained(tiny[arch])
    ids, mask, lengths = _batch()
    lp = model.token_logprobs(ids, attention_mask=mask)
    assert lp.dtype == torch.float32 and lp.shape == (4, ids.shape[1] - 1)
    assert lp.requires_grad  # the gradient path is attached
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)
    assert logits.shape == (4, ids.shape[1], 258)
    seqs = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    # TP 8 splits the tiny models' 8 query heads one per rank; once is enough for CI's time.
    for tp in (1, 2, 4, 8) if arch == "llama" else (1, 2, 4):
        recs = cli.score(tiny[arch], seqs, [1] * len(seqs), tp, tmp_path)
        for i, n in enumerate(lengths):
            got = lp[i, : n - 1].detach().tolist()
            assert f32_bits(got) == f32_bits(recs[i]["logprobs"]), (arch, tp, i)
            # Row p of arbor score's digests is the logits row that predicts token p + 1.
            digests = _native.logits_digest(logits[i, : n - 1].contiguous())
            assert [f"{d:016x}" for d in digests] == recs[i]["logits_digest"], (arch, tp, i)
            assert bool((lp[i, n - 1 :] == 0).all())
            assert bool((logits[i, n:] == 0).all())


def test_token_logprobs_equal_sampled_rollouts_of_generate(
    tiny: dict[str, Path], cli: Cli, tmp_path: Path
) -> None:
    """The RL case: rollouts sampled by `arbor generate` at TP 2, rescored by the trainer."""
    out = tmp_path / "gen.jsonl"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": i, "tokens": [5 + 17 * i + j for j in range(3 + 4 * i)]}) + "\n"
            for i in range(3)
        )
    )
    cli.run(
        2,
        "generate",
        "--model",
        str(tiny["qwen3"]),
        "--prompts",
        str(prompts),
        "--max-tokens",
        "12",
        "--temperature",
        "1.0",
        "--seed",
        "5",
        "--out",
        str(out),
    )
    rollouts = [json.loads(line) for line in out.read_text().splitlines()]
    model = CausalLM.from_pretrained(tiny["qwen3"])
    for r in rollouts:
        seq = torch.tensor([r["prompt_tokens"] + r["tokens"]])
        lp = model.token_logprobs(seq)[0, len(r["prompt_tokens"]) - 1 :]
        assert f32_bits(lp.tolist()) == f32_bits(r["logprobs"]), r["id"]


def test_values_do_not_depend_on_the_batch_or_the_packing(tiny: dict[str, Path]) -> None:
    model = CausalLM.from_pretrained(tiny["llama"])
    ids, mask, lengths = _batch()
    together = model.token_logprobs(ids, attention_mask=mask).detach()
    for i, n in enumerate(lengths):
        alone = model.token_logprobs(ids[i : i + 1, :n]).detach()
        assert f32_bits(alone[0].tolist()) == f32_bits(together[i, : n - 1].tolist())
    # The same sequences packed into one row dimension (`cu_seqlens`), in another order.
    order = [2, 0, 3, 1]
    flat = torch.cat([ids[i, : lengths[i]] for i in order])
    cu = [0]
    for i in order:
        cu.append(cu[-1] + lengths[i])
    packed = model.token_logprobs(flat, cu_seqlens=torch.tensor(cu)).detach()
    assert packed.shape == (cu[-1],)
    for j, i in enumerate(order):
        n = lengths[i]
        assert f32_bits(packed[cu[j] : cu[j] + n - 1].tolist()) == f32_bits(
            together[i, : n - 1].tolist()
        )
        assert float(packed[cu[j] + n - 1]) == 0.0


def test_f32_master_weights_give_the_bf16_bits(tiny: dict[str, Path]) -> None:
    ids, mask, _ = _batch()
    bf16 = CausalLM.from_pretrained(tiny["qwen2"])
    f32 = CausalLM.from_pretrained(tiny["qwen2"], dtype=torch.float32)
    assert f32.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    with torch.no_grad():
        a = bf16.token_logprobs(ids, attention_mask=mask)
        b = f32.token_logprobs(ids, attention_mask=mask)
    assert f32_bits(a.flatten().tolist()) == f32_bits(b.flatten().tolist())
