"""Two jax.distributed processes on localhost (CPU backend, Gloo collectives, 2 devices each)
train on a (data 2, fsdp 2) mesh, each reading only its own half of every batch, and agree
with one process driving all 4 devices; their checkpoint (Orbax from both processes, one
grain state file each) resumes in a single process."""
import os
import socket
import subprocess
import sys
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
