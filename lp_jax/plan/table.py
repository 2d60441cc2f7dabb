"""The plan's rows as the Markdown table the command prints."""
from __future__ import annotations

from lp_jax.plan.gpus import GPU

GB = 1e9
HEADER = ("recipe", "policy", "GB per GPU", "fits", "free", "state GB", "temp GB", "layer B/token/D", "GEMMs per step",
          "kernels", "HBM GB", "TFLOP", "collective GB", "est. step s", "est. TFLOP/s per GPU",
          "est. tokens/s", "est. x BF16")


def _gemms(counts: dict[str, int]) -> str:
    return ", ".join(f"{lib} {n}" for lib, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


def _cells(r: dict) -> list[str]:
    if "error" in r:
        return [r["recipe"], "-", f"error: {r['error']}"] + [""] * (len(HEADER) - 3)
    m, e = r["memory"], r["estimate"]
    ratio = "-" if e["x_bf16"] is None else f"{e['x_bf16']:.2f}"
    layer = r.get("layer_bytes")
    return [r["recipe"], r["policy"], f"{m['per_gpu_bytes'] / GB:.1f}", "yes" if m["fits"] else "NO",
            f"{1 - m['per_gpu_bytes'] / m['capacity_bytes']:.0%}",
            f"{(m['params_bytes'] + m['optimizer_bytes']) / GB:.1f}", f"{m['temp_bytes'] / GB:.1f}",
            "-" if layer is None else f"{layer['per_token_hidden']:.1f}",
            _gemms(r["gemms"]), str(r["kernels"]), f"{r['hbm_bytes'] / GB:.1f}", f"{r['flops'] / 1e12:.1f}",
            f"{r['collective_bytes'] / GB:.2f}", f"{e['step_s']:.3g}", f"{e['tflops_per_gpu']:.0f}",
            f"{e['tokens_per_s']:.4g}", ratio]


def table(rows: list[dict], gpu: GPU, count: int) -> str:
    lines = [f"{count} x {gpu.name} ({gpu.memory_bytes / GB:.0f} GB each); memory from XLA's buffer "
             "assignment, times estimated by the roofline of docs/plan.md (not measured)", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    if any(not r.get("memory", {}).get("fits", True) for r in rows):
        lines.append("")  # the notes below are not table rows (Markdown)
    for r in rows:
        m = r.get("memory", {})
        if not m.get("fits", True):
            biggest = "; ".join(f"{b['instruction']} {b['shape']} {b['bytes'] / GB:.1f} GB"
                                for b in m["largest_buffers"])
            lines.append(f"{r['recipe']} does not fit: largest buffers {biggest}")
            if m["would_help"]:
                lines.append(f"  would help: {'; '.join(m['would_help'])}")
    return "\n".join(lines)
