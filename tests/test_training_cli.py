"""train.py as a user runs it: SIGTERM finishes the step, saves, and exits cleanly."""
import os
import pathlib
import signal
import subprocess
import sys
import sysconfig
import time

import pytest

from lp_jax.training.checkpoint import Checkpointer
from lp_jax.training.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM])
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
