"""Timing and table helpers shared by the benchmarks (not timed tests: they print tables)."""
from __future__ import annotations

import statistics
import time

import jax


def median_seconds(fn, *args, warmup=1, repeats=5):
    """Median wall time of fn(*args) after warm-up calls (compilation excluded)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_seconds(fns, args, base, warmup=1, repeats=5):
    """{name: (median wall seconds, median ratio to fns[base])} of each fn(*args[name]),
    timed in rounds that run every fn once in turn, so a change in the machine's load
    lands on every row alike; the ratio is the median over rounds of the round's
    fn / base, which cancels what load a whole round shares."""
    for name, fn in fns.items():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args[name]))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args[name]))
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), statistics.median(t / b for t, b in zip(ts, times[base])))
            for name, ts in times.items()}


def print_table(headers, rows, title=None):
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def platform_line():
    d = jax.devices()[0]
    return f"jax {jax.__version__}, {d.platform} ({getattr(d, 'device_kind', d.platform)}), {jax.device_count()} device(s)"
