"""train.py as a user runs it: SIGTERM finishes the step, saves, and exits cleanly."""
import os
import pathlib
import signal
import subprocess
import sys
import sysconfig
import time

import numpy as np
import pytest

from lp_jax.config.yaml_io import load_config
from lp_jax.runs.checkpoint import Checkpointer
from lp_jax.training.loop import run
from lp_jax.training.metrics import read_metrics
from lp_jax.training.validate import resolve

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_saves_and_exits_0(sig, tmp_path, token_cache):
    text = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.yaml", f"run_dir={tmp_path}",
           "steps=100000", "data.seq_len=64", "data.global_batch_size=2", "data.micro_batch_size=2",
           f"data.paths=[{text}]", "data.val_fraction=0.3", f"data.cache_dir={token_cache}",
           "logging.progress_bar=false", "logging.tensorboard=false", "logging.val_batches=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run did not start in time"
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    last = read_metrics(tmp_path)[-1]["step"]
    assert f"{signal.Signals(sig).name}: stopped after step {last}; checkpoint saved" in err
    assert 2 <= last < 100000 and "Traceback" not in err
    ckpt = Checkpointer(tmp_path / "checkpoints", 2)
    assert ckpt.latest_step() == last
    ckpt.close()


@pytest.mark.slow
def test_fsdp_on_two_devices_matches_one_device_and_resumes(tmp_path, token_cache):
    """Two forced CPU devices, parameters and moments sharded over them (mesh.fsdp=2),
    stopped and resumed from the sharded checkpoint: the same losses as one device, up to
    the order of the cross-device reductions."""
    text = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
    common = ["steps=6", "data.seq_len=64", "data.global_batch_size=4", f"data.paths=[{text}]",
              "data.val_fraction=0.3", f"data.cache_dir={token_cache}", "logging.progress_bar=false",
              "logging.tensorboard=false", "logging.val_batches=1"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    for stop in ("stop_at=3", "stop_at=6"):
        proc = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml",
                               f"run_dir={tmp_path / 'fsdp'}", "data.micro_batch_size=1",
                               "mesh.fsdp=2", stop, *common],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    assert "resumed from step 3" in proc.stdout
    config = load_config(ROOT / "configs/tiny.yaml", [f"run_dir={tmp_path / 'one'}",
                                                     "data.micro_batch_size=2", *common])
    run(resolve(config))
    sharded = [m["loss"] for m in read_metrics(tmp_path / "fsdp")]
    single = [m["loss"] for m in read_metrics(tmp_path / "one")]
    assert len(sharded) == 6
    np.testing.assert_allclose(sharded, single, rtol=2e-4)
