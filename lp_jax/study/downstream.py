"""Table 1: downstream accuracy of each run's final checkpoint (lp_jax.evaluation).

As eval.py does, every model is evaluated in BF16 with no recipe applied, whatever
precision trained it, so that the scores isolate the training precision. Results are
cached in RUN_DIR/study_eval.json with the checkpoint step and the settings, so writing the
report again does not score again.
"""
from __future__ import annotations

import json
import os
import pathlib

from lp_jax.evaluation import LoglikelihoodScorer, evaluate, load_from_run_dir
from lp_jax.study.runs import checkpoint_steps

CACHE_NAME = "study_eval.json"
DEFAULT_TASKS = ("hellaswag", "arc_challenge", "winogrande", "mmlu")
DEFAULT_LIMIT = 50  # documents per task (per subject for MMLU): a CPU study stays cheap


def evaluate_run(run_dir: str | os.PathLike, tasks: list[str], limit: int | None, shots: int,
                 batch_size: int = 16) -> dict:
    """{"step", "settings", "results": {task: {acc, acc_norm, *_stderr, n, ...}}}."""

    run_dir = pathlib.Path(run_dir)
    settings = {"tasks": list(tasks), "limit": limit, "shots": shots}
    steps = checkpoint_steps(run_dir)
    cache = run_dir / CACHE_NAME
    if cache.is_file() and steps:
        cached = json.loads(cache.read_text())
        if cached.get("settings") == settings and cached.get("step") == steps[-1]:
            return cached
    loaded = load_from_run_dir(str(run_dir))
    scorer = LoglikelihoodScorer(loaded.model, loaded.tokenizer, max_length=loaded.max_length,
                                 batch_size=batch_size, progress=False)
    results = evaluate(scorer, tasks, shots=shots, limit=limit)
    out = {"step": int(loaded.source.rsplit("@", 1)[-1]), "settings": settings,
           "model": loaded.source, "results": results}
    cache.write_text(json.dumps(out, indent=1))
    return out

