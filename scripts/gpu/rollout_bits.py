#!/usr/bin/env python3
"""The trainer's log-probs against the rollout engine's, token by token: the Python side of
scripts/gpu/rollout-bits.sh (which starts the servers and calls this).

    rollout_bits.py make-smollm2 --out DIR [--layers N] [--seed S]
        a random-weight checkpoint of SmolLM2-135M-Instruct's config (transformers'
        LlamaForCausalLM, bf16, save_pretrained)
    rollout_bits.py splits DIR TP
        exit 0 when the model's heads split over TP ranks (each rank whole heads)
    rollout_bits.py sample --addr HOST:PORT --vocab V --out FILE [--prompts 8 --max-new 96]
        sampled rollouts from `arbor serve`'s SGLang `/generate` (token ids and log-probs)
    rollout_bits.py check --model DIR --name NAME --device cuda --json FILE TP=FILE ...
        the rollouts of each TP size against each other, against `arbor.torch`
        (`CausalLM.token_logprobs`, bit for bit) and the gap of two plain PyTorch bf16
        forwards: `arbor.torch.reference` and transformers' own model (SDPA)

`check` prints one PASS / FAIL line per check, `gap` lines for the plain forwards, and
exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# SmolLM2-135M-Instruct's architecture as its GGUF metadata states it (the file
# scripts/ci/fetch-smollm2.sh fetches: llama.block_count 30, embedding_length 576,
# feed_forward_length 1536, attention.head_count 9, head_count_kv 3, rope.freq_base
# 100000, layer_norm_rms_epsilon 1e-5, context_length 8192, vocab_size 49152, no
# output.weight: the head is the embedding), with the token ids and initializer range of
# HuggingFaceTB/SmolLM2-135M-Instruct's published config.json.
SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.041666666666666664,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def make_smollm2(out: Path, layers: int, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers})
    # transformers' own initialisation (normal, std initializer_range; norms at 1), made in
    # f32 and rounded to bf16 as a bf16 checkpoint holds it.
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"SmolLM2-135M-Instruct config, {layers} layers, {n} parameters (random, seed {seed})"
        f" in {out} ({time.time() - t0:.1f} s)"
    )


def splits(model: Path, tp: int) -> bool:
    """Whether each of `tp` ranks gets whole query heads and whole (or replicated) KV heads,
    the rule of the engine's head plan."""
    c = json.loads((model / "config.json").read_text())
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads", heads)
    return heads % tp == 0 and (kv < tp or kv % tp == 0)


def prompt_ids(count: int, vocab: int) -> list[list[int]]:
    """Deterministic token-id prompts of 5 to about 140 tokens (ids 3 and up: past the
    special tokens)."""
    return [
        [3 + (i * 7919 + j * 104729 + 13) % (vocab - 3) for j in range(5 + (i * 37) % 137)]
        for i in range(count)
    ]


def post(addr: str, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        f"http://{addr}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        sys.exit(f"{path} answered {e.code}: {e.read()[:2000]!r}")


def sample(a: argparse.Namespace) -> None:
    prompts = prompt_ids(a.prompts, a.vocab)
    t0 = time.time()
    # One batch, one seed: item i is sampled with (seed, sample i), so every TP size draws
    # the same samples; ignore_eos keeps the lengths equal whatever a random model emits.
    items = post(
        a.addr,
        "/generate",
        {
            "input_ids": prompts,
            "sampling_params": {
                "temperature": 1.0,
                "max_new_tokens": a.max_new,
                "sampling_seed": a.seed,
                "ignore_eos": True,
            },
            "return_logprob": True,
        },
    )
    dt = time.time() - t0
    rows = []
    for p, it in zip(prompts, sorted(items, key=lambda x: x.get("index", 0)), strict=True):
        lps = it["meta_info"]["output_token_logprobs"]
        ids = it["output_ids"]
        if [e[1] for e in lps] != ids:
            sys.exit("output_token_logprobs' ids are not output_ids")
        rows.append({"prompt": p, "tokens": ids, "logprobs": [e[0] for e in lps]})
    Path(a.out).write_text(json.dumps({"rollouts": rows}))
    n = sum(len(r["tokens"]) for r in rows)
    print(f"{len(rows)} rollouts, {n} sampled tokens in {dt:.2f} s")


def f32_bits(values: list[float]) -> list[int]:
    import struct

    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]


def first_mismatch(a: list[float], b: list[float]) -> int | None:
    pairs = zip(f32_bits(a), f32_bits(b), strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), None)


class Rollouts:
    """One TP size's rollouts: per row its prompt, sampled ids and their log-probs."""

    def __init__(self, tp: str, path: Path) -> None:
        self.tp = tp
        self.rows: list[dict[str, Any]] = json.loads(path.read_text())["rollouts"]

    @property
    def tokens(self) -> int:
        return sum(len(r["tokens"]) for r in self.rows)


def same_rollouts(a: Rollouts, b: Rollouts) -> tuple[bool, str]:
    """Token ids and log-prob bits of every row; where they differ first."""
    if len(a.rows) != len(b.rows):
        return False, f"{len(a.rows)} rows against {len(b.rows)}"
    for i, (x, y) in enumerate(zip(a.rows, b.rows, strict=True)):
        if x["prompt"] != y["prompt"]:
            return False, f"row {i}: different prompts"
        xs, ys = x["tokens"], y["tokens"]
        t = next(
            (j for j, (u, v) in enumerate(zip(xs, ys, strict=False)) if u != v),
            None if len(xs) == len(ys) else min(len(xs), len(ys)),
        )
        if t is not None:
            return False, f"row {i} token {t}: different ids"
        j = first_mismatch(x["logprobs"], y["logprobs"])
        if j is not None:
            return False, (
                f"row {i} token {j} (id {x['tokens'][j]}): log-prob {x['logprobs'][j]!r} "
                f"against {y['logprobs'][j]!r}"
            )
    return True, ""


def batch(rows: list[dict[str, Any]], dev: str) -> tuple[Any, Any]:
    """Prompt + completion of every row, right-padded, with its mask."""
    import torch

    seqs = [r["prompt"] + r["tokens"] for r in rows]
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids.to(dev), mask.to(dev)


def completions(lp: Any, rows: list[dict[str, Any]]) -> list[list[float]]:
    """Row i of `[B, T-1]` log-probs at the sampled tokens: position p predicts p + 1."""
    out = []
    for i, r in enumerate(rows):
        p, n = len(r["prompt"]), len(r["tokens"])
        out.append(lp[i, p - 1 : p - 1 + n].float().tolist())
    return out


def gap(got: list[list[float]], want: list[list[float]]) -> dict[str, float]:
    import torch

    g = torch.tensor([x for row in got for x in row], dtype=torch.float64)
    w = torch.tensor([x for row in want for x in row], dtype=torch.float64)
    g32, w32 = g.float(), w.float()
    return {
        "equal": int((g32 == w32).sum()),
        "tokens": g.numel(),
        "max_abs_dp": float((g.exp() - w.exp()).abs().max()),
        "mean_abs_dlogp": float((g - w).abs().mean()),
        "max_abs_dlogp": float((g - w).abs().max()),
    }


def hf_logprobs(model_dir: Path, rows: list[dict[str, Any]], dev: str) -> list[list[float]]:
    """transformers' own model of the checkpoint, bf16 weights and activations, SDPA: what
    a trainer without arbor computes (the log-softmax of its logits in f32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).to(dev)
    model.eval()
    ids, mask = batch(rows, dev)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1))
    out = completions(lp.squeeze(-1), rows)
    del model, logits
    return out


def run_check(a: argparse.Namespace) -> int:
    import torch
    from arbor.torch import CausalLM, reference

    sets = []
    for spec in a.rollouts:
        tp, _, path = spec.partition("=")
        sets.append(Rollouts(tp, Path(path)))
    result: dict[str, Any] = {"model": a.name, "tp": {}}
    base = sets[0]
    for s in sets[1:]:
        ok, why = same_rollouts(base, s)
        check(
            f"{a.name}: rollouts at TP {s.tp} == TP {base.tp} "
            f"({len(s.rows)} rows, {s.tokens} tokens: ids and log-prob bits)",
            ok,
            why,
        )
        result["tp"].setdefault(s.tp, {})["same_as_tp" + base.tp] = ok

    t0 = time.time()
    model = CausalLM.from_pretrained(a.model, device=a.device)
    t_load = time.time() - t0
    t0 = time.time()
    trainer: dict[str, list[list[float]]] = {}
    for s in sets:
        ids, mask = batch(s.rows, a.device)
        with torch.no_grad():
            lp = model.token_logprobs(ids, attention_mask=mask)
        got = completions(lp, s.rows)
        trainer[s.tp] = got
        want = [r["logprobs"] for r in s.rows]
        equal = sum(
            sum(x == y for x, y in zip(f32_bits(g), f32_bits(w), strict=True))
            for g, w in zip(got, want, strict=True)
        )
        detail = f"{equal}/{s.tokens} bit-equal"
        if equal != s.tokens:
            i, j = next(
                (i, j)
                for i, (g, w) in enumerate(zip(got, want, strict=True))
                if (j := first_mismatch(g, w)) is not None
            )
            detail += (
                f"; first: row {i} token {j} (id {s.rows[i]['tokens'][j]}), "
                f"trainer {got[i][j]!r} rollout {want[i][j]!r}"
            )
        check(
            f"{a.name}: arbor.torch token_logprobs ({a.device}) == rollouts at TP {s.tp}",
            equal == s.tokens,
            detail,
        )
        result["tp"].setdefault(s.tp, {}).update({"trainer_equal": equal, "tokens": s.tokens})
    t_score = time.time() - t0

    # The plain forwards, against TP 1's rollouts (the others' are the same bits when the
    # check above passed; against each when they are not).
    t0 = time.time()
    targets = [base] + [s for s in sets[1:] if not same_rollouts(base, s)[0]]
    plain: dict[str, dict[str, Any]] = {}
    for s in targets:
        ids, _ = batch(s.rows, a.device)
        with torch.no_grad():
            ref = completions(reference.token_logprobs(model, ids), s.rows)
        plain[f"reference@tp{s.tp}"] = gap(ref, [r["logprobs"] for r in s.rows])
    del model
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    for s in targets:
        # A report line, not a check: a failure says why the line is missing.
        try:
            hf = hf_logprobs(a.model, s.rows, a.device)
        except (ImportError, OSError, ValueError, KeyError, RuntimeError) as e:
            print(f"gap   {a.name}: transformers' model not run ({type(e).__name__}: {e})"[:300])
            continue
        plain[f"transformers@tp{s.tp}"] = gap(hf, [r["logprobs"] for r in s.rows])
    t_plain = time.time() - t0
    for key, g in plain.items():
        which, _, tp = key.partition("@tp")
        label = (
            "arbor.torch.reference (plain bf16, SDPA)"
            if which == "reference"
            else "transformers LlamaForCausalLM (bf16, SDPA)"
        )
        print(
            f"gap   {a.name} {label} vs rollouts at TP {tp}: {g['equal']}/{g['tokens']} equal, "
            f"max |dp| {g['max_abs_dp']:.6f}, mean |d log p| {g['mean_abs_dlogp']:.6f}, "
            f"max |d log p| {g['max_abs_dlogp']:.6f}",
            flush=True,
        )
    result["plain"] = plain
    result["seconds"] = {"load": t_load, "score": t_score, "plain": t_plain}
    print(
        f"time  {a.name} check: arbor.torch load {t_load:.1f} s, rescoring {t_score:.1f} s, "
        f"plain forwards {t_plain:.1f} s",
        flush=True,
    )
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 1 if FAILED else 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-smollm2")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--layers", type=int, default=30)
    m.add_argument("--seed", type=int, default=1)
    sp = sub.add_parser("splits")
    sp.add_argument("model", type=Path)
    sp.add_argument("tp", type=int)
    s = sub.add_parser("sample")
    s.add_argument("--addr", required=True)
    s.add_argument("--vocab", type=int, required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--prompts", type=int, default=8)
    s.add_argument("--max-new", type=int, default=96)
    s.add_argument("--seed", type=int, default=1234)
    c = sub.add_parser("check")
    c.add_argument("--model", type=Path, required=True)
    c.add_argument("--name", required=True)
    c.add_argument("--device", default="cuda")
    c.add_argument("--json", help="write the counts and gaps here")
    c.add_argument("rollouts", nargs="+", help="TP=FILE, the first the reference TP size")
    a = ap.parse_args()
    if a.cmd == "make-smollm2":
        make_smollm2(a.out, a.layers, a.seed)
    elif a.cmd == "splits":
        return 0 if splits(a.model, a.tp) else 1
    elif a.cmd == "sample":
        sample(a)
    else:
        return run_check(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
