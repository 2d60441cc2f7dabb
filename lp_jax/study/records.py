"""Records of finished runs: what a study reports on, without the checkpoints.

A study of many seeds takes longer than a machine may be kept, and only a repository
travels between machines. So with ``--records DIR`` every finished run's record (its
configs and metrics: a few hundred KB, no weights, and the code and machine it trained
on) is
copied to DIR as the run finishes, under the run's path in the runs folder; a later study
with the same DIR puts the record back into an empty run folder and reuses the run instead
of training it again (docs/study.md, "Runs: train, resume, reuse"). A recorded run has no
checkpoint, so it is not evaluated downstream.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
import re
import shutil

from lp_jax.study.provenance import source_commit
from lp_jax.training.metrics import read_metrics

# config.yaml (the trainer's) decides whether a folder holds this study's run; the
# metrics are what the report reads. (A finished run's log adds nothing the report uses,
# and it names the machine's folders.)
RECORD_FILES = ("config.yaml", "study_config.yaml", "metrics.jsonl")
CONFIGS = ("config.yaml", "study_config.yaml")
REQUIRED = ("config.yaml", "metrics.jsonl")
# The folder is a session key (never compared): a record names it relative to the records.
RUN_DIR_LINE = re.compile(r"^run_dir: .*$", re.MULTILINE)
MACHINE_FILE = "machine.json"
# What a study puts back into a run folder from a record: the run, and what trained it.
RESTORED_FILES = RECORD_FILES + (MACHINE_FILE,)


def reaches(metrics: list[dict], target_step: int) -> bool:
    """The metrics rows reach ``target_step``: the run trained to its end."""
    return bool(metrics) and metrics[-1].get("step", -1) >= target_step


def record_path(records: str | os.PathLike, runs_dir: str | os.PathLike,
                run_dir: str | os.PathLike) -> pathlib.Path:
    """Where the record of ``run_dir`` (a folder under ``runs_dir``) is kept."""
    relative = os.path.relpath(os.path.abspath(run_dir), os.path.abspath(runs_dir))
    if relative.startswith(os.pardir):
        raise ValueError(f"run folder {run_dir} is not under the runs folder {runs_dir}")
    return pathlib.Path(records) / relative


def finished(folder: str | os.PathLike, target_step: int) -> bool:
    """The folder's metrics reach ``target_step`` (the run trained to its end)."""
    if not all((pathlib.Path(folder) / name).is_file() for name in REQUIRED):
        return False
    return reaches(read_metrics(os.fspath(folder)), target_step)


def restore(record: pathlib.Path, run_dir: str | os.PathLike, target_step: int) -> bool:
    """Copies a finished record into ``run_dir`` when that folder holds no run yet (no
    config.yaml); True if it did. A folder with a run of its own is never overwritten."""
    run_dir = pathlib.Path(run_dir)
    if (run_dir / "config.yaml").exists() or not finished(record, target_step):
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in RESTORED_FILES:
        if (record / name).is_file():
            shutil.copy2(record / name, run_dir / name)
    return True


def save(run_dir: str | os.PathLike, record: pathlib.Path, records: str | os.PathLike) -> None:
    """Copies a finished run's record files into ``record`` (a folder under ``records``),
    its configs naming the run folder as the record's path under ``records``; written to a
    temporary folder first, so a record is whole or absent."""
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_name(record.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    relative = os.path.relpath(record, records)
    for name in RECORD_FILES:
        source = pathlib.Path(run_dir) / name
        if not source.is_file():
            continue
        if name in CONFIGS:
            text = RUN_DIR_LINE.sub(lambda _: f"run_dir: {relative}", source.read_text(), count=1)
            (partial / name).write_text(text)
        else:
            shutil.copy2(source, partial / name)
    trained_on = read_machine(run_dir) or machine()
    (partial / MACHINE_FILE).write_text(json.dumps(trained_on, indent=1) + "\n")
    shutil.rmtree(record, ignore_errors=True)
    os.replace(partial, record)


def write_machine(run_dir: str | os.PathLike) -> None:
    """Notes in ``run_dir`` the code and machine that trained it (this process's)."""
    (pathlib.Path(run_dir) / MACHINE_FILE).write_text(json.dumps(machine(), indent=1) + "\n")


def read_machine(folder: str | os.PathLike) -> dict | None:
    """The folder's machine.json, or None when it has none (or an unreadable one)."""
    try:
        data = json.loads((pathlib.Path(folder) / MACHINE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def machine() -> dict:
    """What decides a run's numbers besides its config: the commit of the code (``-dirty``
    when tracked files had changes; None outside git) and the JAX version, and on a CPU the
    processor, since XLA:CPU picks its kernels by its instruction sets and two machines may
    take two paths from one seed. Kept with each record (a seed's runs are paired across
    machines only if these agree)."""
    import jax
    import jaxlib

    cpu, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                cpu = cpu or (value if key == "model name" else "")
                flags = flags or (value if key == "flags" else "")
    except OSError:  # not Linux: the platform's own name for it
        pass
    cpu = cpu or platform.processor() or platform.machine()
    return {"commit": source_commit(),
            "cpu": cpu, "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version()}
