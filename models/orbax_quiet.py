"""Quiet while a checkpoint is read or a save fails: Orbax's logs (``orbax_logs``; a failed
or interrupted save's threads, ``SaveThreadErrorsHushed``) and the reports of the reads (or
writes) a failure abandons (``abandoned_reads_hushed``).

Orbax closes its event loop of concurrent array reads as soon as one read fails; each read
still in flight then raises ``RuntimeError: Event loop is closed`` on a TensorStore thread,
reported through ``sys.unraisablehook`` (docs/bad_input.md, case 5), and a read whose
failure nobody awaited is logged by asyncio as "Future exception was never retrieved" (or
"Task ...", when the read was a task).
Nothing is wrong beyond the failure already reported, so inside ``abandoned_reads_hushed``
those reports (and only those) are dropped, and after a failure the block waits until they
have stopped arriving.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import sys
import threading
import time
import warnings


@contextlib.contextmanager
def orbax_logs(level: int):
    """Orbax logs through absl's logger: only records at ``level`` or above while inside."""
    logger = logging.getLogger("absl")
    previous = logger.level
    logger.setLevel(max(level, previous))
    try:
        yield
    finally:
        logger.setLevel(previous)


class SaveThreadErrorsHushed:
    """Until ``close``: what Orbax's background save threads report of a failed save is
    dropped, their error logs and the closed-loop reports of the writes the failure
    abandons; the failure reaches the caller as an exception when it waits for the save.
    Every other log record and unraisable exception passes."""

    def __init__(self):
        self._logger = logging.getLogger("absl")
        self._logger.addFilter(self._keep)
        self._for_good = False
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._hook

    @staticmethod
    def _keep(record: logging.LogRecord) -> bool:
        return not _from_orbax(record.pathname) or record.levelno < logging.ERROR

    def _hook(self, unraisable) -> None:
        if _is_closed_loop(unraisable) or (self._for_good and _in_save_machinery(unraisable)):
            return
        self._previous_hook(unraisable)

    def close(self) -> None:
        if self._for_good:
            return
        self._logger.removeFilter(self._keep)
        if sys.unraisablehook is self._hook:
            sys.unraisablehook = self._previous_hook

    def for_good(self) -> None:
        """Keeps the hush to the end of the process (``close`` leaves it) and widens it, for
        a save an interrupt cut short. Its threads go on with no one to report to and fail
        as the interpreter shuts down under them; the interrupt itself may have landed while
        Orbax built an event loop or held coroutines. So, after the run's one line, these
        are dropped too: asyncio's reports of Orbax's writes nobody retrieved, exceptions
        ignored in asyncio's or Orbax's finalizers (a half-built event loop's ``__del__``),
        and the warnings of coroutines never awaited."""
        self._for_good = True
        _drop_orbax_unretrieved_for_good()
        warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _from_orbax(filename: str) -> bool:
    return f"{os.sep}orbax{os.sep}" in filename


def _in_save_machinery(unraisable) -> bool:
    """An unraisable exception raised in Orbax's or asyncio's code."""
    tb = unraisable.exc_traceback
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if _from_orbax(filename) or f"{os.sep}asyncio{os.sep}" in filename:
            return True
        tb = tb.tb_next
    return False


# asyncio names the class of the object collected: Future, Task or a subclass of either.
NEVER_RETRIEVED = re.compile(r"\w+ exception was never retrieved")


# TensorStore's errors read "<absl status code>: ...". Set on a future by its C++ threads,
# such an error carries no Python traceback to tell where it came from.
TENSORSTORE_STATUS = re.compile(
    r"(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
    r"PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|"
    r"UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED): ")


def _is_orbax_unretrieved(record: logging.LogRecord) -> bool:
    """An unretrieved future of Orbax's: its traceback passes through Orbax, or it has none
    and holds a TensorStore error (an array write that Orbax never awaited)."""
    if not NEVER_RETRIEVED.match(record.getMessage()) or not record.exc_info:
        return False
    error, tb = record.exc_info[1], record.exc_info[2]
    if tb is None:
        return TENSORSTORE_STATUS.match(str(error)) is not None
    while tb is not None:
        if _from_orbax(tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False


@contextlib.contextmanager
def failed_writes_hushed():
    """``abandoned_reads_hushed`` around an Orbax write (a failed write abandons the others
    alike); once one has failed (and the caller says so), asyncio's reports of the writes it
    abandoned are dropped for the rest of the process: they come when the writes are
    collected, at exit as often as not."""
    try:
        with abandoned_reads_hushed():
            yield
    except Exception:
        _drop_orbax_unretrieved_for_good()
        raise


def _drop_orbax_unretrieved_for_good() -> None:
    logger = logging.getLogger("asyncio")
    if not any(f is _drop_orbax_unretrieved for f in logger.filters):
        logger.addFilter(_drop_orbax_unretrieved)


def _drop_orbax_unretrieved(record: logging.LogRecord) -> bool:
    return not _is_orbax_unretrieved(record)


def _is_closed_loop(unraisable) -> bool:
    value = unraisable.exc_value
    return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


@contextlib.contextmanager
def abandoned_reads_hushed(settle_s: float = 0.5, max_wait_s: float = 10.0):
    """Runs the block with the closed-loop reports of abandoned reads dropped; after an
    exception, waits until none has arrived for ``settle_s`` (at most ``max_wait_s``).
    Every other unraisable exception goes to the hook in force before."""
    previous = sys.unraisablehook
    lock = threading.Lock()
    last = [time.monotonic()]

    def hook(unraisable):
        if _is_closed_loop(unraisable):
            with lock:
                last[0] = time.monotonic()
            return
        previous(unraisable)

    def unretrieved(record: logging.LogRecord) -> bool:
        if NEVER_RETRIEVED.match(record.getMessage()):
            with lock:
                last[0] = time.monotonic()
            return False
        return True

    asyncio_logger = logging.getLogger("asyncio")
    sys.unraisablehook = hook
    asyncio_logger.addFilter(unretrieved)
    try:
        yield
    except Exception:  # (an interrupt does not wait)
        # The abandoned reads finish after the failure: wait for them to be reported.
        with lock:
            last[0] = time.monotonic()
        deadline = last[0] + max_wait_s
        while time.monotonic() < deadline:
            with lock:
                quiet = time.monotonic() - last[0]
            if quiet >= settle_s:
                break
            time.sleep(settle_s / 4)
        gc.collect()  # abandoned futures report when collected: here, while the filter holds
        raise
    finally:
        sys.unraisablehook = previous
        asyncio_logger.removeFilter(unretrieved)
