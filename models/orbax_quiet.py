"""Quiet while a checkpoint is read: Orbax's logs (``orbax_logs``) and the reports of the
reads a failed restore abandons (``abandoned_reads_hushed``).

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
import re
import sys
import threading
import time


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


# asyncio names the class of the object collected: Future, Task or a subclass of either.
NEVER_RETRIEVED = re.compile(r"\w+ exception was never retrieved")


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
