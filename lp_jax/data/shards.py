"""Token shards on disk: flat arrays of token ids, one file per shard, read as memmaps.

A shard is a ``.npy`` file (dtype in its header) or a headerless ``.bin`` file (dtype
given by the reader, ``data.token_dtype``). Documents are concatenated, each starting
with the tokenizer's BOS id, which is how the packer finds document boundaries; a
``meta.json`` beside the shards records the tokenizer that made them.
"""
from __future__ import annotations

import glob
import json
import os
import pathlib
from typing import Iterable

import numpy as np

META = "meta.json"
SHARD_SUFFIXES = (".npy", ".bin")
FORMATS = ("npy", "bin", "megatron")  # what ShardWriter writes


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id (uint16 halves the disk of uint32)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class ShardWriter:
    """Streams documents into ``<prefix>_00000.<fmt>``, ``<prefix>_00001.<fmt>``, ...

    Tokens go to a raw file as they come, so memory stays at one batch of documents; a
    ``.npy`` shard is finished by copying the raw file under a header, since its length is
    known only at the end. Format ``megatron`` keeps the raw file as Megatron's ``.bin`` and
    writes its ``.idx`` beside it (lp_jax/data/megatron.py); its shards are named by prefix.
    """

    def __init__(self, out_dir: pathlib.Path, prefix: str, dtype: np.dtype,
                 shard_tokens: int, fmt: str = "npy"):
        if fmt not in FORMATS:
            raise ValueError(f"shard format {fmt!r} is not one of {', '.join(FORMATS)}")
        self.out_dir, self.prefix, self.dtype = pathlib.Path(out_dir), prefix, np.dtype(dtype)
        self.shard_tokens, self.fmt = shard_tokens, fmt
        self.paths: list[str] = []
        self.total_tokens = 0
        self.total_documents = 0
        self._file = None
        self._count = 0
        self._lengths: list[np.ndarray] = []  # document lengths of the open shard

    def write(self, ids: np.ndarray) -> None:
        """One document."""
        ids = np.asarray(ids)
        self.write_documents(ids, np.array([len(ids)], np.int64))

    def write_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents laid end to end in ``tokens``, ``lengths[i]`` tokens each. A shard is
        closed after the document that brings it to ``shard_tokens``: no document is split."""
        lengths = np.asarray(lengths, np.int64)
        ends = np.cumsum(lengths)
        first, base = 0, 0
        while first < len(lengths):
            if self._file is None:
                raw = self.out_dir / f"{self.prefix}_{len(self.paths):05d}.bin"
                self._file, self._raw, self._count = open(raw, "wb"), raw, 0
            # The first document of the rest whose end fills the shard closes it.
            full = np.searchsorted(ends[first:] - base, self.shard_tokens - self._count)
            last = min(first + int(full), len(lengths) - 1)
            end = int(ends[last])
            self._file.write(np.asarray(tokens[base:end]).astype(self.dtype, copy=False).tobytes())
            self._lengths.append(lengths[first:last + 1])
            self._count += end - base
            self.total_tokens += end - base
            self.total_documents += last + 1 - first
            first, base = last + 1, end
            if self._count >= self.shard_tokens:
                self._close_shard()

    def close(self) -> list[str]:
        if self._file is not None:
            self._close_shard()
        return self.paths

    def _close_shard(self) -> None:
        self._file.close()
        self._file = None
        path = self._raw
        if self.fmt == "npy":
            path = self._raw.with_suffix(".npy")
            raw = np.memmap(self._raw, dtype=self.dtype, mode="r", shape=(self._count,))
            out = np.lib.format.open_memmap(path, mode="w+", dtype=self.dtype, shape=(self._count,))
            step = 1 << 24
            for start in range(0, self._count, step):
                out[start:start + step] = raw[start:start + step]
            out.flush()
            del out, raw
            os.remove(self._raw)
        elif self.fmt == "megatron":
            from lp_jax.data import megatron

            megatron.write_index(self._raw.with_suffix(".idx"), self.dtype,
                                 np.concatenate(self._lengths))
            path = self._raw.with_suffix("")  # Megatron names a dataset by its prefix
        self._lengths = []
        self.paths.append(path.name)


def write_meta(out_dir: pathlib.Path, meta: dict, name: str = META) -> None:
    """Written under a temporary name and renamed: a reader finds the whole file or none."""
    write_json_atomically(pathlib.Path(out_dir) / name, meta)


def write_json_atomically(path: pathlib.Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_meta(shard_path: str | pathlib.Path) -> dict | None:
    """The meta.json beside a shard (or the part.json of a prepare_data --workers part)."""
    folder = pathlib.Path(shard_path).parent
    for name in (META, "part.json"):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    return None


def expand_globs(patterns: Iterable[str]) -> list[str]:
    """Sorted files matching any pattern (``**`` recursive); duplicates removed."""
    found = set()
    for pattern in patterns:
        found.update(p for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                     if os.path.isfile(p))
    return sorted(found)


def open_shards(paths: Iterable[str], bin_dtype: str) -> list[np.ndarray]:
    """Read-only memmaps of the shards (the OS pages them in as sequences are read).

    ValueError, naming the file, for a shard that is not a flat array of integer ids: a
    truncated or garbled file, float values (which would otherwise be cast to ids and
    trained on), more than one dimension."""
    return [_open_shard(path, bin_dtype) for path in paths]


def _open_shard(path: str, bin_dtype: str) -> np.ndarray:
    if not path.endswith(SHARD_SUFFIXES):
        raise ValueError(f"token shard {path!r} is neither .npy nor .bin")
    try:
        if path.endswith(".npy"):
            array = np.load(path, mmap_mode="r")
        else:
            array = np.memmap(path, dtype=np.dtype(bin_dtype), mode="r")
    except (ValueError, EOFError, OSError) as e:
        what = "a .npy file" if path.endswith(".npy") else f"{bin_dtype} tokens"
        raise ValueError(f"token shard {path!r} is not readable as {what} (truncated or "
                         f"damaged?): {' '.join(str(e).split()) or type(e).__name__}") from None
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"token shard {path!r} holds {array.dtype} values, not integer token "
                         "ids (python -m lp_jax.data.prepare_data writes token shards)")
    if array.ndim != 1:
        raise ValueError(f"token shard {path!r} has shape {array.shape}; a shard is one flat "
                         "array of token ids")
    return array
