"""Documents out of the files people keep corpora in, one at a time (a file never has to
fit in memory).

Formats, chosen by name (``--input-format auto``) or forced:

- ``text``: any other file is one document (binary files are left out, as before);
- ``jsonl``: JSON lines, one object per line, plain or ``.gz`` / ``.zst`` compressed
  (``.jsonl``, ``.json``, ``.ndjson``; DCLM, Dolma);
- ``parquet``: a column of a Parquet file, read a row group batch at a time (FineWeb);
- ``arrow``: an Arrow IPC file or stream, and a Hugging Face ``save_to_disk`` folder, whose
  ``state.json`` lists its Arrow stream files in order (each one an input file here).

Each reader yields ``(row, text)`` with ``text`` None for a document left out, the reason
counted in ``skipped``. A text file's bytes that are not UTF-8 are read as U+FFFD, one per
invalid sequence, counted in ``replaced`` (JSON lines must be UTF-8; Arrow strings are).
Bad input raises ``InputError`` as one line naming the file and the line (JSON lines, from
1) or row (Parquet and Arrow, from 0). pyarrow does the decoding: its zstd and gzip
streams, unlike the ``zstandard`` package's reader, refuse a truncated file instead of
ending early.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
from collections import Counter
from typing import Iterator, Sequence

from lp_jax.errors import one_line

FORMATS = ("auto", "text", "jsonl", "parquet", "arrow")
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_HF_STATE = "state.json"  # what makes a folder a Hugging Face save_to_disk dataset
_BATCH_ROWS = 1024  # rows pyarrow decodes at a time

# Why a document is left out (meta.json counts them per file).
EMPTY_TEXT = "empty_text"  # the text is ""
NULL_TEXT = "null_text"  # the field is there with a null value (JSON null, an Arrow null)
MISSING_FIELD = "missing_field"  # a JSON line without the field, with --missing-field skip

# What was read as something else (meta.json counts it per file).
INVALID_UTF8 = "invalid_utf8"  # a byte sequence that is not UTF-8, read as U+FFFD
_REPLACEMENT = "\ufffd"


class InputError(ValueError):
    """A corpus file that cannot be read as its format, as one line with file and place."""


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str
    kind: str  # text | jsonl | parquet | arrow


def kind_of(path: str) -> str:
    """The format ``auto`` reads a file as, from its name."""
    name = path.lower()
    for suffix in _COMPRESSION:
        if name.endswith(suffix):
            name = name[:-len(suffix)]
            break
    if name.endswith(_JSON_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    return "text"


def expand_inputs(globs: Sequence[str], input_format: str = "auto") -> list[InputFile]:
    """The files the globs match, sorted, with a Hugging Face ``save_to_disk`` folder (a
    match that is a folder holding ``state.json``) replaced by its Arrow files in the order
    its ``state.json`` lists them. Other folders are passed over, as globs always did."""
    import glob

    if input_format not in FORMATS:
        raise InputError(f"input format {input_format!r} is not one of {', '.join(FORMATS)}")
    found: dict[str, InputFile] = {}
    for pattern in globs:
        for match in glob.glob(os.path.expanduser(pattern), recursive=True):
            if os.path.isfile(match):
                kind = kind_of(match) if input_format == "auto" else input_format
                found[match] = InputFile(match, kind)
            elif input_format not in ("auto", "arrow"):
                continue  # a folder, passed over as globs always did
            elif os.path.isfile(os.path.join(match, _HF_STATE)):
                for arrow in hf_dataset_files(match):
                    found[arrow] = InputFile(arrow, "arrow")
            elif os.path.isfile(os.path.join(match, "dataset_dict.json")):
                raise InputError(f"{match!r} is a Hugging Face DatasetDict; name one split's "
                                 f"folder ({', '.join(_dataset_dict_splits(match))})")
    return [found[p] for p in sorted(found)]


def hf_dataset_files(folder: str) -> list[str]:
    """The Arrow files of a ``Dataset.save_to_disk`` folder, in its row order."""
    state_path = os.path.join(folder, _HF_STATE)
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{state_path}: not a Hugging Face dataset state (no _data_files "
                         f"list): {one_line(e)}") from None
    paths = [os.path.join(folder, name) for name in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise InputError(f"{state_path} lists {missing[0]!r}, which does not exist")
    return paths


def _dataset_dict_splits(folder: str) -> list[str]:
    try:
        with open(os.path.join(folder, "dataset_dict.json"), encoding="utf-8") as f:
            return [os.path.join(folder, s) for s in json.load(f)["splits"]]
    except (OSError, ValueError, KeyError, TypeError):
        return [os.path.join(folder, "<split>")]


def is_binary(path: str) -> bool:
    """A NUL byte in the first 8 KiB, git's test: text in any 8-bit encoding (the stdlib's
    deliberately Latin-1 test files) has none; images, archives, arrays have plenty."""
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(8192)
    except OSError as e:
        raise InputError(f"{path!r} cannot be read: {e.strerror or e}") from None


def read_documents(source: InputFile, text_field: str = "text", skipped: Counter | None = None,
                   missing_field: str = "error", replaced: Counter | None = None,
                   invalid_utf8: str = "replace") -> Iterator[tuple[int, str | None]]:
    """``(row, text)`` for each document of the file; ``text`` is None for a document left
    out, whose reason is counted in ``skipped``; invalid UTF-8 in a text file is read as
    U+FFFD and counted in ``replaced``, or refused with ``invalid_utf8="error"``."""
    skipped = Counter() if skipped is None else skipped
    replaced = Counter() if replaced is None else replaced
    if source.kind == "text":
        return _text_documents(source.path, skipped, replaced, invalid_utf8 == "error")
    if source.kind == "jsonl":
        return _jsonl_documents(source.path, text_field, skipped, missing_field)
    if source.kind in ("parquet", "arrow"):
        return _columnar_documents(source.path, source.kind, text_field, skipped)
    raise InputError(f"{source.path}: unknown input format {source.kind!r}")


def _text_documents(path: str, skipped: Counter, replaced: Counter,
                    strict: bool) -> Iterator[tuple[int, str | None]]:
    # Some stdlib test files are deliberately not UTF-8, and real corpora hold a few bad
    # bytes: replacing keeps them as text, and the count says how much was replaced. The
    # bytes are read once; the text is decoded from them as text mode reads a file (its
    # newline handling included).
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise InputError(f"{path}: cannot be read: {e.strerror or e}") from None
    text = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors="replace").read()
    # U+FFFD the file holds as valid UTF-8 (EF BF BD) was text, not a replacement (EF never
    # continues a sequence, so each such triple decodes as itself).
    invalid = text.count(_REPLACEMENT) - raw.count(b"\xef\xbf\xbd") if _REPLACEMENT in text else 0
    if invalid and strict:
        raise InputError(f"{path}: {invalid:,} byte sequence(s) that are not UTF-8, the first "
                         f"at byte {_first_invalid(raw):,}; --invalid-utf8 replace reads each "
                         "as U+FFFD and counts them")
    if invalid:
        replaced[INVALID_UTF8] += invalid
    if not text:
        skipped[EMPTY_TEXT] += 1
        yield 0, None
    else:
        yield 0, text


def _first_invalid(raw: bytes) -> int:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start
    return -1  # (not reached: the bytes held an invalid sequence)


def _open_lines(path: str):
    """The file's bytes, decompressed by pyarrow for .gz / .zst."""
    compression = next((c for s, c in _COMPRESSION.items() if path.lower().endswith(s)), None)
    if compression is None:
        return open(path, "rb")
    import pyarrow as pa

    # A small read-ahead keeps the line an error reports close to where the stream broke.
    return io.BufferedReader(pa.input_stream(path, compression=compression), 1 << 16)


def _jsonl_documents(path: str, field: str, skipped: Counter,
                     missing_field: str) -> Iterator[tuple[int, str | None]]:
    line_no = 0
    try:
        with _open_lines(path) as lines:
            for line_no, line in enumerate(lines, 1):
                if not line.strip():
                    continue  # a blank line holds no document
                yield line_no - 1, _json_text(path, line_no, line, field, skipped, missing_field)
    except OSError as e:  # pyarrow's decompressors raise OSError for a bad or cut stream
        raise InputError(f"{path}: {one_line(e)} after line {line_no:,} (truncated or damaged "
                         "file?)") from None


def _json_text(path, line_no, line: bytes, field, skipped, missing_field) -> str | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{line_no}: not a JSON line: {e.msg} at column {e.colno}") from None
    except ValueError as e:  # UnicodeDecodeError
        raise InputError(f"{path}:{line_no}: not a JSON line: {one_line(e, 120)}") from None
    if not isinstance(record, dict):
        raise InputError(f"{path}:{line_no}: a JSON line must hold an object, got "
                         f"{type(record).__name__}")
    if field not in record:
        if missing_field == "skip":
            skipped[MISSING_FIELD] += 1
            return None
        keys = ", ".join(list(record)[:8]) or "none"
        raise InputError(f"{path}:{line_no}: no {field!r} field (keys: {keys}); --text-field "
                         "names the field, --missing-field skip leaves such lines out")
    return _checked_text(record[field], f"{path}:{line_no}", field, skipped)


def _checked_text(value, where: str, field: str, skipped: Counter) -> str | None:
    if value is None:
        skipped[NULL_TEXT] += 1
        return None
    if not isinstance(value, str):
        raise InputError(f"{where}: field {field!r} holds {type(value).__name__} "
                         f"{one_line(repr(value), 40)}, not a string")
    if not value:
        skipped[EMPTY_TEXT] += 1
        return None
    return value


def _columnar_documents(path: str, kind: str, field: str,
                        skipped: Counter) -> Iterator[tuple[int, str | None]]:
    import pyarrow as pa

    try:
        batches, schema = _open_batches(path, kind, field)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{path}: not readable as {kind}: {one_line(e, 160)}") from None
    if field not in schema.names:
        raise InputError(f"{path}: no column {field!r} (columns: "
                         f"{', '.join(schema.names[:12])}); --text-field names the column")
    column_type = schema.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)
            or pa.types.is_string_view(column_type)):
        raise InputError(f"{path}: column {field!r} holds {column_type}, not strings")
    row = 0
    try:
        for batch in batches:
            for value in batch.column(field).to_pylist():
                if value is None:
                    skipped[NULL_TEXT] += 1
                    yield row, None
                elif not value:
                    skipped[EMPTY_TEXT] += 1
                    yield row, None
                else:
                    yield row, value
                row += 1
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{path}: unreadable after row {row}: {one_line(e, 160)} "
                         "(truncated or damaged file?)") from None


def _open_batches(path: str, kind: str, field: str):
    """(record batches of the text column only, the file's schema)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
        columns = [field] if field in schema.names else None
        return parquet.iter_batches(batch_size=_BATCH_ROWS, columns=columns), schema
    source = pa.memory_map(path)
    if source.read(6) == b"ARROW1":  # the random-access file format; HF writes the stream one
        source.seek(0)
        reader = pa.ipc.open_file(source)
        return (reader.get_batch(i) for i in range(reader.num_record_batches)), reader.schema
    source.seek(0)
    reader = pa.ipc.open_stream(source)
    return reader, reader.schema
