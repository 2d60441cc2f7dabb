"""Megatron-LM's indexed datasets: a ``<prefix>.bin`` of token ids and a ``<prefix>.idx``
that cuts it into sequences and documents (megatron/core/datasets/indexed_dataset.py).

The ``.idx`` layout, little-endian, as Megatron's ``_IndexWriter`` writes it:

==========  ==================================  ==========================================
bytes       what                                 type
==========  ==================================  ==========================================
9           magic ``MMIDIDX\\x00\\x00``
8           version, 1                           uint64
1           token dtype code (``DTYPE_CODES``)   uint8
8           sequence count S                     uint64
8           document index length D              uint64
4 S         tokens per sequence                  int32
8 S         byte offset of each sequence in .bin int64
8 D         document index: 0, then the number   int64
            of sequences up to each document's
            end (its last entry is S)
(S)         per-sequence modes, multimodal only  int8
==========  ==================================  ==========================================

Megatron's ``tools/preprocess_data.py`` writes one sequence per document (without ``--split-sentences``);
here a document is the sequences between two document-index entries, and its first token
is where packing starts a new document. The ``.bin`` is read in place, memory-mapped.
"""
from __future__ import annotations

import dataclasses
import glob
import math
import os
import pathlib
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's DType enum: the code stored in the .idx for the .bin's token type.
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document index length


def token_dtype(vocab_size: int) -> np.dtype:
    """The .bin type Megatron's preprocess_data picks (DType.optimal_dtype): uint16 below
    65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    return next(code for code, t in DTYPE_CODES.items() if np.dtype(t) == dtype)


@dataclasses.dataclass
class IndexedDataset:
    """One prefix, checked: ``tokens`` (a memmap of the whole .bin) and ``document_starts``
    (the token offset of each document's first token, then the token count)."""

    prefix: str
    tokens: np.ndarray
    document_starts: np.ndarray

    @property
    def documents(self) -> int:
        return len(self.document_starts) - 1


def open_indexed(prefix: str) -> IndexedDataset:
    """Reads ``prefix.idx`` and maps ``prefix.bin``; ValueError naming the file for an index
    that does not match its data (wrong magic or version, counts beyond the file, sequences
    that do not tile the .bin, a document index that is not ascending from 0 to S)."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise ValueError(f"{path!r} does not exist (a Megatron dataset is a .bin and .idx pair)")
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r") if os.path.getsize(idx_path) else b""
    if len(raw) < _HEADER.size:
        raise ValueError(f"{idx_path}: {len(raw)} bytes, shorter than a Megatron index header")
    magic, version, code, sequences, doc_entries = _HEADER.unpack(bytes(raw[:_HEADER.size]))
    if magic != MAGIC:
        raise ValueError(f"{idx_path}: not a Megatron index (starts {magic!r}, not {MAGIC!r})")
    if version != VERSION:
        raise ValueError(f"{idx_path}: index version {version}, this reader knows {VERSION}")
    if code not in DTYPE_CODES or np.dtype(DTYPE_CODES[code]).kind == "f":
        raise ValueError(f"{idx_path}: token dtype code {code} is not an integer type "
                         f"({', '.join(f'{c}={np.dtype(t).name}' for c, t in DTYPE_CODES.items())})")
    dtype = np.dtype(DTYPE_CODES[code])
    need = _HEADER.size + 12 * sequences + 8 * doc_entries
    if len(raw) < need:
        raise ValueError(f"{idx_path}: header counts {sequences:,} sequences and {doc_entries:,} "
                         f"document entries, {need:,} bytes, but the file has {len(raw):,}")
    at = _HEADER.size
    lengths = np.frombuffer(raw, np.int32, sequences, at)
    pointers = np.frombuffer(raw, np.int64, sequences, at + 4 * sequences)
    doc_index = np.frombuffer(raw, np.int64, doc_entries, at + 12 * sequences)
    bin_bytes = os.path.getsize(bin_path)
    ends = np.cumsum(lengths, dtype=np.int64) * dtype.itemsize
    expected_pointers = np.concatenate([[0], ends[:-1]]) if sequences else ends
    if (lengths < 0).any() or not np.array_equal(pointers, expected_pointers):
        raise ValueError(f"{idx_path}: sequence offsets do not tile {bin_path} back to back "
                         "(damaged index?)")
    total = int(ends[-1]) if sequences else 0
    if total != bin_bytes:
        raise ValueError(f"{idx_path} does not match {bin_path}: its sequences hold {total:,} "
                         f"bytes of {dtype.name} tokens, the .bin has {bin_bytes:,}")
    if (doc_entries == 0 or doc_index[0] != 0 or doc_index[-1] != sequences
            or (np.diff(doc_index) < 0).any()):
        raise ValueError(f"{idx_path}: the document index must rise from 0 to the sequence "
                         f"count {sequences:,} (damaged index?)")
    tokens = (np.memmap(bin_path, dtype=dtype, mode="r") if bin_bytes
              else np.zeros(0, dtype))
    sequence_starts = np.concatenate([[0], ends // dtype.itemsize])
    starts = np.unique(sequence_starts[doc_index])  # an empty document starts nothing
    return IndexedDataset(prefix, tokens, starts)


def write_index(idx_path: str | pathlib.Path, dtype, document_lengths: np.ndarray) -> None:
    """The ``.idx`` for a ``.bin`` holding these documents back to back, one sequence each
    (what preprocess_data writes)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(document_lengths, np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) * dtype.itemsize
    doc_index = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(idx_path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, dtype_code(dtype), len(lengths), len(doc_index)))
        f.write(lengths.tobytes())
        f.write(pointers.astype(np.int64).tobytes())
        f.write(doc_index.tobytes())


def expand_prefixes(patterns) -> list[str]:
    """Prefixes named by the patterns: a pattern with glob characters matches the
    ``<prefix>.idx`` files, sorted; a plain prefix is taken as it is (open_indexed checks)."""
    prefixes = []
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        if glob.has_magic(pattern):
            matched = sorted(p[:-len(".idx")] for p in glob.glob(pattern + ".idx", recursive=True))
            if not matched:
                raise ValueError(f"no Megatron dataset matches {pattern!r} (looked for {pattern}.idx)")
            prefixes.extend(matched)
        else:
            for suffix in (".bin", ".idx"):  # the file's name instead of its prefix
                if pattern.endswith(suffix):
                    pattern = pattern[:-len(suffix)]
            prefixes.append(pattern)
    return prefixes


def parse_blend(entries) -> tuple[list[str], list[float] | None]:
    """``data.paths`` as Megatron's ``--data-path``: prefixes, or ``[w1, prefix1, w2,
    prefix2, ...]``, a blend whose weights are normalized to sum to 1. A list is a blend when
    its first entry is a number; then every other entry must be a positive number."""
    entries = [str(e) for e in entries]
    if not entries or not _is_number(entries[0]):
        numbers = [e for e in entries if _is_number(e)]
        if numbers:
            raise ValueError(f"data.paths mixes prefixes with the number {numbers[0]!r}: a blend "
                             f"starts with a weight ([weight, prefix, ...]), and {entries[0]!r} "
                             "is not a number")
        return expand_prefixes(entries), None
    if len(entries) % 2:
        raise ValueError(f"a blend is weight, prefix pairs, but data.paths has {len(entries)} "
                         f"entries ({', '.join(entries)})")
    weights = []
    for position in range(0, len(entries), 2):
        text = entries[position]
        try:
            weight = float(text)
        except ValueError:
            raise ValueError(f"blend weight {text!r} (entry {position + 1} of data.paths) is not "
                             "a number; a blend is [weight, prefix, weight, prefix, ...]") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"blend weight {text!r} (entry {position + 1} of data.paths) must be "
                             "a positive number")
        if _is_number(entries[position + 1]):
            raise ValueError(f"entry {position + 2} of data.paths, {entries[position + 1]!r}, "
                             "is a number where the blend needs a dataset prefix")
        weights.append(weight)
    prefixes = []
    for prefix in entries[1::2]:
        found = expand_prefixes([prefix])
        if len(found) != 1:
            raise ValueError(f"blend prefix {prefix!r} matches {len(found)} datasets; a weight "
                             "applies to one prefix")
        prefixes += found
    total = sum(weights)
    return prefixes, [w / total for w in weights]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
