"""A run that has to stop (docs/bad_input.md, cases 3 and 4): non-finite steps without end,
a checkpoint that cannot be written. One line, exit 1, at once; earlier checkpoints kept."""
import os
import time

import pytest

from lp_jax.config.schema import TrainConfig
from lp_jax.runs import checkpoint as checkpoint_lib
from lp_jax.runs.checkpoint import Checkpointer
from lp_jax.training.metrics import read_metrics
from tests.support.bad_input import error_line, only_line, tiny, train


def test_too_many_nonfinite_steps_in_a_row_stop_the_run(tmp_path, token_cache, capsys):
    # Steps 2.. all NaN (as with ids outside the vocabulary): without a cap the run would
    # skip every step to the end and exit 0 with the untrained model.
    rc, _, err = train(capsys, tiny(tmp_path, token_cache, "debug.inject_nan_at_steps=[2,3,4,5,6]",
                                    "optimizer.max_nonfinite_in_a_row=3"))
    assert rc == 1
    assert error_line(err, "train.py: stopped: ") == (
        "train.py: stopped: steps 2-4: 3 non-finite steps in a row "
        "(optimizer.max_nonfinite_in_a_row=3), so nothing is being learned: the data or the "
        "weights are broken; no checkpoint was written")
    ckpt = Checkpointer(tmp_path / "checkpoints", 5)
    assert ckpt.all_steps() == []  # step 2's periodic save waits for a finite step
    ckpt.close()
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3]


@pytest.mark.slow  # two runs; 12 s alone
def test_a_rerun_after_the_streak_stop_stops_again_at_the_same_step(tmp_path, token_cache, capsys):
    # Steps 3-5 NaN: no checkpoint inside the streak, so the rerun replays it from step 2
    # and stops again, rather than count afresh from step 4 and finish with exit 0.
    argv = tiny(tmp_path, token_cache, "debug.inject_nan_at_steps=[3,4,5]",
                "optimizer.max_nonfinite_in_a_row=3")
    for _ in range(2):
        rc, _, err = train(capsys, argv)
        assert rc == 1
        assert error_line(err, "train.py: stopped: ").startswith(
            "train.py: stopped: steps 3-5: 3 non-finite steps in a row ")
        assert err.rstrip().endswith("the last checkpoint (step 2) is untouched")
        ckpt = Checkpointer(tmp_path / "checkpoints", 5)
        assert ckpt.all_steps() == [2]
        ckpt.close()


@pytest.mark.slow  # two runs; 12 s alone
def test_a_streak_open_at_stop_at_goes_on_counting_after_the_resume(tmp_path, token_cache, capsys):
    # NaN from step 2, at most 3 in a row: uninterrupted, the run stops at step 4. Stopped
    # at step 3 (streak 2, saved), the resume must stop at step 4 too, not at step 6.
    nan = ("debug.inject_nan_at_steps=[2,3,4,5,6]", "optimizer.max_nonfinite_in_a_row=3")
    assert train(capsys, tiny(tmp_path, token_cache, *nan, "stop_at=3"))[0] == 0
    ckpt = Checkpointer(tmp_path / "checkpoints", 5)
    assert ckpt.all_steps() == [3]  # stop_at's save, with the streak in the state
    ckpt.close()
    rc, _, err = train(capsys, tiny(tmp_path, token_cache, *nan))
    assert rc == 1
    assert error_line(err, "train.py: stopped: ").startswith(
        "train.py: stopped: steps 2-4: 3 non-finite steps in a row ")
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3]


def test_nonfinite_cap_default_and_range(tmp_path, token_cache, capsys):
    assert TrainConfig().optimizer.max_nonfinite_in_a_row == 20
    rc, _, err = train(capsys, tiny(tmp_path, token_cache, "optimizer.max_nonfinite_in_a_row=-1"))
    assert rc == 2 and "optimizer.max_nonfinite_in_a_row=-1 is invalid: must be >= 0" in err


def _folder_becomes_a_file_at(step, monkeypatch):
    """Before the save of `step`, the checkpoint folder is moved away and a file takes its
    place: every write into it then really fails (for root too, unlike a chmod)."""
    real_save = Checkpointer.save

    def save(self, at, *args, **kwargs):
        if at == step:
            self.wait()  # the earlier save is complete: it must survive
            os.rename(self.directory, self.directory + ".moved")
            open(self.directory, "w").close()
        return real_save(self, at, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", save)


@pytest.mark.parametrize("layer", ["probe", "orbax"])
def test_a_save_that_cannot_be_written_stops_at_once(layer, tmp_path, token_cache, capsys,
                                                     monkeypatch):
    _folder_becomes_a_file_at(4, monkeypatch)
    if layer == "orbax":  # no probe: Orbax itself meets the file (it used to wait 300 s)
        monkeypatch.setattr(checkpoint_lib, "write_problem", lambda path: None)
    t0 = time.time()
    rc, _, err = train(capsys, tiny(tmp_path, token_cache))
    assert time.time() - t0 < 150
    assert rc == 1
    line = error_line(err, "train.py: stopped: ")
    folder = tmp_path / "checkpoints"
    if layer == "probe":
        assert line == f"train.py: stopped: cannot save step 4: '{folder}' is a file, not a folder"
    else:
        # The system's reason, not the first 200 characters of Orbax's text.
        assert line == (f"train.py: stopped: saving step 4 in {folder} failed: Not a directory "
                        "(errno 20); the checkpoints saved before it (steps up to 2) are untouched")
    moved = Checkpointer(str(folder) + ".moved", 5)
    assert moved.all_steps() == [2]  # the checkpoint written before is whole
    moved.close()


def test_preempted_exit_code_default_and_range(tmp_path, token_cache, capsys):
    assert TrainConfig().checkpoint.preempted_exit_code == 75
    for taken in (1, 2, 130, 256):  # 1, 2, 130 already mean stopped, bad input, interrupted
        rc, _, err = train(capsys, tiny(tmp_path, token_cache, f"checkpoint.preempted_exit_code={taken}"))
        assert rc == 2 and only_line(err) == (
            f"train.py: error: checkpoint.preempted_exit_code={taken} is invalid: must be 0-255 "
            "and not 1, 2 or 130 (stopped, bad input, interrupted)")
