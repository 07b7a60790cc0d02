#!/usr/bin/env python3
"""`arbor.torch` on a GPU: its token log-probs against `arbor score` / `arbor generate` on
the same GPU (TP 1, 2 and 4, ranks sharing the device), the gap of a plain PyTorch bf16
forward, the backward, and the speed and memory against plain PyTorch (cuBLAS + SDPA
flash) side by side.

Staged by scripts/gpu/build-device.sh (which copies the package into .device/py); run on
the device machine from the repository root:

    python3 scripts/gpu/torch-parity.py --bin .device --out "$OUT" [--bench-layers 4]

Prints one line per check and a table; exits 1 when a bit check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

FAILED: list[str] = []


def bits(values: list[float]) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]


def check(name: str, ok: bool, detail: str = "") -> None:
    print(
        f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}",
        flush=True,
    )
    if not ok:
        FAILED.append(name)


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    out = subprocess.run(
        cmd, check=False, capture_output=True, text=True, env=env, timeout=600
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        )


def cli_score(
    b: Path, model: Path, seqs: list[list[int]], tp: int, work: Path
) -> list[dict]:
    inp, out = work / f"in-{tp}.jsonl", work / f"out-{tp}.jsonl"
    inp.write_text(
        "".join(
            json.dumps({"id": i, "tokens": s, "prompt_len": 1}) + "\n"
            for i, s in enumerate(seqs)
        )
    )
    cmd = [
        str(b / "arbor"),
        "score",
        "--device",
        "cuda",
        "--model",
        str(model),
        "--input",
        str(inp),
        "--out",
        str(out),
    ]
    if tp > 1:
        cmd = [str(b / "arbor-launch"), "-n", str(tp), "--", *cmd]
    run(cmd, env={**os.environ, "ARBOR_RANKS_PER_GPU": "auto"})
    recs = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    return sorted(recs, key=lambda r: r["id"])


def parity(b: Path, work: Path) -> dict:
    from arbor.torch import CausalLM, ops, reference

    results: dict = {}
    g = torch.Generator().manual_seed(11)
    # One row crosses a KV block (64) and an attention split (512).
    lengths = [600, 33, 7, 2]
    for arch in ("llama", "qwen2", "qwen3"):
        model_dir = work / arch
        run(
            [
                str(b / "arbor"),
                "make-model",
                "--arch",
                arch,
                "--preset",
                "tiny",
                "--seed",
                "7",
                "--out",
                str(model_dir),
            ]
        )
        model = CausalLM.from_pretrained(model_dir, device="cuda")
        ids = torch.randint(0, 258, (len(lengths), max(lengths)), generator=g).cuda()
        mask = (
            (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1))
            .long()
            .cuda()
        )
        lp = model.token_logprobs(ids, attention_mask=mask)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask)
        seqs = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
        cuda, stream = ops._cuda(logits)
        for tp in (1, 2, 4):
            recs = cli_score(b, model_dir, seqs, tp, work)
            same_lp = all(
                bits(lp[i, : n - 1].tolist()) == bits(recs[i]["logprobs"])
                for i, n in enumerate(lengths)
            )
            same_rows = True
            for i, n in enumerate(lengths):
                rows = logits[i, : n - 1].contiguous()
                _, digests = cuda.token_logprobs(rows, ids[i, 1:n].tolist(), stream)
                same_rows &= [f"{d:016x}" for d in digests] == recs[i]["logits_digest"]
            check(
                f"{arch} token_logprobs == arbor score --device cuda at TP {tp}",
                same_lp,
            )
            check(f"{arch} logits rows (digests) == arbor score at TP {tp}", same_rows)
        # The gap a plain PyTorch bf16 forward leaves (the trainer without arbor).
        with torch.no_grad():
            plain = reference.token_logprobs(model, ids)
        real = torch.cat([torch.ones(n - 1, dtype=torch.bool) for n in lengths])
        ours = torch.cat([lp[i, : n - 1].detach() for i, n in enumerate(lengths)])
        theirs = torch.cat([plain[i, : n - 1] for i, n in enumerate(lengths)])
        dp = (ours.exp() - theirs.exp()).abs()
        results[arch] = {
            "plain_bf16_max_abs_dp": float(dp.max()),
            "plain_bf16_mean_abs_dlogp": float((ours - theirs).abs().mean()),
            "plain_bf16_equal_tokens": int((ours == theirs).sum()),
            "tokens": int(real.sum()),
        }
        print(
            f"  {arch}: plain bf16 PyTorch forward vs arbor: {results[arch]}",
            flush=True,
        )
        # The backward runs and is close to the plain f32 forward's gradient (the same
        # random weighting of the real positions; the plain forward also predicts padding).
        gen = torch.Generator("cuda").manual_seed(1)
        weights = (
            torch.randn(lp.shape, device="cuda", generator=gen) * mask[:, 1:].float()
        )
        (lp * weights).sum().backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        f32 = CausalLM.from_pretrained(model_dir, device="cuda", dtype=torch.float32)
        plain32 = reference.token_logprobs(f32, ids, dtype=torch.float32)
        (plain32 * weights).sum().backward()
        cos, worst = min(
            (float(F.cosine_similarity(grads[n].flatten(), p.grad.flatten(), dim=0)), n)
            for n, p in f32.named_parameters()
        )
        results[arch]["grad_min_cosine_vs_plain_f32"] = cos
        check(
            f"{arch} gradient close to the plain f32 forward's (min cosine {cos:.5f}, {worst})",
            cos > 0.98,
        )

    # Rollouts sampled by arbor generate at TP 2 on the GPU, rescored by the trainer on it.
    prompts = work / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": i, "tokens": [5 + 17 * i + j for j in range(3 + 4 * i)]})
            + "\n"
            for i in range(4)
        )
    )
    gen = work / "gen.jsonl"
    run(
        [
            str(b / "arbor-launch"),
            "-n",
            "2",
            "--",
            str(b / "arbor"),
            "generate",
            "--device",
            "cuda",
            "--model",
            str(work / "qwen3"),
            "--prompts",
            str(prompts),
            "--max-tokens",
            "24",
            "--temperature",
            "1.0",
            "--seed",
            "5",
            "--out",
            str(gen),
        ],
        env={**os.environ, "ARBOR_RANKS_PER_GPU": "auto"},
    )
    model = CausalLM.from_pretrained(work / "qwen3", device="cuda")
    equal = total = 0
    for line in gen.read_text().splitlines():
        r = json.loads(line)
        seq = torch.tensor([r["prompt_tokens"] + r["tokens"]], device="cuda")
        with torch.no_grad():
            got = model.token_logprobs(seq)[0, len(r["prompt_tokens"]) - 1 :].tolist()
        equal += sum(a == b for a, b in zip(bits(got), bits(r["logprobs"])))
        total += len(r["logprobs"])
    check(
        f"qwen3 sampled rollouts (generate --device cuda, TP 2) rescored: {equal}/{total} bit-equal",
        equal == total,
    )
    results["rollouts"] = {"equal": equal, "total": total}
    return results


def write_shape(dst: Path, layers: int) -> None:
    """Llama-3-8B shapes with `layers` layers, random bf16 (the timing does not depend on
    the values)."""
    from safetensors.torch import save_file

    h, inter, heads, kv, vocab = 4096, 14336, 32, 8, 128256
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": h,
                "intermediate_size": inter,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
                "vocab_size": vocab,
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
            }
        )
    )
    g = torch.Generator("cuda").manual_seed(0)
    t: dict[str, torch.Tensor] = {}

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * 0.02).bfloat16().cpu()

    t["model.embed_tokens.weight"] = rnd(vocab, h)
    t["lm_head.weight"] = rnd(vocab, h)
    t["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[f"{p}.self_attn.q_proj.weight"] = rnd(h, h)
        t[f"{p}.self_attn.k_proj.weight"] = rnd(kv * 128, h)
        t[f"{p}.self_attn.v_proj.weight"] = rnd(kv * 128, h)
        t[f"{p}.self_attn.o_proj.weight"] = rnd(h, h)
        t[f"{p}.mlp.gate_proj.weight"] = rnd(inter, h)
        t[f"{p}.mlp.up_proj.weight"] = rnd(inter, h)
        t[f"{p}.mlp.down_proj.weight"] = rnd(h, inter)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})


def timed(f, reps: int) -> tuple[float, float]:
    """Median ms of `f` over `reps` runs (after one warm-up), and the peak of torch's
    allocator during them (GiB)."""
    f()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30


def op_bits() -> dict:
    """The forward's fast paths against the op by op ones, bit for bit, on this GPU: the
    token log-probs kept on the device against the host-result path, q|k|v and gate/up
    as one GEMM against separate linears, the GEMM's SiLU·mul epilogue (no-grad) against
    the GEMM then SiLU·mul, and the kernels' bf16 companions against torch's rounding."""
    from arbor.torch import ops

    g = torch.Generator(device="cuda").manual_seed(1)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda") * scale

    def same(name: str, a: torch.Tensor, b: torch.Tensor) -> bool:
        ok = a.shape == b.shape and torch.equal(
            a.view(torch.int32), b.view(torch.int32)
        )
        check(f"op bits: {name}", ok, "" if ok else f"{(a != b).sum().item()} differ")
        return ok

    res: dict = {}
    logits = rnd(37, 128256, scale=4.0)
    targets = torch.randint(0, 128256, (37,), generator=g, device="cuda")
    cuda, stream = ops._cuda(logits)
    host, _ = cuda.token_logprobs(logits, targets.tolist(), stream)
    dev = ops._logprob_values(logits, targets)
    res["logprobs"] = same(
        "device log-probs == host path", dev, torch.tensor(host, device="cuda")
    )
    try:
        ops.token_logprobs(logits, torch.full((37,), 128256, device="cuda"))
        check("op bits: out-of-vocabulary target raises", False, "no exception")
    except Exception as e:  # noqa: BLE001
        check(
            "op bits: out-of-vocabulary target raises", "vocabulary" in str(e), str(e)
        )

    x = rnd(300, 4096)
    ws = [rnd(n, 4096, scale=0.02).to(torch.bfloat16) for n in (4096, 1024, 1024)]
    fused = ops.fused_linear(x, ws)
    res["qkv"] = same(
        "q|k|v one GEMM == three",
        fused,
        torch.cat([ops.tree_linear(x, w) for w in ws], 1),
    )
    wg, wu = (rnd(14336, 4096, scale=0.02).to(torch.bfloat16) for _ in range(2))
    want = ops.silu_mul(ops.tree_linear(x, wg), ops.tree_linear(x, wu))
    with torch.no_grad():
        res["gate_up_epilogue"] = same(
            "gate/up GEMM+SiLU epilogue == linears, silu_mul",
            ops.gate_up_silu(x, wg, wu),
            want,
        )
    xg = x.clone().requires_grad_()
    y = ops.gate_up_silu(xg, wg, wu)
    res["gate_up"] = same(
        "gate/up one GEMM, silu_mul_pairs == linears, silu_mul", y, want
    )
    res["companion"] = same(
        "silu companion == torch bf16",
        ops._input_bf16(y).float(),
        y.detach().to(torch.bfloat16).float(),
    )
    w = rnd(4096).to(torch.bfloat16)
    n = ops.rms_norm(x, w, 1e-5)
    res["norm_companion"] = same(
        "rms_norm companion == torch bf16",
        ops._input_bf16(n).float(),
        n.to(torch.bfloat16).float(),
    )
    return res


def profile_summary(name: str, f, top: int = 12) -> dict:
    """One run of `f` under torch's profiler: its wall time, the kernels' summed time, the
    time the GPU ran any kernel (overlaps merged) and so the GPU's idle time from the
    first kernel to the last, and the `top` kernels by total time. Prints it, returns it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    f()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    kernels = [e for e in p.events() if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    summed = sum(e - s for s, e in spans) / 1e3
    busy, reach = 0.0, float("-inf")
    for s, e in spans:
        if e > reach:
            busy += e - max(s, reach)
            reach = e
    extent = (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        t = by_name.setdefault(e.name, [0.0, 0])
        t[0] += e.time_range.elapsed_us() / 1e3
        t[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    print(
        f"  profile {name}: wall {wall:.1f} ms; {len(kernels)} kernels, {summed:.1f} ms summed, "
        f"GPU busy {busy / 1e3:.1f} ms of the {extent:.1f} ms from first to last kernel "
        f"(idle {extent - busy / 1e3:.1f} ms)",
        flush=True,
    )
    for k, (ms, n) in ranked:
        print(f"    {ms:8.2f} ms  {n:5d}x  {k[:100]}", flush=True)
    return {
        "wall_ms": wall,
        "kernels": len(kernels),
        "kernel_ms_summed": summed,
        "gpu_busy_ms": busy / 1e3,
        "first_to_last_ms": extent,
        "top": [{"name": k, "ms": ms, "count": n} for k, (ms, n) in ranked],
    }


def bench(
    work: Path, layers: int, shapes: list[tuple[int, int]], reps: int, profile: bool
) -> dict:
    from arbor.torch import CausalLM, reference

    d = work / "l8b"
    write_shape(d, layers)
    model = CausalLM.from_pretrained(d, device="cuda")
    out: dict = {"layers": layers, "shapes": {}}
    for rows, length in shapes:
        ids = torch.randint(
            0, 128256, (rows, length), generator=torch.Generator().manual_seed(0)
        ).cuda()

        def arbor_fwd(ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                model.token_logprobs(ids)

        def arbor_fwd_bwd(ids: torch.Tensor = ids) -> None:
            model.token_logprobs(ids).sum().backward()
            model.zero_grad(set_to_none=True)

        def plain_fwd(ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                reference.token_logprobs(model, ids)

        def plain_fwd_bwd(ids: torch.Tensor = ids) -> None:
            reference.token_logprobs(model, ids).sum().backward()
            model.zero_grad(set_to_none=True)

        res: dict = {}
        for name, f in [
            ("plain_fwd", plain_fwd),
            ("arbor_fwd", arbor_fwd),
            ("plain_fwd_bwd", plain_fwd_bwd),
            ("arbor_fwd_bwd", arbor_fwd_bwd),
        ]:
            torch.cuda.empty_cache()
            try:
                ms, peak = timed(f, reps)
            except torch.OutOfMemoryError as e:
                print(
                    f"  {rows}x{length} {name}: out of memory ({str(e)[:90]})",
                    flush=True,
                )
                res[name] = {"ms": float("nan"), "oom": True}
                continue
            free, total = torch.cuda.mem_get_info()
            res[name] = {
                "ms": ms,
                "torch_peak_gib": peak,
                "device_used_gib": (total - free) / 2**30,
            }
            print(
                f"  {rows}x{length} {name}: {ms:.1f} ms, torch peak {peak:.2f} GiB, "
                f"device in use {(total - free) / 2**30:.2f} GiB",
                flush=True,
            )
        res["fwd_ratio"] = res["arbor_fwd"]["ms"] / res["plain_fwd"]["ms"]
        res["fwd_bwd_ratio"] = res["arbor_fwd_bwd"]["ms"] / res["plain_fwd_bwd"]["ms"]
        out["shapes"][f"{rows}x{length}"] = res
        print(
            f"bench llama3-8b shape x{layers} layers, {rows} x {length} tokens, "
            f"{torch.cuda.get_device_name()}: forward arbor/plain {res['fwd_ratio']:.3f}, "
            f"forward+backward {res['fwd_bwd_ratio']:.3f}",
            flush=True,
        )
        if profile:
            for name, f in [
                ("arbor_fwd", arbor_fwd),
                ("plain_fwd", plain_fwd),
                ("arbor_fwd_bwd", arbor_fwd_bwd),
            ]:
                res[f"profile_{name}"] = profile_summary(name, f)
            profile = False
    return out


def shape_bits(b: Path, work: Path, layers: int) -> dict:
    """The Llama-3-8B shapes (`layers` layers, random bf16): `token_logprobs` on CUDA
    tensors against `arbor score --device cuda` at TP 1, 2 and 4 (ranks sharing the GPU)."""
    from arbor.torch import CausalLM

    d = work / "l8b-bits"
    write_shape(d, layers)
    model = CausalLM.from_pretrained(d, device="cuda")
    g = torch.Generator().manual_seed(3)
    lengths = [1500, 700, 65]
    ids = torch.randint(0, 128256, (len(lengths), max(lengths)), generator=g).cuda()
    mask = (
        (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)).long().cuda()
    )
    with torch.no_grad():
        lp = model.token_logprobs(ids, attention_mask=mask)
    seqs = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    out = {}
    for tp in (1, 2, 4):
        recs = cli_score(b, d, seqs, tp, work)
        equal = sum(
            sum(
                x == y
                for x, y in zip(
                    bits(lp[i, : n - 1].tolist()), bits(recs[i]["logprobs"])
                )
            )
            for i, n in enumerate(lengths)
        )
        total = sum(n - 1 for n in lengths)
        check(
            f"llama3-8b shape x{layers} layers: token_logprobs == arbor score --device cuda at TP {tp} ({equal}/{total})",
            equal == total,
        )
        out[f"tp{tp}"] = {"equal": equal, "total": total}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bin", type=Path, default=Path(".device"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument(
        "--bench-layers",
        type=int,
        default=4,
        help="layers of the llama3-8b shape (0: no bench)",
    )
    ap.add_argument(
        "--bench-shapes", default="4x4096,8x2048", help="rows x tokens, comma-separated"
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="for the first shape: one arbor forward, plain forward and arbor "
        "forward+backward under torch's profiler (top kernels, kernel time vs wall "
        "time, GPU idle time)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument(
        "--shape-bits",
        type=int,
        default=0,
        help="layers of the llama3-8b shape for a bit check",
    )
    a = ap.parse_args()
    sys.path.insert(0, str((a.bin / "py").resolve()))
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not a.skip_parity:
            result["parity"] = parity(a.bin, work)
        result["op_bits"] = op_bits()
        if a.shape_bits:
            result["shape_bits"] = shape_bits(a.bin, work, a.shape_bits)
        if a.bench_layers:
            shapes = [
                tuple(int(v) for v in x.split("x")) for x in a.bench_shapes.split(",")
            ]
            result["bench"] = bench(work, a.bench_layers, shapes, a.reps, a.profile)
    (a.out / "torch-parity.json").write_text(json.dumps(result, indent=1))
    print("FAILED: " + ", ".join(FAILED) if FAILED else "ALL PASS")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
