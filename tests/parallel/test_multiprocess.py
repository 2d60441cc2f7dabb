"""Two jax.distributed processes on localhost (CPU backend, Gloo collectives, 2 devices each)
train on a (data 2, fsdp 2) mesh, each reading only its own half of every batch, and agree
with one process driving all 4 devices; their checkpoint (Orbax from both processes, one
grain state file each) resumes in a single process."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lp_jax.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--config", "configs/tiny.yaml", "steps=4", "model.num_layers=2", "data.source=mock",
        "data.seq_len=32", "data.global_batch_size=8", "data.micro_batch_size=2", "mesh.data=2",
        "mesh.fsdp=2", "logging.progress_bar=false", "logging.tensorboard=false",
        "logging.val_batches=1", "logging.val_every=2", "checkpoint.async_save=false",
        "schedule.warmup_steps=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                JAX_PLATFORMS="cpu", **extra)


@pytest.mark.slow
def test_two_processes_agree_with_one_and_their_checkpoint_resumes_in_one(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "train.py", *ARGS, f"run_dir={two}", "stop_at=3"], cwd=ROOT,
        env=_env(2, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                 JAX_PROCESS_ID=str(i)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    assert "4 devices, 2 process(es)" in "".join(outs[0])
    assert "data:" not in "".join(outs[1])  # only process 0 reports (and writes metrics)
    data_files = sorted(os.listdir(two / "checkpoints" / "3" / "data"))
    assert "process_0-of-2.json" in data_files and "process_1-of-2.json" in data_files
    assert [m["step"] for m in read_metrics(two)] == [1, 2, 3]

    for run_dir in (two, one):  # resume the two-process checkpoint; a one-process run
        proc = subprocess.run([sys.executable, "train.py", *ARGS, f"run_dir={run_dir}"], cwd=ROOT,
                              env=_env(4), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert ("resumed from step 3" in proc.stdout) == (run_dir == two)
    multi, single = read_metrics(two), read_metrics(one)
    assert [m["step"] for m in multi] == [m["step"] for m in single] == [1, 2, 3, 4]
    np.testing.assert_allclose([m["loss"] for m in multi], [m["loss"] for m in single], rtol=1e-5)
    np.testing.assert_allclose([m["val_loss"] for m in multi if "val_loss" in m],
                               [m["val_loss"] for m in single if "val_loss" in m], rtol=1e-5)


DEATH_REPORTED_WITHIN_S = 10  # docs/scaling.md: within a second of the death; 10 on a loaded 2-core machine


def _launch_two(run_dir, logs):
    """Two training processes whose output goes to files (a pipe nobody reads would fill)."""
    port = _free_port()
    return [subprocess.Popen(
        [sys.executable, "train.py", *ARGS, f"run_dir={run_dir}", "steps=400",
         "logging.val_every=1000", "checkpoint.every=2"], cwd=ROOT,
        # No persistent compilation cache: two CPU processes that load their step from a
        # warm one hang in its first collective (JAX 0.12.1, Gloo).
        env=_env(2, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                 JAX_PROCESS_ID=str(i), JAX_ENABLE_COMPILATION_CACHE="false"),
        stdout=open(logs / f"out{i}", "w"), stderr=open(logs / f"err{i}", "w")) for i in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("dead", [1, 0], ids=["peer", "coordinator"])
def test_a_dead_process_is_named_in_one_line_by_the_survivor(tmp_path, dead):
    """SIGKILL one of two training processes: the other prints one line naming it (the
    coordinator when it is process 0), no traceback and no C++ dump, and exits 75 within
    the documented bound; the checkpoints saved before resume in one process."""
    run_dir = tmp_path / "run"
    procs = _launch_two(run_dir, tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "4").is_dir():  # training, two saves behind it
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [(tmp_path / f"err{i}").read_text()[-2000:] for i in range(2)]
            time.sleep(0.2)
        procs[dead].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = procs[1 - dead]
        survivor.wait(timeout=120)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
            p.wait()
    err = (tmp_path / f"err{1 - dead}").read_text()
    who = "the coordinator (process 0 of 2)" if dead == 0 else "process 1 of 2"
    assert survivor.returncode == 75, err[-4000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        f"train.py: {who} died (its connection to the run closed without a goodbye); this "
        f"process ({1 - dead}) stops: exit 75; the checkpoints saved before are intact: re-run "
        "the same command in every process to resume"], err[-4000:]
    assert took < DEATH_REPORTED_WITHIN_S

    proc = subprocess.run([sys.executable, "train.py", *ARGS, f"run_dir={run_dir}", "steps=6"],
                          cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from step" in proc.stdout
