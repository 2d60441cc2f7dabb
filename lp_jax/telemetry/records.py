"""The statistics as rows: the quant_stats.jsonl record (schema 1, docs/telemetry.md), the
console/markdown table and the SQNR grid of the heatmap.

One record per probe, layers in order, Linears sorted by name within a layer; ``bf16`` says
the layer policy keeps that layer in BF16, and its ``operands`` are then null. Numbers are
plain JSON floats; a NaN or infinite value is the string "nan", "inf" or "-inf" (as in
metrics.jsonl); a scale exponent with no block to measure is null.
"""
from __future__ import annotations

import math

import numpy as np

from lp_jax.telemetry.probe import OPERANDS, Layout
from lp_jax.telemetry.stats import STATS

SCHEMA = 1
_NULL_WHEN_NAN = ("scale_exp_min", "scale_exp_max")


def _plain(stat: str, value) -> float | str | None:
    value = float(value)
    if math.isnan(value):
        return None if stat in _NULL_WHEN_NAN else "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def number(value) -> float:
    """A statistic read back from a record as a float (null and "nan" are NaN)."""
    return math.nan if value is None else float(value)


def layer_rows(layout: Layout, stats: dict) -> list[dict]:
    rows = []
    for layer in range(layout.num_layers):
        for name in layout.linears:
            table = np.asarray(stats[name][layer])
            bf16 = layout.layer_is_bf16(layer)
            rows.append({"layer": layer, "linear": name, "bf16": bf16, "operands": None if bf16 else
                         {op: {s: _plain(s, table[i, j]) for j, s in enumerate(STATS)}
                          for i, op in enumerate(OPERANDS)}})
    return rows


def record(step: int, layout: Layout, stats: dict) -> dict:
    return {"schema": SCHEMA, "step": step, "recipe": layout.recipe.name,
            "policy": layout.recipe.policy, "micro_batch": 0, "layers": layer_rows(layout, stats)}


def sqnr_grid(rows: list[dict]) -> tuple[np.ndarray, list[str]]:
    """([rows, 6] SQNR in dB, one label per (layer, Linear) row: '3 mlp/up_proj (bf16)')."""
    values = np.array([[math.nan if r["operands"] is None else number(r["operands"][op]["sqnr_db"])
                        for op in OPERANDS] for r in rows])
    labels = [f"{r['layer']} {r['linear']}" + (" (bf16)" if r["bf16"] else "") for r in rows]
    return values, labels


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.3g}"


def table(rows: list[dict], stats=("sqnr_db", "underflow", "saturation", "amax",
                                   "scale_exp_min", "scale_exp_max", "scale_at_limit")) -> str:
    """A markdown table, one line per (layer, Linear, operand)."""
    head = ["layer", "linear", "operand", *stats]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["operands"] is None:
            lines.append(f"| {r['layer']} | {r['linear']} | BF16 |" + " |" * len(stats))
            continue
        for op in OPERANDS:
            cells = [str(r["layer"]), r["linear"], op, *(_cell(r["operands"][op][s]) for s in stats)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
