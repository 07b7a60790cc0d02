"""prime-rl's rollout client, unmodified, against `arbor serve`: the `renderers` package
(PyPI `renderers`, which prime-rl's orchestrator and verifiers' `RendererClient` call)
renders a conversation with the model's chat template, POSTs it to
`/inference/v1/generate` (`renderers/client.py`, `generate`) and parses the answer: it
checks every `logprobs.content[i].token` is `token_id:<the sampled id>` and every
log-prob a finite number. Prints one JSON line per rollout for the Rust test to compare
with `/v1/completions`.

    python3 tests/rl/prime_rl_renderers.py BASE_URL MODEL_DIR MODEL_ID
"""

import asyncio
import json
import sys
from typing import Any

from openai import AsyncOpenAI
from renderers import DefaultRendererConfig, create_renderer
from renderers.client import generate
from transformers import AutoTokenizer

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello there"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is two and two"},
    ],
]


async def main(base_url: str, model_dir: str, model_id: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = create_renderer(tokenizer, DefaultRendererConfig())
    client = AsyncOpenAI(base_url=base_url, api_key="EMPTY")
    for i, messages in enumerate(CONVERSATIONS):
        # prime-rl's orchestrator salts the prefix cache per weight version.
        out = await generate(
            client=client,
            renderer=renderer,
            messages=messages,  # type: ignore[arg-type]
            model=model_id,
            sampling_params={"max_tokens": 6, "temperature": 1.0, "top_p": 1.0, "seed": 11 + i},
            cache_salt="step-0",
        )
        print(
            json.dumps(
                {
                    "prompt_ids": out["prompt_ids"],
                    "completion_ids": out["completion_ids"],
                    "completion_logprobs": out["completion_logprobs"],
                    "finish_reason": out["finish_reason"],
                    "content": out["content"],
                    "seed": 11 + i,
                    "stop_token_ids": renderer.get_stop_token_ids(),
                }
            ),
            flush=True,
        )
    await client.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
