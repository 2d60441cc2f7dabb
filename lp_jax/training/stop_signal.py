"""SIGINT and SIGTERM during a run: the first stops it after the step in flight (which is
then saved), the second interrupts it at once.

The first sets a flag the loop reads after each step. The second raises ``Interrupted`` in
the main thread, which the command line reports in one line. Python prints and drops an
exception raised while a garbage-collector callback or a finalizer runs (JAX registers a gc
callback), so the handler does not raise there: it marks the run interrupted, and the loop
raises at its next check (``check()``, after each step, before any save) or, at the latest,
when the run closes, whatever other exception the interruption became on its way (a native
callback re-raises it as its own). Python runs a signal's handler only between bytecodes of
the main thread, so one that arrives while the main thread waits inside a long native call
(a step on the device, Orbax finishing a save) would wait with it; and Python runs the
handler once for all the signals that arrived meanwhile, so two of them look like one. The
signal's number is therefore also written to a pipe at the moment it arrives
(``signal.set_wakeup_fd``), and a watcher thread reading it counts them: at the second it
marks the run interrupted (the handler, or the loop's next check, raises), and it ends the
process itself, with the same one line, when the main thread has not ended the run within
``GRACE_S`` of the second signal. Signals after the second, and any once the run has closed
after a stop, are ignored: the process is on its way out, and they would only add
tracebacks.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

EXIT_INTERRUPTED = 130  # the shell's status for a process ended by SIGINT
GRACE_S = 5.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """A second SIGINT or SIGTERM: the run stops at once, without saving. ``say()`` prints
    its one line, unless the watcher already has."""

    def __init__(self, message: str, say):
        super().__init__(message)
        self.say = lambda: say(message)


class StopSignal:
    """Installed while a run is built, trains and closes (main thread only)."""

    def __init__(self):
        self.received: str | None = None  # the first signal's name
        self.interrupted = False
        self.last_checkpoint: Callable[[], int] = lambda: 0  # its step, for the one line (0: none)
        self._previous = {}
        self._done = threading.Event()
        self._said = threading.Lock()
        self._pipe = None
        self._previous_fd = -1
        self._watcher: threading.Thread | None = None
        self._second = ""  # the second signal's name
        self._second_handled = False  # the handler has seen the second signal

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="lp_jax-stop-signal",
                                         daemon=True)
        self._watcher.start()
        return self

    def agree(self, folder_lost: bool = False) -> bool:
        """With several processes, every one stops if any received a signal (one collective
        per step), so they all save the same step and none waits for the others forever.
        Returns whether any process found the run folder lost (only process 0 looks)."""
        if jax.process_count() == 1:
            return folder_lost

        flags = multihost_utils.process_allgather(
            np.array([self.received is not None, folder_lost], np.int32))
        if self.received is None and np.any(flags[..., 0]):
            self.received = "signal to another process"
        return bool(np.any(flags[..., 1]))

    def message(self, name: str) -> str:
        step = self.last_checkpoint()
        saved = (f"the last checkpoint (step {step}) is untouched; re-run the same command to "
                 "resume" if step else "no checkpoint was written")
        return f"interrupted by a second {name}: stopped at once, without saving; {saved}"

    def check(self) -> None:
        """Raises ``Interrupted`` when a second signal came but could not raise (it arrived
        in a finalizer); the loop calls this after each step and before any save."""
        if self.interrupted:
            raise self._interruption()

    def _interruption(self) -> Interrupted:
        return Interrupted(self.message(self._second), self.say_once)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self._second_handled:
            return
        if self.received is None:
            self.received = name
            if not self.interrupted:  # (the watcher may have counted two already)
                return
        self._second_handled = True
        self.interrupted, self._second = True, self._second or name
        if not _in_finalizer(frame):
            raise Interrupted(self.message(self._second), self.say_once)

    def _watch(self) -> None:
        read_fd, count = self._pipe[0], 0
        try:
            while not self._done.is_set():
                data = os.read(read_fd, 64)
                if not data:  # the write end is closed: the run is over
                    return
                count += sum(1 for b in data if b in SIGNALS)
                if count < 2:
                    continue
                name = signal.Signals(data[-1]).name
                if not self.interrupted:  # the handler ran once for both: raise at the check
                    self._second = name
                    self.received = self.received or name
                    self.interrupted = True
                if not self._done.wait(GRACE_S):
                    self.say_once(self.message(name))
                    os._exit(EXIT_INTERRUPTED)
        finally:
            os.close(read_fd)

    def say_once(self, message: str) -> None:
        if self._said.acquire(blocking=False):
            print(f"train.py: {message}", file=sys.stderr, flush=True)

    def __exit__(self, exc_type, exc, tb):
        self._done.set()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._pipe[1])  # wakes the watcher, which closes the read end
            # It ends here, not at interpreter exit: a thread that ends then and drops the
            # last reference to device arrays (its target holds this object, whose
            # last_checkpoint holds the run) aborts the process as JAX frees them.
            self._watcher.join(timeout=GRACE_S)
        # A second signal that arrived in a finalizer after the last check still ends the
        # run as interrupted; so does one whose exception a native callback caught and
        # re-raised as another (MLIR's walk wraps it in a RuntimeError while JAX compiles).
        late = (self._interruption()
                if self.interrupted and not isinstance(exc, Interrupted) else None)
        self.last_checkpoint = lambda: 0
        for sig, handler in self._previous.items():
            # Once a run was told to stop, its process is on its way out: a signal more
            # would only interrupt the exit with a traceback.
            signal.signal(sig, signal.SIG_IGN if self.received else handler)
        if late is not None:
            raise late from exc


def _in_finalizer(frame) -> bool:
    """Whether ``frame`` runs inside a gc callback or a ``__del__``: Python would print an
    exception raised there ("Exception ignored in ...") and carry on."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False
