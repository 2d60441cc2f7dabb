"""Table 3's columns, rows (MiB) and the method paragraph the report prints under it."""
from __future__ import annotations

MiB = 2**20

# (column header, key of memory.memory_table_row)
COMPONENTS = (
    ("masters (FP32)", "master_weights"),
    ("gradients (FP32)", "gradients"),
    ("Adam m, v (FP32)", "optimizer_moments"),
    ("parameter copies for backward", "parameter_copies"),
    ("activations for backward", "activations"),
    ("of which linear inputs", "linear_inputs"),
)
MEMORY_COLUMNS = ["run"] + [c for c, _ in COMPONENTS] + ["total", "activations vs BF16"]
XLA_COLUMN = "XLA temp of the compiled step"

MEMORY_METHOD = (
    "Computed by `lp_jax/study/memory.py` with the code that writes the report (nothing "
    "runs): the abstract train state's bytes and JAX's saved residuals of one micro-batch "
    "per device; 'total' adds the columns left of it (linear inputs once). The method: "
    "docs/study.md, \"How each number is measured\".")


def _mib(value) -> str:
    return "-" if value is None else f"{value / MiB:.2f}"


def with_xla(numbers: dict) -> bool:
    """Some run has XLA's temp size (the study compiled the train steps)."""
    return any((n.get("memory_bytes") or {}).get("xla_temp") is not None for n in numbers.values())


def memory_columns(numbers: dict) -> list[str]:
    return MEMORY_COLUMNS + ([XLA_COLUMN] if with_xla(numbers) else [])


def memory_rows(numbers: dict) -> list[list[str]]:
    ref = (numbers.get("bf16") or {}).get("memory_bytes") or {}
    xla = with_xla(numbers)
    rows = []
    for n in numbers.values():
        m = n.get("memory_bytes")
        if not m:
            continue
        total = sum(m[k] for _, k in COMPONENTS if k != "linear_inputs")
        ratio = (f"{m['activations'] / ref['activations']:.3f}x"
                 if ref.get("activations") else "-")
        rows.append([n["label"], *(_mib(m[k]) for _, k in COMPONENTS), _mib(total), ratio,
                     *([_mib(m.get("xla_temp"))] if xla else [])])
    return rows
