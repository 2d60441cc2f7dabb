"""Command line of `eval.py`: downstream multiple-choice evaluation of a run or an HF folder.

    python eval.py --checkpoint RUN_DIR | --hf HF_DIR --tasks hellaswag,arc_challenge,winogrande,mmlu
                   [--limit N] [--shots K] [--output results.json] [--log-samples FILE]
                   [--dtype bfloat16|float32] [--batch-size B] [--max-length L]

Bad input (unknown task, missing data package, bad path, more --shots than a task has
examples for) prints one line and exits 2, before the model is loaded: the documents of
every task are built, and every output path probed, first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from lp_jax.errors import UserError
from lp_jax.evaluation.data_package import package_dir
from lp_jax.evaluation.documents import Doc
from lp_jax.evaluation.tasks import TASKS, load_task, parse_task_names
from lp_jax.runs.writable import write_problem
from models.files import file_written_whole

DTYPES = ("bfloat16", "float32")
MMLU_DEV_EXAMPLES = 5  # few-shot examples per subject in MMLU's dev split


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints the whole usage first; one line is enough
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="eval.py", description="lm-evaluation-harness-style log-likelihood evaluation "
        f"on the offline benchmark sets. Tasks: {', '.join(TASKS)}.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="RUN_DIR", help="a training run folder")
    source.add_argument("--hf", metavar="HF_DIR", help="a Hugging Face Llama folder "
                        "(config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--tasks", default="hellaswag,arc_challenge,winogrande,mmlu",
                   help="comma-separated task names (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None,
                   help="score only the first N documents of each split (MMLU: of each subject)")
    p.add_argument("--shots", type=int, default=0, help="few-shot examples (default 0)")
    p.add_argument("--output", default=None, help="results JSON (default: "
                   "RUN_DIR/eval_results.json, or ./eval_results.json with --hf)")
    p.add_argument("--log-samples", metavar="FILE", default=None,
                   help="write one JSON line per document: task, doc, loglikelihoods, gold")
    p.add_argument("--dtype", default="bfloat16",
                   help="compute dtype of the evaluated model (default bfloat16, whatever "
                   "precision it was trained in)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    p.add_argument("--max-length", type=int, default=None,
                   help="override the model's context length (longer prompts lose their start)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p


def _validate(args) -> list[str]:
    tasks = parse_task_names(args.tasks)
    for flag, value, least in (("--limit", args.limit, 1), ("--shots", args.shots, 0),
                               ("--batch-size", args.batch_size, 1),
                               ("--max-length", args.max_length, 1)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be >= {least}, got {value}")
    if args.dtype not in DTYPES:
        raise UserError(f"--dtype {args.dtype}: choose from {', '.join(DTYPES)}")
    if "mmlu" in tasks and args.shots > MMLU_DEV_EXAMPLES:
        raise UserError(f"--shots {args.shots}: MMLU has {MMLU_DEV_EXAMPLES} dev examples "
                        "per subject to draw from")
    path = args.checkpoint or args.hf
    if not os.path.isdir(path):
        raise UserError(f"{'--checkpoint' if args.checkpoint else '--hf'} {path}: no such folder")
    _check_outputs(args)
    package_dir()  # fails early, before any model is loaded, if the data is absent
    return tasks


def _results_path(args) -> str:
    if args.output:
        return args.output
    return os.path.join(args.checkpoint, "eval_results.json") if args.checkpoint \
        else "eval_results.json"


def _output_problem(path: str) -> str | None:
    """Why file `path` cannot be written (by temp file and rename), or None."""
    if os.path.isdir(path):
        return "it is a folder, not a file"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{folder} is a file, not a folder" if os.path.exists(folder) \
            else "its folder does not exist"
    return write_problem(folder)


def _check_outputs(args) -> None:
    """Every file eval.py writes is checked now, not after the scoring it would lose."""
    results = _results_path(args)
    outputs = [("--output" if args.output else "results file", results)]
    if args.log_samples:
        if os.path.realpath(args.log_samples) == os.path.realpath(results):
            raise UserError(f"--log-samples {args.log_samples}: it is also the results file")
        outputs.append(("--log-samples", args.log_samples))
    for what, path in outputs:
        problem = _output_problem(path)
        if problem:
            raise UserError(f"{what} {path}: {problem}")


def _build_docs(args, tasks: list[str]) -> dict[str, list[Doc]]:
    """Each task's documents with their few-shot prompts: a task with fewer examples than
    --shots fails here, the way it would while scoring."""
    return {name: load_task(name, shots=args.shots, limit=args.limit) for name in tasks}


def _load(args):
    import jax.numpy as jnp

    from lp_jax.evaluation.loading import load_from_hf_dir, load_from_run_dir

    dtype = jnp.dtype(args.dtype)
    try:
        if args.hf:
            return load_from_hf_dir(args.hf, dtype=dtype)
        return load_from_run_dir(args.checkpoint, dtype=dtype)
    except ImportError as e:  # the model package of this checkout lacks a piece
        raise UserError(f"cannot load the model: {e}") from None


def run(args, tasks: list[str], loaded, docs: dict[str, list[Doc]] | None = None) -> dict:
    from lp_jax.evaluation.runner import evaluate, format_table
    from lp_jax.evaluation.scorer import LoglikelihoodScorer

    max_length = args.max_length or loaded.max_length
    scorer = LoglikelihoodScorer(loaded.model, loaded.tokenizer, max_length=max_length,
                                 batch_size=args.batch_size, progress=not args.no_progress)
    start = time.time()
    with (file_written_whole(args.log_samples) if args.log_samples
          else contextlib.nullcontext()) as samples:
        results = evaluate(scorer, tasks, shots=args.shots, limit=args.limit, samples=samples,
                           docs=docs)
    report = {
        "config": {"model": loaded.source, "tasks": tasks, "shots": args.shots,
                   "limit": args.limit, "dtype": args.dtype, "batch_size": args.batch_size,
                   "max_length": max_length, "seconds": round(time.time() - start, 1)},
        "results": results,
    }
    output = _results_path(args)
    with file_written_whole(output) as f:
        json.dump(report, f, indent=2)
    print(format_table(results))
    print(f"results written to {output}")
    return report


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        tasks = _validate(args)
        docs = _build_docs(args, tasks)
        loaded = _load(args)
    # Input errors only: a failure while scoring is a bug and keeps its traceback.
    except (ValueError, OSError) as e:  # UserError (DataPackageError too) is a ValueError
        print(f"eval.py: error: {e}", file=sys.stderr)
        return 2
    from lp_jax.evaluation.scorer import UnscorableError

    try:
        run(args, tasks, loaded, docs)
    except UnscorableError as e:  # a model and tokenizer that do not belong together
        print(f"eval.py: error: {loaded.source}: {e}", file=sys.stderr)
        return 2
    return 0
