"""Text files -> token shards, split into train and validation by file.

    python -m lp_jax.data.prepare_data --tokenizer llama3 --out data/stdlib_llama3
    python -m lp_jax.data.prepare_data --tokenizer bytes --out data/kjv 'books/**/*.txt'

With no globs the text is the Python standard library's own ``.py`` files. Writes
``train_00000.npy ...``, ``val_00000.npy ...`` and ``meta.json`` (docs/data.md); the
trainer's ``data.source=text`` runs the same code into its cache.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
import zlib
from typing import Sequence

from lp_jax.data import shards
from lp_jax.data.tokenizers import Tokenizer, encode_document, get_tokenizer

FORMAT_VERSION = 1
_BATCH_FILES = 32  # files handed to the tokenizer at once (its Rust side threads a batch)


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
    if not globs:
        return (*stdlib_files(), [])
    found = shards.expand_globs(globs)
    if not found:
        raise ValueError(f"no file matches {', '.join(map(repr, globs))}")
    is_text = {f: not is_binary(f) for f in found}
    files = [f for f in found if is_text[f]]
    binary = [f for f in found if not is_text[f]]
    if not files:
        raise ValueError(f"the {len(found)} file(s) matching {', '.join(map(repr, globs))} "
                         f"are all binary, none is text (e.g. {binary[0]!r})")
    root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    return files, root, binary


def is_binary(path: str) -> bool:
    """A NUL byte in the first 8 KiB, git's test: text in any 8-bit encoding (the stdlib's
    deliberately Latin-1 test files) has none; images, archives, arrays have plenty."""
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(8192)
    except OSError as e:
        raise ValueError(f"{path!r} cannot be read: {e.strerror or e}") from None


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


def prepare(train_files: Sequence[str], val_files: Sequence[str], tokenizer: Tokenizer,
            out_dir: str | pathlib.Path, *, fmt: str = "npy", shard_tokens: int = 1 << 28,
            progress: bool = True, extra_meta: dict | None = None) -> dict:
    """Tokenizes the files into shards in ``out_dir`` and returns the meta it wrote."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = shards.token_dtype(tokenizer.vocab_size)
    meta = {"version": FORMAT_VERSION, "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id, "dtype": dtype.name, "splits": {}, **(extra_meta or {})}
    from tqdm import tqdm

    bar = tqdm(total=len(train_files) + len(val_files), unit="file", desc="tokenizing",
               disable=not progress, file=sys.stderr)
    for split, files in (("train", train_files), ("val", val_files)):
        writer = shards.ShardWriter(out_dir, split, dtype, shard_tokens, fmt)
        for start in range(0, len(files), _BATCH_FILES):
            batch = files[start:start + _BATCH_FILES]
            texts = [_read_text(f) for f in batch]
            for ids in tokenizer.encode_batch(texts):
                writer.write(encode_document(tokenizer, ids))
            bar.update(len(batch))
            bar.set_postfix(tokens=f"{writer.total_tokens:,}", split=split)
        meta["splits"][split] = {"files": len(files), "tokens": writer.total_tokens,
                                 "shards": writer.close()}
    bar.close()
    shards.write_meta(out_dir, meta)
    return meta


def cached_text_shards(globs: Sequence[str], val_globs: Sequence[str], val_fraction: float,
                       tokenizer: Tokenizer, cache_dir: str | None,
                       progress: bool = True) -> tuple[list[str], list[str], list[str]]:
    """Shard paths (train, val) for text files, tokenizing into the cache on first use, and
    the binary files the globs matched and left out.

    The cache key covers the tokenizer, the split and each file's path, size and mtime,
    so an edited file or another tokenizer makes a new entry. Entries are built in a
    temporary folder and renamed into place, so concurrent runs never read half of one.
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
    key = _fingerprint(tokenizer, root, train_files, val_files)
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
    return paths["train"], paths["val"], binary


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lp_jax")


def _fingerprint(tokenizer: Tokenizer, root: str, train: Sequence[str], val: Sequence[str]) -> str:
    h = hashlib.sha256()
    tok_file = getattr(tokenizer, "path", None)
    tok_id = [tokenizer.name, tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id]
    if tok_file is not None:
        st = os.stat(tok_file)
        tok_id += [st.st_size, st.st_mtime_ns]
    h.update(json.dumps([FORMAT_VERSION, tok_id]).encode())
    for split, files in (("train", train), ("val", val)):
        for f in files:
            st = os.stat(f)
            h.update(f"{split}\0{os.path.relpath(f, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _read_text(path: str) -> str:
    # Some stdlib test files are deliberately not UTF-8; replacing keeps them as text.
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lp_jax.data.prepare_data",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("globs", nargs="*", help="text files (default: the Python stdlib's .py files)")
    parser.add_argument("--out", required=True, help="output folder for the shards and meta.json")
    parser.add_argument("--tokenizer", default="bytes", help="bytes | llama3 | hf:<tokenizer.json>")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="fraction of files held out for validation (default 0.05)")
    parser.add_argument("--format", choices=("npy", "bin"), default="npy")
    parser.add_argument("--shard-tokens", type=int, default=1 << 28,
                        help="start a new shard after this many tokens")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        tokenizer = get_tokenizer(args.tokenizer)
        files, root, binary = text_files(args.globs)
        train, val = split_by_file(files, root, args.val_fraction)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if binary:
        print(f"skipped {len(binary)} binary file(s), e.g. {binary[0]}", file=sys.stderr)
    meta = prepare(train, val, tokenizer, args.out, fmt=args.format,
                   shard_tokens=args.shard_tokens, progress=not args.no_progress,
                   extra_meta={"root": root})
    for split, info in meta["splits"].items():
        print(f"{split}: {info['files']} files, {info['tokens']:,} tokens, "
              f"{len(info['shards'])} shard(s) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
