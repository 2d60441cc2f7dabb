"""Runs tasks through a scorer and collects per-task results and per-document samples."""

from __future__ import annotations

import json
from typing import Mapping, Sequence, TextIO

from lp_jax.evaluation.documents import Doc
from lp_jax.evaluation.metrics import doc_metrics, group_summary, task_summary
from lp_jax.evaluation.mmlu import SUBJECTS
from lp_jax.evaluation.scorer import LoglikelihoodScorer
from lp_jax.evaluation.tasks import SPLITS, load_task, task_groups


def evaluate_task(scorer: LoglikelihoodScorer, name: str, *, shots: int = 0,
                  limit: int | None = None, samples: TextIO | None = None,
                  docs: Sequence[Doc] | None = None) -> dict[str, dict]:
    """Results of one task: `{name: summary}`, plus MMLU's categories and subjects.

    A summary holds acc, acc_norm, acc_bytes, their `_stderr`, n (documents), split and
    shots. With `samples`, one JSON line per document is written to it:
    {"task", "doc" (index in the split), "loglikelihoods" (one per choice), "gold"}.
    `docs` are the task's documents when already built (`load_task(name, shots, limit)`).
    """
    if docs is None:
        docs = load_task(name, shots=shots, limit=limit)
    pairs = [pair for doc in docs for pair in zip(doc.contexts, doc.continuations)]
    loglikelihoods = scorer.score(pairs, desc=name)
    per_doc: dict[str, list[dict[str, float]]] = {}
    position = 0
    for doc in docs:
        lls = loglikelihoods[position:position + len(doc.contexts)]
        position += len(doc.contexts)
        per_doc.setdefault(doc.task, []).append(doc_metrics(lls, doc.gold, doc.choice_texts))
        if samples is not None:
            samples.write(json.dumps({"task": doc.task, "doc": doc.index,
                                      "loglikelihoods": lls, "gold": doc.gold}) + "\n")
    leaves = {key: task_summary(values) for key, values in per_doc.items()}
    groups = {group: group_summary([leaves[m] for m in members if m in leaves])
              for group, members in task_groups(name).items()}
    results = {}
    # The task itself first, then its categories, then its subtasks (harness order).
    for key in [name] + [g for g in groups if g != name] + [k for k in leaves if k != name]:
        summary = groups.get(key) or leaves.get(key)
        if summary is not None:
            results[key] = {**summary, "split": SPLITS[name], "shots": shots}
    return results


def evaluate(scorer: LoglikelihoodScorer, task_names: Sequence[str], *, shots: int = 0,
             limit: int | None = None, samples: TextIO | None = None,
             docs: Mapping[str, Sequence[Doc]] | None = None) -> dict[str, dict]:
    """Results of the tasks in order; `docs` maps task names to their built documents."""
    results: dict[str, dict] = {}
    for name in task_names:
        results.update(evaluate_task(scorer, name, shots=shots, limit=limit, samples=samples,
                                     docs=(docs or {}).get(name)))
    return results


def format_table(results: dict[str, dict]) -> str:
    """A plain-text table of the results (subtasks omitted when a group holds them)."""
    lines = [f"{'task':<28} {'n':>6} {'acc':>14} {'acc_norm':>14}"]
    for key, r in results.items():
        if key.startswith("mmlu_") and key[len("mmlu_"):] in SUBJECTS:
            continue  # the 57 subjects: in the JSON, not on the screen

        def cell(metric: str) -> str:
            value, se = r.get(metric), r.get(f"{metric}_stderr")
            if value is None:
                return "-"
            return f"{value:.4f}" + (f" ±{se:.4f}" if se is not None else "")

        lines.append(f"{key:<28} {r['n']:>6} {cell('acc'):>14} {cell('acc_norm'):>14}")
    return "\n".join(lines)
