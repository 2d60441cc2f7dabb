"""prepare_data on many machines: the input files cut into N parts, and the merge.

``--worker I --workers N`` tokenizes part I into ``<out>/part-0000I-of-0000N/`` (its shards
and a ``part.json``); any scheduler runs the N commands (a Slurm array, a Kubernetes
indexed job). Part I is a contiguous run of the file list, cut where the input bytes
divide evenly, so concatenating the parts' shards in part order gives the tokens of one
run over all files. ``--merge`` checks that every part is there and was made from the same
inputs and settings, then writes ``<out>/meta.json`` naming every part's shards.
"""
from __future__ import annotations

import glob
import json
import os
import pathlib
import re
from typing import Sequence

from lp_jax.data import shards

PART_META = "part.json"
_PART_FOLDER = re.compile(r"part-(\d+)-of-(\d+)$")
# meta.json fields every part must agree on (besides the inputs fingerprint)
_SHARED = ("tokenizer", "vocab_size", "bos_id", "eos_id", "dtype", "format", "root",
           "text_field", "split_by", "val_fraction")


def part_folder(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def part_of_each(sizes: Sequence[int], count: int) -> list[int]:
    """The part of each file: the one its middle byte falls in when the total input is cut
    into ``count`` equal runs of bytes (by file count when every file is empty). Never
    decreasing along the list, so each part is a contiguous run of files."""
    total = sum(sizes)
    parts, before = [], 0
    for position, size in enumerate(sizes):
        if total:
            parts.append(min(count - 1, int((before + size / 2) * count // total)))
        else:
            parts.append(position * count // len(sizes))
        before += size
    return parts


def merge(out_dir: str | pathlib.Path) -> dict:
    """Writes ``out_dir/meta.json`` for the parts in ``out_dir``; ValueError, one line, when
    a part is missing, unfinished, or from other inputs or settings."""
    out_dir = pathlib.Path(out_dir)
    folders = {}
    for path in glob.glob(str(out_dir / "part-*-of-*")):
        match = _PART_FOLDER.search(path)
        if match and os.path.isdir(path):
            folders[(int(match[1]), int(match[2]))] = path
    counts = sorted({count for _, count in folders})
    if not counts:
        raise ValueError(f"{str(out_dir)!r} holds no part-I-of-N folders to merge "
                         "(prepare_data --worker I --workers N writes them)")
    if len(counts) > 1:
        raise ValueError(f"{str(out_dir)!r} holds parts of runs with {' and '.join(map(str, counts))} "
                         "workers; remove the folders of the run that is not wanted")
    count = counts[0]
    metas = []
    for index in range(count):
        path = out_dir / part_folder(index, count) / PART_META
        if not path.is_file():
            raise ValueError(f"part {index} of {count} is not finished: {str(path)!r} does not "
                             "exist (its worker has not run, is running, or failed)")
        metas.append(json.loads(path.read_text()))
    first = metas[0]
    for index, meta in enumerate(metas[1:], 1):
        for key in ("inputs", *_SHARED):
            if meta.get(key) != first.get(key):
                raise ValueError(f"part {index} of {count} differs from part 0 in {key!r} "
                                 f"({meta.get(key)!r} vs {first.get(key)!r}): the parts were made "
                                 "from other inputs or settings; rerun the stale ones")
    files: dict = {}
    for index, meta in enumerate(metas):
        for name, account in meta["files"].items():
            if name in files:
                raise ValueError(f"input {name!r} is in two parts; the parts are not one run's")
            files[name] = account
    if len(files) != first["input_files"]:
        raise ValueError(f"the {count} parts account for {len(files)} input files, the run had "
                         f"{first['input_files']}")
    merged = {k: v for k, v in first.items() if k not in ("part", "splits", "files")}
    merged["files"] = files
    merged["parts"] = count
    merged["splits"] = {}
    for split in first["splits"]:
        infos = [meta["splits"][split] for meta in metas]
        merged["splits"][split] = {
            "files": sum(i["files"] for i in infos),
            "documents": sum(i["documents"] for i in infos),
            "tokens": sum(i["tokens"] for i in infos),
            "shards": [f"{part_folder(index, count)}/{shard}"
                       for index, info in enumerate(infos) for shard in info["shards"]]}
    shards.write_meta(out_dir, merged)
    return merged
