"""What a run reads, as recorded in each of its checkpoints and compared when it resumes.

A checkpoint's data position is a count of sequences into the shuffled stream of its data
(lp_jax/data/batch_stream.py). That count means the same sequences only over the same data
cut by the same tokenizer: a file added, removed or edited, or another tokenizer, moves
every sequence, so a resume would read some twice and others never. The fingerprint says
what the stream was made of:

- ``tokenizer``: its name, vocabulary size, BOS/EOS ids and ``sha256``, the SHA-256 of its
  ``tokenizer.json`` (and ``tokenizer_config.json`` beside it, which picks BOS/EOS) bytes,
  or ``builtin`` for the byte tokenizer;
- ``files``: per split (``train``, ``val``), each file the run reads, by its path relative to
  the data's common folder (so a data set moved whole is the same data), with its size and
  a content hash. Text files (``data.source=text``) are hashed whole (``sha256``: they are
  read whole to be tokenized anyway, and the token cache is keyed by the same hashes). Token
  shards and Megatron ``.bin``/``.idx`` files can be terabytes, so they get
  ``sampled_sha256``: SHA-256 of the size, the first MiB and the last MiB; an append, a
  truncation or a rewrite of either end is caught, an edit of the same size in the middle
  of a shard is not;
- ``stream``: the data keys that shape the stream (source, globs, split, sequence length,
  packing switches, seed), for the record; a change of these is reported by the resume's
  config comparison (``data.seq_len`` is refused there).

``changes`` compares two fingerprints and names what differs; the trainer refuses a resume
with changes unless ``data.allow_changed=true`` (lp_jax/training/loop.py).
"""
from __future__ import annotations

import hashlib
import os
from typing import Iterable, Mapping, Sequence

VERSION = 1
SAMPLE_BYTES = 1 << 20  # the ends of a token shard hashed by sampled_sha256
_CHUNK = 1 << 22
STREAM_KEYS = ("source", "paths", "val_paths", "val_fraction", "seq_len", "token_dtype",
               "reset_attention_mask", "reset_position_ids", "eod_mask_loss")


def content_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def sampled_sha256(path: str | os.PathLike) -> tuple[int, str]:
    """(size, SHA-256 of the size, the first and the last ``SAMPLE_BYTES`` bytes)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.sha256(f"{size}\n".encode())
        h.update(f.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
    return size, h.hexdigest()


def tokenizer_identity(tokenizer) -> dict | None:
    """What identifies a tokenizer's ids: its files' content, not its name or path (None:
    no tokenizer, the mock sources)."""
    if tokenizer is None:
        return None
    path = getattr(tokenizer, "path", None)
    digest = "builtin"
    if path is not None:
        h = hashlib.sha256(bytes.fromhex(content_sha256(path)))
        config = os.path.join(os.path.dirname(os.fspath(path)), "tokenizer_config.json")
        if os.path.isfile(config):
            h.update(bytes.fromhex(content_sha256(config)))
        digest = h.hexdigest()
    return {"name": tokenizer.name, "vocab_size": int(tokenizer.vocab_size),
            "bos_id": int(tokenizer.bos_id), "eos_id": int(tokenizer.eos_id), "sha256": digest}


def common_root(paths: Iterable[str]) -> str:
    folders = [os.path.dirname(os.path.abspath(p)) for p in paths]
    return os.path.commonpath(folders) if folders else "."


def file_entries(paths: Sequence[str], root: str,
                 digests: Mapping[str, str] | None = None) -> dict[str, dict]:
    """{path relative to root: {size, sha256 or sampled_sha256}}: whole-file hashes from
    ``digests`` (path -> SHA-256) where given, sampled ones otherwise."""
    out = {}
    for path in paths:
        name = os.path.relpath(os.path.abspath(path), root)
        if digests is not None and path in digests:
            out[name] = {"size": os.path.getsize(path), "sha256": digests[path]}
        else:
            size, digest = sampled_sha256(path)
            out[name] = {"size": size, "sampled_sha256": digest}
    return out


def fingerprint(data_cfg, tokenizer, seed: int, files: Mapping[str, dict] | None) -> dict:
    """The fingerprint of a run's data (``files``: split -> file_entries; None for the mock
    sources, which read no files)."""
    stream = {k: getattr(data_cfg, k) for k in STREAM_KEYS}
    stream = {k: list(v) if isinstance(v, tuple) else v for k, v in stream.items()}
    stream["seed"] = seed
    return {"version": VERSION, "tokenizer": tokenizer_identity(tokenizer),
            "files": {split: dict(entries) for split, entries in (files or {}).items()},
            "stream": stream}


def changes(saved: Mapping, now: Mapping, limit: int = 3) -> list[str]:
    """What differs between a checkpoint's fingerprint and the current data, in words:
    the tokenizer, then per split the files removed, added and changed (up to ``limit``
    named each, then a count)."""
    out = []
    old_tok, new_tok = saved.get("tokenizer"), now.get("tokenizer")
    if _ids_of(old_tok) != _ids_of(new_tok):  # a tokenizer file moved elsewhere is the same one
        if old_tok and new_tok and old_tok.get("name") == new_tok.get("name"):
            out.append(f"tokenizer {new_tok['name']!r} has other content (sha256 "
                       f"{str(old_tok.get('sha256'))[:12]} -> {str(new_tok.get('sha256'))[:12]})")
        else:
            out.append(f"tokenizer {_tok_name(old_tok)} -> {_tok_name(new_tok)}")
    old_files, new_files = saved.get("files") or {}, now.get("files") or {}
    for split in sorted(set(old_files) | set(new_files)):
        before, after = old_files.get(split) or {}, new_files.get(split) or {}
        removed = sorted(set(before) - set(after))
        added = sorted(set(after) - set(before))
        changed = sorted(n for n in set(before) & set(after) if before[n] != after[n])
        for what, names, describe in (("removed", removed, None), ("added", added, None),
                                      ("changed", changed, lambda n: _size_change(before[n], after[n]))):
            if names:
                shown = [f"{n!r}{describe(n) if describe else ''}" for n in names[:limit]]
                more = f" and {len(names) - limit} more" if len(names) > limit else ""
                out.append(f"{split} file(s) {what}: {', '.join(shown)}{more}")
    return out


def _ids_of(identity: Mapping | None) -> dict | None:
    return None if identity is None else {k: v for k, v in identity.items() if k != "name"}


def _tok_name(identity: Mapping | None) -> str:
    return repr(identity.get("name")) if identity else "none"


def _size_change(before: Mapping, after: Mapping) -> str:
    if before.get("size") != after.get("size"):
        return f" ({before.get('size')} -> {after.get('size')} bytes)"
    return " (same size, other content)"
