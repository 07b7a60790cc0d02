#!/usr/bin/env python3
"""Kernel-by-kernel view of one decode step (scripts/bench/profile-decode.sh runs it).

  profile-report.py arbor NCU_CSV WALL_LOG NUMERICS BATCH
      Reads Nsight Compute's CSV (gpu__time_duration per launch), cuts the launches into
      steps after each row-stats kernel (the last kernel of every prefill and decode step),
      averages the last two decode steps and prints their kernels grouped by name, their
      sum, and the step's wall time from WALL_LOG (an unprofiled `bench decode` in the same
      call): wall - sum is the GPU's time between kernels plus any host stall.
  profile-report.py arbor-steps NCU_CSV [TITLE]
      The same CSV cut into steps the same way: each step's kernel time and launch count,
      then the kernels of the longest step (a `bench decode` run's prefill) grouped by name.
  profile-report.py reference decode_baseline.py|long_context_reference.py ARGS...
      Runs the reference loop with torch.profiler around five replays of each batch's CUDA
      graph and prints the same table (kernels of one step, their sum, the replay's span).
"""
import re
import sys
from collections import defaultdict

# scripts/bench/ is on sys.path: python puts the script's own folder there.
from ncu_steps import cut_steps, longest_step, read_ncu, short


def table(title, per_kernel, steps, span_us=None):
    total = sum(t for t, _ in per_kernel.values()) / steps
    calls = sum(c for _, c in per_kernel.values()) / steps
    print(f"{title}: {total:.0f} µs of kernels in {calls:.0f} launches per step"
          + ("" if span_us is None else f"; step {span_us:.0f} µs -> {span_us - total:.0f} µs between kernels ({(span_us - total) / max(calls, 1):.2f} µs per launch)"))
    print(f"  {'kernel':<58} {'calls':>6} {'µs/step':>9} {'µs/call':>8} {'share':>6}")
    for name, (t, c) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:<58} {c / steps:>6.1f} {t / steps:>9.1f} {t / c:>8.2f} {100 * t / steps / total:>5.1f}%")


def merge(items):
    """{name: (µs, calls)} summed over entries whose short names agree."""
    out = defaultdict(lambda: (0.0, 0))
    for name, (t, c) in items:
        out[name] = (out[name][0] + t, out[name][1] + c)
    return dict(out)


def arbor_steps(csv_path, title):
    steps = cut_steps(read_ncu(csv_path))
    if not steps:
        print(f"{title}: no complete step in {csv_path}")
        return
    for i, s in enumerate(steps):
        print(f"{title} step {i}: {sum(ns for _, ns in s) / 1e3:.0f} µs of kernels in {len(s)} launches")
    i = longest_step(steps)
    table(f"{title}, step {i}, the longest (ncu)", merge((short(name), (ns / 1e3, 1)) for name, ns in steps[i]), 1)


def arbor(csv_path, wall_log, numerics, batch):
    launches = read_ncu(csv_path)
    steps = cut_steps(launches)
    print(f"arbor {numerics} batch {batch}: {len(launches)} launches, {len(steps)} steps "
          f"(prefill and warm-up included)")
    if len(steps) < 3:
        print("  too few steps to report")
        return
    last = steps[-2:]
    per = merge((short(name), (ns / 1e3, 1)) for s in last for name, ns in s)
    wall = None
    pat = re.compile(rf"TP 1 {numerics}\s+batch\s+{batch}: decode\s+([0-9.]+) ms/step")
    with open(wall_log, errors="replace") as log:
        for line in log:
            m = pat.search(line)
            if m:
                wall = float(m.group(1)) * 1e3
    table(f"arbor {numerics} batch {batch} (ncu, mean of the last 2 decode steps; wall from "
          "the unprofiled run)", per, len(last), wall)


PATCH = '''
def _profile_replays(graph, B, n=5):
    from torch.profiler import profile, ProfilerActivity
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    ks = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
    ks.sort(key=lambda e: e.time_range.start)
    per = {}
    for e in ks:
        t, c = per.get(e.name, (0.0, 0))
        per[e.name] = (t + e.time_range.elapsed_us(), c + 1)
    span = (ks[-1].time_range.end - ks[0].time_range.start) / n if ks else 0.0
    _report_table(f"reference profile batch {B} (torch.profiler, mean of {n} graph replays)", per, n, span)
'''


def reference(script, args):
    with open(script) as f:
        src = f.read()
    # decode_baseline.py warms its graph with five replays, long_context_reference.py with
    # three; the profiled replays follow the warm-up.
    markers = ("    for _ in range(5): graph.replay()\n", "    for _ in range(3): graph.replay()\n")
    marker = next((m for m in markers if m in src), None)
    if marker is None:
        sys.exit(f"profile-report: {script} has none of the lines {[m.strip() for m in markers]} to profile after")
    src = src.replace(marker, marker + "    _profile_replays(graph, B)\n", 1)
    sys.argv = [script] + args
    env = {"__name__": "__main__", "_report_table": lambda t, per, n, span: table(
        t, merge((short(k), v) for k, v in per.items()), n, span)}
    # The reference script, run as itself with a profiler call patched in after its
    # warm-up replays: its own code, not input from elsewhere.
    exec(compile(PATCH + src, script, "exec"), env)  # noqa: S102


if __name__ == "__main__":
    if len(sys.argv) >= 6 and sys.argv[1] == "arbor":
        arbor(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
    elif len(sys.argv) >= 3 and sys.argv[1] == "arbor-steps":
        arbor_steps(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "arbor")
    elif len(sys.argv) >= 3 and sys.argv[1] == "reference":
        reference(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
