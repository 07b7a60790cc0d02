"""Nsight Compute CSVs of an `arbor bench decode` run, cut into engine steps.

Shared by profile-report.py and roofline.py (both run from scripts/bench/, so a plain
`import ncu_steps` finds this file).
"""

from __future__ import annotations

import csv
import re

Launch = tuple[str, float]
"""(kernel name, ns) of one launch."""

# ncu's --print-units base writes "ns"; other settings write the unit names.
_NS_PER_UNIT = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}


def short(name: str) -> str:
    """A kernel's name without its argument list, cut to 58 characters."""
    name = re.sub(r"\(.*", "", name)  # argument lists of demangled names
    return name if len(name) <= 58 else name[:55] + "..."


def read_ncu(path: str) -> list[Launch]:
    """[(kernel name, ns)] in launch order."""
    with open(path, newline="", errors="replace") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        return []
    head, body = rows[0], rows[1:]
    col = {h: i for i, h in enumerate(head)}
    out: dict[int, Launch] = {}
    if "Metric Name" in col:  # the details page: one row per (launch, metric)
        for r in body:
            if r[col["Metric Name"]] == "gpu__time_duration.sum":
                unit = r[col["Metric Unit"]] if "Metric Unit" in col else "nsecond"
                v = float(r[col["Metric Value"]].replace(",", ""))
                out[int(r[col["ID"]])] = (r[col["Kernel Name"]], v * _NS_PER_UNIT.get(unit, 1.0))
    else:  # the raw page: one row per launch (a units row first)
        m = col["gpu__time_duration.sum"]
        for r in body:
            try:
                out[int(r[col["ID"]])] = (r[col["Kernel Name"]], float(r[m].replace(",", "")))
            except ValueError:
                continue
    return [out[i] for i in sorted(out)]


def cut_steps(launches: list[Launch]) -> list[list[Launch]]:
    """Launches cut after each row-stats kernel (the last kernel of every step)."""
    steps: list[list[Launch]] = []
    cur: list[Launch] = []
    for name, ns in launches:
        cur.append((name, ns))
        if "row_stats" in name:
            steps.append(cur)
            cur = []
    return steps


def longest_step(steps: list[list[Launch]]) -> int:
    """The index of the step with the most kernel time (a `bench decode` run's prefill)."""
    return max(range(len(steps)), key=lambda i: sum(ns for _, ns in steps[i]))
