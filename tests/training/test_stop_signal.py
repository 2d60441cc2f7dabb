"""The second signal's interruption is never lost: Python prints and drops an exception
raised while a gc callback runs (JAX registers one), so the handler marks the run and the
loop raises at its next check, or the run raises when it closes."""
import gc
import os
import signal

import pytest

from lp_jax.training.stop_signal import Interrupted, StopSignal


def _second_signal_inside_a_gc_callback():
    def callback(phase, info):
        if phase == "start":
            os.kill(os.getpid(), signal.SIGINT)  # handled at the callback's next bytecode
            for _ in range(1000):  # bytecodes for the handler to run on
                pass

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)


def test_a_second_signal_inside_a_gc_callback_raises_at_the_next_check(capfd):
    with pytest.raises(Interrupted, match="interrupted by a second SIGINT"):
        with StopSignal() as stop:
            stop.received = "SIGINT"  # the first signal
            _second_signal_inside_a_gc_callback()
            assert stop.interrupted
            stop.check()
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_second_signal_inside_a_gc_callback_after_the_last_check_raises_on_close(capfd):
    with pytest.raises(Interrupted, match="no checkpoint was written"):
        with StopSignal() as stop:
            stop.received = "SIGINT"
            _second_signal_inside_a_gc_callback()
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_second_signal_in_plain_code_raises_where_it_lands():
    with pytest.raises(Interrupted):
        with StopSignal() as stop:
            stop.received = "SIGINT"
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
            pytest.fail("the handler did not raise")


def test_a_second_signal_a_native_callback_wrapped_still_ends_the_run_as_interrupted():
    """MLIR's operation walk, run while JAX computes a cache key, turns an exception raised
    in its Python callback into a RuntimeError carrying the traceback as text."""
    def native_walk():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        except BaseException as e:
            raise RuntimeError(f"Exception raised in callback: {e}") from None

    with pytest.raises(Interrupted, match="interrupted by a second SIGINT") as caught:
        with StopSignal() as stop:
            stop.received = "SIGINT"
            native_walk()
    assert isinstance(caught.value.__cause__, RuntimeError)


def _two_signals_python_handles_as_one():
    """Two SIGTERMs delivered while the main thread cannot run Python (here: another thread
    holds the interpreter lock; in a run: a step on the device, a compile): each is written
    to the wake-up pipe, but Python runs the handler once for both."""
    import sys
    import threading

    def send_two():
        # Each to this thread, which takes it before the call returns: two process-directed
        # ones sent back to back may merge in the kernel while the first is pending (standard
        # signals do not queue), and the watcher would rightly count one.
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # the sender keeps the lock until it ends
    try:
        sender = threading.Thread(target=send_two)
        sender.start()
        sender.join()
    finally:
        sys.setswitchinterval(interval)


def test_two_signals_handled_as_one_still_interrupt():
    import time

    with pytest.raises(Interrupted, match="interrupted by a second SIGTERM"):
        with StopSignal() as stop:
            _two_signals_python_handles_as_one()
            deadline = time.monotonic() + 3  # (the watcher thread counts them)
            while not stop.interrupted and time.monotonic() < deadline:
                time.sleep(0.01)
            stop.check()
