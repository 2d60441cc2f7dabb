"""A run folder's JSON-lines files (metrics.jsonl, quant_stats.jsonl), read back."""
from __future__ import annotations

import json
import os
import pathlib


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
