"""Model FLOPs, device peaks, and the metrics sinks (metrics.jsonl, TensorBoard, progress bar).

Model FLOPs per token are ``6 N + 12 L H d_head T`` (``flops_per_token`` and
``matmul_params`` of ``models.config``, re-exported here). ``tflops_per_device`` is the
step's model FLOPs / step time / devices; ``mfu`` divides it by the device's dense peak for
the recipe's GEMM format (``PEAK_TFLOPS``). docs/training.md, "Metrics", defines them.
"""
from __future__ import annotations

import math
import os
import pathlib
import sys
from typing import Any

from tqdm import tqdm

from lp_jax.recipes import RECIPES
from lp_jax.runs.jsonl import JsonlAppender, read_jsonl
from models.config import flops_per_token, matmul_params  # noqa: F401  (re-exported)

# Dense (no sparsity) peak tensor-core TFLOP/s per GPU. Sources: NVIDIA H100 Tensor Core GPU
# datasheet (SXM5: BF16 1,979 / FP8 3,958 with sparsity); NVIDIA H200 datasheet (SXM: same
# Hopper tensor cores and clocks as H100 SXM); NVIDIA HGX B200 spec (8 GPUs: BF16 36 PF,
# FP8 72 PF, FP4 144 PF with sparsity); NVIDIA GB200 NVL72 spec (72 GPUs: BF16 360 PF,
# FP8 720 PF, FP4 1,440 PF with sparsity). Dense = half the sparse figure.
PEAK_TFLOPS = {
    "H100": {"bf16": 989.4, "fp8": 1978.9, "fp4": None},
    "H200": {"bf16": 989.4, "fp8": 1978.9, "fp4": None},
    "B200": {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0},
    "GB200": {"bf16": 2500.0, "fp8": 5000.0, "fp4": 10000.0},
}

def device_family(device_kind: str) -> str | None:
    """The PEAK_TFLOPS row for a jax device_kind ('NVIDIA H100 80GB HBM3' -> 'H100'); None
    for unknown devices and for the PCIe/NVL variants, whose peaks are lower."""
    kind = device_kind.upper()
    if "PCIE" in kind or "NVL" in kind:
        return None
    for family in ("GB200", "B200", "H200", "H100"):  # GB200 before B200: substring
        if family in kind:
            return family
    return None


def peak_tflops(device_kind: str, recipe: str) -> float | None:
    family = device_family(device_kind)
    if family is None:
        return None
    fmt = RECIPES[recipe].gemm_dtype if recipe in RECIPES else "bf16"
    peaks = PEAK_TFLOPS[family]
    return peaks[fmt] if peaks.get(fmt) else peaks["bf16"]


def peak_memory_gib(device) -> float | None:
    """Peak bytes in use on the device since start, where the backend reports it (GPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # CPU backends may raise instead of returning None
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**30


class MetricsWriter:
    """One JSON object per logged step in ``metrics.jsonl``, mirrored to TensorBoard.

    On resume, lines after the restored step (written by the interrupted run after its
    last checkpoint) are dropped, so each step appears once and the file reads as if the
    run had never stopped.
    """

    def __init__(self, run_dir: str | os.PathLike, start_step: int, tensorboard: bool = True):
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = JsonlAppender(self.path, start_step, on_damaged=lambda n: print(
            f"metrics: {self.path}: skipped {n} damaged line(s); the other rows are kept",
            file=sys.stderr))
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                print("metrics: tensorboardX is not installed; no TensorBoard files "
                      "(pip install tensorboardX, or logging.tensorboard=false)", file=sys.stderr)
            else:
                self._tb = SummaryWriter(str(pathlib.Path(run_dir) / "tensorboard"))

    def write(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        self._file.write(record)
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl ([] if there is none): a line cut short by a killed
    process, or damaged in the middle, is skipped and the rows after it are kept."""
    return read_jsonl(pathlib.Path(run_dir) / "metrics.jsonl")


class Progress:
    """A tqdm bar over the run's steps (starting at the resumed step), or nothing."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self._bar = None
        if enabled:
            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                             file=sys.stderr)

    def update(self, values: dict[str, Any]) -> None:
        if self._bar is not None:
            shown = {k: f"{values[k]:.4g}" for k in ("loss", "lr", "tokens_per_sec", "mfu")
                     if isinstance(values.get(k), float)}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)

    def write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _plain(value: Any) -> Any:
    """JSON-ready: numpy/JAX scalars to Python numbers, non-finite floats to strings
    (JSON has no NaN; "nan" keeps the file parseable by any reader)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
