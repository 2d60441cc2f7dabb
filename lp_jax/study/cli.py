"""Command line of `python -m lp_jax.study`.

    python -m lp_jax.study --config configs/study_tiny.yaml --precisions bf16,fp8_cs,mxfp8,nvfp4
                           [--out REPORT_DIR] [--ablations] [dotted.key=value ...]
    python -m lp_jax.study --verify docs/study_tiny [--steps 3] [--only 'seed4/*'] [--write]

Exit status: 0 when every run finished and the report is written; 1 when the report is
written but some run failed or conflicts with its folder; 2 for bad input (one line on
stderr, nothing trained); 130 when interrupted (the running run saved; partial report).
With --verify: 0 when every recorded run trains its first steps to the recorded losses,
1 when one differs (or cannot be retrained), 2 for bad input, 130 when interrupted.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Sequence

from lp_jax.study.downstream import DEFAULT_LIMIT, DEFAULT_TASKS
from lp_jax.study.verify import DEFAULT_STEPS
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
    p.add_argument("--config", help="YAML run config (as for train.py); required unless --verify")
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
    p.add_argument("--verify", metavar="RECORDS",
                   help="train nothing but the first steps of each run recorded in RECORDS "
                        "(a study folder or its records/ folder), each from its own config, "
                        "and say which runs' losses differ from the recorded ones")
    p.add_argument("--steps", type=int, default=None,
                   help=f"with --verify: the steps to retrain and compare (default {DEFAULT_STEPS})")
    p.add_argument("--only", default="", metavar="PATTERNS",
                   help="with --verify: only the runs whose names (seed4/bf16) match one of "
                        "these comma-separated glob patterns (seed0/*,seed4/*)")
    p.add_argument("--write", action="store_true",
                   help="with --verify: also write the findings to RECORDS' verify.json, "
                        "which the study's report quotes")
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


def study_options(args: argparse.Namespace, command: str):
    """The StudyOptions the parsed command line asks for; ValueError for bad input."""
    from lp_jax.study.study import StudyOptions

    if args.limit < 0 or args.shots < 0 or args.progress_every <= 0:
        raise ValueError(f"--limit {args.limit}, --shots {args.shots} and --progress-every "
                         f"{args.progress_every} must be >= 0 (the last > 0)")
    if not os.path.isfile(args.config):
        raise ValueError(f"--config {args.config}: no such file")
    return StudyOptions(
        config=args.config, overrides=tuple(args.overrides), precisions=args.precisions,
        ablations=args.ablations, seeds=parse_seeds(args.seeds), twin=not args.no_twin,
        out=args.out, runs_dir=args.runs_dir, records=args.records,
        tasks=_tasks(args.tasks), limit=args.limit or None, shots=args.shots,
        xla_memory=not args.no_xla_memory, train=not args.no_train,
        progress_every=args.progress_every, command=command)


def parse_study_command(command: str):
    """The StudyOptions of a recorded `python -m lp_jax.study ...` command line (as a
    report's study.json keeps it)."""
    words = shlex.split(command)
    if words[:3] != ["python", "-m", "lp_jax.study"]:
        raise ValueError(f"not a study command: {command!r}")
    return study_options(_parser().parse_args(words[3:]), command)


def _verify(args: argparse.Namespace, command: str) -> int:
    from lp_jax.study import records, verify

    steps = DEFAULT_STEPS if args.steps is None else args.steps
    try:
        if args.config or args.overrides:
            raise ValueError("--verify takes no --config or overrides: each run is rebuilt "
                             "from its own record")
        if steps < 1:
            raise ValueError(f"--steps {steps}: give at least 1")
        folder = verify.records_folder(args.verify)
        verify.selected(folder, args.only)
    except ValueError as e:
        print(f"python -m lp_jax.study: error: {e}", file=sys.stderr)
        return 2
    made_by = records.machine()
    try:
        checks = verify.verify(folder, steps, say=lambda line: print(line, flush=True),
                               only=args.only, made_by=made_by)
    except KeyboardInterrupt as e:
        print(f"verify: interrupted ({e or 'SIGINT'}); nothing written", file=sys.stderr)
        return 130
    if args.write:
        path = verify.write(folder, checks, steps, command, made_by)
        print(f"verify: findings written to {path}", file=sys.stderr)
    differ = [c.name for c in checks if not c.same]
    print(f"verify: {len(checks) - len(differ)} of {len(checks)} recorded runs reproduced "
          f"over their first {steps} step(s)", file=sys.stderr)
    return 1 if differ else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = shlex.join(["python", "-m", "lp_jax.study", *(sys.argv[1:] if argv is None else argv)])
    if args.verify is None and (args.steps is not None or args.write or args.only):
        print("python -m lp_jax.study: error: --steps, --only and --write go with --verify "
              "(see --help)", file=sys.stderr)
        return 2
    if args.verify is not None:
        return _verify(args, command)
    if not args.config:
        print("python -m lp_jax.study: error: the following arguments are required: --config "
              "(see --help)", file=sys.stderr)
        return 2
    # This process only analyses (compiles, loads checkpoints) after every run has trained
    # in its own child; on a GPU it must not grab most of the memory JAX preallocates.
    if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        os.environ["LP_JAX_STUDY_SET_PREALLOCATE"] = "1"
    from lp_jax.study.runs import StudyInterrupted
    from lp_jax.study.study import plan_seeds, run_study

    try:
        options = study_options(args, command)
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
