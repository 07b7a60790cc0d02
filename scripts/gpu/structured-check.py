#!/usr/bin/env python3
"""The cost of structured decoding and its bits across TP sizes, against a running
`arbor serve` (scripts/gpu/structured-check.sh starts the servers).

  structured-check.py vocab MODEL_DIR N
      gives the model's byte-level tokenizer.json N-258 more tokens (words, numbers,
      JSON punctuation), so that the constrained-decoding tables have a real vocabulary's
      size; ids past them stay unwritable.
  structured-check.py widen MODEL_DIR N
      gives the model's embedding and LM head N rows (the new ones random), so that a tiny
      model on the CPU has a real vocabulary's logits rows: its forward is cheap, which
      leaves the host's per-row work of constrained decoding to be measured.
  structured-check.py speed --addr HOST:PORT --streams 64 --tokens 256 --out FILE
      the same chat request, `streams` at once, unconstrained, with a JSON schema
      (`response_format`) and with a forced tool call, each run `--repeat` times in turn;
      the decode tokens/s of the window where every stream is decoding (usage counts from
      `stream_options.continuous_usage_stats`), and each constrained mode's ratio to the
      unconstrained one.
  structured-check.py bits --addr HOST:PORT --out FILE
      constrained requests (greedy and seeded, with log-probs) saved for `compare`.
  structured-check.py compare FILE FILE...
      the saved bits equal, else a list of what differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

# An array that cannot end within the run's tokens: every stream decodes to max_tokens.
ROW = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 24},
        "score": {"type": "number"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "maxItems": 4,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "score", "tags", "ok"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"rows": {"type": "array", "items": ROW, "minItems": 5000}},
    "required": ["rows"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "store_rows",
            "description": "Store rows",
            "parameters": SCHEMA,
        },
    }
]
MESSAGES = [
    {"role": "user", "content": "List the rows of the table as JSON, all of them."}
]


def body(mode: str, tokens: int, seed: int) -> dict[str, Any]:
    # Every mode lists the tool, so that the prompts (the template writes the tools into
    # them) and with them the attention's work are the same; only `tool` forces a call.
    b: dict[str, Any] = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": tokens,
        "temperature": 1.0,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if mode == "json_schema":
        b["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "rows", "schema": SCHEMA},
        }
    elif mode == "tool":
        b["tool_choice"] = {"type": "function", "function": {"name": "store_rows"}}
    return b


def stream_one(url: str, b: dict[str, Any], timeout: float) -> list[tuple[float, int]]:
    """(time, completion tokens so far) at every chunk that reports usage."""
    marks: list[tuple[float, int]] = []
    with requests.post(url, json=b, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:400]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            c = json.loads(data)
            if "error" in c:
                raise RuntimeError(f"stream error: {c['error']}")
            u = c.get("usage")
            if u:
                marks.append((time.monotonic(), int(u["completion_tokens"])))
    return marks


def steady_rate(runs: list[list[tuple[float, int]]]) -> tuple[float, float, int]:
    """Tokens/s over the window where every stream has its first token and none has its
    last; the window's seconds and the tokens in it."""
    start = max(m[0][0] for m in runs)
    end = min(m[-1][0] for m in runs)
    if end <= start:
        raise RuntimeError("the streams never all decoded at once (too few tokens?)")

    def at(m: list[tuple[float, int]], t: float) -> int:
        n = 0
        for ts, k in m:
            if ts > t:
                break
            n = k
        return n

    tokens = sum(at(m, end) - at(m, start) for m in runs)
    return tokens / (end - start), end - start, tokens


PHASES = ("between", "plan", "execute", "masks", "apply")


def loop_counters(addr: str) -> dict[str, float]:
    """The server's step count and its loop's seconds by phase (`/metrics`)."""
    text = requests.get(f"http://{addr}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("arbor_steps_total "):
            out["steps"] = float(line.split()[1])
        elif line.startswith("arbor_generation_tokens_total "):
            out["generated"] = float(line.split()[1])
        elif line.startswith('arbor_loop_seconds_total{phase="'):
            phase = line.split('"')[1]
            out[phase] = float(line.split()[1])
    return out


def run_mode(
    addr: str,
    mode: str,
    streams: int,
    tokens: int,
    timeout: float,
    measure: bool = True,
) -> dict[str, Any]:
    url = f"http://{addr}/v1/chat/completions"
    out: list[Any] = [None] * streams
    errors: list[str] = []

    def worker(i: int) -> None:
        try:
            out[i] = stream_one(url, body(mode, tokens, 1000 + i), timeout)
        except Exception as e:  # noqa: BLE001 - reported with the mode below
            errors.append(f"stream {i}: {e}")

    before = loop_counters(addr) if measure else {}
    t0 = time.monotonic()
    threads = [
        threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    wall = time.monotonic() - t0
    if errors:
        raise RuntimeError(f"{mode}: {len(errors)} streams failed, first: {errors[0]}")
    if any(o is None or not o for o in out):
        raise RuntimeError(f"{mode}: a stream did not finish within {timeout} s")
    short = [i for i, o in enumerate(out) if o[-1][1] != tokens]
    if short:
        raise RuntimeError(f"{mode}: streams {short[:8]} ended before {tokens} tokens")
    if not measure:
        return {"mode": mode, "wall_s": wall}
    rate, window, n = steady_rate(out)
    after = loop_counters(addr)
    steps = max(after.get("steps", 0.0) - before.get("steps", 0.0), 1.0)
    per_step = {
        p: 1e3 * (after.get(p, 0.0) - before.get(p, 0.0)) / steps for p in PHASES
    }
    # The engine's rate: tokens generated per second of rank 0's loop while it steps
    # (plan, execute, apply; not the time between steps, which includes the clients'
    # arrivals), over the whole run.
    busy = sum(
        after.get(p, 0.0) - before.get(p, 0.0) for p in ("plan", "execute", "apply")
    )
    generated = after.get("generated", 0.0) - before.get("generated", 0.0)
    return {
        "mode": mode,
        "rate": rate,
        "window_s": window,
        "tokens": n,
        "wall_s": wall,
        "steps": steps,
        "loop_ms_per_step": per_step,
        "engine_rate": generated / busy if busy > 0 else 0.0,
    }


def speed(a: argparse.Namespace) -> int:
    modes = ["plain", "json_schema", "tool"]
    # A warm-up of each mode (compiles the grammars' tables, the CUDA graphs' batch
    # sizes), not timed: short streams need not all decode at once.
    for m in modes:
        run_mode(a.addr, m, a.streams, min(a.tokens, 32), a.timeout, measure=False)
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(a.repeat):
        for m in modes:
            res = run_mode(a.addr, m, a.streams, a.tokens, a.timeout)
            results[m].append(res)
            print(
                f"  round {r + 1} {m:12s} {res['rate']:9.1f} tok/s "
                f"({res['tokens']} tokens in a {res['window_s']:.2f} s window, wall {res['wall_s']:.2f} s)",
                flush=True,
            )
    med = {m: statistics.median(x["rate"] for x in results[m]) for m in modes}
    eng = {m: statistics.median(x["engine_rate"] for x in results[m]) for m in modes}
    step = {
        m: statistics.median(
            sum(x["loop_ms_per_step"][p] for p in ("plan", "execute", "apply"))
            for x in results[m]
        )
        for m in modes
    }
    # Three measures side by side: the step's (rank 0's loop per step while it steps:
    # plan, execute, apply, from /metrics; at 64 decode rows a step, the throughput is
    # their inverse), the engine's (tokens per second of that time over the whole run,
    # which also moves with how the clients' arrivals split the prefills into steps) and
    # the clients' (tokens/s of the window where every stream decodes, timed by this
    # process's threads as chunks arrive: noisy, the window is a fraction of a second).
    # The verdict is the step's.
    print(
        f"decode throughput at {a.streams} streams x {a.tokens} tokens (median of {a.repeat}):"
    )
    print(
        f"  {'mode':12s} {'step ms':>8s} {'ratio':>7s} {'engine':>10s} {'ratio':>7s} "
        f"{'clients':>10s} {'ratio':>7s}"
    )
    for m in modes:
        print(
            f"  {m:12s} {step[m]:8.3f} {step['plain'] / step[m]:7.3f} "
            f"{eng[m]:10.1f} {eng[m] / eng['plain']:7.3f} "
            f"{med[m]:10.1f} {med[m] / med['plain']:7.3f}"
        )
    # Where rank 0's loop spent each step (whole runs, prefill included; masks is part of
    # execute): the median over the rounds.
    print(
        f"rank 0's loop, ms per step (median of {a.repeat} runs; masks within execute):"
    )
    print(f"  {'mode':12s} {'steps':>6s} " + " ".join(f"{p:>8s}" for p in PHASES))
    for m in modes:
        steps = statistics.median(x["steps"] for x in results[m])
        cells = [
            statistics.median(x["loop_ms_per_step"][p] for x in results[m])
            for p in PHASES
        ]
        print(f"  {m:12s} {steps:6.0f} " + " ".join(f"{c:8.3f}" for c in cells))
    Path(a.out).write_text(
        json.dumps(
            {"median": med, "engine": eng, "step_ms": step, "runs": results}, indent=1
        )
    )
    ok = all(step["plain"] / step[m] >= 1 - a.max_cost for m in ("json_schema", "tool"))
    verdict = "PASS" if ok else "FAIL"
    cost = {m: 1 - step["plain"] / step[m] for m in ("json_schema", "tool")}
    print(
        f"{verdict} structured decoding cost (per step): json_schema {cost['json_schema']:+.1%}, "
        f"tool {cost['tool']:+.1%} of decode throughput (limit {a.max_cost:.0%})"
    )
    return 0 if ok else 1


def bits(a: argparse.Namespace) -> int:
    url = f"http://{a.addr}/v1/chat/completions"
    probes = []
    for mode in ("json_schema", "tool"):
        for seed, temp in ((0, 0.0), (7, 1.0)):
            b = body(mode, a.tokens, seed)
            b.update(
                {
                    "stream": False,
                    "temperature": temp,
                    "logprobs": True,
                    "top_logprobs": 2,
                }
            )
            b.pop("stream_options")
            probes.append((mode, seed, b))
    out = []
    for mode, seed, b in probes:
        r = requests.post(url, json=b, timeout=a.timeout)
        if r.status_code != 200:
            print(f"FAIL {mode} seed {seed}: HTTP {r.status_code}: {r.text[:400]}")
            return 1
        c = r.json()["choices"][0]
        text = c["message"].get("content") or json.dumps(c["message"].get("tool_calls"))
        out.append(
            {
                "probe": f"{mode} seed {seed}",
                "token_ids": c.get("token_ids"),
                "logits_digest": c.get("logits_digest"),
                "logprobs": c.get("logprobs"),
                "finish_reason": c.get("finish_reason"),
                "text": text,
            }
        )
        print(
            f"  {mode} seed {seed}: {len(c.get('token_ids') or [])} tokens: {text[:80]!r}"
        )
    Path(a.out).write_text(json.dumps(out))
    return 0


def compare(a: argparse.Namespace) -> int:
    runs = [(f, json.loads(Path(f).read_text())) for f in a.files]
    base_name, base = runs[0]
    bad = 0
    for name, run in runs[1:]:
        for x, y in zip(base, run):
            same = all(
                x[k] == y[k]
                for k in ("token_ids", "logits_digest", "logprobs", "finish_reason")
            )
            if not same:
                bad += 1
                print(f"  DIFF {x['probe']}: {base_name} vs {name}")
        if len(base) != len(run):
            bad += 1
            print(f"  DIFF probe count: {base_name} {len(base)} vs {name} {len(run)}")
    n = len(base)
    verdict = "PASS" if bad == 0 and n > 0 else "FAIL"
    print(
        f"{verdict} constrained bits: {n} probes identical across {len(runs)} TP sizes"
        if bad == 0
        else f"{verdict} constrained bits: {bad} differences"
    )
    return 0 if bad == 0 and n > 0 else 1


def vocab(a: argparse.Namespace) -> int:
    path = Path(a.model) / "tokenizer.json"
    t = json.loads(path.read_text())
    v: dict[str, int] = t["model"]["vocab"]
    # GPT-2's byte characters: the printable bytes stand for themselves, ' ' is 'Ġ'.
    space = "\u0120"
    # The special tokens in the vocabulary too, at their ids: the tokenizers library gives
    # an added token that the vocabulary lacks the next id past the vocabulary's size.
    for x in t["added_tokens"]:
        v[x["content"]] = x["id"]
    taken = set(v)
    next_id = max(v.values()) + 1
    cons = "bcdfghjklmnprstvwz"
    vows = "aeiou"
    syll = [c + w for c in cons for w in vows] + list(vows)
    punct = [
        '{"',
        '":',
        '",',
        '"}',
        "},",
        "],",
        ": ",
        ", ",
        '":"',
        '":{',
        '":[',
        '"]',
        "[{",
        "}]",
    ]

    def words() -> Iterator[str]:
        yield from punct
        for n in range(1000):
            yield str(n)
            yield space + str(n)
        for s1 in syll:
            yield s1
            yield space + s1
        for s1 in syll:
            for s2 in syll:
                w = s1 + s2
                yield w
                yield space + w
                yield space + w.capitalize()
        for s1 in syll:
            for s2 in syll:
                for s3 in syll:
                    w = s1 + s2 + s3
                    yield w
                    yield space + w

    for w in words():
        if next_id >= a.n:
            break
        if w in taken:
            continue
        v[w] = next_id
        taken.add(w)
        next_id += 1
    path.write_text(json.dumps(t))
    print(f"tokenizer.json: {next_id} tokens")
    return 0


def widen(a: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(a.model) / "model.safetensors"
    w = load_file(str(path))
    g = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name not in w:
            continue
        t = w[name]
        extra = torch.randn(a.n - t.shape[0], t.shape[1], generator=g) * t.float().std()
        w[name] = torch.cat([t, extra.to(t.dtype)]).contiguous()
    save_file(w, str(path), metadata={"format": "pt"})
    cfg_path = Path(a.model) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["vocab_size"] = a.n
    cfg_path.write_text(json.dumps(cfg, indent=2))
    print(f"model.safetensors: {a.n} rows of embedding and LM head")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--addr", required=True)
    s.add_argument("--streams", type=int, default=64)
    s.add_argument("--tokens", type=int, default=256)
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--max-cost", type=float, default=0.05)
    s.add_argument("--timeout", type=float, default=240)
    s.add_argument("--out", required=True)
    b = sub.add_parser("bits")
    b.add_argument("--addr", required=True)
    b.add_argument("--tokens", type=int, default=96)
    b.add_argument("--timeout", type=float, default=120)
    b.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("files", nargs="+")
    v = sub.add_parser("vocab")
    v.add_argument("model")
    v.add_argument("n", type=int)
    w = sub.add_parser("widen")
    w.add_argument("model")
    w.add_argument("n", type=int)
    a = p.parse_args()
    cmds = {
        "speed": speed,
        "bits": bits,
        "compare": compare,
        "vocab": vocab,
        "widen": widen,
    }
    return cmds[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
