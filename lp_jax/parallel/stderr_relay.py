"""The C++ side of a multi-process run's stderr, through a small relay process.

When the coordinator (process 0) dies, the other processes' peer watch
(lp_jax.parallel.peer_watch) and XLA's coordination client learn it from the same closed
socket in the same millisecond: the watch ends the process with its one line, but the
client may already have written its error lines ("Polled an error from coordination
service", the FATAL "Terminating process because ..."). So file descriptor 2, where C++
writes, goes to this relay, which copies it to the real stderr as it comes, except that it
holds XLA's coordination-service error lines back for ``HOLD_S``: dropped if the watch
says within that time that it is ending the process (``drop_rest``), else written. Python's
``sys.stderr`` keeps writing to the real stderr directly (a terminal stays a terminal for
the progress bar).

The relay is a process, not a thread, so that what a crashing process wrote last is never
lost: the relay reads the pipe to its end after the writer is gone. It ignores SIGINT,
SIGTERM and SIGHUP (they are the trainer's to handle) and ends at end-of-file.
"""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

HOLD_S = 2.0
DROP_REST = b"\x00lp_jax: drop the rest\n"  # the watch is ending the process
# glog-style lines of XLA's coordination service, its agent and its client
COORDINATION_ERROR = re.compile(
    rb"[EF]\d{4} [\d:.]+ +\d+ (coordination_service_agent|coordination_service|client)\.(cc|h):\d+\]")

_relay: subprocess.Popen | None = None


def install() -> None:
    """Sends file descriptor 2 through the relay; ``sys.stderr`` stays on the real stderr."""
    global _relay
    if _relay is not None:
        return
    real = os.dup(2)
    read_end, write_end = os.pipe()
    _relay = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)], stdin=read_end,
                              stdout=real, stderr=real, close_fds=True)
    os.close(read_end)
    sys.stderr.flush()
    sys.stderr = open(real, "w", buffering=1, encoding=sys.stderr.encoding,
                      errors="backslashreplace", closefd=False)
    os.dup2(write_end, 2)
    os.close(write_end)


def drop_rest() -> None:
    """The process is ending with its own line: the relay writes nothing more of it."""
    if _relay is not None:
        os.write(2, DROP_REST)


def relay(source: int = 0, sink: int = 1) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    pending = b""  # the start of a line not yet ended
    held: list[bytes] = []
    hold_until = None  # while XLA's coordination errors are held back
    dropping = False

    def write(data: bytes) -> None:
        if data and not dropping:
            os.write(sink, data)

    while True:
        timeout = None if hold_until is None else max(0.0, hold_until - time.monotonic())
        if not select.select([source], [], [], timeout)[0]:
            write(b"".join(held))  # nobody claimed them: the user reads them as XLA wrote them
            held, hold_until = [], None
            continue
        data = os.read(source, 65536)
        if not data:
            break
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            line += b"\n"
            if line == DROP_REST:
                dropping, held, hold_until = True, [], None
            elif hold_until is None and COORDINATION_ERROR.match(line):
                hold_until = time.monotonic() + HOLD_S
                held.append(line)
            elif hold_until is not None:
                held.append(line)
            else:
                write(line)
        # A glog line comes whole; anything else need not wait for its newline.
        if pending and hold_until is None and pending[:1] not in (b"E", b"F", b"\x00"):
            write(pending)
            pending = b""
    write(b"".join(held) + pending)


if __name__ == "__main__":
    relay()
