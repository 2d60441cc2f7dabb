"""The tokenizer files of a Hugging Face folder, for the tokenizer a run trained with.

``write_tokenizer_files`` writes tokenizer.json and tokenizer_config.json that map text to
the ids the run trained on: for ``bytes`` a byte-level BPE with no merges (byte b is id b;
BOS 256, EOS 257, PAD 258; BOS prepended, as in training), for ``llama3`` and ``hf:<path>``
a copy of the tokenizer.json the run read. The config names ``PreTrainedTokenizerFast``, so
AutoTokenizer never swaps in LlamaTokenizerFast and its ``<s>`` BOS (docs/models.md).
"""
from __future__ import annotations

import json
import os
import shutil

from lp_jax.data.tokenizers import ByteTokenizer, HFTokenizer, get_tokenizer

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
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
    data.tokenizer value) into out_dir; returns the token ids for config.json."""
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
        from tokenizers import Tokenizer

        token = Tokenizer.from_file(str(tokenizer.path)).id_to_token
        token_config = _token_config(token(tokenizer.bos_id), token(tokenizer.eos_id), None,
                                     model_max_length)
    with open(config_path, "w") as f:
        json.dump(token_config, f, indent=2)
    return ids
