"""A real model from a GGUF file: SmolLM2-135M-Instruct (Q4_1, dequantized to bf16 by
arbor), held by `CausalLM` under HF names; its `token_logprobs` equal `arbor score`'s.

The file comes from scripts/ci/fetch-smollm2.sh (`$ARBOR_SMOLLM2_GGUF`, else
`${ARBOR_CACHE:-~/.cache/arbor}/smollm2/`). Without it the test is skipped, unless `CI` is
set, where it fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import Cli, f32_bits

from arbor.torch import CausalLM, reference


def _gguf() -> Path:
    cache = Path(os.environ.get("ARBOR_CACHE", Path.home() / ".cache" / "arbor"))
    path = Path(
        os.environ.get("ARBOR_SMOLLM2_GGUF", cache / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    )
    if not path.is_file():
        msg = f"{path} is missing: run scripts/ci/fetch-smollm2.sh"
        if os.environ.get("CI", "") not in ("", "0", "false"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def test_smollm2_gguf_token_logprobs_equal_arbor_score(cli: Cli, tmp_path: Path) -> None:
    gguf = _gguf()
    model = CausalLM.from_pretrained(gguf)
    assert model.config.tie_word_embeddings and model.config.num_layers == 30
    assert "model.layers.29.mlp.down_proj.weight" in model.state_dict()
    # Prompts as arbor tokenizes them ("The capital of France is", "def fibonacci(n):"),
    # each with the first tokens arbor generate sampled after it.
    seqs = [
        [504, 3575, 282, 4649, 314, 7042, 30, 198, 29, 16740, 5442],
        [1604, 3987, 46477, 24, 94, 727, 472, 283, 446, 304, 472, 979, 3635, 42],
    ]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lp = model.token_logprobs(ids, attention_mask=mask)
    recs = cli.score(gguf, seqs, [1, 1], 1, tmp_path)
    for i, s in enumerate(seqs):
        assert f32_bits(lp[i, : len(s) - 1].tolist()) == f32_bits(recs[i]["logprobs"]), i
    with torch.no_grad():
        plain = reference.token_logprobs(model, ids)
    d = torch.cat(
        [(plain[i, : len(s) - 1] - lp.detach()[i, : len(s) - 1]).abs() for i, s in enumerate(seqs)]
    )
    assert float(d.max()) < 0.5, float(d.max())  # the plain forward: bf16 noise away
