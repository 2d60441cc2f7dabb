"""Accuracy metrics and standard errors, as lm-evaluation-harness computes them.

Per document (harness `process_results` for multiple choice; ties go to the first choice,
as `np.argmax`):
- acc:       the choice with the highest log-likelihood sum is the gold one;
- acc_norm:  the same after dividing each sum by the length of the choice text in
             characters (the harness's `len(choice)`; equal to bytes on ASCII text);
- acc_bytes: divided by the choice's UTF-8 byte length instead (the harness's `acc_bytes`).

Per task: the mean, and its standard error sample_std / sqrt(n) with the n - 1
denominator (harness `mean_stderr`). A group (MMLU's categories, then MMLU) is the
size-weighted mean of its subtasks (the leaves under it, as the harness 0.4.x pools
them) and the harness's pooled standard error:
sqrt(sum((n_i - 1) * n_i * se_i^2) / (N - k) / N).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

METRICS = ("acc", "acc_norm", "acc_bytes")


def doc_metrics(loglikelihoods: Sequence[float], gold: int,
                choice_texts: Sequence[str]) -> dict[str, float]:
    lls = np.asarray(loglikelihoods, dtype=np.float64)
    chars = np.array([float(len(t)) for t in choice_texts])
    nbytes = np.array([float(len(t.encode("utf-8"))) for t in choice_texts])
    return {
        "acc": float(np.argmax(lls) == gold),
        "acc_norm": float(np.argmax(lls / chars) == gold),
        "acc_bytes": float(np.argmax(lls / nbytes) == gold),
    }


def mean_stderr(values: Sequence[float]) -> float | None:
    """Sample standard deviation (n - 1) over sqrt(n); None for fewer than 2 values."""
    n = len(values)
    if n < 2:
        return None
    mean = math.fsum(values) / n
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return math.sqrt(variance) / math.sqrt(n)


def pooled_stderr(stderrs: Sequence[float | None], sizes: Sequence[int]) -> float | None:
    """The harness's pooled standard error of a size-weighted mean of subtask means."""
    total, count = sum(sizes), len(sizes)
    if total - count <= 0:
        return None
    pooled_variance = 0.0
    for se, n in zip(stderrs, sizes):
        if n > 1:  # a single-document member contributes (n - 1) * ... = 0
            if se is None:
                return None
            pooled_variance += (n - 1) * se**2 * n
    return math.sqrt(pooled_variance / (total - count) / total)


def task_summary(per_doc: Sequence[dict[str, float]]) -> dict[str, float | int | None]:
    """{metric, metric_stderr, n} over the documents of one task or subtask."""
    summary: dict[str, float | int | None] = {}
    for name in METRICS:
        values = [d[name] for d in per_doc]
        summary[name] = math.fsum(values) / len(values) if values else None
        summary[f"{name}_stderr"] = mean_stderr(values)
    summary["n"] = len(per_doc)
    return summary


def group_summary(members: Sequence[dict]) -> dict[str, float | int | None]:
    """Size-weighted mean and pooled standard error of member summaries."""
    members = [m for m in members if m["n"] > 0]
    sizes = [m["n"] for m in members]
    total = sum(sizes)
    summary: dict[str, float | int | None] = {}
    for name in METRICS:
        summary[name] = (math.fsum(m[name] * m["n"] for m in members) / total) if total else None
        summary[f"{name}_stderr"] = pooled_stderr([m[f"{name}_stderr"] for m in members], sizes)
    summary["n"] = total
    return summary
