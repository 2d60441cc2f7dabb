"""Faults a shared cluster throws at train.py (docs/bad_input.md, cases 16-20): two jobs on
one run folder, a resume at another batch geometry, the run folder removed, full disks,
a model too big for the machine, repeated signals. Each ends in one line, touches nothing
already saved, and a following run resumes as if nothing had happened."""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from lp_jax.data import batch_stream
from lp_jax.runs.checkpoint import Checkpointer
from lp_jax.runs.run_lock import LOCK_NAME, RunLock
from lp_jax.training import loop
from lp_jax.training.metrics import read_metrics
from tests.support.bad_input import ROOT, error_line, only_line, tiny, train


def _losses(run_dir) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir)}


def _steps(folder) -> list:
    return sorted(p.name for p in folder.iterdir())


def _command(run_dir, cache, *overrides) -> list[str]:
    return [sys.executable, "train.py", *tiny(run_dir, cache, *overrides)]


def _started(proc, metrics, rows: int = 1, timeout: float = 240) -> None:
    """Waits until the run has written ``rows`` metrics rows."""
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run did not start in time"
        time.sleep(0.1)


# ---- one run folder, one job ----

@pytest.mark.slow  # two real train.py processes
def test_a_second_job_on_a_running_folder_is_refused(tmp_path, token_cache):
    """Two real train.py processes on one run_dir: the second is refused in one line
    naming the first; the first trains on, each step written once."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen(_command(run_dir, token_cache, "steps=40", "logging.every=1"), cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _started(first, run_dir / "metrics.jsonl")
        second = subprocess.run(_command(run_dir, token_cache, "steps=40"), cwd=ROOT,
                                capture_output=True, text=True, timeout=240)
        assert second.returncode == 2, second.stderr[-2000:]
        line = only_line(second.stderr)
        assert line.startswith(f"train.py: error: run_dir {str(run_dir)!r} is in use by process "
                               f"{first.pid} on "), line
        assert f"(lock {run_dir / LOCK_NAME})" in line
        _, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err[-2000:]
    steps = [row["step"] for row in read_metrics(run_dir)]
    assert steps == list(range(1, 41))  # no row twice, none lost
    assert not (run_dir / LOCK_NAME).exists()  # released on exit


def test_a_lock_held_by_a_live_process_refuses_before_writing(tmp_path, token_cache, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = RunLock(run_dir, say=lambda line: None)  # this process, another open file: a live holder
    try:
        rc, _, err = train(capsys, tiny(run_dir, token_cache))
    finally:
        holder.release()
    assert rc == 2
    assert f"is in use by process {os.getpid()} on " in only_line(err)
    assert _steps(run_dir) == []  # no config, no checkpoints, no metrics


def test_a_stale_lock_is_taken_over_with_one_line(tmp_path, token_cache, capsys):
    """The lock file of a process killed with SIGKILL (its flock gone with it)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": "h", "started": "t"}))
    rc, out, err = train(capsys, tiny(run_dir, token_cache, "stop_at=2"))
    assert rc == 0, err
    lines = [line for line in out.splitlines() if "took over" in line]
    assert lines == [f"warning: took over the lock of process {dead.pid} on h (since t), which is "
                     f"no longer running ({run_dir / LOCK_NAME})"]
    assert not (run_dir / LOCK_NAME).exists()


def test_the_lock_is_a_flock_the_kernel_drops():
    """What the takeover relies on: a held lock blocks another open file of it."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        lock = RunLock(d, say=lambda line: None)
        fd = os.open(os.path.join(d, LOCK_NAME), os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.release()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once released
        os.close(fd)


# ---- batch geometry on resume ----

def _record_reads(monkeypatch) -> list:
    """(sequences read before, tokens) of every batch the trainer draws."""
    reads = []
    real_next = batch_stream.BatchStream.__next__

    def record(self):
        before = self.sequences_read
        batch = real_next(self)
        reads.append((before, batch["tokens"].copy()))
        return batch

    monkeypatch.setattr(batch_stream.BatchStream, "__next__", record)
    return reads


def test_a_resume_at_another_global_batch_size_reads_the_next_sequences(tmp_path, token_cache,
                                                                          capsys, monkeypatch):
    """Two steps of 2 sequences, then steps of 4: the third step reads sequences 4-7 of the
    stream (before, a batch index did: sequences 8-11, and 4-7 were never read)."""
    run_dir = tmp_path / "run"
    reads = _record_reads(monkeypatch)
    assert train(capsys, tiny(run_dir, token_cache, "stop_at=2"))[0] == 0
    rc, out, err = train(capsys, tiny(run_dir, token_cache, "stop_at=3", "data.global_batch_size=4"))
    assert rc == 0, err
    assert "data.global_batch_size 2 -> 4: the data stream goes on at sequence 4" in out
    assert [before for before, _ in reads] == [0, 2, 4]
    read = [tokens for _, tokens in reads]
    # The same stream read at 8 sequences a batch: its first 8 are what the three steps read.
    reference = _record_reads(monkeypatch)
    assert train(capsys, tiny(tmp_path / "reference", token_cache, "stop_at=1",
                              "data.global_batch_size=8", "data.micro_batch_size=8"))[0] == 0
    np.testing.assert_array_equal(np.concatenate(read), reference[0][1])


def test_a_resume_at_another_sequence_length_is_refused(tmp_path, token_cache, capsys):
    run_dir = tmp_path / "run"
    assert train(capsys, tiny(run_dir, token_cache, "stop_at=2"))[0] == 0
    rc, _, err = train(capsys, tiny(run_dir, token_cache, "data.seq_len=16"))
    assert rc == 2
    line = error_line(err)
    assert "was trained at data.seq_len=32, now 16: the data stream cannot resume" in line
    assert _steps(run_dir / "checkpoints") == ["2"]


def test_a_checkpoint_that_counts_batches_refuses_a_batch_change(tmp_path, token_cache, capsys):
    """A checkpoint of the grain batch iterator ({"next_index": N}) resumes at its own
    batch size only."""
    run_dir = tmp_path / "run"
    assert train(capsys, tiny(run_dir, token_cache, "stop_at=2"))[0] == 0
    state = run_dir / "checkpoints" / "2" / "data" / "process_0-of-1.json"
    state.write_text(json.dumps({"next_index": 2}))
    rc, _, err = train(capsys, tiny(run_dir, token_cache, "data.global_batch_size=4"))
    assert rc == 2
    assert ("counts its data position in batches of 2; resume it with data.global_batch_size=2"
            in error_line(err))
    rc, _, err = train(capsys, tiny(run_dir, token_cache, "stop_at=3"))  # its own batch size resumes
    assert rc == 0, err


def test_the_batch_stream_resumes_at_its_sequence_whatever_the_batch():
    import grain
    stream = grain.MapDataset.range(0, 100).map(lambda i: {"tokens": np.array([i])}).repeat(None)
    options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    it = batch_stream.BatchStream(stream, 3, options)
    next(it), next(it)
    resumed = batch_stream.BatchStream(stream, 5, options, rows=np.array([1, 3]))
    resumed.set_state(it.get_state())
    assert next(resumed)["tokens"].ravel().tolist() == [7, 9]  # rows 1, 3 of sequences 6-10
    assert json.loads(resumed.get_state()) == {"sequences_read": 11}


# ---- the run folder removed ----

def test_the_run_folder_removed_during_training_stops_the_run(tmp_path, token_cache, capsys,
                                                               monkeypatch):
    run_dir = tmp_path / "run"
    real_record = loop._record

    def record_then_remove(r, step, values):
        real_record(r, step, values)
        if step == 3:
            r.ckpt.wait()  # step 2's save is written (an unfinished one would write on)
            shutil.rmtree(run_dir)  # a cleanup job

    monkeypatch.setattr(loop, "_record", record_then_remove)
    rc, _, err = train(capsys, tiny(run_dir, token_cache))
    assert rc == 1
    assert error_line(err, "train.py: stopped: ") == (
        f"train.py: stopped: the run folder {str(run_dir)!r} was removed or replaced during the "
        "run; nothing written from here on could be found")
    assert not run_dir.exists()  # not made again by a later save or metrics write


# ---- full disks ----

def _unshare_works() -> str | None:
    try:
        proc = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare cannot run: {e}"
    return None if proc.returncode == 0 else f"cannot mount a tmpfs here: {proc.stderr.strip()}"


needs_tmpfs = pytest.mark.skipif(_unshare_works() is not None, reason=str(_unshare_works()))


def _on_small_disk(tmp_path, size: str, fill_bytes: int, argv: list[str], keep: str):
    """Runs argv with ``tmp_path/disk`` a tmpfs of ``size`` holding ``fill_bytes`` already
    (a private mount, gone when the command ends); ``keep`` (a folder on it) is copied to
    ``tmp_path/kept`` before the mount goes."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (f'mount -t tmpfs -o size={size} tmpfs "{disk}" && '
              f'head -c {fill_bytes} /dev/zero > "{disk}/fill" && '
              '"$@"; rc=$?; cp -a "' + keep + f'" "{tmp_path}/kept"; exit $rc')
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=400)


@pytest.mark.slow  # real train.py processes, three compiles
@needs_tmpfs
def test_a_full_disk_during_a_save_is_one_line_and_the_run_resumes_exactly(tmp_path, token_cache):
    """Room for one checkpoint: the second save fails, in one line with the system's reason;
    step 2 stays whole, the partial step is removed, and the run resumed elsewhere ends
    with the losses of a run never interrupted."""
    run_dir = tmp_path / "disk" / "run"
    proc = _on_small_disk(tmp_path, "14m", 0, _command(run_dir, token_cache), str(run_dir))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr == (f"train.py: stopped: saving step 4 in {run_dir / 'checkpoints'} failed: "
                           "No space left on device (errno 28); the checkpoints saved before it "
                           "(steps up to 2) are untouched\n")
    kept = tmp_path / "kept"
    assert _steps(kept / "checkpoints") == ["2"]
    moved = tmp_path / "moved"  # the same run on a disk with room: config.yaml names run_dir
    shutil.move(kept, moved)
    resumed = subprocess.run(_command(moved, token_cache), cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = subprocess.run(_command(tmp_path / "whole", token_cache), cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert _losses(moved) == _losses(tmp_path / "whole")


@needs_tmpfs
def test_a_full_disk_while_writing_metrics_is_one_line_and_keeps_the_rows(tmp_path, token_cache):
    run_dir = tmp_path / "disk" / "run"
    argv = _command(run_dir, token_cache, "steps=24", "logging.every=1", "checkpoint.every=100")
    # Room for the run folder's files, its checkpoint folder's lock and one page of rows.
    proc = _on_small_disk(tmp_path, "64k", 48 * 1024, argv, str(run_dir))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr == (f"train.py: stopped: cannot write {run_dir / 'metrics.jsonl'} (No space "
                           "left on device); the rows written before are kept\n")
    rows = read_metrics(tmp_path / "kept")
    assert rows and [row["step"] for row in rows] == list(range(1, len(rows) + 1))


# ---- a model too big, a cache that is a file ----

def test_a_model_too_big_for_the_machine_is_refused_before_the_run_folder(tmp_path, token_cache,
                                                                         capsys):
    run_dir = tmp_path / "run"
    t0 = time.time()
    rc, _, err = train(capsys, tiny(run_dir, token_cache, "model.preset=llama3_8b"))
    assert rc == 2 and time.time() - t0 < 60
    line = only_line(err)
    assert line.startswith("train.py: error: model.preset=llama3_8b cannot train here: its state "
                           "alone needs "), line
    assert "B parameters: FP32 weights, gradients and AdamW moments), more than this machine's" in line
    assert not run_dir.exists()


def test_a_step_out_of_device_memory_is_one_line(tmp_path, token_cache, capsys, monkeypatch):
    """XLA's RESOURCE_EXHAUSTED (here raised by a stand-in step, as a GPU raises it at the
    step's compile or run) ends the run in one line with XLA's figure; other XLA errors
    keep their traceback."""
    def step_that_does_not_fit(*args):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 203.61GiB.")

    monkeypatch.setattr(loop, "jitted_train_step", lambda spec, state: step_that_does_not_fit)
    rc, _, err = train(capsys, tiny(tmp_path / "run", token_cache))
    assert rc == 1
    assert error_line(err, "train.py: stopped: ") == (
        "train.py: stopped: step 1: the step does not fit the device's memory (XLA: 203.61 "
        "GiB); lower data.micro_batch_size, set model.remat=mlp, elementwise or full, or shard "
        "further (python -m lp_jax.plan finds a setting that fits)")

    def step_that_fails_otherwise(*args):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(loop, "jitted_train_step", lambda spec, state: step_that_fails_otherwise)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        train(capsys, tiny(tmp_path / "other", token_cache))


def test_a_data_cache_that_is_a_file_is_refused(tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.write_text("")
    for where in (cache, cache / "sub"):
        rc, _, err = train(capsys, tiny(tmp_path / "run", where))
        assert rc == 2
        assert only_line(err).startswith(f"train.py: error: data.cache_dir: {str(cache)!r} is a file")
    assert not (tmp_path / "run").exists()


# ---- signals ----

@pytest.mark.parametrize("where", ["thread", "loop"])
def test_a_second_signal_inside_an_async_save_is_one_line(where, tmp_path):
    """A second SIGTERM raised inside Orbax's asynchronous save (tests/support/interrupted_save.py
    sends it once the save has started a background thread, or while Orbax builds an event
    loop): exit 130 with the one line, none of the tracebacks Orbax logs as the abandoned
    save's threads fail on the way out, no half-built loop's "Exception ignored", no
    coroutine never awaited; the checkpoint saved before it restores."""
    folder = tmp_path / "checkpoints"
    proc = subprocess.run([sys.executable, "-m", "tests.support.interrupted_save", str(folder),
                           where], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "train.py: interrupted by a second SIGTERM: stopped at once, without saving; the last "
        "checkpoint (step 1) is untouched; re-run the same command to resume"], proc.stderr[-3000:]
    saved = Checkpointer(folder, 3)
    try:
        assert saved.all_steps() == [1]
        abstract = {"w": jax.ShapeDtypeStruct((4096,), np.float32)}
        state, meta = saved.restore(1, abstract, None)
        assert meta == {"step": 1}
        np.testing.assert_array_equal(state["w"], np.arange(4096, dtype=np.float32))
    finally:
        saved.close()


@pytest.mark.slow  # real train.py processes
def test_a_second_signal_interrupts_at_once_in_one_line(tmp_path, token_cache):
    """The first SIGINT asks for a stop after the step; the second, sent at once, ends the
    run without saving: exit 130, one line, no traceback; the lock goes with the process
    and the next run resumes from the last checkpoint."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_command(run_dir, token_cache, "steps=100000", "checkpoint.every=3"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _started(proc, run_dir / "metrics.jsonl")
        for _ in range(4):  # the third and fourth are ignored while it closes
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.count("interrupted") == 1, err[-3000:]
    assert err.splitlines()[-1].startswith("train.py: interrupted by a second SIGINT: stopped at once, "
                                           "without saving; ")
    saved = Checkpointer(run_dir / "checkpoints", 5)
    steps = saved.all_steps()
    saved.close()
    rc = subprocess.run(_command(run_dir, token_cache, f"stop_at={max(steps, default=0) + 1}"),
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rc.returncode == 0, rc.stderr[-3000:]
