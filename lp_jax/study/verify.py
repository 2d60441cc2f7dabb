"""`python -m lp_jax.study --verify RECORDS`: does today's code still train what a study
recorded? Each recorded run is rebuilt from its own config.yaml, its first steps are
trained again, and their losses are compared with the recorded ones exactly, as stored.

A study's figures describe the code that trained its runs. A change that moves one
rounding (a GEMM's summation order, a kernel XLA:CPU picks for another instruction set)
sends a run down another path from its first step, so the record can no longer be read
as a result of the current code; a few steps are enough to see it, where retraining the
study would take hours.

With ``write`` the findings go to ``verify.json`` in the records folder, which the
study's report quotes (lp_jax.study.report).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import math
import os
import pathlib
import sys
import tempfile
from typing import Callable

from lp_jax.study import provenance, records
from lp_jax.training.metrics import read_metrics

DEFAULT_STEPS = 3
VERIFY_FILE = "verify.json"


@dataclasses.dataclass
class RunCheck:
    """One recorded run against today's code."""

    name: str  # its path under the records folder: seed4/bf16
    made_by: dict  # its machine.json ({} when it has none)
    steps: int  # the steps compared
    step: int | None = None  # the first step whose loss differs
    recorded: object = None  # that step's loss as recorded...
    now: object = None  # ... and as trained now
    error: str | None = None  # why it could not be retrained

    @property
    def same(self) -> bool:
        return self.error is None and self.step is None

    def line(self, now_made_by: dict) -> str:
        result = ("same" if self.same else f"cannot retrain: {self.error}" if self.error else
                  f"differs at step {self.step} (recorded {self.recorded}, now {self.now})")
        return (f"{self.name}: recorded {provenance.describe(self.made_by)}; now "
                f"{provenance.describe(now_made_by)}: {result}")

    def as_json(self) -> dict:
        return {"run": self.name, "recorded_by": self.made_by, "steps": self.steps,
                "same": self.same, "step": self.step, "recorded_loss": self.recorded,
                "now_loss": self.now, "error": self.error}


def records_folder(path: str | os.PathLike) -> pathlib.Path:
    """The records folder that ``path`` names: a study folder holding ``records/``, or the
    records folder itself. ValueError when it holds no record."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise ValueError(f"--verify {path}: no such folder")
    folder = path / "records" if (path / "records").is_dir() else path
    if not find_records(folder):
        raise ValueError(f"--verify {path}: no recorded run in it (a record is a folder "
                         f"with {' and '.join(records.REQUIRED)}; give a study folder or "
                         f"its records/ folder)")
    return folder


def find_records(folder: pathlib.Path) -> list[pathlib.Path]:
    """Every record under ``folder``, in path order (seed0/bf16, seed0/fp8_cs, ...)."""
    found = [pathlib.Path(d) for d, _, files in os.walk(folder)
             if all(name in files for name in records.REQUIRED) and not d.endswith(".partial")]
    return sorted(found, key=lambda p: p.relative_to(folder).parts)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def compare(recorded: list[dict], now: list[dict], steps: int) -> tuple[int, object, object] | None:
    """(step, recorded loss, loss now) at the first of steps 1..``steps`` where they differ
    (a step logged on one side only differs too); None when all agree."""
    before = {int(m["step"]): m.get("loss") for m in recorded if int(m["step"]) <= steps}
    after = {int(m["step"]): m.get("loss") for m in now if int(m["step"]) <= steps}
    for step in sorted(before.keys() | after.keys()):
        if not _same(before.get(step), after.get(step)):
            return step, before.get(step), after.get(step)
    return None


def retrain(record: pathlib.Path, steps: int, work: pathlib.Path) -> list[dict]:
    """Trains the record's run again from its config.yaml, to step ``steps``, in ``work``;
    its metrics rows. Only keys that move no number change: the folder, the stopping step
    (the schedule still spans the recorded ``steps``), TensorBoard and the progress bar."""
    from lp_jax.config.yaml_io import load_config
    from lp_jax.training.api import pretrain

    config = load_config(record / "config.yaml", [f"run_dir={work}", f"stop_at={steps}",
                                                  "logging.tensorboard=false",
                                                  "logging.progress_bar=false"])
    pretrain(config)
    return read_metrics(os.fspath(work))


def run_name(record: pathlib.Path, folder: pathlib.Path) -> str:
    """A record as verify names it: its path under the records folder (seed4/bf16)."""
    return record.relative_to(folder).as_posix() if record != folder else record.name


def selected(folder: pathlib.Path, only: str = "") -> list[pathlib.Path]:
    """The records under ``folder`` whose names match one of the comma-separated glob
    patterns of ``only`` (every record when it is empty); ValueError when none does."""
    found = find_records(folder)
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    if patterns:
        found = [r for r in found if any(fnmatch.fnmatchcase(run_name(r, folder), p)
                                         for p in patterns)]
        if not found:
            raise ValueError(f"--only {only}: no recorded run matches (names such as "
                             f"{run_name(find_records(folder)[0], folder)})")
    return found


def verify(path: str | os.PathLike, steps: int = DEFAULT_STEPS,
           say: Callable[[str], None] = print,
           progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
           only: str = "", made_by: dict | None = None) -> list[RunCheck]:
    """Checks every record under ``path`` (see ``records_folder``), or those ``only``
    names; ``say`` gets one line per run, ``progress`` the trainer's output and what is
    being retrained. ``made_by``: this process's ``records.machine()``, taken before the
    first import of the trainer (a checkout's commit can move while a long check runs)."""
    if steps < 1:
        raise ValueError(f"--steps {steps}: give at least 1")
    folder = records_folder(path)
    chosen = selected(folder, only)
    now_made_by = made_by or records.machine()
    checks = []
    for record in chosen:
        name = run_name(record, folder)
        recorded = read_metrics(os.fspath(record))
        last = max((int(m["step"]) for m in recorded), default=0)
        check = RunCheck(name, records.read_machine(record) or {}, min(steps, last))
        if not check.steps:
            check.error = "its metrics.jsonl has no step"
            say(check.line(now_made_by))
            checks.append(check)
            continue
        progress(f"[{name}] retraining steps 1-{check.steps}")
        try:
            with tempfile.TemporaryDirectory(prefix="lp_jax_verify_") as work, \
                    contextlib.redirect_stdout(sys.stderr):
                now = retrain(record, check.steps, pathlib.Path(work) / "run")
        except Exception as e:  # noqa: BLE001 - one record's failure must not hide the rest
            check.error = f"{type(e).__name__}: {' '.join(str(e).split())}"
        else:
            if not any(int(m["step"]) >= check.steps for m in now):
                # The trainer stops early, and returns, on a first SIGINT/SIGTERM: so
                # does the check, rather than go on to the next record.
                raise KeyboardInterrupt(f"[{name}] stopped before step {check.steps}")
            found = compare(recorded, now, check.steps)
            if found:
                check.step, check.recorded, check.now = found
        say(check.line(now_made_by))
        checks.append(check)
    return checks


def write(folder: pathlib.Path, checks: list[RunCheck], steps: int, command: str,
          made_by: dict) -> pathlib.Path:
    """Adds this verification to verify.json in the records folder: the command, the code
    and machine that ran it (``made_by``, as ``verify`` took it), and each run's finding. It
    replaces an earlier one made with the same JAX, Python and CPU flags, and keeps those
    made elsewhere: a record may reproduce on its own JAX and not on the next one."""
    entry = {"command": command, "steps": steps, "made_by": made_by,
             "runs": [c.as_json() for c in checks]}
    return add(folder, entry)


def _setup(entry: dict) -> tuple:
    made_by = entry.get("made_by") or {}
    return tuple(made_by.get(k) for k in ("jax", "jaxlib", "python", "cpu_flags_sha256"))


def add(folder: pathlib.Path, entry: dict) -> pathlib.Path:
    kept = [c for c in (read(folder) or {}).get("checks", []) if _setup(c) != _setup(entry)]
    path = pathlib.Path(folder) / VERIFY_FILE
    path.write_text(json.dumps({"checks": kept + [entry]}, indent=1) + "\n")
    return path


def read(folder: str | os.PathLike) -> dict | None:
    """The records folder's verify.json ({"checks": [...]}), or None."""
    try:
        data = json.loads((pathlib.Path(folder) / VERIFY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("checks"), list) else None


# Past this many, the report names the differing runs without their losses (verify.json
# has them all).
LISTED = 6


def _names(runs: list[dict], everything: list[dict]) -> str:
    """'seed0/* (7 runs), seed4/bf16': a folder whose every run is listed, by its folder."""
    def parent(name):
        return name.rpartition("/")[0]
    size = {}
    for r in everything:
        size[parent(r["run"])] = size.get(parent(r["run"]), 0) + 1
    listed, out = {}, []
    for r in runs:
        listed.setdefault(parent(r["run"]), []).append(r["run"])
    for folder, names in listed.items():
        if folder and len(names) == size[folder] > 1:
            out.append(f"{folder}/* ({len(names)} runs)")
        else:
            out += names
    return ", ".join(out)


def markdown(data: dict) -> list[str]:
    """The report's section on verify.json: for each verification, which code retrained
    what, and which runs it did not reproduce."""
    lines = ["## Reproduction (`--verify`)", ""]
    for check in data.get("checks", []):
        lines += _check_lines(check) + [""]
    return lines


def _check_lines(check: dict) -> list[str]:
    runs = check.get("runs") or []
    made_by = check.get("made_by") or {}
    differ = [r for r in runs if not r.get("same")]
    head = (f"`{check.get('command')}` ({provenance.describe(made_by)}) retrained each "
            f"record's first {check.get('steps')} step(s): ")
    if not differ:
        return [head + f"all {len(runs)} reproduce their recorded losses bit for bit."]
    if len(differ) == len(runs) and all(r.get("step") == differ[0].get("step") for r in differ):
        return [head + f"none of the {len(runs)} reproduces; every one differs from step "
                       f"{differ[0].get('step')}."]
    head += (f"{len(runs) - len(differ)} of {len(runs)} reproduce their recorded losses bit "
             f"for bit; ")
    if len(differ) > LISTED:
        by_step: dict = {}
        for r in differ:
            by_step.setdefault(r.get("step"), []).append(r)
        return [head + "; ".join(f"{_names(rs, runs)} differ" +
                                 (f" from step {step}" if step else " (cannot retrain)")
                                 for step, rs in by_step.items()) + "."]
    lines = [head + "these differ:", ""]
    for r in differ:
        cpu = (r.get("recorded_by") or {}).get("cpu_flags_sha256")
        where = ("" if not cpu else "; same CPU flags" if
                 cpu == made_by.get("cpu_flags_sha256") else "; other CPU flags")
        what = (f"cannot retrain: {r['error']}" if r.get("error") else
                f"at step {r['step']} (recorded {r['recorded_loss']}, now {r['now_loss']}{where})")
        lines.append(f"- {r['run']}: {what}")
    return lines
