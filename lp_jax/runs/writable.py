"""Can a run write where its config says? A probe write, not a permission check.

``os.access`` answers from the mode bits, which root ignores and which say nothing of a
read-only mount or a full disk; creating and removing a file answers for all of them.
"""
from __future__ import annotations

import os
import tempfile

PROBE_PREFIX = ".lp_jax-write-probe-"


def write_problem(path: str | os.PathLike) -> str | None:
    """Why files cannot be created in folder ``path``, or None when they can.

    A folder that does not exist yet is probed through its nearest existing parent (the
    run makes it there), so nothing is created on disk by asking."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path!r} is a file, not a folder"
    parent = os.path.abspath(path)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent!r} is a file, so {path!r} cannot be a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=parent)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"cannot write in {parent!r} ({e.strerror or e})"
    return None
