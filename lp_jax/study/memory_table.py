"""Table 3's columns, rows (MiB) and the method paragraph the report prints under it."""
from __future__ import annotations

MiB = 2**20

# (column header, key of memory.memory_table_row)
COMPONENTS = (
    ("master weights (FP32)", "master_weights"),
    ("gradients (FP32)", "gradients"),
    ("optimizer moments (FP32 m, v)", "optimizer_moments"),
    ("parameters: compute copies kept for backward", "parameter_copies"),
    ("activations saved for backward", "activations"),
    ("of which linear-layer inputs", "linear_inputs"),
)
MEMORY_COLUMNS = (["run"] + [c for c, _ in COMPONENTS] +
                  ["total", "activations vs BF16", "XLA temp of the compiled step"])

MEMORY_METHOD = (
    "How these are measured (`lp_jax/study/memory.py`, nothing is run): master weights, "
    "gradients and optimizer moments are the byte counts of the trainer's abstract train "
    "state (`nnx.eval_shape`, `jax.eval_shape` of the optax state); they do not depend on "
    "the precision. What the backward keeps is JAX's list of saved residuals (what "
    "`jax.ad_checkpoint.print_saved_residuals` prints) for one micro-batch of the trainer's own "
    "forward, with the run's recipe, layer policy and remat: a residual whose size grows when "
    "the micro-batch doubles is an activation, one that does not is a compute copy of a "
    "parameter (its BF16 cast, or its FP8/FP4 bytes and block scales), and one that is a "
    "function argument aliases the master weights (not counted again). 'Linear-layer "
    "inputs' are the activations saved by lp_jax's dot_general (BF16 in BF16 layers, "
    "quantized bytes plus scales in quantized ones); the rest are norms, attention "
    "probabilities, SwiGLU and loss intermediates, which every recipe keeps in BF16/FP32. "
    "FP4 counts 4 bits per value (XLA packs two per byte, on CPU as on a GPU). Activation "
    "bytes are per micro-batch and device. 'Total' adds the columns left of it (linear "
    "inputs once). JAX's list is taken before XLA optimizes; XLA may fuse or recompute some "
    "residuals, so the last column gives XLA's own `memory_analysis()` temp buffers of the "
    "compiled train step (activations, gradients, quantized copies, for the whole step).")


def _mib(value) -> str:
    return "-" if value is None else f"{value / MiB:.2f}"


def memory_rows(numbers: dict) -> list[list[str]]:
    ref = (numbers.get("bf16") or {}).get("memory_bytes") or {}
    rows = []
    for n in numbers.values():
        m = n.get("memory_bytes")
        if not m:
            continue
        total = sum(m[k] for _, k in COMPONENTS if k != "linear_inputs")
        ratio = (f"{m['activations'] / ref['activations']:.3f}x"
                 if ref.get("activations") else "-")
        rows.append([n["label"], *(_mib(m[k]) for _, k in COMPONENTS), _mib(total), ratio,
                     _mib(m.get("xla_temp"))])
    return rows
