"""`arbor serve` as verl's rollout engine.

verl runs its rollout engine as a server object per replica (`vLLMHttpServer`,
`SGLangHttpServer` in `verl/workers/rollout/*/`), which its agent loop calls as
`generate(prompt_ids=..., sampling_params=..., request_id=...) -> TokenOutput`, and
which its replica wakes, puts to sleep, aborts and flushes; on every trainer rank a
`BaseRollout` adapter (`resume(tags)`, `update_weights(weights)`, `release()`) moves the
new weights in. This module gives both for an `arbor serve` reached over HTTP:

- `ArborHttpServer`: the server's methods, each one or two HTTP calls to arbor's routes
  (`/generate`, `/release_memory_occupation`, `/resume_memory_occupation`,
  `/flush_cache`, `/abort_request`, `/pause_generation`, ...); it launches the server
  (`ArborProcess`) or talks to one at an address.
- `ArborRollout`: the trainer side. `update_weights` pushes the tensors as safetensors
  parts to `/update_weights_from_tensor`; `update_weights_from_disk` names a checkpoint.
- `register()`: adds `"arbor"` to verl's registries when verl (with Ray) is installed.

verl is not needed to import this module: `TokenOutput` is verl's own class when verl
imports, else a dataclass with its fields. HTTP is the standard library's (asyncio
streams), so nothing beyond the package's own dependencies is needed; tensors are read
through torch only when weights are pushed.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from arbor._serve import (
    ArborHttpError,
    ArborProcess,
    Client,
    aiter_any,
    push_tensors,
    safetensors_bytes,
)

try:  # verl's own type when verl (and its Ray stack) imports
    from verl.workers.rollout.replica import TokenOutput
except ImportError:

    @dataclasses.dataclass
    class TokenOutput:  # type: ignore[no-redef]
        """verl's `TokenOutput` (verl/workers/rollout/replica.py), field for field."""

        token_ids: list[int]
        log_probs: list[float] | None = None
        routed_experts: Any | None = None
        stop_reason: str | None = None
        num_preempted: int | None = None
        extra_fields: dict[str, Any] = dataclasses.field(default_factory=dict)


__all__ = [
    "ArborHttpError",
    "ArborHttpServer",
    "ArborProcess",
    "ArborRollout",
    "TokenOutput",
    "register",
    "safetensors_bytes",
]

# verl's rollout modes (verl.workers.rollout.replica.RolloutMode values).
HYBRID, COLOCATED, STANDALONE = "hybrid", "colocated", "standalone"

# verl's sampling parameter names (vLLM's) that arbor's `/generate` spells SGLang's way.
_RENAMED = {
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
}


def _stop_reason(finish: Any) -> str | None:
    """verl's stop reasons (TokenOutput's docstring: 'completed', 'aborted', or None for
    unknown), as vLLMHttpServer.generate maps vLLM's finish reasons."""
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind in ("stop", "length"):
        return "completed"
    if kind == "abort":
        return "aborted"
    return kind


def _routed_experts(encoded: Any, shape: tuple[int, int], request_id: str) -> Any:
    """`meta_info.routed_experts` (base64 of little-endian int32, SGLang's encoding) as an
    int32 array of shape [rows, layers, top_k]."""
    import numpy as np

    if not isinstance(encoded, str):
        raise RuntimeError(f"request {request_id}: the server sent no routed experts")
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    layers, top_k = shape
    if flat.size % (layers * top_k) != 0:
        raise RuntimeError(
            f"request {request_id}: {flat.size} routed experts are not rows of "
            f"{layers} layers x {top_k} experts"
        )
    return flat.astype(np.int32).reshape(-1, layers, top_k)


class ArborHttpServer:
    """verl's rollout server (the interface of `SGLangHttpServer` / `vLLMHttpServer`) on
    top of `arbor serve`.

    Give `address` ("host:port") of a running server, or `model` (and `tp`, `serve_args`)
    for `launch_server()` to start one. The lengths mirror verl's `RolloutConfig`
    (`max_model_len`, `prompt_length`, `response_length`) and set the default number of
    new tokens as verl's servers do; `rollout_mode` and `free_cache_engine` decide what
    `sleep` / `wake_up` release and resume, as in verl's SGLang server.

    `routed_experts` = (num_hidden_layers, num_experts_per_tok) turns on verl's routing
    replay (`RolloutConfig.enable_rollout_routing_replay`): every `generate` asks for the
    experts each token was routed to and returns them in `TokenOutput.routed_experts` as
    verl's SGLang server does, an int32 array of shape [prompt + output - 1, layers,
    top_k] (SGLang's `extract_routed_experts_from_meta_info`, reshaped).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        model: str | os.PathLike[str] | None = None,
        tp: int = 1,
        serve_args: Sequence[str] = (),
        arbor_bin: str | os.PathLike[str] | None = None,
        launch_bin: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        rollout_mode: str = COLOCATED,
        free_cache_engine: bool = True,
        max_model_len: int | None = None,
        prompt_length: int | None = None,
        response_length: int | None = None,
        request_timeout: float | None = None,
        routed_experts: tuple[int, int] | None = None,
    ) -> None:
        if (address is None) == (model is None):
            raise ValueError("give either the address of a running arbor serve or a model to serve")
        if rollout_mode not in (HYBRID, COLOCATED, STANDALONE):
            raise ValueError(
                f"rollout_mode must be hybrid, colocated or standalone, got {rollout_mode!r}"
            )
        self._address = address
        self._launch = {
            "model": model,
            "tp": tp,
            "serve_args": tuple(serve_args),
            "arbor_bin": arbor_bin,
            "launch_bin": launch_bin,
            "env": env,
        }
        self.api_key = api_key
        self.rollout_mode = rollout_mode
        self.free_cache_engine = free_cache_engine
        self.max_model_len = max_model_len
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.request_timeout = request_timeout
        self.routed_experts = routed_experts
        self.process: ArborProcess | None = None
        self.global_steps: int | None = None
        self._reject = False
        self._client = Client(address, api_key) if address else None

    @classmethod
    def from_verl_config(
        cls, config: Any, model_config: Any, rollout_mode: Any, **kw: Any
    ) -> ArborHttpServer:
        """From verl's `RolloutConfig` and `HFModelConfig` (what verl gives its servers)."""
        mode = getattr(rollout_mode, "value", rollout_mode)
        tp = int(config.tensor_model_parallel_size) * int(
            getattr(config, "data_parallel_size", 1) or 1
        )
        args: list[str] = []
        if getattr(config, "max_num_seqs", None):
            args += ["--max-num-seqs", str(config.max_num_seqs)]
        if getattr(config, "max_model_len", None):
            args += ["--max-seq-len", str(config.max_model_len)]
        routed = None
        if getattr(config, "enable_rollout_routing_replay", False):
            hf = getattr(model_config, "hf_config", None)
            layers = getattr(hf, "num_hidden_layers", None)
            top_k = getattr(hf, "num_experts_per_tok", None)
            if layers is None or top_k is None:
                raise AttributeError(
                    "enable_rollout_routing_replay is set, but hf_config is missing "
                    "'num_hidden_layers' or 'num_experts_per_tok': routing replay needs a "
                    "mixture-of-experts model"
                )
            routed = (int(layers), int(top_k))
        return cls(
            model=model_config.local_path,
            tp=tp,
            serve_args=[*args, *kw.pop("serve_args", ())],
            rollout_mode=str(mode),
            free_cache_engine=bool(getattr(config, "free_cache_engine", True)),
            max_model_len=getattr(config, "max_model_len", None),
            prompt_length=getattr(config, "prompt_length", None),
            response_length=getattr(config, "response_length", None),
            routed_experts=routed,
            **kw,
        )

    # --- launching -----------------------------------------------------------------

    async def launch_server(
        self, master_address: str | None = None, master_port: int | None = None
    ) -> None:
        """Start `arbor serve` (when built with a model) and wait until it answers.
        `master_address` / `master_port` (verl's multi-node rendezvous) are not used:
        `arbor-launch` places the ranks itself."""
        if self._client is not None:
            return
        launch = self._launch
        self.process = await asyncio.to_thread(
            ArborProcess,
            launch["model"],
            launch["tp"],
            serve_args=launch["serve_args"],
            arbor_bin=launch["arbor_bin"],
            launch_bin=launch["launch_bin"],
            env=launch["env"],
        )
        self._address = self.process.address
        self._client = Client(self._address, self.api_key)
        if self.max_model_len is None:
            info = await self.client.call("/get_server_info", method="GET")
            self.max_model_len = info.get("context_length")

    def get_server_address(self) -> tuple[str, int]:
        c = self.client
        return c.host, c.port

    def get_master_address(self) -> tuple[None, None]:
        return None, None

    @property
    def address(self) -> str:
        return f"{self.client.host}:{self.client.port}"

    @property
    def client(self) -> Client:
        if self._client is None:
            raise RuntimeError("arbor serve is not running: await launch_server() first")
        return self._client

    def shutdown(self) -> None:
        if self.process is not None:
            self.process.stop()

    # --- generation ----------------------------------------------------------------

    def _max_new(self, sp: dict[str, Any], prompt_len: int) -> int | None:
        limit = sp.pop("max_tokens", None)
        other = sp.pop("max_new_tokens", None)
        if limit is None:
            limit = other
        if limit is None and self.response_length is not None:
            # verl's servers: at most response_length, and within the rollout's budget.
            limit = self.response_length
            if self.prompt_length is not None:
                limit = min(limit, self.prompt_length + self.response_length - prompt_len)
        if self.max_model_len is not None:
            room = self.max_model_len - prompt_len
            if room < 0:
                raise ValueError(
                    f"Prompt length ({prompt_len}) exceeds the model's maximum context length "
                    f"({self.max_model_len})."
                )
            limit = room if limit is None else min(limit, room)
        return None if limit is None else max(0, int(limit))

    async def generate(
        self,
        prompt_ids: Sequence[int] | Any,
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> TokenOutput:
        """Token ids in, token ids out (with their log-probs when `sampling_params`
        has `logprobs` true), through arbor's `POST /generate`.

        `sampling_params` are verl's (vLLM's names: `temperature`, `top_p`, `top_k`,
        `repetition_penalty`, `max_tokens`, `seed`, `stop`, `stop_token_ids`, ...); arbor
        refuses, naming it, any it does not implement. Without `seed`, arbor draws one;
        `extra_fields["sampling_seed"]` returns it (the sample replays with it), and
        `extra_fields["weight_version"]` the weights it ran on.
        """
        if image_data or video_data or kwargs.get("audio_data"):
            raise ValueError(
                "arbor serve takes token prompts only: "
                "image, video and audio data are not supported"
            )
        if self._reject:
            raise RuntimeError(
                f"request {request_id} refused: generation is paused (abort_all_requests)"
            )
        ids = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
        sp = dict(sampling_params)  # verl reuses its dict across turns
        return_logprob = bool(sp.pop("logprobs", False))
        max_new = self._max_new(sp, len(ids))
        if max_new is not None:
            sp["max_new_tokens"] = max_new
        for old, new in _RENAMED.items():
            if old in sp:
                sp[new] = sp.pop(old)
        if sp.pop("include_stop_str_in_output", False):
            sp["no_stop_trim"] = True
        body = {
            "rid": request_id,
            "input_ids": [int(t) for t in ids],
            "sampling_params": sp,
            "return_logprob": return_logprob,
        }
        if self.routed_experts is not None:
            body["return_routed_experts"] = True
        out = await self.client.call("/generate", body, timeout=self.request_timeout)
        meta = out.get("meta_info", {})
        token_ids = [int(t) for t in out.get("output_ids", [])]
        log_probs = None
        if return_logprob:
            log_probs = [float(e[0]) for e in meta.get("output_token_logprobs", [])]
            if len(log_probs) != len(token_ids):
                raise RuntimeError(
                    f"request {request_id}: {len(log_probs)} log-probs for {len(token_ids)} tokens"
                )
        finish = meta.get("finish_reason")
        routed = None
        if self.routed_experts is not None:
            routed = _routed_experts(meta.get("routed_experts"), self.routed_experts, request_id)
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            routed_experts=routed,
            stop_reason=_stop_reason(finish),
            extra_fields={
                "global_steps": self.global_steps,
                "weight_version": meta.get("weight_version"),
                "sampling_seed": meta.get("sampling_seed"),
                "finish_reason": finish,
                "num_cached_tokens": meta.get("cached_tokens"),
            },
        )

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # --- memory --------------------------------------------------------------------

    async def _release(self, tags: list[str]) -> None:
        await self.client.call("/release_memory_occupation", {"tags": tags})

    async def _resume(self, tags: list[str]) -> None:
        await self.client.call("/resume_memory_occupation", {"tags": tags})

    async def wake_up(self) -> None:
        """Resume what `sleep` released, then drop the prefix cache (verl's SGLang
        server: colocated resumes weights and KV, standalone the KV only). In hybrid mode
        the trainer's `ArborRollout` wakes the server with the new weights; resuming here
        would read the last checkpoint on disk, older than what was pushed, so this
        refuses as verl's servers do."""
        if self.rollout_mode == HYBRID:
            raise ValueError(f"wake_up not support rollout_mode {self.rollout_mode}")
        if not self.free_cache_engine:
            return
        await self._resume(
            ["kv_cache"] if self.rollout_mode == STANDALONE else ["kv_cache", "weights"]
        )
        await self.clear_kv_cache()

    async def sleep(self) -> None:
        if not self.free_cache_engine:
            return
        await self._release(
            ["kv_cache"] if self.rollout_mode == STANDALONE else ["kv_cache", "weights"]
        )

    async def is_sleeping(self) -> bool:
        return bool((await self.client.call("/is_sleeping", method="GET"))["is_sleeping"])

    async def release_kv_cache(self) -> None:
        if self.free_cache_engine:
            await self._release(["kv_cache"])

    async def resume_kv_cache(self) -> None:
        if self.free_cache_engine:
            await self._resume(["kv_cache"])
            await self.clear_kv_cache()

    async def clear_kv_cache(self) -> None:
        await self.client.call("/flush_cache")

    # --- aborts --------------------------------------------------------------------

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """End every request in flight (`finish_reason` abort, stop reason "aborted")
        and hold new ones until `resume_generation`, as verl's SGLang server pauses. With
        `reject_request`, `generate` fails at once instead until then."""
        self._reject = reject_request
        return await self.client.call("/pause_generation", {"mode": "abort"})

    async def resume_generation(self) -> None:
        self._reject = False
        await self.client.call("/continue_generation")

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        """End the request named `request_id` (verl's vLLM server's answer shape)."""
        r = await self.client.call("/abort_request", {"rid": request_id})
        n = int(r.get("aborted", 0)) if isinstance(r, dict) else 0
        return {"aborted": n > 0, "request_id": request_id}

    async def wait_for_requests_to_drain(self, poll_s: float = 0.05) -> None:
        while True:
            load = await self.client.call("/get_load", method="GET")
            if all(d.get("num_reqs", 0) == 0 and d.get("num_waiting_reqs", 0) == 0 for d in load):
                return
            await asyncio.sleep(poll_s)

    # --- weights -------------------------------------------------------------------

    async def update_weights_from_disk(
        self,
        model_path: str | os.PathLike[str],
        weight_version: str | None = None,
        policy: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if policy is not None:
            body["policy"] = policy
        return await self.client.call("/update_weights_from_disk", body)

    async def update_weights_from_tensors(
        self,
        weights: Iterable[tuple[str, Any]] | AsyncIterator[tuple[str, Any]],
        *,
        weight_version: str | None = None,
        bucket_bytes: int = 256 << 20,
        policy: str | None = None,
    ) -> dict[str, Any]:
        """Push `(name, torch tensor)` pairs as safetensors parts of at most about
        `bucket_bytes` (each staged, `commit=false`), then commit them as one update."""
        return await push_tensors(
            self.client,
            weights,
            weight_version=weight_version,
            bucket_bytes=bucket_bytes,
            policy=policy,
        )

    async def weight_version(self) -> str:
        return str((await self.client.call("/get_weight_version", method="GET"))["weight_version"])

    # --- profiling (arbor has no profiler route) -----------------------------------

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class ArborRollout:
    """verl's `BaseRollout` (verl/workers/rollout/base.py) for `arbor serve`: what each
    trainer rank calls around a weight sync (`resume(["weights"])`,
    `update_weights(weights)`, `resume(["kv_cache"])`, and `release()` before training).

    Only the rank that leads the server (`leader`, by default every instance) talks to
    it; the others still consume the weights, whose generator gathers shards
    collectively. Weights pushed while the server is released are loaded by the push,
    so `resume(["weights"])` waits for it instead of reading the last checkpoint from disk
    (which a push never wrote)."""

    def __init__(
        self,
        server: ArborHttpServer | str,
        *,
        leader: bool = True,
        bucket_bytes: int = 256 << 20,
        free_cache_engine: bool = True,
    ) -> None:
        self.server = server if isinstance(server, ArborHttpServer) else ArborHttpServer(server)
        self.leader = leader
        self.bucket_bytes = bucket_bytes
        self.free_cache_engine = free_cache_engine
        self._weights_released = False
        self._weights_due = False
        self.updates = 0

    async def release(self) -> None:
        if self.leader and self.free_cache_engine:
            await self.server.client.call(
                "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}
            )
            self._weights_released = True

    async def resume(self, tags: list[str]) -> None:
        if not (self.leader and self.free_cache_engine):
            return
        tags = list(tags)
        if "weights" in tags and self._weights_released:
            tags.remove("weights")
            self._weights_due = True  # the next push loads them; see the class's docstring
        if "kv_cache" in tags and self._weights_due:
            tags.append("weights")  # resumed without a push in between: from disk after all
            self._weights_due = False
            self._weights_released = False
        if tags:
            await self.server.client.call("/resume_memory_occupation", {"tags": tags})
            if "kv_cache" in tags:
                await self.server.clear_kv_cache()

    async def update_weights(
        self,
        weights: Iterable[tuple[str, Any]] | AsyncIterator[tuple[str, Any]],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> dict[str, Any] | None:
        """Push every `(name, tensor)` and apply them as one update. The version is
        `weight_version`, else `global_steps`, else arbor's count of updates."""
        if wire_format != "named_tensors":
            raise NotImplementedError(
                f"wire_format {wire_format!r}: arbor takes full tensors (named_tensors)"
            )
        if not self.leader:
            async for _ in aiter_any(weights):
                pass
            return None
        version = kwargs.get("weight_version", kwargs.get("global_steps"))
        r = await self.server.update_weights_from_tensors(
            weights,
            weight_version=None if version is None else str(version),
            bucket_bytes=self.bucket_bytes,
        )
        self.updates += 1
        self._weights_due = False
        self._weights_released = False
        return r

    async def update_weights_from_disk(
        self, model_path: str | os.PathLike[str], weight_version: str | None = None
    ) -> dict[str, Any]:
        r = await self.server.update_weights_from_disk(model_path, weight_version)
        self.updates += 1
        self._weights_due = False
        self._weights_released = False
        return r


_SERVER_OPTIONS: dict[str, Any] = {}


def register(
    name: str = "arbor",
    *,
    arbor_bin: str | os.PathLike[str] | None = None,
    launch_bin: str | os.PathLike[str] | None = None,
    serve_args: Sequence[str] = (),
) -> None:
    """Make `actor_rollout_ref.rollout.name=arbor` select arbor in verl: the replica in
    `RolloutReplicaRegistry`, the trainer-side adapter in `get_rollout_class`'s table.
    The replica's server actor runs `arbor serve` (found as `ArborProcess` finds it,
    unless given here) with `serve_args` added. Needs verl with its Ray stack."""
    from verl.workers.rollout import base as verl_base
    from verl.workers.rollout import replica as verl_replica

    verl_replica.RolloutReplicaRegistry.register(name, lambda: _verl_classes()[0])
    verl_base._ROLLOUT_REGISTRY[(name, "async")] = f"{__name__}.VerlArborRollout"
    _SERVER_OPTIONS.update(
        arbor_bin=None if arbor_bin is None else str(arbor_bin),
        launch_bin=None if launch_bin is None else str(launch_bin),
        serve_args=tuple(serve_args),
    )


def _verl_classes() -> tuple[type, type]:
    """verl's subclasses, built on first use so that this module imports without verl."""
    global VerlArborReplica, VerlArborRollout
    if "VerlArborReplica" in globals():
        return VerlArborReplica, VerlArborRollout
    import ray
    from verl.workers.rollout.base import BaseRollout
    from verl.workers.rollout.replica import RolloutReplica

    class _Rollout(BaseRollout):  # type: ignore[misc]
        def __init__(self, config: Any, model_config: Any, device_mesh: Any, **kw: Any) -> None:
            super().__init__(config, model_config, device_mesh)
            tp_rank = 0 if device_mesh is None else device_mesh["infer_tp"].get_local_rank()
            # verl's SGLang adapter finds its server the same way: replica = rank // TP.
            tp = self.config.tensor_model_parallel_size * self.config.data_parallel_size
            replica = int(os.environ.get("RANK", "0")) // max(1, tp)
            self._actor_name = f"arbor_server_{replica}"
            self._inner: ArborRollout | None = None
            self._leader = tp_rank == 0
            self._free = bool(getattr(self.config, "free_cache_engine", True))

        async def _rollout(self) -> ArborRollout:
            if self._inner is None:
                host, port = await ray.get_actor(self._actor_name).get_server_address.remote()
                self._inner = ArborRollout(
                    f"{host}:{port}", leader=self._leader, free_cache_engine=self._free
                )
            return self._inner

        async def resume(self, tags: list[str]) -> None:
            await (await self._rollout()).resume(tags)

        async def release(self) -> None:
            await (await self._rollout()).release()

        async def update_weights(
            self, weights: Any, wire_format: str = "named_tensors", **kw: Any
        ) -> Any:
            return await (await self._rollout()).update_weights(weights, wire_format, **kw)

    class _Replica(RolloutReplica):  # type: ignore[misc]
        async def launch_servers(self) -> None:
            # One arbor serve per replica, on the node of its first worker: arbor-launch
            # runs the TP ranks (multi-node replicas are not supported here).
            if self.nnodes != 1:
                raise NotImplementedError("arbor replicas span one node")
            server_cls = ray.remote(ArborHttpServer)
            # As verl's vLLM replica: the node and the GPUs Ray gave the replica's workers,
            # which the ranks then take (each its local rank's visible GPU).
            infos = await asyncio.gather(
                *[
                    w.__ray_call__.remote(
                        lambda self: (
                            ray.get_runtime_context().get_node_id(),
                            ray.get_runtime_context().get_accelerator_ids().get("GPU", []),
                        )
                    )
                    for w in self.workers
                ]
            )
            node_id = infos[0][0]
            gpus = [str(g) for _, ids in infos for g in ids]
            env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else None
            options = dict(_SERVER_OPTIONS)
            options["serve_args"] = ("--device", "auto", *options.get("serve_args", ()))
            server = server_cls.options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                ),
                name=f"arbor_server_{self.replica_rank}",
                max_concurrency=self.max_concurrency,
            ).remote(
                model=self.model_config.local_path,
                tp=self.world_size,
                rollout_mode=self.rollout_mode.value,
                free_cache_engine=self.config.free_cache_engine,
                max_model_len=self.config.max_model_len,
                prompt_length=self.config.prompt_length,
                response_length=self.config.response_length,
                env=env,
                **options,
            )
            await server.launch_server.remote()
            self.servers = [server]
            self._server_handle = server
            host, port = await server.get_server_address.remote()
            self._server_address = f"{host}:{port}"

    VerlArborReplica, VerlArborRollout = _Replica, _Rollout
    return _Replica, _Rollout


def __getattr__(name: str) -> Any:
    if name in ("VerlArborReplica", "VerlArborRollout"):
        replica, rollout = _verl_classes()
        return replica if name == "VerlArborReplica" else rollout
    raise AttributeError(name)
