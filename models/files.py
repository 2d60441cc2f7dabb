"""The files and folders of the model converters (`python -m models.hf`, `python -m
lp_jax.export`), read and written so that damage, a full disk or a killed process is one line
or nothing at all, never a traceback or a folder of mixed files.

Reading: ``read_json_object`` is the one reader of their JSON files (config.json, the
sharded index, a state checkpoint's llama_config.json and hf_config.json); whatever a file
holds instead of a JSON object (a cut-off download, a list, binary bytes) is one line naming
the file.

Writing: an output folder is written whole (``written_whole``). The command writes into a
fresh folder beside its target, ``.<name>.partial-<host>-<pid>``, and only once everything
is written swaps it in: the target (when there is one) is renamed aside to
``.<name>.replaced-<host>-<pid>``, the new folder renamed into place, the old one removed.
So a folder never mixes the files of two exports (an earlier export's tokenizer files do not
outlive it), and a write that fails (a full disk) leaves the target as it was.

What a command may replace is checked before any work (``check_output``), a probe write
included (``write_problem``). An export replaces only an earlier export, recognised by the
marker file ``lp_jax_export.json`` written into every export (what wrote it, from what); any
other folder that holds files is refused, so an export never deletes files it did not write.
An empty folder is fine; files added to an export are replaced with it.

A killed command leaves its ``.partial-`` (or ``.replaced-``) folder behind; the next command
writing the same target removes the ones made on this host by a process that is no longer
alive. One whose process is alive is another export still writing, and one made on another
host (a shared file system) cannot be checked from here, so both are left, the latter named
in a warning.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from typing import Any, Callable, Iterator, TextIO

from models.hf_config import HFError

EXPORT_MARKER = "lp_jax_export.json"
PROBE_PREFIX = ".lp_jax-write-probe-"
_LEFTOVER_KINDS = ("partial", "replaced")

_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


# ---- reading ----

def read_json_object(path: str, error: type[Exception] = HFError) -> dict:
    """The JSON object in file `path`; anything else raises `error` with one line naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise error(f"{path} is not valid JSON: it is not UTF-8 text") from None
    except OSError as e:
        raise error(f"{path} cannot be read: {e.strerror or e}") from None
    return parse_json_object(text, path, error)


def parse_json_object(text: str, where: str, error: type[Exception] = HFError) -> dict:
    """The JSON object `text`, read from `where` (a file, or a line of one)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where} is not valid JSON (truncated?): {e.msg} at line {e.lineno} "
                    f"column {e.colno}") from None
    if not isinstance(value, dict):
        raise error(f"{where} holds {_JSON_KINDS.get(type(value), 'a value')}, not a JSON object")
    return value


# ---- can it be written? ----

def _nearest_existing(path: str) -> str:
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return existing


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be (or become) a folder: it, or the nearest part of it that
    exists, is a file. None otherwise; nothing is written."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path!r} is a file, not a folder"
    parent = _nearest_existing(path)
    if not os.path.isdir(parent):
        return f"{parent!r} is a file, so {path!r} cannot be a folder"
    return None


def write_problem(path: str | os.PathLike) -> str | None:
    """Why files cannot be created in folder ``path``, or None when they can.

    A probe write, not a permission check: ``os.access`` answers from the mode bits, which
    root ignores and which say nothing of a read-only mount or a full disk. A folder that
    does not exist yet is probed through its nearest existing parent (the writer makes it
    there), so nothing is created on disk by asking."""
    path = os.fspath(path)
    problem = folder_problem(path)
    if problem:
        return problem
    parent = _nearest_existing(path)
    try:
        fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=parent)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"cannot write in {parent!r} ({e.strerror or e})"
    return None


def check_output(target: str, role: str, *, replaces_exports: bool) -> None:
    """Raises HFError (one line, starting with `role`) unless `target` can be written whole:
    it must be absent, an empty folder, or (with `replaces_exports`) an earlier export, and
    its parent folder must take the new folder beside it."""
    existing_folder = os.path.isdir(target)
    # An existing folder is replaced from its parent; a new one is made in its nearest parent.
    problem = write_problem(os.path.dirname(_real(target)) if existing_folder else target)
    if problem:
        raise HFError(f"{role}: {problem}")
    if not existing_folder or not os.listdir(target):
        return
    if not replaces_exports:
        raise HFError(f"{role}: {target!r} is not empty; choose a new folder")
    if not os.path.isfile(os.path.join(target, EXPORT_MARKER)):
        raise HFError(f"{role}: {target!r} holds files and is not an earlier export (it has "
                      f"no {EXPORT_MARKER}); choose a new or empty folder")


def _real(target: str) -> str:
    """The folder a target names (a symlinked target is replaced where it points)."""
    return os.path.realpath(os.path.abspath(target))


# ---- writing whole ----

def _warn(message: str) -> None:
    print(message, file=sys.stderr)


@contextlib.contextmanager
def written_whole(target: str, role: str, *, marker: dict[str, Any] | None = None,
                  warn: Callable[[str], Any] = _warn) -> Iterator[str]:
    """Yields a fresh folder to write into; when the block ends without an exception it
    replaces `target` whole (with `marker` written into it as EXPORT_MARKER, the export's
    sign). An exception removes the new folder and leaves `target` as it was; a failed write
    (a full disk, a read-only file system) is an HFError line naming `target` and the
    system's reason."""
    check_output(target, role, replaces_exports=marker is not None)
    real = _real(target)
    _remove_leftovers(real, warn)
    partial, aside = _leftover_path(real, "partial"), _leftover_path(real, "replaced")
    existed = os.path.isdir(real)
    try:
        os.makedirs(os.path.dirname(real), exist_ok=True)
        os.mkdir(partial)  # not mkdtemp: its mode 0700 would become the export's
        yield partial
        if marker is not None:
            with open(os.path.join(partial, EXPORT_MARKER), "w") as f:
                json.dump(marker, f, indent=2)
        _swap_in(partial, real, aside)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        reason = os_reason(e) if isinstance(e, Exception) and not isinstance(e, HFError) else None
        if reason is None:  # not a failed write: an HFError is already the user's line
            raise
        kept = "it is left as it was" if existed else "it was not created"
        raise HFError(f"{role}: cannot write {target!r}: {reason}; {kept}") from None


@contextlib.contextmanager
def file_written_whole(path: str | os.PathLike) -> Iterator[TextIO]:
    """Yields a text file to write that becomes `path` only when the block ends without an
    exception: a temporary file beside it, flushed to disk, then renamed over it. A crash or
    a full disk leaves whatever `path` held before whole and no temporary file behind. The
    new file keeps the old one's mode (or a new file's, not mkstemp's 0600)."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else file_mode()
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)
        raise


def _swap_in(partial: str, real: str, aside: str) -> None:
    if not os.path.lexists(real):
        os.rename(partial, real)
        return
    os.rename(real, aside)
    try:
        os.rename(partial, real)
    except OSError:
        os.rename(aside, real)
        raise
    shutil.rmtree(aside, ignore_errors=True)  # what is left is removed by the next write


def _host() -> str:
    return socket.gethostname().split(".")[0] or "localhost"


def _leftover_path(real: str, kind: str) -> str:
    parent, name = os.path.split(real)
    return os.path.join(parent, f".{name}.{kind}-{_host()}-{os.getpid()}")


def _leftovers(real: str) -> Iterator[tuple[str, str, int]]:
    """(path, host, pid) of the folders earlier writes of `real` left beside it."""
    parent, name = os.path.split(real)
    if not os.path.isdir(parent):
        return
    pattern = re.compile(rf"\.{re.escape(name)}\.(?:{'|'.join(_LEFTOVER_KINDS)})-(.+)-(\d+)")
    for entry in sorted(os.listdir(parent)):
        m = pattern.fullmatch(entry)
        if m and int(m.group(2)) > 0:
            yield os.path.join(parent, entry), m.group(1), int(m.group(2))


def _alive(pid: int) -> bool:
    if pid == os.getpid():  # an earlier process of the same id: this one has written nothing yet
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_leftovers(real: str, warn: Callable[[str], Any]) -> None:
    for path, host, pid in _leftovers(real):
        if host != _host():
            warn(f"warning: left {path}: written by process {pid} on host {host}, which may "
                 "still be running there; remove it if not")
        elif not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)


# TensorStore's (Orbax's) and safetensors' (Rust's) ways of passing on a system error.
_OS_ERROR_CODES = (re.compile(r"\[os_error_code='(\d+)'\]"), re.compile(r"\(os error (\d+)\)"))


def os_reason(e: BaseException) -> str | None:
    """The operating system's reason behind a failed write ("No space left on device (errno
    28)"): from an OSError in the exception's chain or an OS error code in its text (how
    Orbax and safetensors report one); None when it has none."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return f"{e.strerror or os.strerror(e.errno)} (errno {e.errno})"
        for pattern in _OS_ERROR_CODES:
            m = pattern.search(str(e))
            if m:
                return f"{os.strerror(int(m.group(1)))} (errno {m.group(1)})"
        e = e.__cause__ if e.__cause__ is not None or e.__suppress_context__ else e.__context__
    return None


def file_mode() -> int:
    """The mode a file created now gets (0o644 under umask 022): writers that create files
    through a private temporary file (safetensors: 0o600) are set to it."""
    umask = os.umask(0o22)
    os.umask(umask)
    return 0o666 & ~umask
