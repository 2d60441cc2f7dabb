"""Corpus files -> token shards, split into train and validation by file (or by document).

    python -m lp_jax.data.prepare_data --tokenizer llama3 --out data/stdlib_llama3
    python -m lp_jax.data.prepare_data --tokenizer llama3 --out shards/dclm 'dclm/**/*.jsonl.zst'
    python -m lp_jax.data.prepare_data --out shards/x --worker 3 --workers 16 'in/*.parquet'
    python -m lp_jax.data.prepare_data --merge --out shards/x

Reads text files (one file, one document), JSON lines (plain, .gz, .zst), Parquet, Arrow
files and Hugging Face ``save_to_disk`` folders (lp_jax/data/readers.py); with no globs,
the Python standard library's own ``.py`` files. Writes ``train_00000.npy ...``,
``val_00000.npy ...`` (or ``.bin``, or Megatron's ``.bin``/``.idx`` pairs) and ``meta.json``
(docs/data.md); the trainer's ``data.source=text`` runs the same code into its cache.
Files are tokenized by a pool of processes (``--jobs``, every core by default), and the
shards hold the same tokens in the same order whatever the number of processes or parts.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
import zlib
from typing import Iterator, Sequence

import numpy as np

from lp_jax.data import megatron, parts, readers, shards
from lp_jax.data.fingerprint import content_sha256, tokenizer_identity
from lp_jax.data.readers import InputError, InputFile, is_binary  # noqa: F401  (is_binary: API)
from lp_jax.data.tokenize_files import (BY_DOCUMENT, SPLITS, FileJob, Settings, TaskResult,
                                        init_worker, tokenize_task, tokenize_task_in_worker)
from lp_jax.data.tokenizers import Tokenizer, get_tokenizer

FORMAT_VERSION = 2
SPLIT_BY = ("auto", "file", "document")
_TASK_BYTES = 64 << 20  # input handed to one process at a time (consecutive files)


def stdlib_files() -> tuple[list[str], str]:
    """The standard library's .py files and their root folder."""
    root = sysconfig.get_paths()["stdlib"]
    files = [str(p) for p in sorted(pathlib.Path(root).rglob("*.py"))
             if "site-packages" not in p.parts and "__pycache__" not in p.parts]
    return files, root


def text_files(globs: Sequence[str]) -> tuple[list[str], str, list[str]]:
    """Text files matching the globs (the stdlib when there are none), their common root,
    and the matching files left out because they are binary (their bytes would decode to
    replacement characters and be trained on)."""
    inputs, root, binary = corpus_files(globs, "text")
    return [f.path for f in inputs], root, binary


def corpus_files(globs: Sequence[str], input_format: str = "auto"
                 ) -> tuple[list[InputFile], str, list[str]]:
    """The input files the globs name (the stdlib's .py files when there are none), their
    common root, and the files read as text that were left out as binary."""
    if not globs:
        files, root = stdlib_files()
        return [InputFile(f, "text") for f in files], root, []
    found = readers.expand_inputs(globs, input_format)
    if not found:
        raise ValueError(f"no file matches {', '.join(map(repr, globs))}")
    binary = [f.path for f in found if f.kind == "text" and is_binary(f.path)]
    left_out = set(binary)
    inputs = [f for f in found if f.path not in left_out]
    if not inputs:
        raise ValueError(f"the {len(found)} file(s) matching {', '.join(map(repr, globs))} "
                         f"are all binary, none is text (e.g. {binary[0]!r})")
    root = os.path.commonpath([os.path.dirname(os.path.abspath(f.path)) for f in inputs])
    return inputs, root, binary


def split_by_file(files: Sequence[str], root: str, val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val): a file is in val when the CRC32 of its path relative to ``root``,
    as a fraction of 2**32, is below ``val_fraction``. A file's side depends only on its
    own name (not on the seed, nor on which other files exist: adding files never moves
    one across), and the sides never overlap. Too few files for the fraction to pick any:
    the one with the smallest hash is held out, so validation is never silently empty."""
    if val_fraction <= 0:
        return list(files), []
    if len(files) < 2:
        raise ValueError(f"a validation split by file needs at least 2 files, got {len(files)}; "
                         "set data.val_fraction=0 or give data.val_paths")

    def position(f):
        return zlib.crc32(os.path.relpath(f, root).encode()) / 2**32

    val = {f for f in files if position(f) < val_fraction}
    if not val:
        val = {min(files, key=position)}
    if len(val) == len(files):
        val.remove(max(files, key=position))
    return [f for f in files if f not in val], sorted(val)


def prepare(train_files: Sequence[str | InputFile], val_files: Sequence[str | InputFile],
            tokenizer: Tokenizer, out_dir: str | pathlib.Path, *, fmt: str = "npy",
            shard_tokens: int = 1 << 28, progress: bool = True, extra_meta: dict | None = None,
            by_document: Sequence[str | InputFile] = (), val_fraction: float = 0.0,
            text_field: str = "text", missing_field: str = "error",
            invalid_utf8: str = "replace", jobs: int = 1,
            root: str | None = None, part: tuple[int, int] | None = None) -> dict:
    """Tokenizes the files into shards in ``out_dir`` and returns the meta it wrote.

    ``train_files`` and ``val_files`` go whole to their split; each document of a
    ``by_document`` file goes to validation when its id's hash is below ``val_fraction``
    (tokenize_files.document_in_val). A path string is a text file. With ``part=(I, N)``
    only part I of the files is tokenized, into ``out_dir/part-I-of-N`` with a
    ``part.json`` for ``parts.merge``. The meta file is written last, under a temporary
    name and renamed, and an old one is removed first: a folder whose run did not finish
    has none, so nothing trusts its shards.
    """
    def as_input(f):
        return f if isinstance(f, InputFile) else InputFile(str(f), "text")

    groups = (("train", train_files), ("val", val_files), (BY_DOCUMENT, by_document))
    inputs = [(as_input(f), split) for split, files in groups for f in files]
    if root is None:
        root = (extra_meta or {}).get("root") or (os.path.commonpath(
            [os.path.dirname(os.path.abspath(f.path)) for f, _ in inputs]) if inputs else ".")
    jobs_all = [FileJob(f, os.path.relpath(f.path, root), split) for f, split in inputs]
    sizes = [_size(job.source.path) for job in jobs_all]
    split_by = "document" if by_document else "file"
    dtype = (megatron.token_dtype(tokenizer.vocab_size) if fmt == "megatron"
             else shards.token_dtype(tokenizer.vocab_size))
    meta = {"version": FORMAT_VERSION, "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id, "dtype": dtype.name, "format": fmt, "root": root,
            "text_field": text_field, "split_by": split_by, "val_fraction": val_fraction,
            **(extra_meta or {})}
    out_dir = pathlib.Path(out_dir)
    meta_name = shards.META
    if part is not None:
        index, count = part
        mine = parts.part_of_each(sizes, count)
        meta["inputs"] = _inputs_fingerprint(meta, jobs_all, sizes)
        meta["input_files"] = len(jobs_all)
        meta["part"] = {"index": index, "count": count}
        jobs_all = [job for job, p in zip(jobs_all, mine) if p == index]
        sizes = [size for size, p in zip(sizes, mine) if p == index]
        out_dir, meta_name = out_dir / parts.part_folder(index, count), parts.PART_META
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / meta_name).unlink(missing_ok=True)  # stale: about to be overwritten
    writers = {split: shards.ShardWriter(out_dir, split, dtype, shard_tokens, fmt) for split in SPLITS}
    settings = Settings(text_field, missing_field, val_fraction, invalid_utf8)
    tasks = _tasks(jobs_all, sizes, jobs)
    files: dict[str, dict] = {}
    from tqdm import tqdm

    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="tokenizing",
               disable=not progress, file=sys.stderr)
    work = tempfile.mkdtemp(prefix=".tokenizing-", dir=out_dir)
    try:
        for task, result in zip(tasks, _run_tasks(tasks, tokenizer, settings, work, jobs)):
            _append(result, writers)
            files.update(result.files)
            bar.update(sum(_size(job.source.path) for job in task))
            bar.set_postfix(tokens=f"{writers['train'].total_tokens:,}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        bar.close()
    meta["files"] = files
    meta["splits"] = {split: {"files": sum(1 for a in files.values() if split in a),
                              "documents": writer.total_documents,
                              "tokens": writer.total_tokens, "shards": writer.close()}
                      for split, writer in writers.items()}
    shards.write_meta(out_dir, meta, meta_name)
    return meta


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError as e:
        raise InputError(f"{path!r} cannot be read: {e.strerror or e}") from None


def _inputs_fingerprint(meta: dict, jobs: Sequence[FileJob], sizes: Sequence[int]) -> str:
    """What every part of a run must share: the settings and the whole file list."""
    h = hashlib.sha256(json.dumps({k: meta[k] for k in sorted(meta)}, sort_keys=True).encode())
    for job, size in zip(jobs, sizes):
        h.update(f"{job.name}\0{job.source.kind}\0{job.split}\0{size}\n".encode())
    return h.hexdigest()[:20]


def _tasks(jobs: Sequence[FileJob], sizes: Sequence[int], processes: int) -> list[list[FileJob]]:
    """Consecutive files grouped so that each process gets a few tasks of similar size
    (a big file is a task of its own)."""
    target = min(_TASK_BYTES, max(1, sum(sizes) // max(1, 4 * processes)))
    tasks, current, held = [], [], 0
    for job, size in zip(jobs, sizes):
        current.append(job)
        held += size
        if held >= target:
            tasks.append(current)
            current, held = [], 0
    if current:
        tasks.append(current)
    return tasks


def _run_tasks(tasks, tokenizer, settings, work: str, processes: int) -> Iterator[TaskResult]:
    """The tasks' results in task order: in this process, or from a pool of spawned ones
    with at most two tasks per process in flight (memory and temporary disk stay bounded)."""
    prefixes = [os.path.join(work, f"{i:06d}") for i in range(len(tasks))]
    if processes <= 1 or len(tasks) <= 1:
        for task, prefix in zip(tasks, prefixes):
            yield tokenize_task(task, tokenizer, settings, prefix)
        return
    workers = min(processes, len(tasks))
    rust_threads = max(1, (os.cpu_count() or 1) // workers)
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=init_worker,
        initargs=(tokenizer, rust_threads))
    try:
        pending = collections.deque()
        queue = iter(zip(tasks, prefixes))
        for task, prefix in queue:
            pending.append(pool.submit(tokenize_task_in_worker, task, settings, prefix))
            if len(pending) >= 2 * workers:
                break
        while pending:
            result = pending.popleft().result()
            for task, prefix in queue:  # one in, one out
                pending.append(pool.submit(tokenize_task_in_worker, task, settings, prefix))
                break
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _append(result: TaskResult, writers: dict) -> None:
    for split in SPLITS:
        path, lengths = result.tokens[split], result.lengths[split]
        if len(lengths):
            tokens = np.memmap(path, dtype=np.int32, mode="r")
            writers[split].write_documents(tokens, lengths)
            del tokens
        os.remove(path)


@dataclasses.dataclass(frozen=True)
class TextShards:
    """The token shards of a run's text files (``text_shards``)."""

    train: list[str]  # shard paths
    val: list[str]
    binary: list[str]  # files the globs matched and left out as binary
    invalid_utf8: dict[str, int]  # text file -> its byte sequences that were not UTF-8
    train_files: list[str]  # the text files of each split
    val_files: list[str]
    root: str  # their common folder
    digests: dict[str, str]  # text file -> SHA-256 of its bytes


def text_shards(globs: Sequence[str], val_globs: Sequence[str], val_fraction: float,
                tokenizer: Tokenizer, cache_dir: str | None, progress: bool = True) -> TextShards:
    """The token shards of the text files the globs name, tokenizing into the cache on
    first use.

    The cache key covers the tokenizer's content, the split and each file's path and the
    SHA-256 of its bytes, so an edited file (even one of the same size and modification
    time) or another tokenizer makes a new entry; hashing costs a fraction of tokenizing.
    Entries are built in a temporary folder and renamed into place, so concurrent runs
    never read half of one.
    """
    files, root, binary = text_files(globs)
    if val_globs:
        val_files, _, val_binary = text_files(val_globs)
        binary = sorted(set(binary) | set(val_binary))
        val_set = set(val_files)
        train_files = [f for f in files if f not in val_set]
    else:
        train_files, val_files = split_by_file(files, root, val_fraction)
    if not train_files:
        raise ValueError("data.paths leaves no training file once the validation files are removed")
    digests = {}
    for f in [*train_files, *val_files]:
        try:
            digests[f] = content_sha256(f)
        except OSError as e:
            raise InputError(f"{f!r} cannot be read: {e.strerror or e}") from None
    key = _cache_key(tokenizer, root, train_files, val_files, digests)
    entry = pathlib.Path(cache_dir or default_cache_dir()) / "tokens" / key
    if not (entry / shards.META).is_file():
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}-", dir=entry.parent))
        try:
            prepare(train_files, val_files, tokenizer, tmp, progress=progress,
                    extra_meta={"root": root})
            try:
                os.rename(tmp, entry)
            except OSError:  # another process finished the same entry first: use theirs
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads((entry / shards.META).read_text())
    paths = {s: [str(entry / p) for p in meta["splits"][s]["shards"]] for s in ("train", "val")}
    invalid = {os.path.join(root, name): n for name, n in invalid_utf8(meta).items()}
    return TextShards(paths["train"], paths["val"], binary, invalid, list(train_files),
                      list(val_files), root, digests)


def invalid_utf8(meta: dict) -> dict[str, int]:
    """meta.json's input files (relative to its root) whose bytes held sequences that are
    not UTF-8, each read as U+FFFD, with how many."""
    return {name: account["replaced"][readers.INVALID_UTF8]
            for name, account in meta["files"].items()
            if account.get("replaced", {}).get(readers.INVALID_UTF8)}


def invalid_utf8_note(invalid: dict[str, int]) -> str | None:
    """One line on the files whose invalid UTF-8 was replaced, or None when there were none."""
    if not invalid:
        return None
    worst = max(invalid, key=lambda name: (invalid[name], name))
    return (f"replaced {sum(invalid.values()):,} invalid UTF-8 byte sequence(s) with U+FFFD in "
            f"{len(invalid)} file(s), most in {worst} ({invalid[worst]:,})")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lp_jax")


def _cache_key(tokenizer: Tokenizer, root: str, train: Sequence[str], val: Sequence[str],
               digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([FORMAT_VERSION, tokenizer_identity(tokenizer)], sort_keys=True).encode())
    for split, files in (("train", train), ("val", val)):
        for f in files:
            h.update(f"{split}\0{os.path.relpath(f, root)}\0{digests[f]}\n".encode())
    return h.hexdigest()[:20]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lp_jax.data.prepare_data",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("globs", nargs="*", help="corpus files and Hugging Face save_to_disk "
                        "folders (default: the Python stdlib's .py files)")
    parser.add_argument("--out", required=True, help="output folder for the shards and meta.json")
    parser.add_argument("--tokenizer", default="bytes", help="bytes | llama3 | hf:<tokenizer.json>")
    parser.add_argument("--input-format", choices=readers.FORMATS, default="auto",
                        help="how to read the files (auto: by name: .jsonl/.json/.ndjson, also "
                        ".gz/.zst; .parquet; .arrow; anything else is one text document)")
    parser.add_argument("--text-field", default="text",
                        help="the JSON field or Parquet/Arrow column holding the text (default text)")
    parser.add_argument("--missing-field", choices=("error", "skip"), default="error",
                        help="a JSON line without the text field: stop (default) or skip and count it")
    parser.add_argument("--invalid-utf8", choices=("replace", "error"), default="replace",
                        help="bytes of a text file that are not UTF-8: read each sequence as "
                        "U+FFFD and count them (default), or stop")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="fraction held out for validation (default 0.05)")
    parser.add_argument("--split-by", choices=SPLIT_BY, default="auto",
                        help="hold out whole files, or documents by a hash of their id (auto: "
                        "by document for a single input file, else by file)")
    parser.add_argument("--format", choices=shards.FORMATS, default="npy",
                        help="npy | bin (headerless) | megatron (.bin/.idx pairs)")
    parser.add_argument("--shard-tokens", type=int, default=1 << 28,
                        help="start a new shard after this many tokens")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes tokenizing at once (default: every core)")
    parser.add_argument("--worker", type=int, help="tokenize only part I of --workers N")
    parser.add_argument("--workers", type=int, help="the number of parts the files are cut into")
    parser.add_argument("--merge", action="store_true",
                        help="write --out/meta.json from the finished parts of a --workers run")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    def fail(message):
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    if args.merge:
        if args.globs:
            fail("--merge takes no input files, only --out")
        try:
            meta = parts.merge(args.out)
        except ValueError as e:
            fail(e)
        _print_summary(meta, args.out)
        return 0
    if (args.worker is None) != (args.workers is None):
        fail("--worker I and --workers N go together")
    if args.workers is not None and not 0 <= args.worker < args.workers:
        fail(f"--worker {args.worker} is not in 0 .. --workers - 1 = {args.workers - 1}")
    if not 0 <= args.val_fraction < 1:
        fail(f"--val-fraction {args.val_fraction} is not in [0, 1)")
    try:
        tokenizer = get_tokenizer(args.tokenizer)
        inputs, root, binary = corpus_files(args.globs, args.input_format)
        split_by = args.split_by
        if split_by == "auto":
            split_by = "document" if len(inputs) == 1 else "file"
        train, val, by_document = [], [], []
        if split_by == "document":
            by_document = inputs
        else:
            by_path = {f.path: f for f in inputs}
            train_paths, val_paths = split_by_file(list(by_path), root, args.val_fraction)
            train, val = [by_path[p] for p in train_paths], [by_path[p] for p in val_paths]
        if binary:
            print(f"skipped {len(binary)} binary file(s), e.g. {binary[0]}", file=sys.stderr)
        extra = {"binary_files_left_out": [os.path.relpath(b, root) for b in binary]} if binary else {}
        meta = prepare(train, val, tokenizer, args.out, fmt=args.format,
                       shard_tokens=args.shard_tokens, progress=not args.no_progress,
                       extra_meta=extra, root=root, by_document=by_document,
                       val_fraction=args.val_fraction if split_by == "document" else 0.0,
                       text_field=args.text_field, missing_field=args.missing_field,
                       invalid_utf8=args.invalid_utf8,
                       jobs=max(1, args.jobs),
                       part=None if args.workers is None else (args.worker, args.workers))
    except ValueError as e:  # InputError included: one line naming the file and line
        fail(e)
    where = args.out if args.workers is None else os.path.join(
        args.out, parts.part_folder(args.worker, args.workers))
    _print_summary(meta, where)
    return 0


def _print_summary(meta: dict, where: str) -> None:
    note = invalid_utf8_note(invalid_utf8(meta))
    if note:
        print(note, file=sys.stderr)
    for split, info in meta["splits"].items():
        print(f"{split}: {info['files']} files, {info['documents']:,} documents, "
              f"{info['tokens']:,} tokens, {len(info['shards'])} shard(s) in {where}")
    skipped = collections.Counter()
    for account in meta["files"].values():
        skipped.update(account.get("skipped", {}))
    if skipped:
        print("skipped documents: " + ", ".join(f"{n:,} {why}" for why, n in sorted(skipped.items())))


if __name__ == "__main__":
    sys.exit(main())
