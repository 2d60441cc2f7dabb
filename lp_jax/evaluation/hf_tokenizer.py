"""A Hugging Face folder's `tokenizer.json`, seen as lm-evaluation-harness sees it.

The harness encodes with `add_special_tokens=True`, so the prefix its tokenizer's
post-processor adds (Llama 3: `<|begin_of_text|>`; GPT-2: nothing) starts every
sequence. `bos_id` is that prefix token, found by encoding a probe string with and
without special tokens, or None when the post-processor adds no single prefix token.
"""

from __future__ import annotations

import os


class HFTokenizerFile:
    def __init__(self, path: str):
        from tokenizers import Tokenizer  # the `data` extra: imported where needed

        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer file at {path}")
        self.path = path
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception for any bad file
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from None
        self.bos_id = self._prefix_token()

    def encode(self, text: str) -> list[int]:
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
