"""`arbor serve` as verl's rollout engine, on CPU, in a few seconds.

Starts `arbor serve` at TP 2 on a tiny model through `arbor.verl.ArborHttpServer`, calls
it as verl's agent loop calls its server (`generate(request_id=..., prompt_ids=...,
sampling_params=...)`), then syncs new weights in verl's order (`release`, `resume
weights`, `update_weights`, `resume kv_cache`) through `arbor.verl.ArborRollout`, and
checks the rollouts against `/v1/completions` of a server started on those weights.

    cargo build --release && python3 -m pip install ./python safetensors
    python3 examples/verl_rollout.py
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from uuid import uuid4

from arbor.verl import ArborHttpServer, ArborProcess, ArborRollout
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
ARBOR, LAUNCH = REPO / "target/release/arbor", REPO / "target/release/arbor-launch"


def completion(address: str, prompt: list[int], n: int, seed: int) -> dict:
    body = json.dumps(
        {"prompt": prompt, "max_tokens": n, "seed": seed, "logprobs": 0}
    ).encode()
    req = urllib.request.Request(f"http://{address}/v1/completions", data=body)
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())["choices"][0]


def make_models(work: Path) -> None:
    for name, seed in (("a", 7), ("b", 8)):
        subprocess.run(
            [
                ARBOR,
                "make-model",
                "--preset",
                "tiny",
                "--seed",
                str(seed),
                "--out",
                work / name,
            ],
            check=True,
            capture_output=True,
        )


async def main(work: Path) -> None:
    server = ArborHttpServer(
        model=work / "a", tp=2, arbor_bin=ARBOR, launch_bin=LAUNCH, response_length=8
    )
    await server.launch_server()
    print(f"arbor serve at TP 2 on {server.address}")
    try:
        # verl's agent loop: one generate per sample, its sampling params.
        params = {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "repetition_penalty": 1.0,
            "logprobs": True,
        }
        prompts = [[1, 2, 3], [256, 72, 101], [9, 9]]
        outs = await asyncio.gather(
            *[
                server.generate(
                    prompt_ids=p, sampling_params=params, request_id=uuid4().hex
                )
                for p in prompts
            ]
        )
        o = outs[0]
        print(f"TokenOutput(token_ids={o.token_ids}, stop_reason={o.stop_reason!r},")
        print(f"  log_probs={[round(x, 4) for x in o.log_probs]},")
        shown = {k: o.extra_fields[k] for k in ("weight_version", "sampling_seed")}
        print(f"  extra_fields={shown})")

        # verl's weight sync (engine_workers.update_weights), the trainer's tensors pushed.
        rollout = ArborRollout(server)
        await rollout.release()
        await rollout.resume(tags=["weights"])
        r = await rollout.update_weights(
            load_file(work / "b" / "model.safetensors").items(), global_steps=1
        )
        await rollout.resume(tags=["kv_cache"])
        print(f"update_weights: {r['message']}, weight_version {r['weight_version']!r}")

        outs = await asyncio.gather(
            *[
                server.generate(
                    prompt_ids=p, sampling_params=params, request_id=uuid4().hex
                )
                for p in prompts
            ]
        )
        with ArborProcess(work / "b", 1, arbor_bin=ARBOR) as fresh:
            same = 0
            for p, o in zip(prompts, outs, strict=True):
                ref = completion(fresh.address, p, 8, o.extra_fields["sampling_seed"])
                ids, lps = ref["token_ids"], ref["logprobs"]["token_logprobs"]
                same += o.token_ids == ids and o.log_probs == lps
        print(
            f"after the push: {same}/{len(prompts)} rollouts equal a fresh TP 1 server on the new "
            "weights, token ids and log-probs"
        )
    finally:
        server.shutdown()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        make_models(Path(d))
        asyncio.run(main(Path(d)))
