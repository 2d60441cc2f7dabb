"""train.py as a user runs it: SIGTERM finishes the step, saves, and exits 75 (or
checkpoint.preempted_exit_code) for a scheduler to requeue the run."""
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
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, None), (signal.SIGINT, 99)])
def test_signal_finishes_the_step_saves_and_exits_the_preempted_code(sig, code, tmp_path, token_cache):
    text = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.yaml", f"run_dir={tmp_path}",
           "steps=100000", "data.seq_len=64", "data.global_batch_size=2", "data.micro_batch_size=2",
           f"data.paths=[{text}]", "data.val_fraction=0.3", f"data.cache_dir={token_cache}",
           "logging.progress_bar=false", "logging.tensorboard=false", "logging.val_batches=1",
           *([f"checkpoint.preempted_exit_code={code}"] if code is not None else [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run did not start in time"
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == (75 if code is None else code), err
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


@pytest.mark.slow  # three in-process runs
def test_a_signal_stop_exits_75_a_planned_stop_and_the_end_exit_0(tmp_path, token_cache, capsys,
                                                                  monkeypatch):
    """Exit 75 only when a signal stopped the run before its end: stop_at, a resume to the
    end, and a signal that arrives on the last step all exit 0."""
    from lp_jax.training import cli, loop
    from tests.support.bad_input import tiny

    record, signal_at = loop._record, {}

    def record_then_signal(r, step, values):  # a SIGTERM from outside, after the step
        record(r, step, values)
        if step == signal_at.get("step"):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(loop, "_record", record_then_signal)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:  # the run leaves the signals ignored once one came (its process is on its way out)
        signal_at["step"] = 3
        assert cli.main(tiny(tmp_path, token_cache)) == 75
        assert "SIGTERM: stopped after step 3; checkpoint saved" in capsys.readouterr().err
        assert cli.main(tiny(tmp_path, token_cache, "stop_at=4")) == 0
        signal_at["step"] = 6
        assert cli.main(tiny(tmp_path, token_cache)) == 0  # it had finished
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
