"""A measured table's record (`bench/records/<name>.json`): its keys, their checks, and the
markdown it renders to."""
from __future__ import annotations

import json
import pathlib
import re

REQUIRED = {"title": str, "command": str, "commit": str, "jax": (str, type(None)), "where": str,
            "estimate": bool, "columns": list, "rows": list}
OPTIONAL = {"note": str, "estimate_columns": list}
NAME = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
# A short hash, `-dirty` when the tree had uncommitted changes: the stamp must name a
# commit someone can check out, not a free-form description.
COMMIT = re.compile(r"[0-9a-f]{7,40}(?:-dirty)?")
SCRIPT = "python -m bench.results"


class RecordError(ValueError):
    """A record, a page or a marker that cannot be rendered; the message is one line."""


def records_dir(root: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(root) / "bench" / "records"


def record_path(root: pathlib.Path, name: str) -> pathlib.Path:
    return records_dir(root) / f"{name}.json"


def validate(record: object, where: str) -> dict:
    """The record itself when it is well formed; else RecordError naming `where`."""
    def bad(problem: str):
        raise RecordError(f"{where}: {problem}")

    if not isinstance(record, dict):
        bad("not a JSON object")
    missing = sorted(set(REQUIRED) - set(record))
    unknown = sorted(set(record) - set(REQUIRED) - set(OPTIONAL))
    if missing:
        bad(f"missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    if unknown:
        bad(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            f"(known: {', '.join([*REQUIRED, *OPTIONAL])})")
    for key, kind in {**REQUIRED, **OPTIONAL}.items():
        # bool is an int in Python but not here, and an int is no bool
        if key in record and not isinstance(record[key], kind):
            bad(f"{key!r} is {type(record[key]).__name__}, not {_kind_name(kind)}")
    for key in ("title", "command", "where", "note"):
        if key in record and not record[key].strip():
            bad(f"{key!r} is empty")
        if key in record and "\n" in record[key]:
            bad(f"{key!r} holds a newline (it prints as one line)")
    if not COMMIT.fullmatch(record["commit"]):
        bad(f"'commit' {record['commit']!r} is not a short commit hash (git rev-parse --short HEAD)")
    columns = record["columns"]
    if not columns or not all(isinstance(c, str) and c.strip() for c in columns):
        bad("'columns' must be a non-empty list of non-empty strings")
    for i, row in enumerate(record["rows"]):
        if not isinstance(row, list):
            bad(f"row {i} is {type(row).__name__}, not a list")
        if len(row) != len(columns):
            bad(f"row {i} has {len(row)} cells for {len(columns)} columns")
        for j, cell in enumerate(row):
            if not isinstance(cell, str):
                bad(f"row {i}, column {columns[j]!r}: {cell!r} is {type(cell).__name__}, not a "
                    "string (cells are written exactly as they print)")
            if "\n" in cell or re.search(r"(?<!\\)\|", cell):
                bad(f"row {i}, column {columns[j]!r}: a newline or an unescaped '|' breaks the table")
    est = record.get("estimate_columns", [])
    if est and not record["estimate"]:
        bad("'estimate_columns' needs \"estimate\": true")
    if unknown_cols := [c for c in est if c not in columns]:
        bad(f"'estimate_columns' names {', '.join(map(repr, unknown_cols))}, not in 'columns'")
    return record


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "a string", bool: "true or false", list: "a list", type(None): "null"}
    return " or ".join(names[k] for k in kinds)


def load(root: pathlib.Path, name: str) -> dict:
    path = record_path(root, name)
    rel = path.relative_to(root).as_posix()
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecordError(f"{rel}: no such record") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"{rel}: {e}") from None
    return validate(record, rel)


def _code(text: str) -> str:
    """`text` as inline code, fenced by more backticks than it holds."""
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def render(name: str, record: dict) -> list[str]:
    """The lines that go between a page's marker pair: the table, its stamp, its note."""
    est = set(record.get("estimate_columns", []))
    header = [f"{c} (est.)" if c in est else c for c in record["columns"]]
    lines = ["", _row(header), "|" + "---|" * len(header), *(_row(r) for r in record["rows"]), ""]
    jax = f"JAX {record['jax']}" if record["jax"] else "JAX version not recorded"
    source = (f"{_code(record['command'])} at commit {_code(record['commit'])} "
              f"({jax}; {record['where']}). Written by {_code(SCRIPT)} from "
              f"{_code(f'bench/records/{name}.json')}.")
    if record["estimate"]:
        lines.append(f"<sub>**Estimates, not GPU measurements**: computed with {source}</sub>")
    else:
        lines.append(f"<sub>Measured with {source}</sub>")
    if "note" in record:
        lines += ["", record["note"]]
    return [*lines, ""]


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"
