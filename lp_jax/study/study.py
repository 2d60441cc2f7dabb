"""The study: train (or collect) one run per precision, then analyse and report.

    from lp_jax.study import StudyOptions, run_study
    summary = run_study(StudyOptions("configs/study_tiny.yaml", ablations=True))

Order matters on an accelerator: every run trains in its own child process first, and
only then does this process compile anything (memory analysis) or load checkpoints
(evaluation), so it never holds device memory while a run trains.
"""
from __future__ import annotations

import dataclasses
import pathlib
import signal
import time
from typing import Callable

from lp_jax.config.yaml_io import apply_overrides
from lp_jax.errors import UserError
from lp_jax.study import curves, downstream, memory, records, runs, throughput
from lp_jax.study.report import write_report
from lp_jax.study.variants import (
    DEFAULT_PRECISIONS,
    Variant,
    ablation_variants,
    nvfp4_reference,
    parse_precisions,
    twin_variant,
    variant_config,
)
from lp_jax.training.api import load
from lp_jax.training.metrics import read_metrics
from lp_jax.training.validate import resolve


@dataclasses.dataclass
class StudyOptions:
    config: str | None  # YAML run config (None: the trainer's defaults)
    # Dotted key=value, applied to every run; NAME:key=value only to run NAME (nvfp4,
    # fp8_cs, nvfp4_no_rht, ...), e.g. nvfp4:data.micro_batch_size=4, as the Megatron Bridge
    # study ran NVFP4.
    overrides: tuple[str, ...] = ()
    precisions: str = DEFAULT_PRECISIONS
    ablations: bool = False  # add the NVFP4 ablation runs
    # Every run once per seed (the trained seed, as the config's `seed` key), plus a BF16
    # twin per seed; the report adds paired gaps with confidence intervals. (): one run per
    # precision with the config's seed, as a single-seed study.
    seeds: tuple[int, ...] = ()
    twin: bool = True  # with seeds: the BF16 twin (variants.twin_variant)
    out: str | None = None  # report folder (default runs/study/<config name>)
    runs_dir: str | None = None  # run folders (default <out>/runs)
    # Finished runs' records (lp_jax.study.records), kept and reused there; None: not kept.
    records: str | None = None
    tasks: tuple[str, ...] = downstream.DEFAULT_TASKS  # () skips Table 1
    limit: int | None = downstream.DEFAULT_LIMIT
    shots: int = 0
    xla_memory: bool = True  # compile each train step for memory_analysis()
    train: bool = True  # False: report on what the run folders hold, train nothing
    progress_every: float = 30.0  # seconds between progress lines
    command: str | None = None  # the command line, for the report (None: rebuilt from these)


def report_dir(options: StudyOptions) -> pathlib.Path:
    if options.out:
        return pathlib.Path(options.out)
    name = pathlib.Path(options.config).stem if options.config else "default"
    return pathlib.Path("runs") / "study" / name


def runs_root(options: StudyOptions) -> pathlib.Path:
    """The folder holding every run folder (seed<k>/ folders, with --seeds)."""
    return pathlib.Path(options.runs_dir) if options.runs_dir else report_dir(options) / "runs"


def plan_seeds(options: StudyOptions) -> dict[int | None, list[tuple[Variant, object]]]:
    """{seed: its runs} (one entry, None, without --seeds); every config error of every
    seed raises before anything trains."""
    seeds = options.seeds or (None,)
    return {seed: plan_variants(options, seed) for seed in seeds}


def plan_variants(options: StudyOptions, seed: int | None = None) -> list[tuple[Variant, object]]:
    """(variant, its TrainConfig) for every run of one seed (None: the config's seed, run
    folders straight under the runs folder; else under `seed<k>/`); config errors raise
    before any training."""
    common, own = split_overrides(options.overrides)
    base = load(options.config, *common, *([] if seed is None else [f"seed={seed}"]))
    variants = parse_precisions(options.precisions)
    if options.ablations:
        variants += nvfp4_reference(variants) + ablation_variants(variants)
    if options.seeds and options.twin:
        variants.append(twin_variant(base))
    unknown = sorted(set(own) - {v.name for v in variants})
    if unknown:
        raise UserError(f"override for {unknown[0]!r}, which is not a run of this study "
                        f"(runs: {', '.join(v.name for v in variants)})")
    runs_dir = runs_root(options)
    if seed is not None:
        runs_dir = runs_dir / f"seed{seed}"
    planned = []
    for variant in variants:
        try:
            config = variant_config(base, variant, str(runs_dir / variant.name))
            config = apply_overrides(config, own.get(variant.name, []))
            plan = resolve(config)
        except UserError as e:
            raise UserError(f"precision {variant.name}: {e}") from None
        recipe, layers = plan.phases[0].recipe, plan.model_config.num_layers
        if recipe.quantized and recipe.first_bf16_layers + recipe.last_bf16_layers >= layers:
            # The trainer allows it (with a warning); in a study it would be a BF16 run
            # under another name.
            raise UserError(
                f"precision {variant.name}: layer policy {recipe.policy} keeps all {layers} "
                f"layers in BF16, so nothing would be quantized; give a policy that fits, "
                f"e.g. {variant.recipe}:F0L1")
        planned.append((variant, config))
    return planned


def split_overrides(items) -> tuple[list[str], dict[str, list[str]]]:
    """(overrides for every run, {run name: its own overrides}) from key=value and
    NAME:key=value items (a colon before the '=' names the run)."""
    common, own = [], {}
    for item in items:
        key = item.partition("=")[0]
        if ":" in key:
            name, _, rest = item.partition(":")
            own.setdefault(name.strip(), []).append(rest)
        else:
            common.append(item)
    return common, own


class _TermAsInterrupt:
    """SIGTERM stops the study as Ctrl-C does: the running child saves, the report is
    written from what exists."""

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._raise)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        return self

    @staticmethod
    def _raise(signum, frame):
        raise runs.StudyInterrupted("SIGTERM")

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def run_study(options: StudyOptions, say: Callable[[str], None] = print) -> dict:
    """Trains what is missing, writes the report folder, returns the study's numbers."""
    started = time.time()
    plans = plan_seeds(options)
    out = report_dir(options)
    out.mkdir(parents=True, exist_ok=True)
    names = [v.name for v, _ in next(iter(plans.values()))]
    seeds_text = "" if options.seeds else "; "
    if options.seeds:
        seeds_text = f" x {len(plans)} seeds ({', '.join(map(str, options.seeds))}); "
    say(f"study: {len(names)} runs ({', '.join(names)}){seeds_text}report in {out}")
    statuses: dict[tuple, runs.RunStatus] = {}
    interrupted = None
    with _TermAsInterrupt():
        # Seed by seed: a study grows one complete seed at a time across sessions.
        for seed, planned in plans.items():
            for variant, config in planned:
                key, name = (seed, variant.name), _run_name(seed, variant.name)
                if interrupted:
                    statuses[key] = runs.RunStatus("not run", config.end_step,
                                                   message="the study was interrupted")
                    continue
                record = None
                if options.records:
                    record = records.record_path(options.records, runs_root(options), config.run_dir)
                    if records.restore(record, config.run_dir, config.end_step):
                        say(f"[{name}] restored its record from {record}")
                try:
                    if options.train:
                        statuses[key] = runs.train(config, name, say, options.progress_every)
                    else:
                        statuses[key] = runs.inspect_run(config)
                except (KeyboardInterrupt, runs.StudyInterrupted) as e:
                    interrupted = str(e) or "interrupted"
                    statuses[key] = runs.RunStatus("interrupted", config.end_step,
                                                   message=interrupted)
                if statuses[key].state == "conflict":
                    say(f"[{name}] {statuses[key].message}")
                elif statuses[key].state == "complete":
                    say(f"[{name}] reusing the finished run in {config.run_dir}")
                if record is not None and statuses[key].ok and not records.finished(
                        record, config.end_step):
                    records.save(config.run_dir, record, options.records)
                    say(f"[{name}] record kept in {record}")
    # The first seed is analysed in full (memory, downstream evaluation); the others only
    # for their losses, which is all the statistics across seeds need.
    by_seed = {}
    for i, (seed, planned) in enumerate(plans.items()):
        by_seed[seed] = [_analyse(variant, config, statuses[(seed, variant.name)], options, say,
                                  heavy=interrupted is None and i == 0)
                         for variant, config in planned]
    entries = next(iter(by_seed.values()))
    summary = write_report(out, entries, options, interrupted, seconds=time.time() - started,
                           by_seed=by_seed if options.seeds else None)
    # Runs of every seed that did not reach their target (the report's runs are one seed's).
    summary["unfinished"] = [_run_name(seed, name) for (seed, name), status in statuses.items()
                             if not status.ok]
    say(f"study: report written to {out / 'report.md'}")
    if interrupted:
        raise runs.StudyInterrupted(interrupted)
    return summary


def _run_name(seed: int | None, name: str) -> str:
    """A run as progress lines and the exit summary name it: bf16, or seed1/bf16."""
    return name if seed is None else f"seed{seed}/{name}"


def _analyse(variant: Variant, config, status: runs.RunStatus, options: StudyOptions,
             say: Callable[[str], None], heavy: bool) -> dict:
    """Everything the report says about one run; a failure in any part is recorded."""
    metrics = read_metrics(config.run_dir)
    entry = {"variant": variant, "config": config, "status": status, "metrics": metrics,
             "summary": curves.summarize(metrics, status.target_step),
             "throughput": throughput.throughput(metrics), "memory": None, "eval": None,
             "errors": {}, "machine": records.read_machine(config.run_dir)}
    if not heavy:
        return entry
    try:
        say(f"[{variant.name}] memory analysis" + (" (compiling the train step)"
                                                   if options.xla_memory else ""))
        entry["memory"] = memory.memory_table_row(config, xla=options.xla_memory)
    except Exception as e:  # noqa: BLE001 - one run's analysis must not lose the others
        entry["errors"]["memory"] = f"{type(e).__name__}: {e}"
        say(f"[{variant.name}] memory analysis failed: {entry['errors']['memory']}")
    if options.tasks and status.ok and runs.checkpoint_steps(config.run_dir):
        try:
            say(f"[{variant.name}] evaluating {','.join(options.tasks)} (limit {options.limit})")
            entry["eval"] = downstream.evaluate_run(config.run_dir, list(options.tasks),
                                                    options.limit, options.shots)
        except Exception as e:  # noqa: BLE001
            entry["errors"]["eval"] = f"{type(e).__name__}: {e}"
            say(f"[{variant.name}] evaluation failed: {entry['errors']['eval']}")
    return entry
