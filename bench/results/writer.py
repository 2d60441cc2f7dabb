"""Writing a record from a fresh measurement: the benchmark gives the table, the helper
adds the commit and the JAX version it ran at."""
from __future__ import annotations

import json
import os
import pathlib

from bench.results.records import NAME, RecordError, record_path, validate
from lp_jax.study.provenance import jax_version, source_commit

ROOT = pathlib.Path(__file__).resolve().parents[2]


def current_commit(root: pathlib.Path = ROOT) -> str:
    """The commit a record is measured at, `-dirty` for an edited tree (a figure measured
    there is not the commit's figure)."""
    commit = source_commit(root)
    if commit is None:
        raise RecordError(f"cannot read the commit of {root}: not a git checkout")
    return commit


def machine() -> str:
    """Where a benchmark runs, for a record's "where": the GPU's name, or the CPU cores
    this process may use (the machine may have more than it is given)."""
    import jax  # only benchmarks that already run JAX call this

    device = jax.devices()[0]
    if device.platform == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return f"{cores}-core CPU machine"
    kind = getattr(device, "device_kind", device.platform)
    return f"{jax.device_count()} x {kind}" if jax.device_count() > 1 else kind


def write_record(name, title, command, columns, rows, where, estimate=False, note=None, *,
                 estimate_columns=None, root=ROOT) -> pathlib.Path:
    """Writes `bench/records/<name>.json` (checked as `python -m bench.results` checks it)
    and returns its path; cells must already be the strings the table prints."""
    if not NAME.fullmatch(name):
        raise RecordError(f"record name {name!r}: lowercase words joined by '-'")
    record = {"title": title, "command": command, "commit": current_commit(root),
              "jax": jax_version(), "where": where, "estimate": estimate,
              "columns": list(columns), "rows": [list(r) for r in rows]}
    if estimate_columns:
        record["estimate_columns"] = list(estimate_columns)
    if note is not None:
        record["note"] = note
    path = record_path(root, name)
    validate(record, path.relative_to(root).as_posix())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(dumps(record), encoding="utf-8")
    os.replace(tmp, path)
    return path


def dumps(record: dict) -> str:
    """JSON with one table row per line, so that a refreshed record diffs row by row."""
    def one(value):
        return json.dumps(value, ensure_ascii=False)

    lines = []
    for key, value in record.items():
        if key == "rows" and value:
            body = ",\n".join(f"    {one(r)}" for r in value)
            lines.append(f'  "rows": [\n{body}\n  ]')
        else:
            lines.append(f"  {one(key)}: {one(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"
