"""One run folder, one writer: the lock a training run holds on its run folder.

The lock is ``RUN_DIR/train.lock``, a file that names its holder (process id, host, start
time) and carries an exclusive ``flock`` for as long as the holder lives. The kernel drops
a flock when its process dies, however it dies, so a lock file whose flock can be taken is
stale (its process was killed before it could remove it) and is taken over; one whose
flock is held refuses the second job, naming the holder. The holder also watches the file:
a run folder removed (or replaced) under a running job shows as a lock file that is gone,
or is no longer the one it holds.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from lp_jax.errors import RunStoppedError, UserError

LOCK_NAME = "train.lock"


class RunFolderLostError(RunStoppedError):
    """The run folder went away (or was replaced) while the run held it: nothing written
    from here on would be found, so the run stops."""

    def __init__(self, run_dir: str):
        super().__init__(f"the run folder {run_dir!r} was removed or replaced during the run; "
                         "nothing written from here on could be found")


class RunLock:
    """The lock of ``run_dir`` (which must exist), taken at construction."""

    def __init__(self, run_dir: str | os.PathLike, say=print):
        self.path = os.path.join(os.fspath(run_dir), LOCK_NAME)
        self._fd = None
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _try_flock(fd, self.path):
                holder = _describe(_read(fd))
                os.close(fd)
                raise UserError(f"run_dir {os.path.dirname(self.path)!r} is in use by {holder} "
                                f"(lock {self.path}): one run folder takes one job; wait for "
                                "it to end, or use another run_dir")
            if _same_file(fd, self.path):
                self._fd = fd
            else:  # the holder removed the file between our open and our flock: try again
                os.close(fd)
        stale = _read(self._fd)
        if stale:
            say(f"warning: took over the lock of {_describe(stale)}, which is no longer "
                f"running ({self.path})")
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(self._fd)

    def lost(self) -> bool:
        """Whether the lock file is no longer this lock's: the run folder was removed,
        moved or replaced under the run."""
        return self._fd is not None and not _same_file(self._fd, self.path)

    def release(self) -> None:
        if self._fd is None:
            return
        if _same_file(self._fd, self.path):
            os.remove(self.path)  # removed before the flock goes, so no one takes a dying lock
        os.close(self._fd)
        self._fd = None


def _try_flock(fd: int, path: str) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise UserError(f"cannot lock {path} ({e.strerror}): the run folder's file system "
                        "does not support file locks") from None


def _same_file(fd: int, path: str) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read(fd: int) -> dict | None:
    text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return {"damaged": text[:80]}
    return record if isinstance(record, dict) else {"damaged": text[:80]}


def _describe(record: dict | None) -> str:
    if not record or "pid" not in record:
        return "another process (its lock file names none)"
    return (f"process {record['pid']} on {record.get('host', '?')} "
            f"(since {record.get('started', '?')})")
