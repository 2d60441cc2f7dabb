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


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id (uint16 halves the disk of uint32)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class ShardWriter:
    """Streams documents into ``<prefix>_00000.<fmt>``, ``<prefix>_00001.<fmt>``, ...

    Tokens go to a raw file as they come, so memory stays at one document; a ``.npy``
    shard is finished by copying the raw file under a header, since its length is known
    only at the end.
    """

    def __init__(self, out_dir: pathlib.Path, prefix: str, dtype: np.dtype,
                 shard_tokens: int, fmt: str = "npy"):
        if fmt not in ("npy", "bin"):
            raise ValueError(f"shard format {fmt!r} is not one of npy, bin")
        self.out_dir, self.prefix, self.dtype = out_dir, prefix, np.dtype(dtype)
        self.shard_tokens, self.fmt = shard_tokens, fmt
        self.paths: list[str] = []
        self.total_tokens = 0
        self._file = None
        self._count = 0

    def write(self, ids: np.ndarray) -> None:
        if self._file is None:
            raw = self.out_dir / f"{self.prefix}_{len(self.paths):05d}.bin"
            self._file, self._raw, self._count = open(raw, "wb"), raw, 0
        self._file.write(np.asarray(ids).astype(self.dtype, copy=False).tobytes())
        self._count += len(ids)
        self.total_tokens += len(ids)
        if self._count >= self.shard_tokens:  # documents are never split across shards
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
        self.paths.append(path.name)


def write_meta(out_dir: pathlib.Path, meta: dict) -> None:
    (out_dir / META).write_text(json.dumps(meta, indent=1, sort_keys=True))


def read_meta(shard_path: str | pathlib.Path) -> dict | None:
    meta = pathlib.Path(shard_path).parent / META
    return json.loads(meta.read_text()) if meta.is_file() else None


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
