"""One folder, one writer: the locks a training run holds on every folder it writes.

A run writes its run folder and its checkpoint folder (``checkpoint.dir``, which may be
elsewhere and may be named by another run too): each gets a lock (``FolderLocks``). The lock
is ``FOLDER/train.lock``, a file that names its holder (process id, host, start time, run
folder) and carries an exclusive ``flock`` for as long as the holder lives. It is never
opened through a symbolic link (a link there would have the lock written into its target). The kernel drops
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
    """A folder of the run went away (or was replaced) while the run held it: nothing
    written from here on would be found, so the run stops."""

    def __init__(self, run_dir: str, what: str = "run folder"):
        super().__init__(f"the {what} {run_dir!r} was removed or replaced during the run; "
                         "nothing written from here on could be found")


class RunLock:
    """The lock of ``folder`` (which must exist), taken at construction. ``key`` is the
    config key that names the folder (for the refusal), ``run_dir`` the run folder of the
    run taking it (recorded, so that a refused job learns which run holds the folder)."""

    def __init__(self, folder: str | os.PathLike, say=print, key: str = "run_dir",
                 run_dir: str | os.PathLike | None = None):
        self.path = os.path.join(os.fspath(folder), LOCK_NAME)
        self.key = key
        self._fd = None
        while self._fd is None:
            fd = _open_no_link(self.path, key)
            if not _try_flock(fd, self.path):
                holder = _describe(_read(fd))
                os.close(fd)
                what = "run folder" if key == "run_dir" else "checkpoint folder"
                raise UserError(f"{key} {os.path.dirname(self.path)!r} is in use by {holder} "
                                f"(lock {self.path}): one {what} takes one job; wait for "
                                f"it to end, or use another {key}")
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
        if run_dir is not None:
            record["run_dir"] = os.fspath(run_dir)
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


class FolderLocks:
    """The locks of the folders a run writes, ``[(config key, folder), ...]``, taken in that
    order (folders that resolve to one are locked once); released together."""

    def __init__(self, folders, say=print, run_dir: str | os.PathLike | None = None):
        self.locks: list[RunLock] = []
        seen = set()
        try:
            for key, folder in folders:
                real = os.path.realpath(folder)
                if real not in seen:
                    seen.add(real)
                    # Made only once the folders before it are locked: a refused job makes
                    # no folder in a run folder that another job holds.
                    os.makedirs(real, exist_ok=True)
                    self.locks.append(RunLock(real, say, key, run_dir))
        except BaseException:
            self.release()
            raise

    def lost(self) -> RunLock | None:
        """The first lock whose file is no longer this run's (its folder removed, moved or
        replaced), or None."""
        return next((lock for lock in self.locks if lock.lost()), None)

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()


def _open_no_link(path: str, key: str) -> int:
    """The lock file, opened (or made) without following a symbolic link: a link named
    train.lock would have the lock record written over the file it points at."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{key}: {path} is a symbolic link (to {os.readlink(path)!r}); a "
                            "run never writes through a link: remove it") from None
        raise


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
        here, there = os.fstat(fd), os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # removed, or its folder replaced by a file
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
    run = f", run_dir {record['run_dir']!r}" if record.get("run_dir") else ""
    return (f"process {record['pid']} on {record.get('host', '?')} "
            f"(since {record.get('started', '?')}){run}")
