"""A second SIGTERM that lands inside an asynchronous Orbax save, made deterministic for
tests/bad_input/test_bad_input_cluster.py.

    python -m tests.support.interrupted_save FOLDER thread|loop

Saves step 1 whole, takes a first SIGTERM (a stop: save the step), then starts saving
step 2 and sends the second SIGTERM from inside Orbax's save, so that ``Interrupted`` is
raised there, at one of the two places a real run showed noise after its one line:

- ``thread``: once Orbax has started a background thread of the save. The thread is then
  an orphan. In a real run it fails when the interpreter's shutdown catches up with it (it
  closes the executors the thread hands file work to), early or late; here it is held until
  the checkpointer is closed, the executors are shut down as the interpreter does it, and
  it goes on into that failure ("cannot schedule new futures after shutdown"), which Orbax
  logs with its traceback.
- ``loop``: while Orbax builds an event loop: the half-built loop fails in its
  ``__del__`` ("Exception ignored in ...") and coroutines are left never awaited.

Exits as train.py does on ``Interrupted``: its one line, status 130.
"""
import asyncio.selector_events
import os
import signal
import sys
import threading
from concurrent.futures import thread as executor_threads

import jax.numpy as jnp
from orbax.checkpoint._src.futures import future as orbax_future

from lp_jax.runs.checkpoint import Checkpointer
from lp_jax.training.stop_signal import EXIT_INTERRUPTED, Interrupted, StopSignal

_closed = threading.Event()  # the checkpointer is closed: the save's threads are orphans
_start_thread = orbax_future._SignalingThread.start
_wait_for_signals = orbax_future._SignalingThread._wait_for_signals
_make_self_pipe = asyncio.selector_events.BaseSelectorEventLoop._make_self_pipe


def _second_signal() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before kill returns


def _start_then_signal(thread) -> None:
    _start_thread(thread)
    _second_signal()


def _run_into_the_shutdown(thread) -> None:
    _closed.wait(60)
    executor_threads._python_exit()  # what the interpreter's shutdown runs first
    _wait_for_signals(thread)


def _half_built_loop(loop) -> None:
    _make_self_pipe(loop)
    if threading.current_thread() is threading.main_thread():
        _second_signal()


def _interrupt_inside_the_save(where: str) -> None:
    if where == "thread":
        orbax_future._SignalingThread.start = _start_then_signal
        orbax_future._SignalingThread._wait_for_signals = _run_into_the_shutdown
    elif where == "loop":
        asyncio.selector_events.BaseSelectorEventLoop._make_self_pipe = _half_built_loop
    else:
        sys.exit(f"unknown place {where!r}")


def main(folder: str, where: str) -> None:
    state = {"w": jnp.arange(4096, dtype=jnp.float32)}
    with StopSignal() as stop:
        ckpt = Checkpointer(folder, keep=3)
        stop.last_checkpoint = lambda: 1
        try:
            ckpt.save(1, state, None, {"step": 1})
            ckpt.wait()
            _interrupt_inside_the_save(where)
            os.kill(os.getpid(), signal.SIGTERM)  # the first: stop after the step, saving it
            ckpt.save(2, state, None, {"step": 2})
        finally:
            try:
                ckpt.close()
            finally:
                _closed.set()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except Interrupted as e:
        e.say()
        sys.exit(EXIT_INTERRUPTED)
    sys.exit("the second signal did not interrupt the save")
