"""Table 2: training throughput per variant from its metrics.jsonl.

The first step after every compilation (step 1; the first step of a resumed session)
includes compiling the train step: those steps are left out. They are recognised by
time, not by position (metrics.jsonl does not mark resumes): step 1, and any step slower
than COMPILE_FACTOR x the run's median step. The table states how many were dropped.

tokens/s = tokens of the kept steps / their summed step time; TFLOP/s per device = the
model FLOPs of those steps (each line's tflops_per_device x its step time) / the same
time: both are time-weighted means, so a slow step counts for its whole duration.
"""
from __future__ import annotations

import statistics

COMPILE_FACTOR = 5.0


def kept_steps(metrics: list[dict]) -> tuple[list[dict], int]:
    """(metric lines that time a plain training step, number of compile steps dropped)."""
    timed = [m for m in metrics if isinstance(m.get("step_time_s"), (int, float))
             and isinstance(m.get("tokens_per_sec"), (int, float))]
    if not timed:
        return [], 0
    rest = [m for m in timed if m["step"] != 1] or timed
    limit = COMPILE_FACTOR * statistics.median(m["step_time_s"] for m in rest)
    kept = [m for m in timed if m["step"] != 1 and m["step_time_s"] <= limit]
    return kept, len(timed) - len(kept)


def throughput(metrics: list[dict]) -> dict:
    kept, dropped = kept_steps(metrics)
    if not kept:
        return {"steps_timed": 0, "compile_steps_dropped": dropped, "tokens_per_sec": None,
                "tflops_per_device": None, "step_time_s": None, "mfu": None}
    seconds = sum(m["step_time_s"] for m in kept)
    tokens = sum(m["tokens_per_sec"] * m["step_time_s"] for m in kept)
    tflop = sum(m["tflops_per_device"] * m["step_time_s"] for m in kept
                if isinstance(m.get("tflops_per_device"), (int, float)))
    every_mfu = all(isinstance(m.get("mfu"), (int, float)) for m in kept)
    return {"steps_timed": len(kept), "compile_steps_dropped": dropped,
            "tokens_per_sec": tokens / seconds, "tflops_per_device": tflop / seconds,
            "step_time_s": seconds / len(kept),
            "mfu": sum(m["mfu"] * m["step_time_s"] for m in kept) / seconds
            if every_mfu else None}


def speedup(row: dict, reference: dict | None) -> float | None:
    if not reference or not row.get("tokens_per_sec") or not reference.get("tokens_per_sec"):
        return None
    return row["tokens_per_sec"] / reference["tokens_per_sec"]
