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


LAYER_HEADER = ("recipe", "layer HBM GB", "extra over BF16 GB", "quantization floor GB", "extra / floor",
                "kernels", "kernels x BF16", "GEMM ms", "other ms", "other / GEMM", "est. ms",
                "est. x BF16", "outside loops GB / kernels / ms")


def _layer_cells(r: dict, base: dict | None) -> list[str]:
    c = r["layer_cost"]
    loops, outside = c["loops"], c["outside"]
    extra = None if base is None else loops["hbm_bytes"] - base["loops"]["hbm_bytes"]
    floor = c["quant_minimum_bytes"]
    ratio = lambda a, b: "-" if b in (None, 0) or a is None else f"{a / b:.2f}"  # noqa: E731
    return [r["recipe"], f"{loops['hbm_bytes'] / GB:.2f}",
            "-" if extra is None or r["recipe"] == "bf16" else f"{extra / GB:.2f}",
            "-" if not floor else f"{floor / GB:.2f}",
            "-" if not floor else ratio(extra, floor),
            str(loops["kernels"]), "-" if base is None else ratio(loops["kernels"], base["loops"]["kernels"]),
            f"{loops['gemm_s'] * 1e3:.2f}", f"{loops['other_s'] * 1e3:.2f}",
            ratio(loops["other_s"], loops["gemm_s"]), f"{loops['time_s'] * 1e3:.2f}",
            "-" if base is None else ratio(base["loops"]["time_s"], loops["time_s"]),
            f"{outside['hbm_bytes'] / GB:.2f} / {outside['kernels']} / {outside['time_s'] * 1e3:.2f}"]


def layer_table(rows: list[dict], gpu: GPU) -> str:
    """One layer's forward and backward per recipe (``--layer-cost``): the difference of the
    step at 3 and 2 layers inside the layer loops, the rest of that difference apart."""
    measured = [r for r in rows if "layer_cost" in r]
    if not measured:
        return ""
    base = next((r["layer_cost"] for r in measured if r["recipe"] == "bf16"), None)
    seq = measured[0]["layer_cost"]["seq_len"]
    lines = [f"One layer, forward and backward, sequence {seq}, every Linear quantized, on one {gpu.name} "
             "(the step at 3 layers less the step at 2; times estimated by the roofline, not measured)", "",
             "| " + " | ".join(LAYER_HEADER) + " |", "|" + "---|" * len(LAYER_HEADER)]
    lines += ["| " + " | ".join(_layer_cells(r, base)) + " |" for r in measured]
    return "\n".join(lines)
