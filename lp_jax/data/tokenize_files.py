"""One unit of prepare_data's work: a run of consecutive input files read, tokenized and
written to temporary token files, one per split, in the files' order.

The same function runs in the calling process (``jobs=1``) or in a pool of spawned
processes; the caller appends the results to the shards in task order, so the token
stream is the same however many processes made it.
"""
from __future__ import annotations

import dataclasses
import os
import zlib
from collections import Counter
from typing import Sequence

import numpy as np

from lp_jax.data.readers import InputError, InputFile, read_documents
from lp_jax.data.rust_panics import TokenizerPanic
from lp_jax.data.tokenizers import Tokenizer

SPLITS = ("train", "val")
BY_DOCUMENT = "document"  # a file whose documents are split by the hash of their id
_BATCH_CHARS = 4 << 20  # text handed to the tokenizer at once (its Rust side threads a batch)
_BATCH_DOCUMENTS = 4096


@dataclasses.dataclass(frozen=True)
class FileJob:
    source: InputFile
    name: str  # the path relative to the corpus root: the file's id in meta.json and the hash
    split: str  # train | val | BY_DOCUMENT


@dataclasses.dataclass(frozen=True)
class Settings:
    text_field: str = "text"
    missing_field: str = "error"
    val_fraction: float = 0.0  # for BY_DOCUMENT files
    invalid_utf8: str = "replace"  # or "error": refuse a text file that is not UTF-8


@dataclasses.dataclass
class TaskResult:
    tokens: dict[str, str]  # split -> temporary file of its tokens (int32)
    lengths: dict[str, np.ndarray]  # split -> tokens per document, in order
    files: dict[str, dict]  # file name -> its accounting for meta.json


def document_in_val(name: str, row: int, val_fraction: float) -> bool:
    """A document of a file split by document is held out when the CRC32 of
    ``<file name>\\0<row>``, over 2**32, is below ``val_fraction``: its side depends only
    on its own id, never on the seed or the other documents."""
    return zlib.crc32(f"{name}\0{row}".encode()) / 2**32 < val_fraction


def frame(tokenizer: Tokenizer, encoded: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The documents as packing lays them out, ``[BOS] ids [EOS]`` (no EOS when it is BOS),
    end to end, and the length of each."""
    tail = [np.array([tokenizer.eos_id], np.int32)] if tokenizer.eos_id != tokenizer.bos_id else []
    bos = np.array([tokenizer.bos_id], np.int32)
    pieces = []
    for ids in encoded:
        pieces += [bos, np.asarray(ids, np.int32), *tail]
    lengths = np.array([len(ids) + 1 + len(tail) for ids in encoded], np.int64)
    return (np.concatenate(pieces) if pieces else np.zeros(0, np.int32)), lengths


def tokenize_task(jobs: Sequence[FileJob], tokenizer: Tokenizer, settings: Settings,
                  tmp_prefix: str) -> TaskResult:
    """Tokenizes the files into ``<tmp_prefix>.<split>`` token files. Documents are handed
    to the tokenizer in batches that run across files (many small text files make one
    batch), in order."""
    outputs = {split: open(f"{tmp_prefix}.{split}", "wb") for split in SPLITS}
    lengths: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    counts = {job.name: {split: [0, 0] for split in SPLITS} for job in jobs}  # documents, tokens
    skipped = {job.name: Counter() for job in jobs}
    replaced = {job.name: Counter() for job in jobs}  # invalid UTF-8 read as U+FFFD
    batch: list[tuple[str, str, str]] = []  # (text, split, file name)
    path_of = {job.name: job.source.path for job in jobs}
    chars = 0

    def flush():
        try:
            encoded = tokenizer.encode_batch([text for text, _, _ in batch])
        except TokenizerPanic as e:  # a batch runs across files: name the ones it holds
            paths = list(dict.fromkeys(path_of[name] for _, _, name in batch))
            where = paths[0] if len(paths) == 1 else f"a document of {paths[0]} ... {paths[-1]}"
            raise InputError(f"{where}: {e}") from None
        for split in SPLITS:
            mine = [(ids, name) for ids, (_, side, name) in zip(encoded, batch) if side == split]
            if not mine:
                continue
            tokens, doc_lengths = frame(tokenizer, [ids for ids, _ in mine])
            outputs[split].write(tokens.tobytes())
            lengths[split].append(doc_lengths)
            for (_, name), n in zip(mine, doc_lengths.tolist()):
                counts[name][split][0] += 1
                counts[name][split][1] += n
        batch.clear()

    try:
        for job in jobs:
            documents = read_documents(job.source, settings.text_field, skipped[job.name],
                                       settings.missing_field, replaced[job.name],
                                       settings.invalid_utf8)
            for row, text in documents:
                if text is None:
                    continue
                side = job.split
                if side == BY_DOCUMENT:
                    side = "val" if document_in_val(job.name, row, settings.val_fraction) else "train"
                batch.append((text, side, job.name))
                chars += len(text)
                if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCUMENTS:
                    flush()
                    chars = 0
        if batch:
            flush()
    finally:
        for f in outputs.values():
            f.close()
    files = {}
    for job in jobs:
        account: dict = {split: {"documents": d, "tokens": t}
                         for split, (d, t) in counts[job.name].items() if d}
        if skipped[job.name]:
            account["skipped"] = dict(sorted(skipped[job.name].items()))
        if replaced[job.name]:
            account["replaced"] = dict(sorted(replaced[job.name].items()))
        files[job.name] = account
    return TaskResult({split: f"{tmp_prefix}.{split}" for split in SPLITS},
                      {split: np.concatenate(lengths[split]) if lengths[split]
                       else np.zeros(0, np.int64) for split in SPLITS}, files)


# ---- the pool: each spawned process builds nothing until its first task

_worker_tokenizer = None


def init_worker(tokenizer: Tokenizer, rust_threads: int) -> None:
    """Runs first in each pool process: the tokenizer's Rust threads are limited so that
    the processes together use the cores once, not once each."""
    global _worker_tokenizer
    os.environ["RAYON_NUM_THREADS"] = str(rust_threads)  # read when the Rust pool starts
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if rust_threads > 1 else "false"
    _worker_tokenizer = tokenizer


def tokenize_task_in_worker(jobs, settings, tmp_prefix) -> TaskResult:
    return tokenize_task(jobs, _worker_tokenizer, settings, tmp_prefix)
