"""Command line of `python -m lp_jax.study`.

    python -m lp_jax.study --config configs/study_tiny.yaml --precisions bf16,fp8_cs,mxfp8,nvfp4
                           [--out REPORT_DIR] [--ablations] [dotted.key=value ...]

Exit status: 0 when every run finished and the report is written; 1 when the report is
written but some run failed or conflicts with its folder; 2 for bad input (one line on
stderr, nothing trained); 130 when interrupted (the running run saved; partial report).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Sequence

from lp_jax.study.downstream import DEFAULT_LIMIT, DEFAULT_TASKS
from lp_jax.study.variants import DEFAULT_PRECISIONS


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="python -m lp_jax.study",
        description="Train the same run in several precisions (or collect the finished runs) "
                    "and write a report: loss curves with the gap to BF16, downstream accuracy, "
                    "throughput, memory per component. Re-running resumes and reuses runs.",
        epilog="Overrides are the trainer's dotted keys (steps=2000 model.num_layers=8), applied "
               "to every run; NAME:key=value applies to run NAME only (nvfp4:data.micro_batch_size=4). "
               "docs/study.md describes the report.")
    p.add_argument("--config", required=True, help="YAML run config (as for train.py)")
    p.add_argument("--precisions", default=DEFAULT_PRECISIONS,
                   help="comma-separated bf16, fp8_cs, fp8_block, mxfp8, nvfp4, each optionally "
                        "with a layer policy (nvfp4:F0L1); nvfp4:4over6 for 4/6 block scales "
                        "(nvfp4:4over6:F0L1); must include bf16 (default %(default)s)")
    p.add_argument("--ablations", action="store_true",
                   help="add NVFP4 with F0L0, without RHT, without stochastic rounding, "
                        "without 2D weight blocks")
    p.add_argument("--seeds", default="",
                   help="train every run once per seed and report paired gaps with 95%% "
                        "confidence intervals: a list (0,1,2) or a count N (seeds 0..N-1); "
                        "adds a BF16 twin per seed as the noise band (default: the config's "
                        "seed only)")
    p.add_argument("--no-twin", action="store_true",
                   help="with --seeds: no BF16 twin runs")
    p.add_argument("--out", help="report folder (default runs/study/<config name>)")
    p.add_argument("--runs-dir", help="where the run folders are (default <out>/runs); "
                                      "finished runs found there are reused")
    p.add_argument("--records", metavar="DIR",
                   help="keep each finished run's record (configs and metrics; no "
                        "checkpoints) in DIR and reuse the runs recorded there, so that a "
                        "study can span machines that keep only the repository")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help="downstream tasks for Table 1, or 'none' (default %(default)s)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                   help="documents per task (MMLU: per subject); 0 scores all (default %(default)s)")
    p.add_argument("--shots", type=int, default=0, help="few-shot examples (default 0)")
    p.add_argument("--no-xla-memory", action="store_true",
                   help="skip compiling each train step for XLA's memory_analysis()")
    p.add_argument("--no-train", action="store_true",
                   help="train nothing: report on what the run folders hold")
    p.add_argument("--progress-every", type=float, default=30.0, metavar="SECONDS",
                   help="seconds between progress lines while a run trains (default 30)")
    p.add_argument("overrides", nargs="*", metavar="[NAME:]key=value")
    return p


def _tasks(text: str) -> tuple[str, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    from lp_jax.evaluation.data_package import package_dir
    from lp_jax.evaluation.tasks import parse_task_names

    tasks = tuple(parse_task_names(text))
    package_dir()  # the benchmark data must be there before hours of training
    return tasks


def parse_seeds(text: str) -> tuple[int, ...]:
    """'' -> (); '4' -> (0, 1, 2, 3); '0,2,5' -> (0, 2, 5)."""
    text = text.strip()
    if not text:
        return ()
    try:
        if "," not in text:
            count = int(text)
            if count < 1:
                raise ValueError
            return tuple(range(count))
        seeds = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--seeds {text!r}: give a count (4) or a list of integers (0,1,2)") from None
    if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise ValueError(f"--seeds {text!r}: seeds must be distinct non-negative integers")
    return seeds


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # This process only analyses (compiles, loads checkpoints) after every run has trained
    # in its own child; on a GPU it must not grab most of the memory JAX preallocates.
    if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        os.environ["LP_JAX_STUDY_SET_PREALLOCATE"] = "1"
    from lp_jax.study.runs import StudyInterrupted
    from lp_jax.study.study import StudyOptions, plan_seeds, run_study

    try:
        if args.limit < 0 or args.shots < 0 or args.progress_every <= 0:
            raise ValueError(f"--limit {args.limit}, --shots {args.shots} and --progress-every "
                             f"{args.progress_every} must be >= 0 (the last > 0)")
        if not os.path.isfile(args.config):
            raise ValueError(f"--config {args.config}: no such file")
        options = StudyOptions(
            config=args.config, overrides=tuple(args.overrides), precisions=args.precisions,
            ablations=args.ablations, seeds=parse_seeds(args.seeds), twin=not args.no_twin,
            out=args.out, runs_dir=args.runs_dir, records=args.records,
            tasks=_tasks(args.tasks), limit=args.limit or None, shots=args.shots,
            xla_memory=not args.no_xla_memory, train=not args.no_train,
            progress_every=args.progress_every,
            command=shlex.join(["python", "-m", "lp_jax.study",
                                *(sys.argv[1:] if argv is None else argv)]))
        plan_seeds(options)  # every config error before anything trains
    except ValueError as e:  # UserError (DataPackageError too) is a ValueError
        print(f"python -m lp_jax.study: error: {e}", file=sys.stderr)
        return 2
    say = lambda line: print(line, flush=True)  # noqa: E731 - progress reaches nohup logs at once
    try:
        summary = run_study(options, say)
    except StudyInterrupted as e:
        say(f"study: interrupted ({e}); re-run the same command to resume")
        return 130
    bad = summary["unfinished"]
    if bad:
        say(f"study: {len(bad)} run(s) did not finish: {', '.join(bad)} (see the report)")
        return 1
    return 0
