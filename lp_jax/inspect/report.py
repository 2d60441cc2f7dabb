"""What ``python -m lp_jax.inspect`` prints and writes: the statistics table, the per-layer
sensitivity, the proposed policy as a config override; RUN_DIR/inspect.md and the SQNR
heatmap RUN_DIR/inspect_sqnr.png."""
from __future__ import annotations

import os

from lp_jax.telemetry import heatmap
from lp_jax.telemetry.probe import OPERANDS
from lp_jax.telemetry.records import sqnr_grid, table

MARKDOWN = "inspect.md"
PNG = "inspect_sqnr.png"


def _sensitivity_table(result) -> str:
    s = result.sensitivity
    lines = ["| layers quantized | loss | gap to all-BF16 |", "|---|---|---|",
             f"| none (all BF16) | {s.bf16_loss:.5f} | 0 |",
             f"| all | {s.quantized_loss:.5f} | {s.gap_pct(s.quantized_loss):+.3f}% |"]
    for i in s.ranking():
        lines.append(f"| only layer {i} | {s.layer_loss[i]:.5f} | {s.gap_pct(s.layer_loss[i]):+.3f}% |")
    return "\n".join(lines)


def _proposal(result) -> str:
    p = result.proposal
    kept = ", ".join(map(str, p.bf16_layers)) or "none"
    return (f"Proposed policy for a budget of {result.budget_pct:g}%: {p.policy} (BF16 layers: "
            f"{kept}), loss {p.loss:.5f}, gap {p.gap_pct:+.3f}%\n"
            f"Config override: {p.override()}")


def _header(result) -> str:
    r = result.recipe
    return (f"lp_jax.inspect: {result.run_dir}: weights {result.source}; recipe {r.name} "
            f"on every layer; {result.batches} batch(es) of the run's data")


def console(result) -> str:
    parts = [_header(result), "", "Quantization statistics (mean over the batches):",
             table(result.rows), "", "Sensitivity (forward loss, the most sensitive first):",
             _sensitivity_table(result), "", _proposal(result)]
    written = [os.path.join(result.run_dir, MARKDOWN)]
    if result.heatmap:
        written.append(result.heatmap)
    parts.append("Wrote " + ", ".join(written))
    return "\n".join(parts)


def write_files(result) -> None:
    if heatmap.available():
        values, labels = sqnr_grid(result.rows)
        fig = heatmap.sqnr_figure(values, labels, list(OPERANDS),
                                  f"SQNR (dB), {result.recipe.name} on every layer")
        result.heatmap = os.path.join(result.run_dir, PNG)
        heatmap.save_png(fig, result.heatmap)
    picture = (f"![SQNR heatmap]({PNG})\n\n" if result.heatmap else
               "(no heatmap: matplotlib is not installed)\n\n")
    text = (f"# Quantization inspection\n\n{_header(result)}\n\n## Proposal\n\n"
            f"{_proposal(result)}\n\n## Sensitivity\n\n{_sensitivity_table(result)}\n\n"
            f"## SQNR heatmap\n\n{picture}## Statistics\n\n{table(result.rows)}\n")
    with open(os.path.join(result.run_dir, MARKDOWN), "w") as f:
        f.write(text)
