"""A run folder's JSON-lines files (metrics.jsonl, quant_stats.jsonl), read back."""
from __future__ import annotations

import json
import os
import pathlib


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The objects of a JSON-lines file ([] if there is none), up to a line cut short."""
    path = pathlib.Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows
