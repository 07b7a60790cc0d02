#!/usr/bin/env python3
"""Side-by-side table of scripts/bench/bench-decode.sh's results (no dependencies beyond Python).

Reads DIR/decode-arbor-tp*-{invariant,fast,invariant-eager}.json (arbor bench decode; the
eager run is ARBOR_CUDA_GRAPHS=0: every decode step op by op instead of from CUDA graphs),
DIR/decode-sampled-tp*-*.json (bench decode --temperature [--top-k]),
DIR/decode-reference-tp*.json (decode_baseline.py) and DIR/decode-copy.json; prints ms/step
and the ratios the engine's targets are stated in, and writes DIR/decode-report.json
and DIR/decode-report.svg (ms/step vs batch, one line per TP and engine).
"""
import glob
import json
import math
import os
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


d = sys.argv[1] if len(sys.argv) > 1 else "."
arbor = {}  # (tp, numerics, batch) -> row; numerics "invariant-eager" for runs without graphs
for f in glob.glob(os.path.join(d, "decode-arbor-tp*-*.json")):
    for r in load(f):
        # Runs older than the CUDA graphs carry no flag and recorded nothing.
        eager = "-eager" if r.get("cuda_graphs") is False else ""
        arbor[(r["tp"], r["numerics"] + eager, r["batch"])] = r
ref = {}  # (tp, batch) -> ms
for f in glob.glob(os.path.join(d, "decode-reference-tp*.json")):
    j = load(f)
    for b, ms in j["ms_per_step"].items():
        ref[(int(j["world"]), int(b))] = float(ms)
copy_gbps = None
if os.path.exists(os.path.join(d, "decode-copy.json")):
    copy_gbps = load(os.path.join(d, "decode-copy.json"))["copy_gbps"]

tps = sorted({k[0] for k in arbor} | {k[0] for k in ref})
batches = sorted({k[2] for k in arbor} | {k[1] for k in ref})
def ms(tp, num, b):
    r = arbor.get((tp, num, b)); return r["decode_ms_per_step"] if r else None
def fmt(x, p=3):
    return "—" if x is None else f"{x:.{p}f}"
def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b

rows = []
print(f"decode ms/step (llama3-8b shape); roofline = bf16 weight bytes per rank / copy bandwidth "
      f"({fmt(copy_gbps, 0)} GB/s)")
hdr = f"{'TP':>2} {'batch':>5} {'invariant':>10} {'fast':>8} {'reference':>9} {'roofline':>8} {'inv eager':>9} | {'inv/ref':>7} {'inv/fast':>8} {'fast/ref':>8} {'inv/roof':>8} {'TP1/TP':>7} {'eager/inv':>9}"
print(hdr); print("-" * len(hdr))
for tp in tps:
    for b in batches:
        inv, fast, rf = ms(tp, "invariant", b), ms(tp, "fast", b), ref.get((tp, b))
        eager = ms(tp, "invariant-eager", b)
        r = arbor.get((tp, "invariant", b)) or arbor.get((tp, "fast", b))
        roof = r["weight_bytes_per_rank"] / (copy_gbps * 1e9) * 1e3 if r and copy_gbps else None
        tp1 = ratio(ms(1, "invariant", b), inv) if tp != 1 else None
        row = {"tp": tp, "batch": b, "invariant_ms": inv, "fast_ms": fast, "reference_ms": rf,
               "roofline_ms": roof, "invariant_over_reference": ratio(inv, rf),
               "invariant_over_fast": ratio(inv, fast), "fast_over_reference": ratio(fast, rf),
               "invariant_over_roofline": ratio(inv, roof), "tp1_over_this_tp": tp1,
               "invariant_eager_ms": eager, "eager_over_invariant": ratio(eager, inv),
               "prefill_ms_invariant": (arbor.get((tp, "invariant", b)) or {}).get("prefill_ms"),
               "prefill_ms_fast": (arbor.get((tp, "fast", b)) or {}).get("prefill_ms")}
        rows.append(row)
        print(f"{tp:>2} {b:>5} {fmt(inv):>10} {fmt(fast):>8} {fmt(rf):>9} {fmt(roof):>8} {fmt(eager):>9} | "
              f"{fmt(row['invariant_over_reference'], 2):>7} {fmt(row['invariant_over_fast'], 2):>8} "
              f"{fmt(row['fast_over_reference'], 2):>8} {fmt(row['invariant_over_roofline'], 2):>8} {fmt(tp1, 2):>7} "
              f"{fmt(row['eager_over_invariant'], 2):>9}")
print("prefill ms (batch × 128 tokens), invariant / fast:")
for r in rows:
    if r["prefill_ms_invariant"] is not None or r["prefill_ms_fast"] is not None:
        print(f"  TP {r['tp']} batch {r['batch']:>3}: {fmt(r['prefill_ms_invariant'], 1)} / {fmt(r['prefill_ms_fast'], 1)}")
# Sampled decode (invariant): DIR/decode-sampled-tp*-*.json, next to greedy.
sampled = {}  # (tp, label, batch) -> ms
for f in glob.glob(os.path.join(d, "decode-sampled-tp*-*.json")):
    for r in load(f):
        label = (f"T={r['temperature']:g}" + (f" top-k {r['top_k']}" if r.get("top_k") else "")
                 + (f" top-p {r['top_p']:g}" if r.get("top_p", 1.0) < 1.0 else ""))
        sampled[(r["tp"], label, r["batch"])] = r["decode_ms_per_step"]
sampled_rows = []
if sampled:
    print("sampled decode ms/step (invariant; a pure temperature draws on the device; top-k and top-p draw on the host from candidates selected on the device, a top-p nucleus beyond them from its row):")
    for tp, label, b in sorted(sampled):
        g = ms(tp, "invariant", b)
        sampled_rows.append({"tp": tp, "sampling": label, "batch": b, "ms": sampled[(tp, label, b)],
                             "greedy_ms": g})
        print(f"  TP {tp} {label:<20} batch {b:>3}: {fmt(sampled[(tp, label, b)])} (greedy {fmt(g)}, "
              f"ratio {fmt(ratio(sampled[(tp, label, b)], g), 2)})")
with open(os.path.join(d, "decode-report.json"), "w") as out_json:
    json.dump({"copy_gbps": copy_gbps, "rows": rows, "sampled": sampled_rows}, out_json, indent=1)

# SVG: ms/step vs batch (log2 x), one polyline per (TP, engine).
W, H, L, B = 720, 420, 60, 50
series = {}
for r in rows:
    for key, name in (("invariant_ms", "arbor invariant"), ("fast_ms", "arbor fast"),
                      ("invariant_eager_ms", "arbor inv. eager"), ("reference_ms", "reference")):
        if r[key] is not None:
            series.setdefault(f"{name} TP{r['tp']}", []).append((r["batch"], r[key]))
if series:
    ymax = max(v for s in series.values() for _, v in s) * 1.1
    xs = sorted({b for s in series.values() for b, _ in s})
    lx = lambda b: L + (W - L - 170) * (math.log2(b) - math.log2(xs[0])) / max(math.log2(xs[-1]) - math.log2(xs[0]), 1)
    ly = lambda v: H - B - (H - B - 20) * v / ymax
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<line x1="{L}" y1="{H-B}" x2="{W-170}" y2="{H-B}" stroke="black"/><line x1="{L}" y1="20" x2="{L}" y2="{H-B}" stroke="black"/>',
           f'<text x="{(W-170+L)/2}" y="{H-10}" text-anchor="middle">batch</text>',
           f'<text x="15" y="{H/2}" transform="rotate(-90 15 {H/2})" text-anchor="middle">ms / decode step</text>']
    for b in xs:
        out.append(f'<text x="{lx(b):.1f}" y="{H-B+16}" text-anchor="middle">{b}</text>')
    for i in range(6):
        v = ymax * i / 5
        out.append(f'<text x="{L-6}" y="{ly(v)+4:.1f}" text-anchor="end">{v:.1f}</text>')
    for i, (name, pts) in enumerate(sorted(series.items())):
        c = colors[i % len(colors)]; dash = ' stroke-dasharray="5,3"' if name.startswith("reference") else ""
        pts = sorted(pts)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="' + " ".join(f"{lx(b):.1f},{ly(v):.1f}" for b, v in pts) + '"/>')
        out.append(f'<text x="{W-160}" y="{30+16*i}" fill="{c}">{name}</text>')
    out.append("</svg>")
    with open(os.path.join(d, "decode-report.svg"), "w") as svg:
        svg.write("\n".join(out))
