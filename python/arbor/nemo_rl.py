"""`arbor serve` behind NeMo-RL's `GenerationInterface`
(nemo_rl/models/generation/interfaces.py).

`ArborGeneration.generate(data, greedy)` takes NeMo-RL's `GenerationDatumSpec` (right-padded
`input_ids` [B, T], `input_lengths` [B], optional per-sample `stop_strings`) and returns its
`GenerationOutputSpec`: `output_ids` (prompt then generated tokens, right-padded with the
pad id), `logprobs` (0 at prompt positions, arbor's log-prob at each generated one),
`generation_lengths`, `unpadded_sequence_lengths`, `truncated` (ended by the length
limit), as NeMo-RL's SGLang backend builds them; each sample is one `POST /generate`.
`prepare_for_generation(tags=...)` / `finish_generation()` resume and release the
server's memory, `invalidate_kv_cache()` flushes it.

NeMo-RL's own refit paths move weights by CUDA IPC or by its NCCL collective from its
policy workers; they are not wired here. Weights go in with `update_weights_from_tensors`
(pushed over HTTP) or `update_weights_from_disk`.

nemo_rl is not needed to import this module: the output is its `BatchedDataDict` when it
imports, else a plain dict with the same keys.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from arbor._serve import ArborHttpError, ArborProcess, Client, push_tensors

try:  # NeMo-RL's own types when it (and Ray) import
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict as _Batch
    from nemo_rl.models.generation.interfaces import GenerationInterface as _Base
except ImportError:
    _Batch = dict  # type: ignore[assignment,misc]
    _Base = object  # type: ignore[assignment,misc]

__all__ = ["ArborGeneration", "ArborHttpError"]

T = TypeVar("T")


class ArborGeneration(_Base):  # type: ignore[misc,valid-type]
    """NeMo-RL's `GenerationInterface` on `arbor serve` (at `address`, or started on
    `model` at TP `tp`).

    `config` is NeMo-RL's `GenerationConfig` (`max_new_tokens`, `temperature`, `top_p`,
    `top_k`, `stop_token_ids`, `stop_strings`, `_pad_token_id`); `seed` fixes every
    sample's seed (else arbor draws one per sample, returned in `sampling_seeds`).
    """

    def __init__(
        self,
        config: dict[str, Any],
        *,
        address: str | None = None,
        model: str | os.PathLike[str] | None = None,
        tp: int = 1,
        serve_args: Sequence[str] = (),
        arbor_bin: str | os.PathLike[str] | None = None,
        launch_bin: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
        max_concurrency: int = 256,
        seed: int | None = None,
    ) -> None:
        if (address is None) == (model is None):
            raise ValueError("give either the address of a running arbor serve or a model to serve")
        self.cfg = config
        self.seed = seed
        self.process: ArborProcess | None = None
        if model is not None:
            self.process = ArborProcess(
                model, tp, serve_args=serve_args, arbor_bin=arbor_bin, launch_bin=launch_bin
            )
            address = self.process.address
        assert address is not None
        self.client = Client(address, api_key)
        self.address = address
        self.max_concurrency = max_concurrency
        # generate() is synchronous, as NeMo-RL calls it; the HTTP calls run on a loop of
        # their own, so it works from inside a running loop too.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._context: int | None = None

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # --- generation ----------------------------------------------------------------

    def _params(self, greedy: bool, max_new: int, stop: list[str]) -> dict[str, Any]:
        cfg = self.cfg
        sp: dict[str, Any] = {
            "max_new_tokens": max_new,
            "temperature": 0.0 if greedy else float(cfg.get("temperature", 1.0)),
            "top_p": 1.0 if greedy else float(cfg.get("top_p", 1.0)),
            # As NeMo-RL's SGLang backend: stop strings stay in the output.
            "no_stop_trim": True,
        }
        top_k = cfg.get("top_k")
        if not greedy and top_k is not None and top_k != -1:
            sp["top_k"] = int(top_k)
        if cfg.get("stop_token_ids"):
            sp["stop_token_ids"] = [int(t) for t in cfg["stop_token_ids"]]
        if stop:
            sp["stop"] = stop
        if self.seed is not None:
            sp["sampling_seed"] = self.seed
        return sp

    def _stops(self, data: Any, n: int) -> list[list[str]]:
        base = set(self.cfg.get("stop_strings") or [])
        per = data.get("stop_strings") or [None] * n
        out = []
        for s in per:
            merged = set(base)
            if isinstance(s, str):
                merged.add(s)
            elif s:
                merged.update(s)
            out.append(sorted(merged))
        return out

    async def _context_length(self) -> int:
        if self._context is None:
            info = await self.client.call("/get_server_info", method="GET")
            self._context = int(info["context_length"])
        return self._context

    async def _one(
        self, ids: list[int], sp: dict[str, Any]
    ) -> tuple[list[int], list[float], bool, Any]:
        out = await self.client.call(
            "/generate", {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
        )
        meta = out["meta_info"]
        tokens = [int(t) for t in out["output_ids"]]
        lps = [float(e[0]) for e in meta.get("output_token_logprobs", [])]
        finish = meta.get("finish_reason") or {}
        return tokens, lps, finish.get("type") == "length", meta.get("sampling_seed")

    async def _generate(self, data: Any, greedy: bool) -> dict[str, Any]:
        import torch

        input_ids, lengths = data["input_ids"], data["input_lengths"]
        b = int(lengths.shape[0])
        pad = int(self.cfg.get("_pad_token_id", 0))
        context = await self._context_length()
        stops = self._stops(data, b)
        sem = asyncio.Semaphore(self.max_concurrency)

        async def one(i: int) -> tuple[list[int], list[float], bool, Any]:
            n = int(lengths[i])
            max_new = max(0, min(int(self.cfg["max_new_tokens"]), context - n - 1))
            if max_new == 0:
                return [], [], False, None
            async with sem:
                return await self._one(
                    input_ids[i, :n].tolist(), self._params(greedy, max_new, stops[i])
                )

        results = await asyncio.gather(*[one(i) for i in range(b)])
        total = max(
            [int(input_ids.shape[1])] + [int(lengths[i]) + len(r[0]) for i, r in enumerate(results)]
        )
        output_ids = torch.full((b, total), pad, dtype=input_ids.dtype)
        logprobs = torch.zeros((b, total), dtype=torch.float32)
        gen_lens, seq_lens = [], []
        for i, (tokens, lps, _, _) in enumerate(results):
            n = int(lengths[i])
            output_ids[i, :n] = input_ids[i, :n]
            if tokens:
                output_ids[i, n : n + len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
                logprobs[i, n : n + len(lps)] = torch.tensor(lps, dtype=torch.float32)
            gen_lens.append(len(tokens))
            seq_lens.append(n + len(tokens))
        return _Batch(
            {
                "output_ids": output_ids,
                "logprobs": logprobs,
                "generation_lengths": torch.tensor(gen_lens, dtype=torch.long),
                "unpadded_sequence_lengths": torch.tensor(seq_lens, dtype=torch.long),
                "truncated": torch.tensor([r[2] for r in results], dtype=torch.bool),
                "sampling_seeds": [r[3] for r in results],
            }
        )

    def generate(self, data: Any, greedy: bool = False) -> Any:
        """NeMo-RL's batch generate: every sample at once, the results as its spec lays
        them out."""
        return self._run(self._generate(data, greedy))

    async def generate_async(
        self, data: Any, greedy: bool = False
    ) -> AsyncIterator[tuple[int, Any]]:
        """One sample (batch size 1, as NeMo-RL's async contract): yields `(0, result)`."""
        if int(data["input_lengths"].shape[0]) != 1:
            raise ValueError("generate_async takes one sample at a time")
        fut = asyncio.run_coroutine_threadsafe(self._generate(data, greedy), self._loop)
        yield 0, await asyncio.wrap_future(fut)

    # --- memory and lifecycle ------------------------------------------------------

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Resume what is released (`tags`: `weights`, `kv_cache`; default both). Waking a
        running server changes nothing."""
        tags = kwargs.get("tags") or ["weights", "kv_cache"]
        sleeping = self._run(self.client.call("/is_sleeping", method="GET"))["is_sleeping"]
        if sleeping:
            self._run(self.client.call("/resume_memory_occupation", {"tags": list(tags)}))
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Release the weights and the KV cache (`tags` to release fewer)."""
        tags = kwargs.get("tags") or ["weights", "kv_cache"]
        self._run(self.client.call("/release_memory_occupation", {"tags": list(tags)}))
        return True

    def invalidate_kv_cache(self) -> bool:
        self._run(self.client.call("/flush_cache"))
        return True

    def shutdown(self) -> bool:
        if self.process is not None:
            self.process.stop()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        return True

    # --- weights -------------------------------------------------------------------

    def update_weights_from_tensors(
        self,
        weights: Iterable[tuple[str, Any]],
        *,
        weight_version: str | None = None,
        bucket_bytes: int = 256 << 20,
    ) -> dict[str, Any]:
        """Push `(name, torch tensor)` pairs (HF names) and apply them as one update."""
        return self._run(
            push_tensors(
                self.client, weights, weight_version=weight_version, bucket_bytes=bucket_bytes
            )
        )

    def update_weights_from_disk(
        self, model_path: str | os.PathLike[str], weight_version: str | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._run(self.client.call("/update_weights_from_disk", body))

    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int
    ) -> list[Any]:
        raise NotImplementedError(
            "NeMo-RL's NCCL refit is not wired to arbor: push the weights with "
            "update_weights_from_tensors, or join arbor's group with /init_weights_update_group"
        )

    def update_weights_from_collective(self) -> list[Any]:
        raise NotImplementedError("see init_collective")

    def update_weights_via_ipc_zmq(self) -> list[Any]:
        raise NotImplementedError(
            "CUDA IPC refit needs the engine in the trainer's process; arbor serve runs its own"
        )

    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None:
        return None
