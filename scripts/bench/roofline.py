#!/usr/bin/env python3
"""Each kernel of one engine step against the GPU's peaks: achieved TFLOP/s and TB/s.

  roofline.py NCU_CSV --tokens M [--batch B] [--context C] [--step N|last] [--gpu h100|h200]
              [--markdown] [model dims: --hidden --heads --kv-heads --head-dim
              --intermediate --vocab --layers] [--lm-rows R]

NCU_CSV is Nsight Compute's CSV of one `arbor bench decode` run (`ncu --metrics
gpu__time_duration.sum --csv --print-units base`, as scripts/bench/profile-decode.sh takes
it), cut into steps after each row-stats kernel (ncu_steps.py). --step picks one (default:
the step of the most kernel time, a bench run's prefill; `last`: the last step). The step's
shape is given, not read: M rows (tokens) in the step; a prefill is B sequences of M/B
tokens each, causal, over C keys each (default C = M/B: no prefix); a decode step is M
sequences of one row each, every row attending to C keys. Whether the step is a prefill or
a decode step is read from its attention kernels.

Each launch is classified by its name and its place in the layer (q/k/v GEMM, RoPE + KV
write, attention, o GEMM, add + RMSNorm, gate/up GEMM, down GEMM, add + RMSNorm; then the
final norm, LM head and row stats), and given its FLOPs and its minimum bytes:
  GEMM [M, K] x [K, N]: 2·M·N·K FLOPs; W (N·K bf16) + X (M·K bf16, the bf16 companion the
    previous kernel wrote) + the f32 output (M·N·4); gate/up with the SiLU·mul epilogue
    writes [M, I] f32 + bf16 instead of [M, 2I] f32;
  prefill attention: 4·B·H·hd·(T·(C-T) + T²/2) FLOPs (causal); each sequence's K and V read
    once per KV head (B·C·KVH·hd·2·2) + q f32 + the output f32 and bf16;
  decode attention: 4·M·H·C·hd FLOPs; M·C·KVH·hd·2·2 of K/V + q f32, and per row and head
    either the output (one split) or one f32 partial (hd + 2 values) per split of 512 keys,
    which the combine kernel reads back before writing the output;
  norms, RoPE, SiLU·mul, embedding, row stats: what they read and write once.
A cuBLAS split-K reduce and any kernel that matches no rule is listed with its time only:
no FLOP or byte count is made up for it, and it adds nothing to the sum of floors.

Launches of the same role and kernel are summed over the layers. Per row: calls, µs per
call, the achieved TFLOP/s and TB/s with their % of the GPU's peak, which roof is nearer,
and the floor per call, max(FLOPs / peak FLOP/s, bytes / peak bandwidth). Last, the step's
kernel time against the sum of the floors.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

# scripts/bench/ is on sys.path: python puts the script's own folder there.
from ncu_steps import Launch, cut_steps, longest_step, read_ncu, short

# Dense bf16 tensor-core FLOP/s and HBM bytes/s of the SXM cards.
PEAKS: dict[str, tuple[float, float, str]] = {
    "h100": (989e12, 3.35e12, "H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3"),
    "h200": (989e12, 4.8e12, "H200: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e"),
}

# Keys of one attention split (ATTN_SPLIT_BLOCKS 8 × blocks of 64 positions): part of the
# numerics, so fixed; a decode row at position p runs p // 512 + 1 splits.
SPLIT_KEYS = 512

F32, BF16 = 4, 2


@dataclass(frozen=True)
class Model:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    layers: int = 32


@dataclass(frozen=True)
class Shape:
    tokens: int
    batch: int
    context: int
    lm_rows: int


@dataclass(frozen=True)
class Cost:
    """One launch's work: FLOPs (0 for data movement) and minimum bytes."""

    flops: float
    bytes: float


@dataclass
class Classified:
    name: str
    ns: float
    label: str
    cost: Cost | None  # None: not classified, time only


@dataclass
class Row:
    label: str
    kernel: str
    calls: int
    ns: float
    cost: Cost | None  # per call

    @property
    def us_per_call(self) -> float:
        return self.ns / self.calls / 1e3


# --- costs -------------------------------------------------------------------------------


def gemm_cost(m: int, n: int, k: int, out_bytes: float | None = None) -> Cost:
    """X [m, k] bf16 · W [n, k]ᵀ bf16; the output is [m, n] f32 unless out_bytes says."""
    out = m * n * F32 if out_bytes is None else out_bytes
    return Cost(2.0 * m * n * k, n * k * BF16 + m * k * BF16 + out)


def splits(context: int) -> int:
    return (context - 1) // SPLIT_KEYS + 1


def prefill_attention_cost(md: Model, sh: Shape) -> Cost:
    b, m = sh.batch, sh.tokens
    t = m // b
    c = sh.context
    hd, h, kvh = md.head_dim, md.heads, md.kv_heads
    flops = 4.0 * b * h * hd * (t * (c - t) + t * t / 2)
    kv = b * c * kvh * hd * BF16 * 2
    return Cost(flops, kv + m * h * hd * F32 + m * h * hd * (F32 + BF16))


def decode_attention_cost(md: Model, sh: Shape) -> Cost:
    m, c = sh.tokens, sh.context
    hd, h, kvh = md.head_dim, md.heads, md.kv_heads
    s = splits(c)
    out = m * h * hd * (F32 + BF16) if s == 1 else m * h * s * (hd + 2) * F32
    return Cost(4.0 * m * h * c * hd, m * c * kvh * hd * BF16 * 2 + m * h * hd * F32 + out)


def combine_cost(md: Model, sh: Shape) -> Cost:
    m, hd, h = sh.tokens, md.head_dim, md.heads
    s = splits(sh.context)
    if s == 1:  # the kernel returns at once: the decode kernel wrote the output
        return Cost(0.0, 0.0)
    return Cost(0.0, m * h * s * (hd + 2) * F32 + m * h * hd * (F32 + BF16))


def rope_cost(md: Model, m: int) -> Cost:
    hd, h, kvh = md.head_dim, md.heads, md.kv_heads
    read = m * (h + 2 * kvh) * hd * F32 + m * hd * F32  # q/k/v f32, each row's cos and sin
    write = m * h * hd * F32 + m * kvh * hd * BF16 * 2  # rotated q f32, k and v into the cache
    return Cost(0.0, read + write)


def norm_cost(md: Model, m: int, add: bool) -> Cost:
    """RMSNorm writing f32 and the bf16 companion; with add, x += y first (x written back)."""
    # Read x, write out and its bf16 copy; the add also reads y and writes x back.
    row = F32 + F32 + BF16 + (F32 + F32 if add else 0)
    return Cost(0.0, m * md.hidden * row + md.hidden * F32)


# --- classification ----------------------------------------------------------------------

_GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|tree_matmul_leaf", re.IGNORECASE)
_ATTN = ("attn_prefill", "attn_decode", "attn_combine")


def kind(name: str) -> str:
    """What a kernel is, from its name alone."""
    n = short(name)
    if "splitKreduce" in n or n == "tree_combine":
        return "reduce"
    if "moe" in n:
        return "other"
    for prefix, k in (("pa_prefill", "attn_prefill"), ("pa_decode", "attn_decode"), ("pa_combine", "attn_combine")):
        if n.startswith(prefix):
            return k
    exact = {
        "embedding_kernel": "embedding",
        "rms_norm_kernel": "norm",
        "add_rms_norm_kernel": "add_norm",
        "add_assign_kernel": "add_assign",
        "silu_mul_pairs_kernel": "silu",
        "select_rows_kernel": "select",
        "row_stats_kernel": "row_stats",
        "qkv_rope_kv_kernel": "rope",
        "qkv_rope_kv4_kernel": "rope",
    }
    if n in exact:
        return exact[n]
    return "gemm" if _GEMM.search(n) else "other"


def step_mode(launches: list[Launch]) -> str:
    kinds = {kind(n) for n, _ in launches}
    if "attn_prefill" in kinds and "attn_decode" not in kinds:
        return "prefill"
    if "attn_decode" in kinds and "attn_prefill" not in kinds:
        return "decode"
    return "mixed" if "attn_prefill" in kinds else "none"


def classify(launches: list[Launch], md: Model, sh: Shape) -> list[Classified]:
    """Every launch with its role in the layer and its cost (None where no rule fits)."""
    kinds = [kind(n) for n, _ in launches]
    mode = step_mode(launches)
    anchors = [i for i, k in enumerate(kinds) if k != "reduce"]
    pos = {i: j for j, i in enumerate(anchors)}
    out: list[Classified] = []
    gemm_role: dict[int, str] = {}
    last_gemm: str | None = None
    h, m = md.hidden, sh.tokens
    attn_n = md.heads * md.head_dim
    qkv_n = (md.heads + 2 * md.kv_heads) * md.head_dim
    inter = md.intermediate

    def at(j: int) -> str:
        return kinds[anchors[j]] if 0 <= j < len(anchors) else "end"

    for i, ((name, ns), k) in enumerate(zip(launches, kinds, strict=True)):
        label, cost = short(name), None
        if k == "reduce":
            owner = next((gemm_role[p] for p in range(i - 1, -1, -1) if p in gemm_role), None)
            label = f"{owner or 'GEMM'} split-K reduce"
            out.append(Classified(name, ns, label, None))
            continue
        j = pos[i]
        prev, nxt = at(j - 1), at(j + 1)
        if k == "gemm":
            role = None
            if nxt == "rope":
                role, label, cost = "q/k/v", f"q/k/v GEMM {h}×{qkv_n}", gemm_cost(m, qkv_n, h)
            elif prev in _ATTN:
                role, label, cost = "o", f"o GEMM {attn_n}×{h}", gemm_cost(m, h, attn_n)
            elif prev == "add_norm" and last_gemm == "o":
                role = "gate/up"
                if nxt == "silu":
                    label, cost = f"gate/up GEMM {h}×{2 * inter}", gemm_cost(m, 2 * inter, h)
                else:  # the SiLU·mul epilogue: [M, I] f32 and bf16 out
                    label = f"gate/up GEMM {h}×{2 * inter} + SiLU·mul"
                    cost = gemm_cost(m, 2 * inter, h, m * inter * (F32 + BF16))
            elif last_gemm == "gate/up" and prev in ("gemm", "silu"):
                role, label, cost = "down", f"down GEMM {inter}×{h}", gemm_cost(m, h, inter)
            elif prev == "norm" and nxt in ("row_stats", "end"):
                role = "LM head"
                label, cost = f"LM head GEMM {h}×{md.vocab}", gemm_cost(sh.lm_rows, md.vocab, h)
            if role is not None:
                gemm_role[i] = role
                last_gemm = role
            else:
                label = f"GEMM? {short(name)}"
        elif k == "rope":
            label, cost = "RoPE + KV write", rope_cost(md, m)
        elif k == "attn_prefill" and mode == "prefill":
            label, cost = "attention prefill", prefill_attention_cost(md, sh)
        elif k == "attn_decode" and mode == "decode":
            label, cost = "attention decode", decode_attention_cost(md, sh)
        elif k == "attn_combine" and mode == "decode":
            label, cost = "attention combine", combine_cost(md, sh)
        elif k == "add_norm" and last_gemm in ("o", "down"):
            where = "post-attention" if last_gemm == "o" else "next layer's input"
            label, cost = f"add + RMSNorm ({where})", norm_cost(md, m, add=True)
        elif k == "norm" and prev == "embedding":
            label, cost = "RMSNorm (layer 0 input)", norm_cost(md, m, add=False)
        elif k == "norm" and prev in ("add_assign", "select"):
            label, cost = "RMSNorm (final)", norm_cost(md, sh.lm_rows, add=False)
        elif k == "silu":
            label, cost = "SiLU·mul", Cost(0.0, m * 2 * inter * F32 + m * inter * (F32 + BF16))
        elif k == "embedding":
            label, cost = "embedding", Cost(0.0, m * 4 + m * h * (BF16 + F32))
        elif k == "add_assign":
            label, cost = "residual add (last layer)", Cost(0.0, m * h * 3 * F32)
        elif k == "select":
            label, cost = "select rows", Cost(0.0, sh.lm_rows * (4 + 2 * h * F32))
        elif k == "row_stats":
            # The kernel reads each row twice; the floor counts one read.
            label, cost = "row stats", Cost(0.0, sh.lm_rows * md.vocab * F32)
        out.append(Classified(name, ns, label, cost))
    return out


def group(items: list[Classified]) -> list[Row]:
    """Launches of one role and kernel summed, in order of first appearance."""
    rows: dict[tuple[str, str], Row] = {}
    for c in items:
        key = (c.label, short(c.name))
        r = rows.get(key)
        if r is None:
            rows[key] = Row(c.label, short(c.name), 1, c.ns, c.cost)
        else:
            r.calls += 1
            r.ns += c.ns
    return list(rows.values())


# --- report ------------------------------------------------------------------------------


def floor_s(cost: Cost, flops_peak: float, bw_peak: float) -> float:
    return max(cost.flops / flops_peak, cost.bytes / bw_peak)


def cells(r: Row, flops_peak: float, bw_peak: float) -> list[str]:
    us = r.us_per_call
    if r.cost is None:
        return [f"{us:.1f}", "—", "—", "—", "—"]
    s = us * 1e-6
    tf = r.cost.flops / s if s > 0 else 0.0
    bw = r.cost.bytes / s if s > 0 else 0.0
    tf_cell = "—" if r.cost.flops == 0 else f"{tf / 1e12:.{0 if tf >= 10e12 else 1}f} ({100 * tf / flops_peak:.0f} %)"
    bw_cell = "—" if r.cost.bytes == 0 else f"{bw / 1e12:.2f} ({100 * bw / bw_peak:.0f} %)"
    if r.cost.flops == 0 and r.cost.bytes == 0:
        nearer = "—"
    else:
        nearer = "compute" if tf / flops_peak >= bw / bw_peak else "memory"
    floor = floor_s(r.cost, flops_peak, bw_peak) * 1e6
    return [f"{us:.1f}", tf_cell, bw_cell, nearer, f"{floor:.1f}"]


HEAD = ["kernel", "calls", "µs/call", "TFLOP/s (% peak)", "TB/s (% peak)", "nearer roof", "floor µs/call"]


def report(items: list[Classified], gpu: str, markdown: bool) -> str:
    flops_peak, bw_peak, _ = PEAKS[gpu]
    rows = group(items)
    table = []
    for r in rows:
        name = f"{r.label} `{r.kernel}`" if markdown else f"{r.label} [{r.kernel}]"
        if r.label == r.kernel:
            name = f"`{r.kernel}`" if markdown else r.kernel
        table.append([name, str(r.calls), *cells(r, flops_peak, bw_peak)])
    lines: list[str] = []
    if markdown:
        lines.append("| " + " | ".join(HEAD) + " |")
        lines.append("|---|" + "---:|" * (len(HEAD) - 1))
        lines += ["| " + " | ".join(t) + " |" for t in table]
    else:
        widths = [max(len(x[i]) for x in [HEAD, *table]) for i in range(len(HEAD))]
        fmt = [f"{{:<{widths[0]}}}"] + [f"{{:>{w}}}" for w in widths[1:]]
        for t in [HEAD, *table]:
            lines.append("  ".join(f.format(x) for f, x in zip(fmt, t, strict=True)).rstrip())
    total = sum(c.ns for c in items) / 1e3
    floors = sum(floor_s(c.cost, flops_peak, bw_peak) for c in items if c.cost is not None) * 1e6
    loose = [c for c in items if c.cost is None]
    loose_us = sum(c.ns for c in loose) / 1e3
    lines.append("")
    lines.append(
        f"step: {total:.0f} µs of kernels in {len(items)} launches; sum of the classified "
        f"kernels' floors {floors:.0f} µs ({100 * floors / total:.0f} % of the step's kernel time)"
        + (f"; {len(loose)} launches ({loose_us:.0f} µs) with time only" if loose else "")
    )
    return "\n".join(lines)


def pick_step(steps: list[list[Launch]], which: str | None) -> int:
    if which is None:
        return longest_step(steps)
    if which == "last":
        return len(steps) - 1
    try:
        i = int(which)
    except ValueError:
        raise SystemExit(f"roofline: --step {which!r} is neither a step number nor 'last'") from None
    if not 0 <= i < len(steps):
        raise SystemExit(f"roofline: --step {i} is out of range: the CSV has steps 0..{len(steps) - 1}")
    return i


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="Nsight Compute CSV of one `arbor bench decode` run")
    p.add_argument("--tokens", type=int, required=True, help="rows in the step (M)")
    p.add_argument("--batch", type=int, default=1, help="prefill: sequences in the step")
    p.add_argument("--context", type=int, help="keys each row attends to (decode: required; prefill: default M/B)")
    p.add_argument("--step", help="step number, or 'last' (default: the step of the most kernel time)")
    p.add_argument("--gpu", choices=sorted(PEAKS), default="h100")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--lm-rows", type=int, help="rows the LM head computes (default: B after select_rows, else M)")
    d = Model()
    for field in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "layers"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(d, field))
    a = p.parse_args(argv)
    md = Model(a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate, a.vocab, a.layers)

    steps = cut_steps(read_ncu(a.csv))
    if not steps:
        raise SystemExit(f"roofline: no complete step (no row_stats kernel) in {a.csv}")
    i = pick_step(steps, a.step)
    launches = steps[i]
    mode = step_mode(launches)
    if a.tokens < 1 or a.batch < 1:
        raise SystemExit(f"roofline: --tokens {a.tokens} and --batch {a.batch} must be positive")
    if mode == "prefill" and a.tokens % a.batch:
        raise SystemExit(f"roofline: --tokens {a.tokens} is not a multiple of --batch {a.batch}")
    if mode == "decode" and a.context is None:
        raise SystemExit(f"roofline: step {i} is a decode step: give --context (keys per row)")
    per_seq = a.tokens // a.batch if mode == "prefill" else 1
    context = a.context if a.context is not None else per_seq
    if mode == "prefill" and context < per_seq:
        raise SystemExit(f"roofline: --context {context} is shorter than the {per_seq} tokens of each sequence")
    has_select = any(kind(n) == "select" for n, _ in launches)
    lm_rows = a.lm_rows if a.lm_rows is not None else (a.batch if has_select else a.tokens)
    sh = Shape(a.tokens, a.batch, context, lm_rows)
    items = classify(launches, md, sh)

    _, _, peak_text = PEAKS[a.gpu]
    if mode == "prefill":
        what = f"prefill of {a.batch} × {per_seq} tokens over {context} keys each"
    elif mode == "decode":
        what = f"decode of {a.tokens} rows over {context} keys each ({splits(context)} split{'s' if splits(context) > 1 else ''} of {SPLIT_KEYS} keys)"
    else:
        what = f"{mode} step ({a.tokens} rows): attention listed with time only"
    print(f"step {i} (of steps 0–{len(steps) - 1}) in {a.csv}: {what}; LM head over {lm_rows} rows; {peak_text}")
    print()
    print(report(items, a.gpu, a.markdown))


if __name__ == "__main__":
    main(sys.argv[1:])
