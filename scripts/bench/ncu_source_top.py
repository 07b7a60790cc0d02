#!/usr/bin/env python3
"""Where a kernel's warps stall, by SASS instruction, from an Nsight Compute report.

Reads the CSV of `ncu --import R.ncu-rep --page source --csv --print-source sass` (a
report taken with `--import-source yes --section SourceCounters`, as `STALLS=1
scripts/bench/profile-gemm.sh` takes it) on standard input, or runs ncu itself when given
the report's path, and prints:

- the instructions with the most warp-stall samples (address, share, SASS text);
- the samples summed by opcode (the SASS text's first word, predicate dropped), which is
  what tells, for example, an mbarrier wait (SYNCS) from a named barrier (BAR) or a wgmma
  wait (WARPGROUP).

Usage: ncu_source_top.py [--top N] [--ncu PATH] [REPORT.ncu-rep]
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
from collections import defaultdict


def read_rows(text: str) -> list[dict[str, str]]:
    """The CSV's rows as dicts; ncu prints a few header lines before the table."""
    lines = text.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if '"Source"' in line or "Source," in line),
        None,
    )
    if start is None:
        raise SystemExit(
            "no source table in the input (was the report taken with --import-source yes?)"
        )
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def number(value: str | None) -> float:
    if not value:
        return 0.0
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass: str) -> str:
    words = sass.strip().split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].rstrip(";") if words else "?"


def summarize(rows: list[dict[str, str]], top: int) -> str:
    if not rows:
        return "no instructions in the source table\n"
    columns = list(rows[0].keys())
    samples = next(
        (c for c in columns if c.startswith("Warp Stall Sampling (All")), None
    )
    if samples is None:
        raise SystemExit(
            f"no 'Warp Stall Sampling (All Samples)' column; columns: {columns}"
        )
    address = next((c for c in columns if "Address" in c), columns[0])
    counted = [
        (number(r.get(samples)), r.get(address, ""), r.get("Source", "")) for r in rows
    ]
    total = sum(n for n, _, _ in counted) or 1.0
    out = [
        f"{total:.0f} stall samples over {len(rows)} instructions",
        "top instructions:",
    ]
    for n, addr, src in sorted(counted, reverse=True)[:top]:
        if n <= 0:
            break
        out.append(f"  {100 * n / total:5.1f} %  {addr:>8}  {src.strip()}")
    by_op: dict[str, float] = defaultdict(float)
    for n, _, src in counted:
        by_op[opcode(src)] += n
    out.append("by opcode:")
    for op, n in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        if n <= 0:
            break
        out.append(f"  {100 * n / total:5.1f} %  {op}")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "report", nargs="?", help="an .ncu-rep file (else the CSV on stdin)"
    )
    ap.add_argument(
        "--top", type=int, default=25, help="instructions and opcodes to list"
    )
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    args = ap.parse_args()
    if args.report:
        cmd = [
            args.ncu,
            "--import",
            args.report,
            "--page",
            "source",
            "--csv",
            "--print-source",
            "sass",
        ]
        got = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if got.returncode != 0:
            raise SystemExit(
                f"{' '.join(cmd)} failed ({got.returncode}): {got.stderr.strip()[:400]}"
            )
        text = got.stdout
    else:
        text = sys.stdin.read()
    sys.stdout.write(summarize(read_rows(text), args.top))


if __name__ == "__main__":
    main()
