"""A run folder's JSON-lines files (metrics.jsonl, quant_stats.jsonl): read back, and
appended to by a run that may have resumed."""
from __future__ import annotations

import json
import os
import pathlib

from lp_jax.errors import RunStoppedError
from models.files import file_written_whole


def read_jsonl_counted(path: str | os.PathLike) -> tuple[list[dict], int]:
    """(the objects of a JSON-lines file, the number of damaged lines skipped): [] and 0 if
    there is none. A line that is not a JSON object is skipped, not the lines after it; a
    last line cut short (a killed writer) is dropped without being counted."""
    path = pathlib.Path(path)
    if not path.is_file():
        return [], 0
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    rows, damaged = [], 0
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif i < len(lines) - 1:
            damaged += 1
    return rows, damaged


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The objects of a JSON-lines file ([] if there is none), damaged lines skipped."""
    return read_jsonl_counted(path)[0]


class JsonlWriteError(RunStoppedError):
    """A run's JSON-lines file could not be written (a full disk, a folder gone read-only):
    one line naming the file and the system's reason."""


class JsonlAppender:
    """Appends one JSON object per line to ``path``, each flushed at once.

    Opened for a resumed run, the rows after ``start_step`` (written by an interrupted run
    after its last checkpoint) are dropped first, by writing the kept rows to a temporary
    file that then replaces the old one: a disk that fills meanwhile costs no row already
    written. A write that fails is a JsonlWriteError."""

    def __init__(self, path: str | os.PathLike, start_step: int, on_damaged=None):
        self.path = pathlib.Path(path)
        self._file = None
        try:
            if self.path.exists():
                rows, damaged = read_jsonl_counted(self.path)
                if damaged and on_damaged is not None:
                    on_damaged(damaged)
                kept = [row for row in rows if row.get("step", 0) <= start_step]
                with file_written_whole(self.path) as f:
                    f.write("".join(json.dumps(row) + "\n" for row in kept))
            self._file = open(self.path, "a")
        except OSError as e:
            raise self._error(e) from None

    def write(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:
            self._abandon()
            raise self._error(e) from None

    def _error(self, e: OSError) -> JsonlWriteError:
        return JsonlWriteError(f"cannot write {self.path} ({e.strerror or e}); the rows "
                               "written before are kept")

    def _abandon(self) -> None:
        """Closes the file without flushing again what failed to write."""
        try:
            self._file.close()
        except OSError:
            pass
        self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._abandon()

