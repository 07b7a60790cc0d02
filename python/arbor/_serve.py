"""What the in-process adapters (`arbor.verl`, `arbor.nemo_rl`) share: starting
`arbor serve`, JSON calls to it over asyncio streams, and pushing tensors to it as
safetensors parts."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

_LISTENING = re.compile(r"listening on http://(\S+?):(\d+)")


class ArborHttpError(RuntimeError):
    """A route answered with an error: its status and arbor's message."""

    def __init__(self, route: str, status: int, message: str) -> None:
        super().__init__(f"{route}: HTTP {status}: {message}")
        self.route = route
        self.status = status
        self.message = message


def _error_message(body: bytes) -> str:
    try:
        v = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")
    if isinstance(v, dict):
        err = v.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in v:
            return str(v["message"])
    return body.decode("utf-8", "replace")


async def _request(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    content_type: str = "application/json",
    api_key: str | None = None,
    timeout: float | None = None,
) -> tuple[int, bytes]:
    """One HTTP/1.1 exchange on its own connection (loopback connections are cheap, and
    a connection per request lets any number run at once without a pool)."""

    async def go() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            head = [
                f"{method} {path} HTTP/1.1",
                f"Host: {host}:{port}",
                "Connection: close",
                f"Content-Length: {len(body or b'')}",
            ]
            if body is not None:
                head.append(f"Content-Type: {content_type}")
            if api_key:
                head.append(f"Authorization: Bearer {api_key}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
            if body:
                writer.write(body)
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass
        sep = raw.find(b"\r\n\r\n")
        if sep < 0:
            raise ConnectionError(f"{method} {path}: no HTTP response from {host}:{port}")
        lines = raw[:sep].decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])
        }
        payload = raw[sep + 4 :]
        if headers.get("transfer-encoding", "").lower() == "chunked":
            payload = _dechunk(payload)
        return status, payload

    return await asyncio.wait_for(go(), timeout)


def _dechunk(data: bytes) -> bytes:
    out, i = bytearray(), 0
    while True:
        eol = data.index(b"\r\n", i)
        size = int(data[i:eol].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[eol + 2 : eol + 2 + size]
        i = eol + 2 + size + 2


def _find(name: str, given: str | os.PathLike[str] | None, env: str) -> str:
    for cand in (given, os.environ.get(env), shutil.which(name)):
        if cand and Path(cand).is_file():
            return str(cand)
    raise FileNotFoundError(f"cannot find `{name}`: pass its path, set ${env}, or put it on PATH")


class ArborProcess:
    """`arbor serve` started by this process (under `arbor-launch -n TP` when TP > 1),
    bound to loopback on a port it picks itself; `stop()` ends it."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        tp: int = 1,
        *,
        serve_args: Sequence[str] = (),
        arbor_bin: str | os.PathLike[str] | None = None,
        launch_bin: str | os.PathLike[str] | None = None,
        startup_timeout: float = 120.0,
        log_path: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        arbor = _find("arbor", arbor_bin, "ARBOR_BIN")
        cmd = [arbor, "serve", "--model", str(model), "--port", "0", *serve_args]
        if tp > 1:
            cmd = [_find("arbor-launch", launch_bin, "ARBOR_LAUNCH_BIN"), "-n", str(tp), "--", *cmd]
        self.cmd = cmd
        self.log: list[str] = []
        self._log_file = open(log_path, "w") if log_path else None
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, **env} if env else None,
        )
        found: list[tuple[str, int]] = []
        ready = threading.Event()

        def pump() -> None:
            # The server logs on this pipe all its life: keep reading so it never blocks.
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line)
                if self._log_file:
                    self._log_file.write(line)
                    self._log_file.flush()
                m = _LISTENING.search(line)
                if m and not found:
                    found.append((m.group(1), int(m.group(2))))
                    ready.set()
            ready.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + startup_timeout
        if not ready.wait(startup_timeout) or not found:
            self.stop()
            raise RuntimeError(f"arbor serve did not start: {' '.join(cmd)}\n{''.join(self.log)}")
        self.host, self.port = found[0]
        while True:  # listening comes before the ranks have loaded: wait for /health
            try:
                with urllib.request.urlopen(f"http://{self.address}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"arbor serve did not become healthy:\n{''.join(self.log)}")
            time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> ArborProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Client:
    """JSON calls to one `arbor serve`."""

    def __init__(self, address: str, api_key: str | None = None) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address must be HOST:PORT, got {address!r}")
        self.host, self.port = host.strip("[]"), int(port)
        self.api_key = api_key

    async def call(
        self,
        route: str,
        body: dict[str, Any] | bytes | None = None,
        *,
        method: str = "POST",
        query: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        path = route + ("?" + urllib.parse.urlencode(query) if query else "")
        if isinstance(body, bytes):
            data, ctype = body, "application/octet-stream"
        else:
            data = (
                json.dumps(body if body is not None else {}).encode() if method == "POST" else None
            )
            ctype = "application/json"
        status, payload = await _request(
            self.host, self.port, method, path, data, ctype, self.api_key, timeout
        )
        if status >= 400:
            raise ArborHttpError(route, status, _error_message(payload))
        return json.loads(payload) if payload.strip() else None


async def aiter_any(xs: Iterable[Any] | AsyncIterator[Any]) -> AsyncIterator[Any]:
    if hasattr(xs, "__aiter__"):
        async for x in xs:  # type: ignore[union-attr]
            yield x
    else:
        for x in xs:  # type: ignore[union-attr]
            yield x


_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def safetensors_bytes(named: Iterable[tuple[str, Any]]) -> bytes:
    """A safetensors image of `(name, torch tensor)` pairs (bf16, f16 or f32; any device,
    any layout), without the `safetensors` package."""
    tensors = []
    header: dict[str, Any] = {}
    offset = 0
    for name, t in named:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be pushed (bf16, f16 or f32)")
        # A fresh CPU copy owns exactly its elements, in order.
        c = t.detach().to("cpu").contiguous().clone()
        n = c.numel() * c.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(c.shape),
            "data_offsets": [offset, offset + n],
        }
        tensors.append((c, n))
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    out = bytearray(len(head).to_bytes(8, "little") + head)
    for c, n in tensors:
        out += ctypes.string_at(c.data_ptr(), n) if n else b""
    return bytes(out)


async def push_tensors(
    client: Client,
    weights: Iterable[tuple[str, Any]] | AsyncIterator[tuple[str, Any]],
    *,
    weight_version: str | None = None,
    bucket_bytes: int = 256 << 20,
    policy: str | None = None,
) -> dict[str, Any]:
    """Push `(name, torch tensor)` pairs to `/update_weights_from_tensor` as safetensors
    parts of at most about `bucket_bytes` (each staged, `commit=false`), then commit them
    as one update; returns the commit's answer."""
    bucket: list[tuple[str, Any]] = []
    size = 0

    async def send(named: list[tuple[str, Any]]) -> None:
        data = await asyncio.to_thread(safetensors_bytes, named)
        await client.call("/update_weights_from_tensor", data, query={"commit": "false"})

    async for name, t in aiter_any(weights):
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            await send(bucket)
            bucket, size = [], 0
    if bucket:
        await send(bucket)
    query = {"commit": "true"}
    if weight_version is not None:
        query["weight_version"] = weight_version
    if policy is not None:
        query["policy"] = policy
    return await client.call("/update_weights_from_tensor", b"", query=query)
