"""Loss curves from metrics.jsonl: training loss (smoothed), validation loss, the final
values, and the relative gap of each to the reference (BF16) run, step by step."""
from __future__ import annotations

import math

import numpy as np


def _finite(value) -> float:
    """metrics.jsonl writes non-finite losses as strings ("nan"): NaN here."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return math.nan
    return value


def _curve(metrics: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the metric lines that hold ``key``."""
    rows = [m for m in metrics if key in m]
    return (np.array([m["step"] for m in rows], dtype=np.int64),
            np.array([_finite(m[key]) for m in rows]))


def train_curve(metrics: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    return _curve(metrics, "loss")


def val_curve(metrics: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    return _curve(metrics, "val_loss")


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (the value at step s averages steps s-window+1..s), NaN-safe:
    a skipped non-finite step does not poison its neighbours."""
    if window <= 1 or len(values) == 0:
        return values.astype(float)
    finite = np.isfinite(values)
    sums = np.convolve(np.where(finite, values, 0.0), np.ones(window), mode="full")[:len(values)]
    counts = np.convolve(finite.astype(float), np.ones(window), mode="full")[:len(values)]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / counts, np.nan)


def smoothing_window(num_steps: int) -> int:
    """About 2% of the run (at least 1): flattens step-to-step noise, keeps the trend."""
    return max(1, num_steps // 50)


def relative_gap(steps: np.ndarray, values: np.ndarray, ref_steps: np.ndarray,
                 ref_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(steps both runs logged, (value - reference) / reference) on those steps."""
    common, i, j = np.intersect1d(steps, ref_steps, return_indices=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return common, (values[i] - ref_values[j]) / ref_values[j]


def summarize(metrics: list[dict], target_step: int) -> dict:
    """Final numbers of a run: the validation loss at its last validation step (and
    whether that is the target step), and the training loss averaged over its last 2%."""
    steps, loss = train_curve(metrics)
    v_steps, v_loss = val_curve(metrics)
    out = {"last_step": int(steps[-1]) if len(steps) else 0, "target_step": target_step,
           "final_val_loss": None, "final_val_loss_stderr": None, "final_val_step": None,
           "final_train_loss": None}
    if len(v_steps):
        out["final_val_loss"], out["final_val_step"] = float(v_loss[-1]), int(v_steps[-1])
        last = next(m for m in reversed(metrics) if "val_loss" in m)
        if last.get("val_loss_stderr") is not None:  # not in every run's metrics.jsonl
            out["final_val_loss_stderr"] = _finite(last["val_loss_stderr"])
    if len(steps):
        tail = loss[-smoothing_window(len(loss)):]
        tail = tail[np.isfinite(tail)]
        out["final_train_loss"] = float(tail.mean()) if len(tail) else None
    return out


def gap(value: float | None, reference: float | None) -> float | None:
    """(value - reference) / reference, or None when either is missing."""
    if value is None or reference is None or not reference:
        return None
    return (value - reference) / reference
