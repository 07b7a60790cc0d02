"""`arbor.verl` inside verl itself: verl's own classes call it through Ray.

Runs only where verl and Ray import (`pip install verl`; CI's environment has neither, and
importing verl and starting Ray take about 35 s on 2 cores). It uses, unmodified:
- `RolloutReplicaRegistry` / `get_rollout_replica_class` and `get_rollout_class`
  (verl/workers/rollout/replica.py, base.py), through `arbor.verl.register()`;
- `RolloutReplica`'s own `sleep`, `wake_up`, `abort_all_requests`, `resume_generation`,
  `clear_kv_cache` (replica.py), which call the server actor's methods `.remote()`;
- `LLMServerClient.generate` with `GlobalRequestLoadBalancer` (llm_server.py, router.py),
  what the agent loop awaits for every sample;
- `RolloutConfig` and `HFModelConfig` (verl/workers/config/) built from the tiny model.
The replica is launched by `launch_servers()` with a placeholder worker: verl's
`init_standalone` / `init_hybrid` reserve GPU bundles, which a CPU machine lacks.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
from pathlib import Path
from uuid import uuid4

import pytest
from conftest import Cli
from safetensors.torch import load_file
from test_verl import PROMPTS, agent_loop_params, completions

ray = pytest.importorskip("ray")
pytest.importorskip("verl.workers.rollout.llm_server")

from omegaconf import OmegaConf  # noqa: E402
from verl.workers.config import HFModelConfig, RolloutConfig  # noqa: E402
from verl.workers.rollout.base import BaseRollout, get_rollout_class  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerClient  # noqa: E402
from verl.workers.rollout.replica import (  # noqa: E402
    RolloutMode,
    RolloutReplica,
    TokenOutput,
    get_rollout_replica_class,
)
from verl.workers.rollout.router import GlobalRequestLoadBalancer  # noqa: E402

import arbor.verl  # noqa: E402
from arbor.verl import ArborProcess  # noqa: E402


@ray.remote
class Placeholder:
    """Stands for the replica's first worker (only its node is asked)."""


def test_verl_drives_arbor_through_ray(cli: Cli, tiny: dict[str, Path], tmp_path: Path) -> None:
    b = tmp_path / "b"
    cli.run(1, "make-model", "--arch", "llama", "--preset", "tiny", "--seed", "8", "--out", str(b))
    assert arbor.verl.TokenOutput is TokenOutput  # verl's own type when verl imports

    # The server actor runs in a process of its own: it is told where the binaries are.
    arbor.verl.register(arbor_bin=cli.arbor, launch_bin=cli.launch)
    replica_cls = get_rollout_replica_class("arbor")
    rollout_cls = get_rollout_class("arbor", "async")
    assert issubclass(replica_cls, RolloutReplica) and not inspect.isabstract(replica_cls)
    assert issubclass(rollout_cls, BaseRollout) and not inspect.isabstract(rollout_cls)

    config = RolloutConfig(
        name="arbor", tensor_model_parallel_size=2, prompt_length=16, response_length=12
    )
    model_config = HFModelConfig(path=str(tiny["llama"]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    replica = None
    try:
        replica = replica_cls(replica_rank=0, config=config, model_config=model_config)
        replica.rollout_mode = RolloutMode.STANDALONE
        replica.workers = [Placeholder.remote()]
        asyncio.run(replica.launch_servers())
        with ArborProcess(b, 1, arbor_bin=cli.arbor) as fresh_b:
            asyncio.run(drive(replica, rollout_cls, config, model_config, b, fresh_b.address))
    finally:
        if replica is not None and replica.servers:
            ray.get([s.shutdown.remote() for s in replica.servers])
        ray.shutdown()


async def drive(replica, rollout_cls, config, model_config, b: Path, fresh_b: str) -> None:
    lb = ray.remote(GlobalRequestLoadBalancer).remote(
        servers={replica.server_address: replica.server_handle}
    )
    verl_config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"name": "arbor", "full_determinism": False}}}
    )
    client = LLMServerClient(config=verl_config, load_balancer_handle=lb)

    async def rollouts(**extra: object) -> list:
        return await asyncio.gather(
            *[
                client.generate(
                    uuid4().hex, prompt_ids=p, sampling_params=agent_loop_params(**extra)
                )
                for p in PROMPTS
            ]
        )

    def same_as(address: str, outs: list, version: str) -> None:
        for p, o in zip(PROMPTS, outs, strict=True):
            assert isinstance(o, TokenOutput)
            ref = completions(address, p, 12, o.extra_fields["sampling_seed"], top_k=-1)
            assert o.token_ids == ref["token_ids"]
            assert o.log_probs == ref["logprobs"]["token_logprobs"]  # floats from JSON: exact
            assert o.extra_fields["weight_version"] == version

    first = await rollouts()
    same_as(replica.server_address, first, "0")

    # RolloutReplica's own methods, which call the server actor.
    await replica.sleep()
    await replica.wake_up()
    await replica.clear_kv_cache()
    await replica.abort_all_requests()
    await replica.resume_generation()
    again = await rollouts(seed=first[0].extra_fields["sampling_seed"])
    assert again[0].token_ids == first[0].token_ids

    # The trainer side, as verl builds it on a rank (no device mesh: the TP leader), and
    # engine_workers.update_weights' order of calls.
    rollout = rollout_cls(config=config, model_config=model_config, device_mesh=None)
    await rollout.release()
    await rollout.resume(tags=["weights"])
    weights = load_file(b / "model.safetensors")
    await rollout.update_weights(iter(weights.items()), global_steps=1)
    await rollout.resume(tags=["kv_cache"])
    same_as(fresh_b, await rollouts(), "1")


def test_the_plugin_registers_arbor_in_a_fresh_process() -> None:
    """What every Ray worker does when it imports verl: the `verl.plugins` entry point (or
    `VERL_USE_EXTERNAL_MODULES`) imports arbor.verl_plugin, and the name resolves."""
    code = (
        "from verl.workers.rollout.replica import get_rollout_replica_class\n"
        "from verl.workers.rollout.base import get_rollout_class\n"
        "print(get_rollout_replica_class('arbor').__name__, "
        "get_rollout_class('arbor', 'async').__name__)\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "arbor.verl_plugin"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["_Replica", "_Rollout"]
