"""`arbor.verl`: `arbor serve` at TP 2 driven as verl drives its rollout servers.

How verl calls a server, from verl 0.9.1's code:
- verl/workers/rollout/llm_server.py, `LLMServerClient.generate`: `server.generate.remote(
  request_id=uuid4().hex, prompt_ids=..., sampling_params=..., image_data=..., video_data=...)`
  and reads `output.extra_fields.get("global_steps")`;
- verl/experimental/agent_loop/agent_loop.py, `AgentLoopWorker.generate_sequences`: the
  sampling params, `dict(temperature, top_p, top_k, repetition_penalty=1.0,
  logprobs=calculate_log_probs)`, one task per sample, gathered;
- verl/workers/rollout/replica.py, `RolloutReplica`: `wake_up`, `sleep`,
  `abort_all_requests(reject_request=...)`, `resume_generation`, `clear_kv_cache`;
  verl/workers/rollout/vllm_rollout/vllm_async_server.py: `abort_request(request_id)`;
- verl/workers/engine_workers.py, `update_weights`: `rollout.resume(tags=["weights"])`,
  `rollout.update_weights(per_tensor_param, ...)`, `rollout.resume(tags=["kv_cache"])`,
  and `rollout.release()` before training (the `BaseRollout` of verl/workers/rollout/base.py).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import urllib.request
from pathlib import Path
from uuid import uuid4

import pytest
import torch
from conftest import Cli, f32_bits
from safetensors.torch import load, load_file

from arbor.verl import (
    ArborHttpError,
    ArborHttpServer,
    ArborProcess,
    ArborRollout,
    TokenOutput,
    safetensors_bytes,
)

PROMPTS = [
    [1, 2, 3],
    [256, 72, 101, 108],
    [9, 9, 9, 9, 9],
    [200, 13],
    [5],
    [77, 78, 79, 80, 81, 82],
]
RESPONSE_LENGTH = 12


def agent_loop_params(logprobs: bool = True, **extra: object) -> dict[str, object]:
    """What AgentLoopWorker.generate_sequences sends (rollout defaults: temperature 1,
    top_p 1, top_k -1)."""
    return dict(
        temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=logprobs, **extra
    )


def completions(address: str, prompt: list[int], max_tokens: int, seed: int, **kw: object) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "logprobs": 0, **kw}
    req = urllib.request.Request(
        f"http://{address}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]


@pytest.fixture(scope="module")
def models(
    cli: Cli, tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    b = tmp_path_factory.mktemp("verl") / "b"
    cli.run(1, "make-model", "--arch", "llama", "--preset", "tiny", "--seed", "8", "--out", str(b))
    return {"a": tiny["llama"], "b": b}


@pytest.fixture(scope="module")
def server(cli: Cli, models: dict[str, Path]):
    s = ArborHttpServer(
        model=models["a"],
        tp=2,
        arbor_bin=cli.arbor,
        launch_bin=cli.launch,
        rollout_mode="colocated",
        prompt_length=16,
        response_length=RESPONSE_LENGTH,
    )
    asyncio.run(s.launch_server())
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def fresh_b(cli: Cli, models: dict[str, Path]):
    """A server started on the new weights (TP 1): what an update must give."""
    with ArborProcess(models["b"], 1, arbor_bin=cli.arbor) as p:
        yield p.address


async def rollouts(server: ArborHttpServer, params: dict[str, object]) -> list[TokenOutput]:
    return await asyncio.gather(
        *[
            server.generate(
                request_id=uuid4().hex,
                prompt_ids=p,
                sampling_params=dict(params),
                image_data=None,
                video_data=None,
            )
            for p in PROMPTS
        ]
    )


def assert_same_as_completions(address: str, outs: list[TokenOutput], version: str) -> None:
    for prompt, o in zip(PROMPTS, outs, strict=True):
        seed = o.extra_fields["sampling_seed"]
        ref = completions(address, prompt, RESPONSE_LENGTH, seed, top_k=-1)
        assert o.token_ids == ref["token_ids"], prompt
        assert f32_bits(o.log_probs) == f32_bits(ref["logprobs"]["token_logprobs"]), prompt
        assert o.extra_fields["weight_version"] == version
        assert o.stop_reason == "completed"


def test_generate_is_completions_bit_for_bit(server: ArborHttpServer) -> None:
    outs = asyncio.run(rollouts(server, agent_loop_params()))
    assert all(isinstance(o, TokenOutput) for o in outs)
    # verl's default length: response_length (no max_tokens in the params); a sample
    # may end earlier on EOS.
    for o in outs:
        finish = o.extra_fields["finish_reason"]
        if finish["type"] == "length":
            assert finish["length"] == RESPONSE_LENGTH == len(o.token_ids)
        else:
            assert finish["type"] == "stop" and len(o.token_ids) < RESPONSE_LENGTH
    assert len({o.extra_fields["sampling_seed"] for o in outs}) == len(outs)  # fresh seeds
    assert_same_as_completions(server.address, outs, "0")

    # The seed replays the sample; without logprobs, none come back.
    first = outs[0]
    again = asyncio.run(
        server.generate(
            PROMPTS[0],
            agent_loop_params(logprobs=False, seed=first.extra_fields["sampling_seed"]),
            uuid4().hex,
        )
    )
    assert again.token_ids == first.token_ids and again.log_probs is None

    # The caller's dict is left as it was (verl reuses it across turns).
    params = agent_loop_params(max_tokens=3)
    asyncio.run(server.generate(PROMPTS[1], params, uuid4().hex))
    assert params == agent_loop_params(max_tokens=3)


def test_stop_reasons(server: ArborHttpServer) -> None:
    async def go() -> None:
        base = await server.generate(PROMPTS[0], agent_loop_params(seed=5, max_tokens=6), "s0")
        assert base.stop_reason == "completed" and len(base.token_ids) == 6
        assert base.extra_fields["finish_reason"]["type"] == "length"

        stop = base.token_ids[2]
        cut = await server.generate(
            PROMPTS[0], agent_loop_params(seed=5, max_tokens=6, stop_token_ids=[stop]), "s1"
        )
        first = base.token_ids.index(stop)
        assert cut.token_ids == base.token_ids[: first + 1]
        assert cut.log_probs == base.log_probs[: first + 1]
        assert cut.stop_reason == "completed"
        assert cut.extra_fields["finish_reason"] == {"type": "stop", "matched": stop}

        # One request aborted by its id: held (paused in place) so that it is surely
        # in flight when the abort comes.
        await server.client.call("/pause_generation", {"mode": "in_place"})
        task = asyncio.create_task(server.generate(PROMPTS[1], agent_loop_params(), "victim"))
        await wait_waiting(server, 1)
        assert await server.abort_request("victim") == {"aborted": True, "request_id": "victim"}
        out = await task
        assert out.stop_reason == "aborted" and out.token_ids == [] and out.log_probs == []
        assert await server.abort_request("nobody") == {"aborted": False, "request_id": "nobody"}
        await server.resume_generation()

        # Every request, as verl's partial rollout aborts them; with reject_request new
        # ones fail until resume_generation.
        await server.client.call("/pause_generation", {"mode": "in_place"})
        tasks = [
            asyncio.create_task(server.generate(p, agent_loop_params(), f"all-{i}"))
            for i, p in enumerate(PROMPTS[:3])
        ]
        await wait_waiting(server, 3)
        answer = await server.abort_all_requests(reject_request=True)
        assert answer["aborted"] == 3
        assert [o.stop_reason for o in await asyncio.gather(*tasks)] == ["aborted"] * 3
        with pytest.raises(RuntimeError, match="paused"):
            await server.generate(PROMPTS[0], agent_loop_params(), "late")
        await server.resume_generation()
        after = await server.generate(PROMPTS[0], agent_loop_params(seed=5, max_tokens=6), "s2")
        assert after.token_ids == base.token_ids and after.stop_reason == "completed"

    asyncio.run(go())


async def wait_waiting(server: ArborHttpServer, n: int) -> None:
    for _ in range(400):
        load = await server.client.call("/get_load", method="GET")
        if load[0]["num_waiting_reqs"] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} requests never queued: {load}")


def test_sleep_and_wake_up(server: ArborHttpServer) -> None:
    async def go() -> None:
        before = await server.generate(PROMPTS[3], agent_loop_params(seed=11), "w0")
        await server.sleep()
        assert await server.is_sleeping()
        with pytest.raises(ArborHttpError) as e:
            await server.generate(PROMPTS[3], agent_loop_params(seed=11), "w1")
        assert e.value.status == 503
        await server.wake_up()
        assert not await server.is_sleeping()
        after = await server.generate(PROMPTS[3], agent_loop_params(seed=11), "w2")
        assert (after.token_ids, after.log_probs) == (before.token_ids, before.log_probs)
        await server.clear_kv_cache()
        # Hybrid: the trainer's resume brings the pushed weights back, not wake_up.
        hybrid = ArborHttpServer(server.address, rollout_mode="hybrid")
        with pytest.raises(ValueError, match="hybrid"):
            await hybrid.wake_up()

    asyncio.run(go())


def test_update_from_disk_gives_a_fresh_server_on_the_new_weights(
    server: ArborHttpServer, models: dict[str, Path], fresh_b: str
) -> None:
    async def go() -> None:
        old = await rollouts(server, agent_loop_params(seed=3))
        r = await server.update_weights_from_disk(models["b"], "step-1")
        assert r["weight_version"] == "step-1"
        try:
            new = await rollouts(server, agent_loop_params(seed=3))
            assert [o.token_ids for o in new] != [o.token_ids for o in old]
            assert_same_as_completions(fresh_b, new, "step-1")
        finally:
            await server.update_weights_from_disk(models["a"], "0")
        back = await rollouts(server, agent_loop_params(seed=3))
        assert [(o.token_ids, o.log_probs) for o in back] == [
            (o.token_ids, o.log_probs) for o in old
        ]

    asyncio.run(go())


def test_push_in_verls_order_gives_a_fresh_server_on_the_new_weights(
    server: ArborHttpServer, models: dict[str, Path], fresh_b: str
) -> None:
    """engine_workers.update_weights' sequence, the trainer's tensors pushed over HTTP in
    several parts (a small bucket), while the server's memory is released."""
    rollout = ArborRollout(server, bucket_bytes=200_000)
    b_weights = load_file(models["b"] / "model.safetensors")
    a_weights = load_file(models["a"] / "model.safetensors")

    async def sync(weights: dict[str, torch.Tensor], step: int) -> dict:
        await rollout.release()
        await rollout.resume(tags=["weights"])
        r = await rollout.update_weights(((n, t) for n, t in weights.items()), global_steps=step)
        await rollout.resume(tags=["kv_cache"])
        await server.set_global_steps(step)
        return r

    async def go() -> None:
        old = await rollouts(server, agent_loop_params(seed=4))
        r = await sync(b_weights, 1)
        assert r["weight_version"] == "1"
        new = await rollouts(server, agent_loop_params(seed=4))
        assert_same_as_completions(fresh_b, new, "1")
        assert all(o.extra_fields["global_steps"] == 1 for o in new)
        assert [o.token_ids for o in new] != [o.token_ids for o in old]

        # f32 tensors (a trainer's master weights) push the same values.
        await sync({n: t.float() for n, t in a_weights.items()}, 2)
        back = await rollouts(server, agent_loop_params(seed=4))
        assert [(o.token_ids, o.log_probs) for o in back] == [
            (o.token_ids, o.log_probs) for o in old
        ]

        # A tensor the model does not read is refused and nothing changes.
        with pytest.raises(ArborHttpError, match="lora_A"):
            await rollout.update_weights([("model.layers.0.lora_A.weight", torch.zeros(2, 2))])
        assert await server.weight_version() == "2"

    try:
        asyncio.run(go())
    finally:
        asyncio.run(server.update_weights_from_disk(models["a"], "0"))


def test_resume_without_a_push_reloads_the_weights(server: ArborHttpServer) -> None:
    async def go() -> None:
        rollout = ArborRollout(server)
        before = await server.generate(PROMPTS[2], agent_loop_params(seed=9), "r0")
        await rollout.release()
        await rollout.resume(tags=["weights"])
        await rollout.resume(tags=["kv_cache"])
        after = await server.generate(PROMPTS[2], agent_loop_params(seed=9), "r1")
        assert (after.token_ids, after.log_probs) == (before.token_ids, before.log_probs)

    asyncio.run(go())


def test_safetensors_bytes_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 10, generator=g)
    named = [
        ("a", full.to(torch.bfloat16)),
        ("b", full[:, 3:7]),  # a strided view: only its own elements are written
        ("c", full.half().t()),
        ("d", torch.zeros(0, 4)),
    ]
    back = load(safetensors_bytes(named))
    for n, t in named:
        assert back[n].dtype == t.dtype and torch.equal(back[n], t.contiguous()), n
    with pytest.raises(ValueError, match="int64"):
        safetensors_bytes([("x", torch.zeros(2, dtype=torch.int64))])


def _verl_file(rel: str) -> Path | None:
    spec = importlib.util.find_spec("verl")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    return path if path.is_file() else None


def _methods(path: Path, cls: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                f.name: f
                for f in node.body
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                and not f.name.startswith("_")
            }
    raise AssertionError(f"{cls} not in {path}")


def test_has_verls_server_and_rollout_methods() -> None:
    """Against verl's installed sources (read, not imported: verl needs Ray to import):
    every public method of its SGLang server and BaseRollout, with the parameters verl
    passes, is here and as async as verl awaits it."""
    sglang = _verl_file("workers/rollout/sglang_rollout/async_sglang_server.py")
    base = _verl_file("workers/rollout/base.py")
    if sglang is None or base is None:
        pytest.skip("verl is not installed (pip install verl --no-deps is enough)")
    pairs = [(sglang, "SGLangHttpServer", ArborHttpServer), (base, "BaseRollout", ArborRollout)]
    skip = {"launch_server", "set_pd_peer", "lora_as_adapter", "generate_sequences"}
    for path, name, ours in pairs:
        for m, f in _methods(path, name).items():
            if m in skip:
                continue
            mine = getattr(ours, m, None)
            assert mine is not None, f"{ours.__name__} lacks {name}.{m}"
            assert asyncio.iscoroutinefunction(mine) == isinstance(f, ast.AsyncFunctionDef), m
            params = [a.arg for a in f.args.args[1:]]
            code = mine.__code__
            accepted = code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]
            takes_kwargs = bool(code.co_flags & 0x08)
            missing = [p for p in params if p not in accepted and not takes_kwargs]
            # PD disaggregation's bootstrap arguments are taken by **kwargs and unused.
            assert not missing, f"{ours.__name__}.{m} lacks parameters {missing}"


def test_chunked_bodies_are_read_whole() -> None:
    from arbor._serve import _dechunk

    assert _dechunk(b"4\r\nWiki\r\n6;x=y\r\npedia \r\n0\r\n\r\n") == b"Wikipedia "


@pytest.fixture(scope="module")
def routed_server(cli: Cli, moe: dict[str, Path]):
    """A tiny Qwen3-MoE (layer 0 dense) served for verl's routing replay."""
    config = json.loads((moe["qwen3_moe"] / "config.json").read_text())
    s = ArborHttpServer(
        model=moe["qwen3_moe"],
        tp=1,
        arbor_bin=cli.arbor,
        launch_bin=cli.launch,
        response_length=RESPONSE_LENGTH,
        routed_experts=(config["num_hidden_layers"], config["num_experts_per_tok"]),
    )
    asyncio.run(s.launch_server())
    yield s, config
    s.shutdown()


def test_routing_replay_returns_each_tokens_experts(routed_server) -> None:
    """verl's `enable_rollout_routing_replay` (sglang_rollout/async_sglang_server.py:
    `return_routed_experts` on the request, `routed_experts` reshaped to [-1, layers,
    top_k] in the `TokenOutput`): a row per fed token (prompt + output - 1), the dense
    layer 0 all zeros, each sparse layer's experts distinct and in range; asking changes
    no token."""
    s, config = routed_server
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    outs = asyncio.run(rollouts(s, agent_loop_params()))
    for prompt, o in zip(PROMPTS, outs, strict=True):
        r = o.routed_experts
        assert r.dtype.name == "int32"
        assert r.shape == (len(prompt) + len(o.token_ids) - 1, layers, top_k), prompt
        assert (r[:, 0, :] == 0).all(), "layer 0 is dense"
        sparse = r[:, 1:, :]
        assert ((sparse >= 0) & (sparse < config["num_experts"])).all()
        assert all(len(set(row)) == top_k for row in sparse.reshape(-1, top_k).tolist())
        ref = completions(s.address, prompt, RESPONSE_LENGTH, o.extra_fields["sampling_seed"])
        assert o.token_ids == ref["token_ids"], prompt
        assert f32_bits(o.log_probs) == f32_bits(ref["logprobs"]["token_logprobs"]), prompt


def test_routing_replay_from_verls_config_needs_an_moe_config() -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(
        tensor_model_parallel_size=1, enable_rollout_routing_replay=True, max_model_len=None
    )
    dense = SimpleNamespace(local_path="/m", hf_config=SimpleNamespace(num_hidden_layers=2))
    with pytest.raises(AttributeError, match="num_experts_per_tok"):
        ArborHttpServer.from_verl_config(config, dense, "colocated")
    moe_config = SimpleNamespace(
        local_path="/m", hf_config=SimpleNamespace(num_hidden_layers=4, num_experts_per_tok=2)
    )
    s = ArborHttpServer.from_verl_config(config, moe_config, "colocated")
    assert s.routed_experts == (4, 2)
