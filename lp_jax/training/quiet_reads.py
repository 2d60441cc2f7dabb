"""Silence for the reads a failed checkpoint restore abandons.

Orbax reads a checkpoint's arrays concurrently, in an event loop it closes as soon as one
read fails (``orbax.checkpoint._src.asyncio_utils``). The reads still in flight complete
afterwards into the closed loop, and for each one TensorStore prints a six-line
``RuntimeError: Event loop is closed`` traceback to stderr: 244 of them after resuming the
tiny config over one truncated checkpoint, burying the one warning that matters. Nothing
is wrong beyond the failure already reported, so inside ``abandoned_reads_hushed`` those
tracebacks (and only those) are dropped: stderr is held while the block runs and, after a
failure, until it has been quiet for a moment; the rest of what was written then goes out.
"""
from __future__ import annotations

import contextlib
import io
import re
import sys
import threading
import time

_CLOSED_LOOP = re.compile(r"Traceback \(most recent call last\):\n(?:  [^\n]*\n)*?"
                          r"RuntimeError: Event loop is closed\n")


class _Held(io.TextIOBase):
    """Holds what is written, per writing thread: the abandoned reads complete on several
    threads at once, and their tracebacks' lines interleave in the order written."""

    def __init__(self, target):
        self.target, self.parts, self.last = target, {}, time.monotonic()
        self.lock = threading.Lock()

    def write(self, text):
        with self.lock:
            self.parts.setdefault(threading.get_ident(), []).append(text)
            self.last = time.monotonic()
        return len(text)

    def flush(self):
        pass

    def release(self) -> None:
        with self.lock:
            texts, self.parts = ["".join(p) for p in self.parts.values()], {}
        text = "".join(_CLOSED_LOOP.sub("", t) for t in texts)
        if text:
            self.target.write(text)
            self.target.flush()


@contextlib.contextmanager
def abandoned_reads_hushed(settle_s: float = 0.5, max_wait_s: float = 10.0):
    """Runs the block with stderr held; drops the closed-loop tracebacks of abandoned reads
    (waiting, after an exception, until stderr has been quiet ``settle_s`` since it, at most
    ``max_wait_s``) and writes the rest to the real stderr."""
    held = _Held(sys.stderr)
    sys.stderr = held
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        if failed:  # the abandoned reads finish after the failure: wait for them
            with held.lock:
                held.last = time.monotonic()
            deadline = time.monotonic() + max_wait_s
            while time.monotonic() < deadline and time.monotonic() - held.last < settle_s:
                time.sleep(settle_s / 4)
        sys.stderr = held.target
        held.release()
