"""Training the study's runs: what each run folder already holds (``inspect_run``), and
``train``, which trains what is missing in a child process (one at a time), printing progress
lines from its metrics.

The child is exactly `python train.py --config RUN_DIR/study_config.yaml` (its output in
RUN_DIR/train.log), so any run can be repeated by hand; a failure ends that child only
(docs/study.md, "Runs: train, resume, reuse").
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Callable

import yaml

from lp_jax.config.schema import TrainConfig
from lp_jax.config.yaml_io import SESSION_KEYS, changed_keys, dump_yaml, to_dict, with_defaults
from lp_jax.runs.run_folder import checkpoint_folder
from lp_jax.study import records
from lp_jax.training.metrics import read_metrics

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG_NAME = "study_config.yaml"
LOG_NAME = "train.log"
# Keys that may differ between a run folder's config and the study's without making the
# run a different experiment: the trainer's session keys, and whether TensorBoard logs.
IGNORED_KEYS = SESSION_KEYS | {"logging.tensorboard"}


class StudyInterrupted(Exception):
    """SIGINT/SIGTERM reached the study: the running child was asked to save and stop."""


@dataclasses.dataclass
class RunStatus:
    """What a run folder holds, and what became of training it."""

    state: str  # complete | partial | new | conflict, then trained | failed | interrupted
    target_step: int
    checkpoint_step: int | None = None
    message: str = ""
    recorded: bool = False  # complete from a record: its metrics, no checkpoint

    @property
    def ok(self) -> bool:
        return self.state in ("complete", "trained")


def checkpoint_steps(run_dir: str | os.PathLike) -> list[int]:
    """Committed checkpoint steps (Orbax names a finished one by its step alone)."""
    folder = pathlib.Path(checkpoint_folder(os.fspath(run_dir)))
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())


def config_differences(run_dir: str | os.PathLike, config: TrainConfig) -> list[str]:
    """Dotted keys where the folder's config.yaml (written by the trainer) differs."""
    path = pathlib.Path(run_dir) / "config.yaml"
    if not path.is_file():
        return []
    # Keys added to the trainer since the run was written count at their defaults.
    saved = with_defaults(yaml.safe_load(path.read_text()) or {})
    return changed_keys(saved, to_dict(config), IGNORED_KEYS)


def inspect_run(config: TrainConfig) -> RunStatus:
    """complete: metrics and a checkpoint at the target step, or metrics to the target step
    and no checkpoint (a record; both reused as they are); partial: a
    checkpoint before it (the trainer resumes); new: nothing usable yet; conflict: the
    folder holds a run of another config (never touched)."""
    target = config.end_step
    differences = config_differences(config.run_dir, config)
    if differences:
        return RunStatus("conflict", target, message=(
            f"{config.run_dir} holds a run with another config (differs in "
            f"{', '.join(differences[:6])}); remove it or choose another --out/--runs-dir"))
    steps = checkpoint_steps(config.run_dir)
    latest = steps[-1] if steps else None
    metrics = read_metrics(config.run_dir)
    if latest is not None and latest >= target and metrics and metrics[-1].get("step") == latest:
        return RunStatus("complete", target, latest)
    if latest is None and records.reaches(metrics, target):
        # A finished run's record (lp_jax.study.records): its metrics, no checkpoint.
        return RunStatus("complete", target, recorded=True)
    if latest is not None:
        return RunStatus("partial", target, latest)
    return RunStatus("new", target)


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # The study sets this for its own (analysis) process only; a run keeps JAX's default.
    if env.get("LP_JAX_STUDY_SET_PREALLOCATE") == "1":
        env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
        env.pop("LP_JAX_STUDY_SET_PREALLOCATE", None)
    return env


def _last_lines(path: pathlib.Path, n: int = 3) -> str:
    if not path.is_file():
        return ""
    lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    return " | ".join(lines[-n:])


def _progress_line(name: str, metrics: list[dict], target: int, started: float,
                   first_step: int) -> str | None:
    if not metrics:
        return None
    last = metrics[-1]
    step = int(last["step"])
    done = step - first_step
    elapsed = time.monotonic() - started
    val = next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), None)
    parts = [f"[{name}] step {step}/{target}", f"loss {_num(last.get('loss'))}"]
    if val is not None:
        parts.append(f"val {_num(val)}")
    if done > 0 and elapsed > 0:
        rate = done / elapsed
        parts.append(f"{rate:.2f} steps/s, eta {_duration((target - step) / rate)}")
    return ", ".join(parts)


def _num(value) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else str(value)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


def train(config: TrainConfig, name: str, say: Callable[[str], None] = print,
          progress_every: float = 30.0) -> RunStatus:
    """Trains (or resumes) one run to its target step in a child process."""
    status = inspect_run(config)
    if status.state in ("complete", "conflict"):
        return status
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / CONFIG_NAME
    config_path.write_text(dump_yaml(config))
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), "--config", str(config_path)]
    start_step = status.checkpoint_step or 0
    say(f"[{name}] {'resuming from step ' + str(start_step) if start_step else 'training'} "
        f"to step {status.target_step}: {' '.join(cmd[1:])} (log {run_dir / LOG_NAME})")
    log = open(run_dir / LOG_NAME, "a")
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} study: {' '.join(cmd)}\n")
    log.flush()
    # Its own session: a Ctrl-C at the terminal reaches the study only, which passes one
    # SIGINT on (two would make the trainer stop without saving).
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(),
                             start_new_session=True)
    started, last_said = time.monotonic(), None
    try:
        while True:
            try:
                rc = child.wait(timeout=progress_every)
                break
            except subprocess.TimeoutExpired:
                line = _progress_line(name, read_metrics(run_dir), status.target_step,
                                      started, start_step)
                if line and line != last_said:
                    say(line)
                    last_said = line
    except (KeyboardInterrupt, StudyInterrupted):
        child.send_signal(signal.SIGINT)
        rc = child.wait()
        log.close()
        raise StudyInterrupted(f"[{name}] interrupted; the run saved at its last step "
                               f"(exit status {rc}); re-run the study to resume") from None
    log.close()
    if rc and rc == config.checkpoint.preempted_exit_code:
        # A signal that reached the run itself (a scheduler's SIGTERM): it saved, and the
        # machine is going away, so the study stops as on its own SIGTERM.
        raise StudyInterrupted(f"[{name}] stopped by a signal after saving (exit status {rc}); "
                               "re-run the study to resume")
    after = inspect_run(config)
    if rc == 0 and after.state == "complete":
        records.write_machine(run_dir)  # the code that trained its last steps
        say(f"[{name}] done in {_duration(time.monotonic() - started)}")
        return RunStatus("trained", status.target_step, after.checkpoint_step)
    reason = f"exit status {rc}" if rc else "ended before its target step"
    message = f"training failed ({reason}): {_last_lines(run_dir / LOG_NAME)}"
    say(f"[{name}] {message}")
    return RunStatus("failed", status.target_step, after.checkpoint_step, message)

